"""ALiBi and the attention soft-cap end to end on the Triton backend (the interpreter on CPU,
see conftest.py), against transformers at a reduced size: 2 prompts, 8 greedy tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.engine.family_check import assert_matches_transformers, save_family_model  # noqa: E402
from tests.engine.test_families import CONFIGS as LLAMA_SHAPED  # noqa: E402
from tests.engine.test_families_alibi import CONFIGS as ALIBI  # noqa: E402
from tests.tiny_models import build_tokenizer  # noqa: E402


@pytest.mark.parametrize("name", ["bloom_6heads", "falcon_rw", "gemma2"])
def test_family_on_triton_backend(tmp_path, name):
    """Bloom with 6 heads: ALiBi slopes off the power-of-two sequence, LayerNorm with bias and
    GELU-tanh through their kernels, the embedding LayerNorm. Falcon RW: slopes scaled by the
    softmax scale. Gemma 2: the attention soft-cap with sliding layers, and the final soft-cap."""
    tok = build_tokenizer()
    config = (LLAMA_SHAPED if name == "gemma2" else ALIBI)[name](tok)
    path = save_family_model(str(tmp_path / name), config)
    assert_matches_transformers(path, new_tokens=8, lengths=(3, 20), attention_backend="triton")

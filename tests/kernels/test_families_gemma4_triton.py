"""Gemma 4 end to end on the Triton backend (the interpreter on CPU, see conftest.py) against
transformers at a reduced size: 2 prompts (1 for the plain and MoE models), 12 greedy tokens,
across the window. The paged kernel reads the cache views of the layers of another head shape
(strided) and the shared-KV layers read their source's cache; the norms, rotary and
activations run their kernels, the MoE block's experts the fused MoE kernel."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.engine.family_check import assert_matches_transformers  # noqa: E402
from tests.engine.test_families_gemma4 import CONFIGS, save_gemma4  # noqa: E402
from tests.tiny_models import build_tokenizer  # noqa: E402


@pytest.mark.parametrize("name", ["gemma4", "gemma4_plain", "gemma4_moe"])
def test_gemma4_on_triton_backend(tmp_path, name):
    path = save_gemma4(str(tmp_path / name), CONFIGS[name](build_tokenizer()))
    lengths = (3, 20) if name == "gemma4" else (20,)
    assert_matches_transformers(path, new_tokens=12, lengths=lengths, attention_backend="triton")

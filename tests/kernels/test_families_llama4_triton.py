"""Llama 4 end to end on the Triton backend (the interpreter on CPU, see conftest.py) against
transformers at a reduced size: 3 prompts, 24 greedy tokens, across chunk boundaries (the paged
attention kernel's chunk rule, the interleaved rotary, the fused MoE kernel on weighted inputs)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.engine.family_check import assert_matches_transformers, save_family_model  # noqa: E402
from tests.engine.test_families_llama4 import CONFIGS  # noqa: E402
from tests.tiny_models import build_tokenizer  # noqa: E402


@pytest.mark.parametrize("name", ["llama4", "llama4_scout"])
def test_llama4_on_triton_backend(tmp_path, name):
    path = save_family_model(str(tmp_path / name), CONFIGS[name](build_tokenizer()))
    assert_matches_transformers(
        path, new_tokens=24, lengths=(3, 17, 30), attention_backend="triton"
    )

"""Model families whose options run through new kernels, end to end on the Triton backend (the
interpreter on CPU, see conftest.py), against transformers at a reduced size: 2 prompts, 8
greedy tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.engine.family_check import assert_matches_transformers, save_family_model  # noqa: E402
from tests.engine.test_families import CONFIGS  # noqa: E402
from tests.tiny_models import build_tokenizer  # noqa: E402


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "phi3", "cohere"])
def test_family_on_triton_backend(tmp_path, name):
    """Qwen 3: per-head q/k RMSNorm through the RMSNorm kernel. Gemma 3: that, GELU-tanh gated,
    two rope tables and sliding layers. Phi-3: partial rotary (neox) with LongRoPE. Cohere:
    LayerNorm without bias, gpt-j layout rotary, parallel block."""
    path = save_family_model(str(tmp_path / name), CONFIGS[name](build_tokenizer()))
    assert_matches_transformers(path, new_tokens=8, lengths=(3, 20), attention_backend="triton")


@pytest.mark.parametrize("name", ["qwen2_moe", "granitemoe"])
def test_moe_family_on_triton_backend(tmp_path, name):
    """The fused MoE kernels in a whole model: Qwen2-MoE (a dense layer, a shared expert, top-3
    of 8) and Granite-MoE (top-3 of 6, softmax over the top-k logits)."""
    from tests.engine.test_families_moe import CONFIGS as MOE_CONFIGS

    path = save_family_model(str(tmp_path / name), MOE_CONFIGS[name](build_tokenizer()))
    assert_matches_transformers(path, new_tokens=8, lengths=(3, 20), attention_backend="triton")

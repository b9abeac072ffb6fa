"""Qwen3-Next end to end on the Triton backend (the interpreter on CPU, see conftest.py) against
transformers at a reduced size, 2 prompts, 8 greedy tokens: the Gated DeltaNet layers' causal
convolution, gated delta rule (chunked prefill, recurrent decodes) and gated RMSNorm, the gated
attention with partial rotary, and the fused MoE kernels with a shared expert, all as Triton
kernels in one model."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.engine.family_check import assert_matches_transformers, save_family_model  # noqa: E402
from tests.engine.test_families_linear import CONFIGS  # noqa: E402
from tests.tiny_models import build_tokenizer  # noqa: E402


def test_qwen3_next_on_triton_backend(tmp_path):
    path = save_family_model(str(tmp_path / "qwen3_next"), CONFIGS["qwen3_next"](build_tokenizer()))
    assert_matches_transformers(path, new_tokens=8, lengths=(3, 20), attention_backend="triton")

"""DeepSeek-style routing (issue 37) in whole models on the Triton backend (the interpreter on
CPU, see conftest.py), against transformers at a reduced size: 2 prompts, 8 greedy tokens. The
routing is torch on both backends; the experts run the fused MoE kernels."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.engine.family_check import assert_matches_transformers  # noqa: E402
from tests.engine.test_families_moe2 import BIAS_STD, CONFIGS, save_with_biases  # noqa: E402
from tests.tiny_models import build_tokenizer  # noqa: E402


@pytest.mark.parametrize("name", ["glm4_moe", "ernie4_5_moe"])
def test_moe2_family_on_triton_backend(tmp_path, name):
    """GLM-4.5 (grouped sigmoid routing with the correction bias, a shared expert, a dense first
    layer, partial rotary, q/k norms) and ERNIE 4.5 (softmax routing with the bias, biases on
    every linear, interleaved rotary)."""
    path = save_with_biases(str(tmp_path / name), CONFIGS[name](build_tokenizer()), BIAS_STD[name])
    assert_matches_transformers(path, new_tokens=8, lengths=(3, 20), attention_backend="triton")

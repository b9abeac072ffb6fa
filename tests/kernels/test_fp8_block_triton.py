"""Block-FP8 checkpoints kept 8-bit on the Triton backend (interpreted on CPU): every decoder
linear through the block-scaled FP8 GEMM (kernels/fp8_block.py), DeepSeek-V3's experts through
fused_moe's grouped GEMM with block scales; the greedy tokens equal transformers' on the float
weights the checkpoints stand for (issue 37)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm import LLM, SamplingParams  # noqa: E402
from serverless_llm.engine.kernels import fp8_block  # noqa: E402
from serverless_llm.engine.layers import moe as moe_layer  # noqa: E402
from serverless_llm.engine.layers.moe import Experts  # noqa: E402
from serverless_llm.engine.layers.quant_linear import Fp8BlockWeight, QuantLinear  # noqa: E402
from tests.engine.reference import hf_greedy  # noqa: E402
from tests.engine.test_engine_vs_transformers import prompts_for  # noqa: E402
from tests.quant_checkpoints import MLA_LINEAR, write_fp8_block  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402


def _count(monkeypatch, module, name: str) -> list:
    calls: list = []
    fn = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or fn(*a, **kw))
    return calls


@pytest.mark.parametrize("style", ["fp8", "compressed-tensors"])
def test_llama_through_the_block_fp8_gemm(tmp_path, monkeypatch, style):
    """128 x 128 blocks cut short at both edges (hidden 192, intermediate 320; q's second
    block shared with nothing, k and v their own grids in the fused qkv)."""
    calls = _count(monkeypatch, fp8_block, "fp8_block_linear")
    src = build_tiny_model(str(tmp_path / "src"), "llama", seed=8, hidden_size=192,
                           intermediate_size=320, num_attention_heads=6)  # fmt: skip
    float_dir, quant_dir = write_fp8_block(
        src, str(tmp_path / "float"), str(tmp_path / "quant"), style
    )
    llm = LLM(quant_dir, attention_backend="triton", dtype="float32", block_size=8,
              num_kv_blocks=64, max_model_len=256, quantized_weights="packed")  # fmt: skip
    quant = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
    assert quant and all(m.use_kernels and isinstance(m.packed[0], Fp8BlockWeight) for m in quant)
    assert "kept 8-bit: block-scaled Triton GEMM" in llm.engine.model.quantization
    prompts = prompts_for(llm.engine.vocab_size, seed=5, lengths=(3, 17, 40))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(float_dir, prompt, 10), len(prompt)
    assert len(calls) > len(quant)  # the kernel ran (its self-check's probe is one call)


def test_deepseek_v3_moe_through_the_block_scaled_kernels(tmp_path, monkeypatch):
    """Every linear and expert of a DeepSeek-V3 MoE in 32 x 64 blocks, held as bytes: MLA's
    projections through the dense GEMM, the experts through the grouped GEMM with block
    scales (no float expert weights)."""
    from tests.engine.family_check import save_family_model
    from tests.engine.test_families_mla import CONFIGS
    from tests.tiny_models import build_tokenizer

    dense = _count(monkeypatch, fp8_block, "fp8_block_linear")
    grouped = _count(monkeypatch, moe_layer, "fused_moe_fp8_block")
    config = CONFIGS["deepseek_v3_moe"](build_tokenizer())
    src = save_family_model(str(tmp_path / "src"), config, std=0.1)
    float_dir, quant_dir = write_fp8_block(
        src, str(tmp_path / "float"), str(tmp_path / "quant"), "fp8", (32, 64), linear=MLA_LINEAR
    )
    llm = LLM(quant_dir, attention_backend="triton", dtype="float32", block_size=8,
              num_kv_blocks=64, max_model_len=128, quantized_weights="packed")  # fmt: skip
    experts = [m for m in llm.engine.model.modules() if isinstance(m, Experts)]
    assert experts and all(m.use_kernels and m.quantized == {"w13", "w2"} for m in experts)
    assert all(m.w13_weight.dtype == torch.uint8 and "w13" not in m._modules for m in experts)
    prompts = prompts_for(llm.engine.vocab_size, seed=3)[:2]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(float_dir, prompt, 6), len(prompt)
    assert dense and grouped

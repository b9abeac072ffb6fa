"""End to end: a GPTQ act-order and an AWQ tiny model held packed at 4 bits, every linear of
the decoder layers through the Triton W4A16 GEMM (interpreted on CPU), and FP8 checkpoints
held as their bytes through the W8A16 FP8 GEMM (the path of GPUs without FP8 arithmetic; no
`_scaled_mm` here), generate the greedy tokens transformers generates on the float weights they
stand for."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm import LLM, SamplingParams  # noqa: E402
from serverless_llm.engine.layers.quant_linear import QuantLinear  # noqa: E402
from tests.engine.reference import hf_greedy  # noqa: E402
from tests.engine.test_engine_vs_transformers import prompts_for  # noqa: E402
from tests.quant_checkpoints import write_fp8, write_quantized  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402


@pytest.mark.parametrize(
    ("kind", "method", "act_order"), [("llama", "gptq", True), ("qwen2", "awq", False)]
)
def test_packed_model_through_the_triton_gemm(tmp_path, monkeypatch, kind, method, act_order):
    src = build_tiny_model(
        str(tmp_path / "src"), kind, seed=5, hidden_size=96, intermediate_size=160
    )
    float_dir, quant_dir = write_quantized(
        src, str(tmp_path / "float"), str(tmp_path / "quant"), method, 4, 32, act_order
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    llm = LLM(
        quant_dir,
        attention_backend="triton",
        dtype="float32",
        block_size=8,
        num_kv_blocks=64,
        max_model_len=256,
        quantized_weights="packed",
    )
    quant = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
    assert quant and all(m.use_kernels and m.packed is not None for m in quant)
    prompts = prompts_for(llm.engine.vocab_size, seed=4, lengths=(3, 17, 40))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(float_dir, prompt, 12), len(prompt)


def test_packed_moe_through_the_triton_kernels(tmp_path):
    """A GPTQ act-order Qwen2-MoE held packed (experts included) on the Triton backend: the
    packed MoE kernel and the W4A16 GEMM give transformers' tokens on the float twin."""
    from serverless_llm.engine.layers.moe import Experts
    from tests.engine.family_check import save_family_model
    from tests.engine.test_families_moe import CONFIGS
    from tests.tiny_models import build_tokenizer

    src = save_family_model(str(tmp_path / "src"), CONFIGS["qwen2_moe"](build_tokenizer()), std=0.1)
    float_dir, quant_dir = write_quantized(
        src, str(tmp_path / "float"), str(tmp_path / "quant"), "gptq", 4, 32, True
    )
    llm = LLM(quant_dir, attention_backend="triton", dtype="float32", block_size=8,
              num_kv_blocks=64, max_model_len=128, quantized_weights="packed")  # fmt: skip
    experts = [m for m in llm.engine.model.modules() if isinstance(m, Experts)]
    assert experts and all(m.use_kernels and m.quantized for m in experts)
    prompts = prompts_for(llm.engine.vocab_size, seed=2)[:2]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(float_dir, prompt, 6), len(prompt)


@pytest.mark.parametrize(
    ("kind", "style", "strategy"),
    [("llama", "fp8", "tensor"), ("qwen2", "compressed-tensors", "channel")],
)
def test_fp8_model_through_the_w8a16_gemm(tmp_path, monkeypatch, kind, style, strategy):
    from serverless_llm.engine.kernels import fp8

    calls = []
    kernel = fp8.fp8_w8a16_linear
    monkeypatch.setattr(fp8, "fp8_w8a16_linear", lambda *a: calls.append(1) or kernel(*a))
    src = build_tiny_model(
        str(tmp_path / "src"), kind, seed=6, hidden_size=96, intermediate_size=160
    )
    float_dir, quant_dir = write_fp8(
        src, str(tmp_path / "float"), str(tmp_path / "quant"), style, strategy, False
    )
    llm = LLM(quant_dir, attention_backend="triton", dtype="float32", block_size=8,
              num_kv_blocks=64, max_model_len=256, quantized_weights="packed")  # fmt: skip
    quant = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
    assert quant and all(m.use_kernels and m.packed is not None for m in quant)
    prompts = prompts_for(llm.engine.vocab_size, seed=5, lengths=(3, 17, 40))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(float_dir, prompt, 12), len(prompt)
    assert len(calls) > len(quant)  # the kernel ran (its self-check's probe is one call)


@pytest.mark.parametrize(
    ("style", "strategy"), [("fp8", "tensor"), ("compressed-tensors", "channel")]
)
def test_fp8_moe_held_as_bytes_through_the_triton_kernels(tmp_path, style, strategy):
    """An FP8 Qwen2-MoE held packed on the Triton backend: the experts stay e4m3 bytes with
    float32 channel scales (no float expert weights), run by the grouped GEMM decoding them;
    the dense layers by the W8A16 GEMM: transformers' tokens on the float twin."""
    from serverless_llm.engine.layers.moe import Experts
    from tests.engine.family_check import save_family_model
    from tests.engine.test_families_moe import CONFIGS
    from tests.tiny_models import build_tokenizer

    src = save_family_model(str(tmp_path / "src"), CONFIGS["qwen2_moe"](build_tokenizer()), std=0.1)
    float_dir, quant_dir = write_fp8(
        src, str(tmp_path / "float"), str(tmp_path / "quant"), style, strategy
    )
    llm = LLM(quant_dir, attention_backend="triton", dtype="float32", block_size=8,
              num_kv_blocks=64, max_model_len=128, quantized_weights="packed")  # fmt: skip
    experts = [m for m in llm.engine.model.modules() if isinstance(m, Experts)]
    assert experts and all(m.use_kernels and m.quantized == {"w13", "w2"} for m in experts)
    for m in experts:
        assert m.w13_weight.dtype == torch.uint8 and m.w13_scale.dtype == torch.float32
        assert "w13" not in m._modules and "w2" not in m._modules  # no float expert weights
    assert "(experts dequantized)" not in llm.engine.model.quantization
    prompts = prompts_for(llm.engine.vocab_size, seed=3)[:2]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(float_dir, prompt, 6), len(prompt)

"""The fused MoE kernels compiled for a real GPU at real layer shapes (Mixtral-8x7B: 8 experts,
top-2, 4096 -> 14336; Qwen3-30B-A3B: 128 experts, top-8, 2048 -> 768), float16 and bfloat16,
1 to 300 tokens, against the torch path on the same GPU. Run with `pytest -m gpu` on a CUDA
machine; skipped elsewhere.

Tolerance, relative to the output's largest magnitude: the kernel accumulates each GEMM in
float32 over K = 768-14336 in another order, applies the router weight before rounding and sums
a token's top-k outputs in float32 (the reference rounds after each): 1e-2 for float16, 4e-2 for
bfloat16."""

from __future__ import annotations

import pytest
import torch

from serverless_llm.engine.kernels.fused_moe import fused_moe, fused_moe_reference
from tests.gpu_marks import GPU_ONLY

pytestmark = GPU_ONLY
TOL = {torch.float16: 1e-2, torch.bfloat16: 4e-2}
SHAPES = {"mixtral": (8, 2, 4096, 14336), "qwen3-moe": (128, 8, 2048, 768)}


@pytest.mark.parametrize("tokens", [1, 7, 32, 300])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_moe_on_gpu(shape, tokens, dtype):
    experts, top_k, hidden, inter = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(tokens)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * 0.02).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=g) * 0.02).to(dtype)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype)
    logits = torch.randn(tokens, experts, device="cuda", generator=g)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    got = fused_moe(x, w13, w2, weights, ids).float()
    want = fused_moe_reference(x, w13, w2, weights, ids).float()
    err = (got - want).abs().max() / want.abs().max()
    assert err < TOL[dtype], float(err)


@pytest.mark.parametrize("tokens", [1, 32, 300])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_moe_fp8_on_gpu(shape, tokens):
    """FP8 experts (e4m3 bytes, channel scales) decoded in the kernel, bfloat16 activations,
    against the dequantized experts on the torch path."""
    from serverless_llm.engine.kernels.fused_moe import (
        Fp8Experts,
        fused_moe_fp8,
        fused_moe_fp8_reference,
    )

    experts, top_k, hidden, inter = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(tokens)

    def fp8(n: int, k: int) -> Fp8Experts:
        w = torch.randn(experts, n, k, device="cuda", generator=g) * 100
        codes = w.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        return Fp8Experts(codes, torch.rand(experts, n, device="cuda", generator=g) * 2e-4)

    w13, w2 = fp8(2 * inter, hidden), fp8(hidden, inter)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, device="cuda", generator=g)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    got = fused_moe_fp8(x, w13, w2, weights, ids).float()
    want = fused_moe_fp8_reference(x, w13, w2, weights, ids).float()
    err = (got - want).abs().max() / want.abs().max()
    assert err < TOL[torch.bfloat16], float(err)

"""The W4A16 GEMM and the FP8 path compiled for a real GPU at Llama-3-8B linear shapes (4096 -> 4096, 4096 ->
14336, 14336 -> 4096), 4 and 8 bits, act-order, float16 and bfloat16, rows 1 to 256. Run with
`pytest -m gpu` on a CUDA machine; skipped elsewhere.

Tolerance: the kernel rounds each dequantized weight to the activation dtype before the dot
(the reference multiplies in float32) and sums K = 4096-14336 products in another order:
relative to the output's largest magnitude, 1e-2 for float16 and 4e-2 for bfloat16."""

from __future__ import annotations

import pytest
import torch

from serverless_llm.engine.kernels.w4a16 import pack_int32, w4a16_linear, w4a16_linear_ref
from tests.gpu_marks import GPU_ONLY

pytestmark = GPU_ONLY
TOL = {torch.float16: 1e-2, torch.bfloat16: 4e-2}


@pytest.mark.parametrize("m", [1, 7, 16, 64, 256])
@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 14336), (14336, 4096)], ids=str)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gemm_at_model_shapes(m, shape, bits, dtype):
    k, n = shape
    g = torch.Generator().manual_seed(m + bits)
    group = 128
    q = torch.randint(0, 1 << bits, (k, n), generator=g)
    scales = (torch.rand(k // group, n, generator=g) * 0.01 + 0.001).to(dtype)
    zeros = torch.randint(1, 1 << bits, (k // group, n), generator=g).to(dtype)
    g_idx = (torch.arange(k) // group).int()
    perm = torch.randperm(k, generator=g)
    x = torch.randn(m, k, generator=g).to(dtype)
    dev = [t.cuda() for t in (pack_int32(q, bits, 0), scales, zeros, g_idx, perm)]
    got = w4a16_linear(x.cuda(), *dev, bits)
    want = w4a16_linear_ref(x.cuda(), *dev, bits)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype] * scale, rtol=0)


@pytest.mark.parametrize("m", [1, 16, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fp8_scaled_mm_at_model_shapes(m, dtype):
    """FP8 weights through torch._scaled_mm (H100/H200 run it natively: the probe must pick
    it) against the float32 reference."""
    from serverless_llm.engine.kernels.fp8 import FP8, fp8_linear, fp8_linear_ref, native_out_dtype

    if torch.cuda.get_device_capability() >= (8, 9):
        assert native_out_dtype(torch.device("cuda"), dtype) is not None
    g = torch.Generator().manual_seed(m)
    w = (torch.randn(4096, 4096, generator=g) * 100).clamp(-448, 448).to(FP8).cuda()
    s = (torch.rand(4096, generator=g) * 0.001).cuda()
    x = torch.randn(m, 4096, generator=g).to(dtype).cuda()
    got, want = fp8_linear(x, w, s).float(), fp8_linear_ref(x, w, s).float()
    torch.testing.assert_close(got, want, atol=TOL[dtype] * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("m", [1, 16, 256])
@pytest.mark.parametrize("shape", [(4096, 4096), (14336, 4096)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fp8_w8a16_gemm_at_model_shapes(m, shape, dtype):
    """The FP8 weight-only GEMM (the path of GPUs without FP8 arithmetic; run here directly, as
    its self-check must pass on any GPU) against its float32 reference."""
    from serverless_llm.engine.kernels.fp8 import FP8, fp8_w8a16_linear, fp8_w8a16_ref, w8a16_works

    assert w8a16_works(torch.device("cuda"), dtype)
    k, n = shape
    g = torch.Generator().manual_seed(m)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8).cuda()
    s = (torch.rand(n, generator=g) * 0.001).cuda()
    x = torch.randn(m, k, generator=g).to(dtype).cuda()
    got, want = fp8_w8a16_linear(x, w, s).float(), fp8_w8a16_ref(x, w, s).float()
    torch.testing.assert_close(got, want, atol=TOL[dtype] * want.abs().max().item(), rtol=0)

"""RMSNorm (with and without the fused residual add) and SiLU-and-mul (Triton, interpreted)
against the torch references the CPU path runs.

Tolerances: RMSNorm rounds exactly where the reference does (the sum to the input dtype, the
normalised row before the weight), so only the float32 mean and rsqrt differ: float32 within
1e-5 relative (atol 1e-5), float16 within one fp16 ulp (rtol 1e-3, atol 1e-3). The residual sum
is bit-exact. SiLU-and-mul: float32 rtol/atol 1e-5; float16 within one ulp (rtol 1e-3,
atol 1e-3), since exp differs by an ulp between libm and the kernel.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm.engine.kernels.activation import (  # noqa: E402
    silu_and_mul,
    silu_and_mul_reference,
)
from serverless_llm.engine.kernels.rms_norm import rms_norm, rms_norm_reference  # noqa: E402
from tests.kernels.batch import DEVICE  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


@pytest.mark.parametrize("hidden", [64, 200, 1024], ids=lambda h: f"h{h}")
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "residual"])
@DTYPES
def test_rms_norm(dtype, fused, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(7, hidden, generator=g) * 3).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE, dtype)
    res = torch.randn(7, hidden, generator=g).to(DEVICE, dtype) if fused else None
    got = rms_norm(x, w, 1e-6, res)
    ref = rms_norm_reference(x, w, 1e-6, res)
    if fused:
        torch.testing.assert_close(got[0], ref[0], **TOL[dtype])
        assert torch.equal(got[1], ref[1])
    else:
        torch.testing.assert_close(got, ref, **TOL[dtype])


def test_rms_norm_strided_rows_and_3d():
    """Rows of a wider buffer (row stride > hidden) and a leading batch shape."""
    buf = torch.randn(2, 5, 96, device=DEVICE)
    x = buf[..., :64]
    w = torch.rand(64, device=DEVICE) + 0.5
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))


@DTYPES
def test_rms_norm_per_head_on_a_fused_qkv_split(dtype):
    """Per-head q/k RMSNorm (Qwen3, OLMo 2, Gemma 3): q and k are non-contiguous views of the
    fused QKV projection's output, normalised over head_dim as [T * H, D] rows or as the
    [T, H, D] view itself; odd row counts and a head_dim that is not a power of two."""
    T, H, KVH, D = 5, 3, 1, 24
    g = torch.Generator().manual_seed(11)
    qkv = (torch.randn(T, (H + 2 * KVH) * D, generator=g) * 2).to(DEVICE, dtype)
    q, k, _ = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(DEVICE, dtype)
    for x in (q.view(T, H, D), q.reshape(T * H, D), k.view(T, KVH, D)):
        got = rms_norm(x, w, 1e-6)
        assert got.shape == x.shape
        torch.testing.assert_close(got, rms_norm_reference(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("inter", [64, 1000, 2048 + 16], ids=lambda i: f"i{i}")
@DTYPES
def test_silu_and_mul(dtype, inter):
    g = torch.Generator().manual_seed(inter)
    x = (torch.randn(5, 2 * inter, generator=g) * 4).to(DEVICE, dtype)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), **TOL[dtype])


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(100): inf, as on GPU
def test_silu_and_mul_extremes():
    x = torch.tensor([[-100.0, -1.0, 0.0, 30.0, 2.0, 3.0, 4.0, 5.0]], device=DEVICE)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), atol=1e-6, rtol=1e-6)

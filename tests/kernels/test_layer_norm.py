"""LayerNorm (Triton, interpreted) against its torch reference: weight and bias, weight only,
neither; with and without the fused residual add; ragged shapes (odd row counts, hidden sizes
that are not powers of two).

Tolerances: the kernel rounds once, where the reference does (after the float32 affine step),
so only the float32 mean/variance summation order differs: float32 atol = rtol = 1e-5, float16
within one fp16 ulp (atol = rtol = 1e-3). The residual sum is bit-exact.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm.engine.kernels.layer_norm import (  # noqa: E402
    layer_norm,
    layer_norm_reference,
)
from serverless_llm.engine.layers.norm import LayerNorm  # noqa: E402
from tests.kernels.batch import DEVICE  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3)}
AFFINE = {"wb": (True, True), "w": (True, False), "none": (False, False)}


@pytest.mark.parametrize("hidden", [64, 200, 1030], ids=lambda h: f"h{h}")
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("affine", list(AFFINE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_layer_norm(dtype, affine, fused, hidden):
    has_w, has_b = AFFINE[affine]
    g = torch.Generator().manual_seed(hidden)
    # An offset mean, so the centring matters.
    x = (torch.randn(7, hidden, generator=g) * 3 + 2).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE, dtype) if has_w else None
    b = (0.5 * torch.randn(hidden, generator=g)).to(DEVICE, dtype) if has_b else None
    res = torch.randn(7, hidden, generator=g).to(DEVICE, dtype) if fused else None
    got = layer_norm(x, w, b, 1e-5, res)
    ref = layer_norm_reference(x, w, b, 1e-5, res)
    if fused:
        assert got[0].dtype == ref[0].dtype == dtype
        torch.testing.assert_close(got[0], ref[0], **TOL[dtype])
        assert torch.equal(got[1], ref[1])
    else:
        assert got.dtype == ref.dtype == dtype
        torch.testing.assert_close(got, ref, **TOL[dtype])


def test_layer_norm_strided_rows_3d_and_empty():
    """Rows of a wider buffer (row stride > hidden), a leading batch shape, and no rows."""
    buf = torch.randn(3, 5, 96, device=DEVICE)
    x = buf[..., :72]
    w = torch.rand(72, device=DEVICE) + 0.5
    b = torch.randn(72, device=DEVICE)
    torch.testing.assert_close(layer_norm(x, w, b, 1e-6), layer_norm_reference(x, w, b, 1e-6))
    empty = torch.empty(0, 72, device=DEVICE)
    assert layer_norm(empty, w, b, 1e-6).shape == (0, 72)


@pytest.mark.parametrize("affine", list(AFFINE))
def test_layer_module_uses_the_kernel(affine):
    has_w, has_b = AFFINE[affine]
    ref_norm = LayerNorm(48, 1e-5, weight=has_w, bias=has_b).to(DEVICE)
    kernel_norm = LayerNorm(48, 1e-5, weight=has_w, bias=has_b, use_kernels=True).to(DEVICE)
    with torch.no_grad():
        for p_ref, p_ker in zip(ref_norm.parameters(), kernel_norm.parameters()):
            p_ref.normal_()
            p_ker.copy_(p_ref)
    x, r = torch.randn(5, 48, device=DEVICE), torch.randn(5, 48, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(kernel_norm(x), ref_norm(x), **TOL[torch.float32])
        got, ref = kernel_norm(x, r), ref_norm(x, r)
    torch.testing.assert_close(got[0], ref[0], **TOL[torch.float32])
    assert torch.equal(got[1], ref[1])

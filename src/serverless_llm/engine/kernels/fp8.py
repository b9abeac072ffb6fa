"""FP8 (e4m3) weights with a float32 scale per output channel, times activations quantized to
FP8 per token at each call (the "dynamic per-token" scheme FP8 checkpoints are made for): on a
GPU that multiplies FP8 natively through `torch._scaled_mm`, and everywhere as the torch
reference below, which computes the same quantities in float32.

A per-tensor weight scale is the per-channel case with every channel's scale equal, so both
checkpoint strategies run the same path. Activation scale of row m: max |x[m]| / 448 (the
largest e4m3 value), so each row uses FP8's whole range; a zero row gets a tiny scale instead
of a division by zero.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_SCALE = 1e-12


def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """(x as FP8 [M, K], float32 scales [M, 1]) with x ≈ x8 * scale."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear_ref(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] times FP8 `weight` [N, K] with float32 `scale` [N], the activation quantized per
    token first; float32 arithmetic, the result in x's dtype."""
    x8, xs = quantize_per_token(x)
    out = (x8.float() * xs) @ (weight.float() * scale[:, None]).t()
    out = out.to(x.dtype)
    return out if bias is None else out + bias


def _scaled_mm(x: Tensor, weight: Tensor, scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    x8, xs = quantize_per_token(x)
    return torch._scaled_mm(
        x8, weight.t(), scale_a=xs, scale_b=scale[None, :].float(), out_dtype=out_dtype
    )


_NATIVE: dict[tuple, torch.dtype | None] = {}  # (device, dtype) -> _scaled_mm's out dtype


def native_out_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """Whether `torch._scaled_mm` runs here with row-wise scales, and with which output dtype
    (x's own, else bfloat16, which some builds require for row-wise scaling): checked once per
    device and dtype against `fp8_linear_ref` on a probe. None: use the reference."""
    key = (str(device), dtype)
    if key in _NATIVE:
        return _NATIVE[key]
    result = None
    if device.type == "cuda":
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 64, generator=g).to(device, dtype)
        w = (torch.randn(48, 64, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX).to(device, FP8)
        s = (torch.rand(48, generator=g) * 0.01 + 1e-3).to(device)
        want = fp8_linear_ref(x, w, s).float()
        for out_dtype in (dtype, torch.bfloat16):
            try:
                got = _scaled_mm(x, w, s, out_dtype).float()
            except Exception as e:  # no FP8 support on this GPU or build
                logger.debug("torch._scaled_mm with out_dtype %s: %s", out_dtype, e)
                continue
            if torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()):
                result = out_dtype
                break
        if result is None:
            logger.warning(
                "FP8 weights: torch._scaled_mm is unavailable or wrong on %s; using the "
                "dequantizing torch path (correct, slower)",
                torch.cuda.get_device_name(device),
            )
    _NATIVE[key] = result
    return result


def fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """`fp8_linear_ref`'s contract, natively where `native_out_dtype` allows (K and N multiples
    of 16, as `_scaled_mm` needs)."""
    n, k = weight.shape
    out_dtype = native_out_dtype(x.device, x.dtype) if n % 16 == 0 and k % 16 == 0 else None
    if out_dtype is None:
        return fp8_linear_ref(x, weight, scale, bias)
    out = _scaled_mm(x.contiguous(), weight, scale, out_dtype).to(x.dtype)
    return out if bias is None else out + bias

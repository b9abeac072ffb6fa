"""FP8 (e4m3) weights with a float32 scale per output channel, times activations quantized to
FP8 per token at each call (the "dynamic per-token" scheme FP8 checkpoints are made for): on a
GPU that multiplies FP8 natively through `torch._scaled_mm`, and everywhere as the torch
reference below, which computes the same quantities in float32.

A per-tensor weight scale is the per-channel case with every channel's scale equal, so both
checkpoint strategies run the same path. Activation scale of row m: max |x[m]| / 448 (the
largest e4m3 value), so each row uses FP8's whole range; a zero row gets a tiny scale instead
of a division by zero.

GPUs without FP8 arithmetic (before Ada/Hopper: the A100, A10, T4 and their kin) run the weight
only in 8 bits instead (W8A16, what vLLM does there too): a Triton GEMM reads the FP8 bytes,
decodes them inside its K loop to the activations' 16-bit type (exact: every e4m3 value is a
float16 and a bfloat16), multiplies the unquantized activations and applies the channel scales
to the sums. Its torch reference is `fp8_w8a16_ref`. The bytes are decoded with integer
operations (kernels/e4m3.py), not Triton's float8 type, which older GPUs' code generation
refuses; e4m3fn's NaN code (0x7F/0xFF) is not handled, and no checkpoint holds it. The kernel checks itself against
its reference once per device before its first use, and a device where it disagrees runs the
dequantizing reference with a warning.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from .e4m3 import e4m3_decode
from .triton_common import dot_acc, w_tile, x_tile
from .triton_lazy import jit
from .w4a16 import run_split_k, split_k_tile, store_split

tl = None  # triton.language, bound at the first launch (see triton_lazy)

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
    """The kernel path: `fp8_linear_ref`'s contract natively where `native_out_dtype` allows (K
    and N multiples of 16, as `_scaled_mm` needs), else the weight-only Triton GEMM
    (`fp8_w8a16_linear`, the contract of `fp8_w8a16_ref`) where it passed its self-check, else
    the dequantizing reference."""
    n, k = weight.shape
    out_dtype = native_out_dtype(x.device, x.dtype) if n % 16 == 0 and k % 16 == 0 else None
    if out_dtype is None:
        if w8a16_works(x.device, x.dtype):
            return fp8_w8a16_linear(x, weight, scale, bias)
        return fp8_linear_ref(x, weight, scale, bias)
    out = _scaled_mm(x.contiguous(), weight, scale, out_dtype).to(x.dtype)
    return out if bias is None else out + bias


# -- W8A16: the weight in FP8, the activations as they are (GPUs without FP8 arithmetic) ---------


def fp8_w8a16_ref(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] times FP8 `weight` [N, K] with float32 `scale` [N], the activations not
    quantized: float32 arithmetic, the result in x's dtype."""
    out = (x.float() @ weight.float().t()) * scale.float()
    out = out.to(x.dtype)
    return out if bias is None else out + bias


@jit
def _fp8_w8a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_os,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[split, m, n] = scale[n] * sum over this split's k of x[m, k] * w[n, k], w's e4m3 bytes
    decoded in the K loop (kernels/e4m3.py). float32 partial sums; the launcher adds the
    splits."""
    offs_m, mask_m, offs_n, mask_n, k_begin, k_end = split_k_tile(
        M, N, K, k_per_split, BLOCK_M, BLOCK_N
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = x_tile(x_ptr, stride_xm, offs_m, mask_m, offs_k, mask_k)
        byte = w_tile(w_ptr, stride_wn, offs_k, mask_k, offs_n, mask_n).to(tl.int32)  # 0..255
        acc = dot_acc(acc, x, e4m3_decode(byte))
    scale = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    store_split(out_ptr, acc * scale[None, :], offs_m, mask_m, offs_n, mask_n, stride_os, stride_om)


def fp8_w8a16_linear(
    x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None
) -> Tensor:
    """The Triton kernel with `fp8_w8a16_ref`'s contract; x [M, K] in float16, bfloat16 or
    float32 (float32 accumulation), `weight` [N, K] FP8 (or its bytes as uint8), row-major."""
    x = x.contiguous()
    if weight.stride(1) != 1:
        raise ValueError("fp8_w8a16_linear reads the weight row-major")
    wbytes = weight.view(torch.uint8)
    weights = (wbytes, scale.float().contiguous())
    return run_split_k(_fp8_w8a16_kernel, x, weight.shape[0], weights, (wbytes.stride(0),), bias)


_W8A16_OK: dict[tuple, bool] = {}  # (device, dtype) -> the kernel agreed with its reference


def w8a16_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `fp8_w8a16_linear` runs here and agrees with `fp8_w8a16_ref` on a probe that
    holds every e4m3 byte but NaN's (subnormals, both zeros, the largest values), checked once
    per device and dtype. False (with a warning) sends the caller to the reference."""
    key = (str(device), dtype)
    if key in _W8A16_OK:
        return _W8A16_OK[key]
    ok = False
    try:
        g = torch.Generator().manual_seed(0)
        codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
        w = codes[torch.randperm(len(codes), generator=g)][: 48 * 5].reshape(48, 5)
        w = w.repeat(1, 7)[:, :32].contiguous().view(FP8).to(device)  # [48, 32]
        x = torch.randn(3, 32, generator=g).to(device, dtype)
        s = (torch.rand(48, generator=g) * 0.01 + 1e-3).to(device)
        want = fp8_w8a16_ref(x, w, s).float()
        got = fp8_w8a16_linear(x, w, s).float()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        ok = torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item())
        if not ok:
            logger.warning(
                "FP8 weights: the W8A16 Triton kernel disagrees with its reference on %s "
                "(max difference %.3g); using the dequantizing torch path (correct, slower)",
                device,
                (got - want).abs().max().item(),
            )
    except Exception as e:  # noqa: BLE001 - any failure means: do not use the kernel here
        logger.warning("FP8 weights: the W8A16 Triton kernel failed on %s (%s: %s); using the "
                       "dequantizing torch path", device, type(e).__name__, e)  # fmt: skip
    _W8A16_OK[key] = ok
    return ok

"""FP8 (e4m3) weights with a scale per block of the weight (DeepSeek-V3's "fine-grained" FP8,
`weight_block_size: [128, 128]`, and compressed-tensors' `block` strategy): a Triton GEMM that
keeps the weight in 8 bits, and its torch reference (dequantize, then matmul).

The layout, as both formats write it: `weight` float8_e4m3fn [N, K] (nn.Linear's), and one
float scale per block of `block_n` output rows by `block_k` input columns, [ceil(N / block_n),
ceil(K / block_k)] (the last row and column of blocks may be partial); weight (n, k) =
weight[n, k] * scale[n // block_n, k // block_k]. DeepSeek names the scale `weight_scale_inv`,
compressed-tensors `weight_scale`; both multiply.

Here a weight's scale rows are found through `row_block` int32 [N], the scale row of each output
row (n // block_n for one checkpoint tensor). That is what lets the engine fuse parts (q, k, v;
gate, up) whose row counts are not multiples of block_n: each part keeps its own block grid,
the grids are stacked, and row_block points each row at its part's grid. The extra memory is 4
bytes per output row.

**The kernel: weight-only (W8A16), the block scale applied to each K tile's partial sums.**
Each program streams [BLOCK_K, BLOCK_N] tiles of the FP8 weight, converts them to the
activations' 16-bit type (exact: every e4m3 value is a float16 and a bfloat16 value), multiplies
the activations as they are (`tl.dot`, float32 accumulation) and multiplies that tile's float32
partial sums by the scales of its block column before adding them up. BLOCK_K (64) divides
block_k, so a tile never straddles two scale columns. Split K for few rows, as kernels/w4a16.py.

Why not quantize the activations to FP8 per token-group of 128 and multiply in FP8 (the
DeepSeek-V3 recipe, which doubles the tensor-core rate on Hopper)? Serving is mostly decoding, a
handful of rows per step, where the GEMM is bound by reading the weight: both forms read the
same 1 byte per weight, and the activation quantization would be one more pass (a launch and a
round trip through memory) per linear per step for no gain in bytes. W8A16 is also the more
exact of the two (only the checkpoint's own rounding: the CPU path, which dequantizes, and the
GPU compute the same function up to float summation order), and it runs on every GPU from sm80
on: Ada/Hopper convert the bytes with Triton's e4m3 type, older GPUs with the integer codec of
kernels/e4m3.py. What it gives up is the FP8 tensor-core rate in large prefills (compute
bound): there it runs at the 16-bit rate. bench/fp8_block_gemm.py measures it against bf16
matmul at M = 1, 16 and 256.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from .e4m3 import e4m3_as_bytes, e4m3_decode
from .triton_common import w_tile, x_tile
from .triton_lazy import cdiv, jit
from .w4a16 import run_split_k, split_k_tile, store_split

tl = None  # triton.language, bound at the first launch (see triton_lazy)

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
KERNEL_BLOCK_K = 64  # the GEMM's K tile (kernels/w4a16.py `_gemm_blocks`): divides block_k


def block_rows(n: int, block_n: int, device=None) -> Tensor:
    """The scale row of each of `n` output rows of one checkpoint tensor: n // block_n, int32."""
    return (torch.arange(n, device=device) // block_n).to(torch.int32)


def fp8_block_dequantize(
    weight: Tensor, scale: Tensor, row_block: Tensor, block_k: int, dtype=torch.float32
) -> Tensor:
    """The float weight [N, K]: each e4m3 value times its block's scale, in float32 (exact: a
    3-bit mantissa times a float32 scale), then `dtype`. `weight` float8_e4m3fn or its bytes."""
    w = weight.view(FP8) if weight.dtype == torch.uint8 else weight
    k = w.shape[1]
    s = scale.float()[row_block.long()]  # [N, K blocks]
    s = s.repeat_interleave(block_k, dim=1)[:, :k]
    return (w.float() * s).to(dtype)


def fp8_block_ref(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    row_block: Tensor,
    block_k: int,
    bias: Tensor | None = None,
) -> Tensor:
    """x [M, K] times the block-scaled FP8 weight [N, K], dequantized first (float32 arithmetic);
    the result in x's dtype, plus `bias`."""
    w = fp8_block_dequantize(weight, scale, row_block, block_k)
    out = (x.float() @ w.t()).to(x.dtype)
    return out if bias is None else out + bias


@jit
def _fp8_block_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    srow_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_sr,
    stride_os,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_K: tl.constexpr,
    E4M3_BYTES: tl.constexpr,
):
    """out[split, m, n] = sum over this split's K tiles t of scale[row_block[n], t // SCALE_K]
    * sum over k in t of x[m, k] * w[n, k]. The weight is float8 (Triton's e4m3 type), or its
    bytes decoded with integer operations when E4M3_BYTES (GPUs before sm89). float32 partial
    sums; the launcher adds the splits."""
    offs_m, mask_m, offs_n, mask_n, k_begin, k_end = split_k_tile(
        M, N, K, k_per_split, BLOCK_M, BLOCK_N
    )
    srow = tl.load(srow_ptr + offs_n, mask=mask_n, other=0)
    s_rows = s_ptr + srow.to(tl.int64) * stride_sr  # each column's row of block scales
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = x_tile(x_ptr, stride_xm, offs_m, mask_m, offs_k, mask_k)
        if E4M3_BYTES:
            w = e4m3_decode(w_tile(w_ptr, stride_wn, offs_k, mask_k, offs_n, mask_n).to(tl.int32))
        else:  # Triton's e4m3 type: the masked lanes' `other` must be a float
            w = tl.load(
                w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                mask=mask_k[:, None] & mask_n[None, :],
                other=0.0,
            )
        if x.dtype == tl.float32:
            part = tl.dot(x, w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, w.to(x.dtype))
        scale = tl.load(s_rows + k0 // SCALE_K, mask=mask_n, other=0.0)
        acc += part * scale[None, :]
    store_split(out_ptr, acc, offs_m, mask_m, offs_n, mask_n, stride_os, stride_om)


def fp8_block_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    row_block: Tensor,
    block_k: int,
    bias: Tensor | None = None,
    e4m3_bytes: bool | None = None,
) -> Tensor:
    """The Triton kernel with `fp8_block_ref`'s contract; x [M, K] in float16, bfloat16 or
    float32 (float32 accumulation), `weight` [N, K] float8_e4m3fn or its bytes (uint8),
    row-major; `scale` float32 [rows of blocks, ceil(K / block_k)]; block_k a multiple of 64.
    `e4m3_bytes`: decode the bytes with integer operations (default: on GPUs before sm89)."""
    if block_k % KERNEL_BLOCK_K:
        raise ValueError(f"fp8_block_linear: block_k {block_k} is not a multiple of 64")
    if weight.stride(1) != 1:
        raise ValueError("fp8_block_linear reads the weight row-major")
    n, k = weight.shape
    if scale.shape[1] != cdiv(k, block_k) or row_block.shape != (n,):
        raise ValueError(
            f"fp8_block_linear: scales {tuple(scale.shape)} and row_block "
            f"{tuple(row_block.shape)} do not fit a [{n}, {k}] weight in blocks of {block_k}"
        )
    if e4m3_bytes is None:
        e4m3_bytes = e4m3_as_bytes(FP8, x.device)
    w = weight.view(torch.uint8) if e4m3_bytes else weight.view(FP8)
    scale = scale.float().contiguous()
    weights = (w, scale, row_block.to(torch.int32).contiguous())
    strides = (w.stride(0), scale.stride(0))
    flags = dict(SCALE_K=block_k, E4M3_BYTES=e4m3_bytes)
    return run_split_k(_fp8_block_kernel, x.contiguous(), n, weights, strides, bias, **flags)


_WORKS: dict[tuple, bool] = {}  # (device, dtype) -> the kernel agreed with its reference


def block_kernel_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `fp8_block_linear` runs here and agrees with `fp8_block_ref` on a probe (every
    e4m3 code but NaN's, two rows of blocks, a partial block column), once per device and
    dtype. False (with a warning) sends the caller to the reference."""
    key = (str(device), dtype)
    if key in _WORKS:
        return _WORKS[key]
    ok = False
    try:
        g = torch.Generator().manual_seed(0)
        codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
        w = codes[torch.randint(0, len(codes), (48, 160), generator=g)].view(FP8).to(device)
        scale = (torch.rand(2, 3, generator=g) * 0.01 + 1e-3).to(device)
        rows = block_rows(48, 32, device)
        x = torch.randn(3, 160, generator=g).to(device, dtype)
        want = fp8_block_ref(x, w, scale, rows, 64).float()
        got = fp8_block_linear(x, w, scale, rows, 64).float()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        ok = torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item())
        if not ok:
            logger.warning(
                "block FP8 weights: the Triton GEMM disagrees with its reference on %s (max "
                "difference %.3g); using the dequantizing torch path (correct, slower)",
                device,
                (got - want).abs().max().item(),
            )
    except Exception as e:  # noqa: BLE001 - any failure means: do not use the kernel here
        logger.warning("block FP8 weights: the Triton GEMM failed on %s (%s: %s); using the "
                       "dequantizing torch path", device, type(e).__name__, e)  # fmt: skip
    _WORKS[key] = ok
    return ok


def fp8_block_forward(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    row_block: Tensor,
    block_k: int,
    use_kernels: bool,
    bias: Tensor | None = None,
) -> Tensor:
    """The layer's path: the Triton GEMM where kernels are in use, block_k suits it and it
    passed its self-check on this device; else the reference."""
    if use_kernels and block_k % KERNEL_BLOCK_K == 0 and block_kernel_works(x.device, x.dtype):
        return fp8_block_linear(x, weight, scale, row_block, block_k, bias)
    return fp8_block_ref(x, weight, scale, row_block, block_k, bias)

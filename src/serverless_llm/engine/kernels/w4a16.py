"""Integer-weight checkpoints (GPTQ, AWQ): how their packed tensors read, as torch references.

Issue 16 builds a Triton W4A16 GEMM on these layouts; this module holds the references it will
be tested against (dequantize, then matmul), written from the formats as their producers
document and write them:

- **GPTQ** (AutoGPTQ / GPTQModel, the "v1" checkpoint format transformers and vLLM read):
  `qweight` int32 [in / p, out] where p = 32 / bits, each int32 holding p consecutive *input*
  rows of one output column, the first in the lowest bits; `qzeros` int32 [groups, out / p],
  packed the same way along the *output* columns, each stored as the zero point minus one;
  `scales` [groups, out]; `g_idx` int32 [in], the group of each input row (i // group_size
  unless the checkpoint was quantized in activation order, desc_act). Weight (i, o) is
  scales[g, o] * (q[i, o] - (stored_zero[g, o] + 1)) with g = g_idx[i].
- **AWQ**, GEMM layout (AutoAWQ): `qweight` int32 [in, out / 8], each int32 holding 8 *output*
  columns of one input row, in the interleaved order AWQ_ORDER (field k, bits 4k..4k+3, holds
  column 8c + AWQ_ORDER[k]); `qzeros` int32 [groups, out / 8] in the same order, stored as is;
  `scales` [groups, out]. Weight (i, o) is scales[g, o] * (q[i, o] - zero[g, o]) with
  g = i // group_size.

Both dequantize to nn.Linear's [out, in] layout in the scales' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .triton_common import dot_acc, x_tile
from .triton_lazy import cdiv, jit

tl = None  # triton.language, bound at the first launch (see triton_lazy)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field k of an AWQ int32 holds column AWQ_ORDER[k]


def unpack_int32(packed: Tensor, bits: int, dim: int, order: Sequence[int] | None = None) -> Tensor:
    """The `bits`-wide unsigned fields of int32 `packed`, 32 // bits per element, laid out along
    `dim` (which grows by that factor), lowest bits first; with `order`, field k of each element
    goes to position order[k] of its group. int32 result."""
    if 32 % bits:
        raise ValueError(f"{bits}-bit fields do not tile an int32")
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    mask = (1 << bits) - 1
    moved = packed.movedim(dim, -1).to(torch.int32)
    fields = (moved.unsqueeze(-1) >> shifts) & mask  # [..., n, per]: field k at index k
    if order is not None:
        if sorted(order) != list(range(per)):
            raise ValueError(f"order {list(order)} is not a permutation of 0..{per - 1}")
        inverse = [0] * per
        for k, pos in enumerate(order):
            inverse[pos] = k
        fields = fields[..., inverse]  # position j takes the field that holds it
    return fields.flatten(-2).movedim(-1, dim)


def dequantize_gptq(
    qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int
) -> Tensor:
    """A GPTQ (v1) linear's weight, [out, in] in the scales' dtype."""
    q = unpack_int32(qweight, bits, dim=0)  # [in, out]
    zeros = unpack_int32(qzeros, bits, dim=1) + 1  # [groups, out]
    if q.shape[0] != g_idx.shape[0] or zeros.shape != scales.shape:
        raise ValueError(
            f"GPTQ shapes disagree: qweight gives {tuple(q.shape)}, g_idx {tuple(g_idx.shape)}, "
            f"qzeros {tuple(zeros.shape)}, scales {tuple(scales.shape)}"
        )
    g = g_idx.long()
    w = (q - zeros[g]).to(scales.dtype) * scales[g]
    return w.t().contiguous()


def dequantize_awq(qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int) -> Tensor:
    """An AWQ (GEMM layout, 4-bit) linear's weight, [out, in] in the scales' dtype."""
    q = unpack_int32(qweight, 4, dim=1, order=AWQ_ORDER)  # [in, out]
    zeros = unpack_int32(qzeros, 4, dim=1, order=AWQ_ORDER)  # [groups, out]
    groups = -(-q.shape[0] // group_size)
    if zeros.shape != scales.shape or zeros.shape[0] != groups or q.shape[1] != scales.shape[1]:
        raise ValueError(
            f"AWQ shapes disagree: qweight gives {tuple(q.shape)}, qzeros {tuple(zeros.shape)}, "
            f"scales {tuple(scales.shape)}, group size {group_size}"
        )
    g = torch.arange(q.shape[0], device=q.device) // group_size
    w = (q - zeros[g]).to(scales.dtype) * scales[g]
    return w.t().contiguous()


def pack_int32(values: Tensor, bits: int, dim: int) -> Tensor:
    """The inverse of `unpack_int32` without an order: `values` (0 <= v < 2**bits) laid out
    along `dim`, 32 // bits to an int32, the first in the lowest bits."""
    per = 32 // bits
    moved = values.movedim(dim, -1).to(torch.int64)
    if moved.shape[-1] % per:
        raise ValueError(f"{moved.shape[-1]} values do not fill {bits}-bit int32 words")
    fields = moved.reshape(*moved.shape[:-1], -1, per)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    words = (fields << shifts).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # two's complement int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def dequantize_grouped(q: Tensor, zeros: Tensor, scales: Tensor, g_idx: Tensor) -> Tensor:
    """Weight [out, in] in float32 from unpacked values q [out, in], zeros and scales
    [out, groups] and the group of each input column g_idx [in]: (q - zero) * scale, computed
    exactly (an integer times a 16-bit scale fits float32's mantissa)."""
    g = g_idx.long()
    return (q.float() - zeros.float()[:, g]) * scales.float()[:, g]


def w4a16_linear_ref(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor,
    g_idx: Tensor,
    perm: Tensor | None,
    bits: int,
    bias: Tensor | None = None,
) -> Tensor:
    """The engine's packed integer-weight linear, as torch: x [M, in] times the weight held as
    `qweight` int32 [in / (32 / bits), out] (input rows packed, lowest bits first, in the order
    `perm` gives: row j is input column perm[j]), `scales` and `zeros` [groups, out] and
    g_idx [in] (the group of packed row j). Dequantizes the whole weight, then matmuls."""
    q = unpack_int32(qweight, bits, dim=0)  # [in, out]
    g = g_idx.long()
    w = (q.float() - zeros.float()[g]) * scales.float()[g]
    xs = x if perm is None else x.index_select(-1, perm)
    out = torch.matmul(xs.float(), w).to(x.dtype)
    return out if bias is None else out + bias


# -- the Triton GEMM -----------------------------------------------------------------------------


@jit
def _w4a16_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_os,
    stride_om,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[split, m, n] = sum over this split's k of x[m, k] * w[k, n], w dequantized in the K
    loop: field k % (32 / BITS) of qweight row k // (32 / BITS), minus the zero point and times
    the scale of group g_idx[k]. float32 partial sums; the launcher adds the splits."""
    offs_m, mask_m, offs_n, mask_n, k_begin, k_end = split_k_tile(
        M, N, K, k_per_split, BLOCK_M, BLOCK_N
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = x_tile(x_ptr, stride_xm, offs_m, mask_m, offs_k, mask_k)
        w = int_weight_tile(
            qw_ptr, s_ptr, z_ptr, g_ptr, stride_qk, stride_sg, offs_k, mask_k, offs_n, mask_n, BITS
        )
        acc = dot_acc(acc, x, w)
    store_split(out_ptr, acc, offs_m, mask_m, offs_n, mask_n, stride_os, stride_om)


@jit
def int_weight_tile(
    qw_ptr, s_ptr, z_ptr, g_ptr, stride_qk, stride_sg, offs_k, mask_k, offs_n, mask_n,
    BITS: tl.constexpr,
):  # fmt: skip
    """The float32 [BLOCK_K, BLOCK_N] weight tile of packed rows `offs_k` (this module's
    layout; kernels/fused_moe_w4a16.py passes an expert's pointers): field k % (32 / BITS) of
    qweight row k // (32 / BITS), minus the zero point and times the scale of group g_idx[k]."""
    per = 32 // BITS
    mask_kn = mask_k[:, None] & mask_n[None, :]
    words = tl.load(
        qw_ptr + (offs_k // per)[:, None].to(tl.int64) * stride_qk + offs_n[None, :],
        mask=mask_kn,
        other=0,
    )
    q = (words >> ((offs_k % per) * BITS)[:, None]) & ((1 << BITS) - 1)
    g = tl.load(g_ptr + offs_k, mask=mask_k, other=0)
    at = g[:, None].to(tl.int64) * stride_sg + offs_n[None, :]
    s = tl.load(s_ptr + at, mask=mask_kn, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + at, mask=mask_kn, other=0.0).to(tl.float32)
    return (q.to(tl.float32) - z) * s


# The pieces every weight-streaming split-K GEMM of this layout shares (this module's and
# kernels/fp8.py's): program (m tile, n tile, split) owns out[split, tile] over its share of K.
# (Their activation tile and dot, which every GEMM kernel shares, are in kernels/triton_common.py.)


@jit
def split_k_tile(M, N, K, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows and columns (with their masks) and its K range [k_begin, k_end)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(2) * k_per_split
    return offs_m, offs_m < M, offs_n, offs_n < N, k_begin, tl.minimum(k_begin + k_per_split, K)


@jit
def store_split(out_ptr, acc, offs_m, mask_m, offs_n, mask_n, stride_os, stride_om):
    """This program's float32 partial sums into out[split]."""
    out = out_ptr + tl.program_id(2) * stride_os
    out += offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


def _gemm_blocks(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, splits of K). Few rows (decoding) read the weight once with
    narrow tiles, and split K so that enough programs run to pull the weight from memory at
    full bandwidth; many rows use wider tiles. Every size a power of two, at least 16 (tl.dot)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 32 else 128
    block_k = 64
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    k_blocks = cdiv(k, block_k)
    splits = 1
    if m <= 32:
        while splits * 2 <= k_blocks // 2 and tiles * splits < 512:
            splits *= 2
    return block_m, block_n, block_k, splits


def w4a16_linear(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor,
    g_idx: Tensor,
    perm: Tensor | None,
    bits: int,
    bias: Tensor | None = None,
) -> Tensor:
    """The Triton kernel with `w4a16_linear_ref`'s contract (the same packed layout); x [M, in]
    in float16, bfloat16 or float32 (float32 accumulation), the result in x's dtype."""
    if perm is not None:
        x = x.index_select(-1, perm)
    x = x.contiguous()
    if not (qweight.stride(1) == scales.stride(1) == zeros.stride(1) == 1):
        raise ValueError("w4a16_linear reads qweight, scales and zeros row-major")
    return run_split_k(
        _w4a16_kernel,
        x,
        qweight.shape[1],
        (qweight, scales, zeros, g_idx),
        (qweight.stride(0), scales.stride(0)),
        bias,
        BITS=bits,
    )


def run_split_k(kernel, x: Tensor, n: int, weights: tuple, weight_strides: tuple, bias, **flags):
    """Launches a weight-streaming GEMM kernel of this layout (this module's and kernels/fp8.py's
    W8A16): arguments x, the weight's tensors, the float32 partial sums, M, N, K, k_per_split,
    x's row stride, the weight's strides, the partial sums' strides, then BLOCK_M/N/K and
    `flags`. Tiles and K splits from `_gemm_blocks`; returns the splits' sum in x's dtype, plus
    `bias`."""
    m, k = x.shape
    block_m, block_n, block_k, splits = _gemm_blocks(m, n, k)
    k_per_split = cdiv(cdiv(k, splits), block_k) * block_k
    splits = cdiv(k, k_per_split)
    partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (cdiv(m, block_m), cdiv(n, block_n), splits)
    kernel[grid](
        x,
        *weights,
        partial,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        *weight_strides,
        partial.stride(0),
        partial.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        **flags,
    )
    out = (partial[0] if splits == 1 else partial.sum(0)).to(x.dtype)
    return out if bias is None else out + bias

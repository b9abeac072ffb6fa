"""The mixture-of-experts MLP on MXFP4 expert weights (gpt-oss), kept 4-bit: the grouped GEMM of
kernels/fused_moe.py with an E2M1 decoder in its K loop (weight-only, W4A16-style: the
activations stay in their 16- or 32-bit type), and its torch reference.

`Mxfp4Experts` holds one projection of E experts as the checkpoint stores it, with each block's
16 bytes run together along the input: `blocks` uint8 [E, N, K / 2] (two E2M1 codes a byte, the
even input column in the low nibble) and `scales` uint8 [E, N, K / 32] (E8M0: 2^(s - 127) for
the 32 columns of a block); kernels/mxfp4.py describes the format. Weight (n, k) of expert e is
e2m1(code) * 2^(scales[e, n, k // 32] - 127). A quarter of the bytes of bfloat16 experts (plus a
scale byte per 32 values).

The kernel decodes each [BLOCK_K, BLOCK_N] weight tile with integer ops (each code's float32
bits: sign, exponent, mantissa moved into place; the scale byte is a float32 exponent field),
scales it by its block's power of two in float32 and multiplies the activations as they are;
the tiles, the alignment and the biases are fused_moe's. (A scale byte of 0, 2^-127, reads as
0 in the kernel: no trained weight sits there.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .fused_moe import expert_block, fused_moe_reference, run_experts, store_rows
from .mxfp4 import BLOCK, mxfp4_dequantize
from .triton_common import dot_acc, x_tile
from .triton_lazy import cdiv, jit

tl = None  # triton.language, bound at the first launch (see triton_lazy)


@dataclass
class Mxfp4Experts:
    blocks: Tensor  # uint8 [E, N, K / 2]
    scales: Tensor  # uint8 [E, N, K / 32]

    @property
    def num_experts(self) -> int:
        return self.blocks.shape[0]

    @property
    def out_features(self) -> int:
        return self.blocks.shape[1]

    @property
    def in_features(self) -> int:
        return self.blocks.shape[2] * 2

    @staticmethod
    def from_checkpoint(blocks: Tensor, scales: Tensor) -> Mxfp4Experts:
        """From a checkpoint's `*_blocks` [E, N, K / 32, 16] and `*_scales` [E, N, K / 32]."""
        if blocks.dim() != 4 or blocks.shape[-1] != BLOCK // 2:
            raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)}: expected [E, N, K / 32, 16]")
        if tuple(blocks.shape[:-1]) != tuple(scales.shape):
            raise ValueError(
                f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} disagree"
            )
        return Mxfp4Experts(blocks.flatten(2).contiguous(), scales.contiguous())

    def dequantize(self, e: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """Expert e's weight [N, K] in `dtype`."""
        blocks = self.blocks[e].view(self.out_features, -1, BLOCK // 2)
        return mxfp4_dequantize(blocks, self.scales[e], dtype)


def fused_moe_mxfp4_reference(
    x: Tensor,
    w13: Mxfp4Experts,
    w2: Mxfp4Experts,
    weights: Tensor,
    ids: Tensor,
    act="silu",
    b13: Tensor | None = None,
    b2: Tensor | None = None,
) -> Tensor:
    """The experts that received a token dequantized (x's dtype), then the float path
    (fused_moe_reference)."""

    class _Lazy:
        def __init__(self, packed: Mxfp4Experts) -> None:
            self.packed = packed

        def __len__(self) -> int:
            return self.packed.num_experts

        def __getitem__(self, e: int) -> Tensor:
            return self.packed.dequantize(e, x.dtype)

    return fused_moe_reference(x, _Lazy(w13), _Lazy(w2), weights, ids, act, b13=b13, b2=b2)


@jit
def mxfp4_weight_tile(b_ptr, s_ptr, stride_bn, stride_sn, offs_k, mask_k, offs_n, mask_n):
    """The float32 [BLOCK_K, BLOCK_N] tile of w^T for w [N, K] in MXFP4 (bytes [N, K / 2], scale
    bytes [N, K / 32]), zeros outside."""
    mask = mask_k[:, None] & mask_n[None, :]
    rows = offs_n[None, :].to(tl.int64)
    byte = tl.load(b_ptr + rows * stride_bn + (offs_k // 2)[:, None], mask=mask, other=0)
    code = (byte.to(tl.int32) >> ((offs_k % 2) * 4)[:, None]) & 15
    # The code's float32 bits: E2M1's exponent e (bias 1) is float32's e + 126 with the
    # mantissa bit on top of its fraction; e = 0 is 0 or the subnormal 0.5 (2^-1); the sign
    # bit moves from bit 3 to bit 31.
    exponent = (code >> 1) & 3
    mantissa = code & 1
    bits = tl.where(
        exponent > 0, ((exponent + 126) << 23) | (mantissa << 22), mantissa * (126 << 23)
    )
    value = (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)
    # E8M0's byte s is float32's exponent field of 2^(s - 127) (s = 0: 0.0, not 2^-127)
    scale = tl.load(s_ptr + rows * stride_sn + (offs_k // 32)[:, None], mask=mask, other=127)
    return value * (scale.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@jit
def _moe_mxfp4_kernel(
    a_ptr,
    b_ptr,
    s_ptr,
    out_ptr,
    rows_ptr,
    block_expert_ptr,
    weight_ptr,
    bias_ptr,
    N,
    K,
    num_rows,
    stride_am,
    stride_be,
    stride_bn,
    stride_se,
    stride_sn,
    stride_biase,
    stride_om,
    A_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[r, n] = sum over k of a[r // A_DIV, k] * w[e, n, k] (+ bias[e, n] with HAS_BIAS) for
    the rows r of this block (one expert e), w decoded from MXFP4 in the K loop; times weight[r]
    when MUL_WEIGHT. Sentinel rows are neither read nor written; expert -1 returns at once."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows, mask_m, a_rows, offs_n, mask_n = expert_block(
        rows_ptr, pid_m, pid_n, N, num_rows, A_DIV, BLOCK_M, BLOCK_N
    )
    e64 = expert.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = x_tile(a_ptr, stride_am, a_rows, mask_m, offs_k, mask_k)
        w = mxfp4_weight_tile(
            b_ptr + e64 * stride_be,
            s_ptr + e64 * stride_se,
            stride_bn,
            stride_sn,
            offs_k,
            mask_k,
            offs_n,
            mask_n,
        )
        acc = dot_acc(acc, a, w)
    if HAS_BIAS:
        e_bias = bias_ptr + e64 * stride_biase
        acc += tl.load(e_bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    store_rows(out_ptr, acc, rows, mask_m, offs_n, mask_n, stride_om, weight_ptr, MUL_WEIGHT, False)


def mxfp4_gemm(a, w: Mxfp4Experts, rows, block_expert, weights, num_rows, a_div, tiles, bias=None):
    """`grouped_gemm`'s contract (kernels/fused_moe.py) over MXFP4 experts."""
    block_m, block_n, block_k, warps = tiles
    n, k = w.out_features, w.in_features
    if k % BLOCK:
        raise ValueError(f"MXFP4 experts of {k} inputs: a multiple of {BLOCK} expected")
    out = torch.empty(num_rows, n, dtype=a.dtype, device=a.device)
    grid = (block_expert.numel(), cdiv(n, block_n))
    _moe_mxfp4_kernel[grid](
        a,
        w.blocks,
        w.scales,
        out,
        rows,
        block_expert,
        weights if weights is not None else a,
        bias if bias is not None else a,
        n,
        k,
        num_rows,
        a.stride(0),
        w.blocks.stride(0),
        w.blocks.stride(1),
        w.scales.stride(0),
        w.scales.stride(1),
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        A_DIV=a_div,
        MUL_WEIGHT=weights is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    return out


def fused_moe_mxfp4(
    x: Tensor,
    w13: Mxfp4Experts,
    w2: Mxfp4Experts,
    weights: Tensor,
    ids: Tensor,
    act="silu",
    b13: Tensor | None = None,
    b2: Tensor | None = None,
) -> Tensor:
    """The Triton path with `fused_moe_mxfp4_reference`'s contract; x [T, H] in float16,
    bfloat16 or float32, the result in x's dtype."""
    return run_experts(x, w13, w2, weights, ids, w13.num_experts, mxfp4_gemm, act, True, b13, b2)

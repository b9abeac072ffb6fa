"""The mixture-of-experts MLP on 4/8-bit expert weights (GPTQ, AWQ, compressed-tensors
pack-quantized), kept packed: the grouped GEMM of kernels/fused_moe.py with the W4A16 GEMM's
dequantize in the K loop (kernels/w4a16.py), and its torch reference.

The experts of one projection are stacked in `PackedExperts`, the layout of w4a16.py per
expert: `qweight` int32 [E, in / (32 / bits), out] (input rows packed, lowest bits first, rows
sorted by group), `scales` and `zeros` [E, groups, out], `g_idx` int32 [E, in] (the group of
each packed row) and `perm` int64 [E, in] (the input column of each packed row; act-order) or
None when every expert's rows are in order. Weight (row j, column o) of expert e is
(q - zeros[e, g, o]) * scales[e, g, o] with g = g_idx[e, j], applied to input column
perm[e, j].

The kernel reads each block's expert's packed tile once per BLOCK_M rows, gathers the input
columns through the expert's `perm` when there is one, and accumulates in float32; the tiles
and the alignment are fused_moe's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .fused_moe import expert_block, fused_moe_reference, run_experts, store_rows
from .triton_common import dot_acc, x_tile
from .triton_lazy import cdiv, jit
from .w4a16 import int_weight_tile, pack_int32, unpack_int32

tl = None  # triton.language, bound at the first launch (see triton_lazy)


@dataclass
class PackedExperts:
    qweight: Tensor  # int32 [E, in / per, out]
    scales: Tensor  # [E, groups, out]
    zeros: Tensor  # [E, groups, out], in the scales' dtype
    g_idx: Tensor  # int32 [E, in]
    perm: Tensor | None  # int64 [E, in]
    bits: int

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[2]

    def to(self, device) -> PackedExperts:
        move = [t.to(device) for t in (self.qweight, self.scales, self.zeros, self.g_idx)]
        perm = None if self.perm is None else self.perm.to(device)
        return PackedExperts(*move, perm, self.bits)

    def dequantize(self, e: int) -> Tensor:
        """Expert e's float32 weight [out, in], columns in input order."""
        q = unpack_int32(self.qweight[e], self.bits, dim=0)  # [in (packed order), out]
        g = self.g_idx[e].long()
        w = (q.float() - self.zeros[e].float()[g]) * self.scales[e].float()[g]  # [in, out]
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(0, self.perm[e], w)
        return w.t()


def pack_experts(forms: list[tuple], bits: int) -> PackedExperts:
    """Stacks each expert's unpacked weight (q [out, in] integers, zeros and scales
    [out, groups], g_idx [in], as QuantLinear unpacks a checkpoint) into `PackedExperts`:
    rows sorted by group (act-order becomes `perm`), packed along the input."""
    qws, scales, zeros, g_idxs, perms = [], [], [], [], []
    for q, z, s, g in forms:
        g = g.long()
        perm = torch.argsort(g, stable=True)
        q, g = q[:, perm], g[perm]
        qws.append(pack_int32(q.t(), bits, dim=0))
        scales.append(s.t().contiguous())
        zeros.append(z.t().to(s.dtype).contiguous())
        g_idxs.append(g.to(torch.int32))
        perms.append(perm)
    ordered = all(torch.equal(p, torch.arange(len(p))) for p in perms)
    return PackedExperts(
        torch.stack(qws),
        torch.stack(scales),
        torch.stack(zeros),
        torch.stack(g_idxs),
        None if ordered else torch.stack(perms),
        bits,
    )


def fused_moe_w4a16_reference(
    x: Tensor,
    w13: PackedExperts,
    w2: PackedExperts,
    weights: Tensor,
    ids: Tensor,
    act: str = "silu",
) -> Tensor:
    """Each expert dequantized, then the float path (fused_moe_reference), in x's dtype."""

    class _Lazy:  # dequantizes only the experts that received a token
        def __init__(self, packed: PackedExperts) -> None:
            self.packed = packed

        def __len__(self) -> int:
            return self.packed.num_experts

        def __getitem__(self, e: int) -> Tensor:
            return self.packed.dequantize(e).to(x.dtype)

    return fused_moe_reference(x, _Lazy(w13), _Lazy(w2), weights, ids, act)


@jit
def _moe_w4a16_kernel(
    a_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    perm_ptr,
    out_ptr,
    rows_ptr,
    block_expert_ptr,
    weight_ptr,
    N,
    K,
    num_rows,
    stride_am,
    stride_qe,
    stride_qk,
    stride_se,
    stride_sg,
    stride_ge,
    stride_om,
    BITS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    A_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[r, n] = sum over packed rows j of a[r // A_DIV, perm[e, j]] * w[e, j, n] for the
    rows r of this block (one expert e), w dequantized in the K loop; times weight[r] when
    MUL_WEIGHT. Sentinel rows are neither read nor written; expert -1 returns at once."""
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
        if HAS_PERM:
            cols = tl.load(perm_ptr + e64 * stride_ge + offs_k, mask=mask_k, other=0)
        else:
            cols = offs_k
        a = x_tile(a_ptr, stride_am, a_rows, mask_m, cols, mask_k)
        w = int_weight_tile(
            qw_ptr + e64 * stride_qe,
            s_ptr + e64 * stride_se,
            z_ptr + e64 * stride_se,
            g_ptr + e64 * stride_ge,
            stride_qk,
            stride_sg,
            offs_k,
            mask_k,
            offs_n,
            mask_n,
            BITS,
        )
        acc = dot_acc(acc, a, w)
    store_rows(out_ptr, acc, rows, mask_m, offs_n, mask_n, stride_om, weight_ptr, MUL_WEIGHT, False)


def _packed_gemm(a, w: PackedExperts, rows, block_expert, weights, num_rows, a_div, tiles):
    block_m, block_n, block_k, warps = tiles
    n, k = w.out_features, w.g_idx.shape[1]
    out = torch.empty(num_rows, n, dtype=a.dtype, device=a.device)
    perm = w.perm if w.perm is not None else w.g_idx
    grid = (block_expert.numel(), cdiv(n, block_n))
    _moe_w4a16_kernel[grid](
        a,
        w.qweight,
        w.scales,
        w.zeros,
        w.g_idx,
        perm,
        out,
        rows,
        block_expert,
        weights if weights is not None else a,
        n,
        k,
        num_rows,
        a.stride(0),
        w.qweight.stride(0),
        w.qweight.stride(1),
        w.scales.stride(0),
        w.scales.stride(1),
        w.g_idx.stride(0),
        out.stride(0),
        BITS=w.bits,
        HAS_PERM=w.perm is not None,
        A_DIV=a_div,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    return out


def fused_moe_w4a16(
    x: Tensor,
    w13: PackedExperts,
    w2: PackedExperts,
    weights: Tensor,
    ids: Tensor,
    act: str = "silu",
) -> Tensor:
    """The Triton path with `fused_moe_w4a16_reference`'s contract; x [T, H] in float16,
    bfloat16 or float32, the result in x's dtype."""
    return run_experts(x, w13, w2, weights, ids, w13.num_experts, _packed_gemm, act)

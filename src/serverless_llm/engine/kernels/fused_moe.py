"""The mixture-of-experts MLP: a Triton grouped GEMM over tokens sorted by expert, and its torch
reference (the CPU path).

Each token goes to `top_k` experts; the (token, slot) pairs are its T * top_k "rows". Both paths
compute, for every token t,

    out[t] = sum over j < top_k of weight[t, j] * W2[e] @ act_and_mul(W13[e] @ x[t]),  e = ids[t, j]

with W13 [E, 2I, H] (each expert's gate rows, then its up rows) and W2 [E, H, I]. Non-gated
experts (`gated=False`, Nemotron-H's relu^2 experts) have W13 [E, I, H], their up rows alone,
and apply act(W13[e] @ x[t]) in place of act_and_mul. Experts with biases (gpt-oss: `b13`
[E, 2I], `b2` [E, H]) add b13[e] to the gate/up product and b2[e] to the down product, before
the router weight.

**Reference** (`fused_moe_reference`): the rows gathered in expert order, one pair of matmuls per
expert that received any row (an expert with no row costs nothing), each output scaled by its
router weight in x's dtype and the top_k outputs of a token summed in expert order.

**Kernel** (`fused_moe`): `moe_align` sorts the rows by expert and pads each expert's run to a
multiple of BLOCK_M with a sentinel row, so every block of BLOCK_M sorted rows belongs to one
expert; `block_expert` names it (-1 for the blocks past the end). One launch of
`_moe_gemm_kernel` computes the gate/up GEMM for every block (reading its expert's weight tile
once per BLOCK_M rows, the x rows gathered by index), the gated activation runs on the
[rows, 2I] result, and a second launch the down GEMM with the router weight applied in float32
before the store. The top_k outputs of a token are then summed. The alignment is torch ops with
no host synchronisation and a grid sized by an upper bound (T * top_k + min(T * top_k, E) *
(BLOCK_M - 1) rows), so a decode step that uses it can be captured in a CUDA graph.

**Tiles** (`moe_tiles`): the rows per active expert decide BLOCK_M. A decode step sends one or
a few rows to each expert, so a 16-row tile (the least tl.dot takes) wastes the least on padding
while still reading each weight tile once; a prefill sends dozens to hundreds, and 32- or
64-row tiles reuse each weight tile over more rows. BLOCK_N is 64 for narrow row tiles (more
programs to cover the weight when there are few blocks) and 128 for 64-row tiles; BLOCK_K is 64
for 16-bit inputs and 32 for float32 (half the bytes per K step, the same shared memory).

**FP8 experts** (`Fp8Experts`, `fused_moe_fp8`): an FP8 checkpoint's experts kept as their e4m3
bytes [E, N, K] with a float32 scale per expert and output channel [E, N]. The same kernel
decodes each weight tile to float32 (kernels/e4m3.py), multiplies the activations as they are
(weight-only, W8A16: the FP8 path of kernels/fp8.py on GPUs without FP8 arithmetic) and scales
each output channel's sums. Its reference dequantizes every expert (w x scale, float32, then
x's dtype) and runs `fused_moe_reference`. Block-FP8 experts (`Fp8BlockExperts`, DeepSeek-V3's:
a scale per 128 x 128 block) go through the same kernel, each K tile's partial sums scaled by
its block's scale (`fused_moe_fp8_block`; kernels/fp8_block.py describes the layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .activation import act_and_mul, act_and_mul_reference, activation, activation_reference
from .e4m3 import e4m3_decode
from .fp8_block import fp8_block_dequantize
from .triton_common import dot_acc, w_tile, x_tile
from .triton_lazy import cdiv, jit

tl = None  # triton.language, bound at the first launch (see triton_lazy)


# -- the torch reference -------------------------------------------------------------------------


def group_by_expert(ids: Tensor, num_experts: int) -> tuple[Tensor, list[int]]:
    """The rows of `ids` [T, k] in expert order, as flat indices into ids.view(-1) (stable: one
    expert's rows keep their token order), and each expert's row count."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


def fused_moe_reference(
    x: Tensor,  # [T, H]
    w13,  # [E, 2I, H]
    w2,  # [E, H, I]
    weights: Tensor,  # [T, k], any float dtype
    ids: Tensor,  # [T, k]
    act: str = "silu",
    linear=F.linear,
    gated: bool = True,
    b13: Tensor | None = None,
    b2: Tensor | None = None,
) -> Tensor:
    """The torch path (see the module docstring), in x's dtype. `w13` and `w2` are stacked
    tensors, or any per-expert sequences `linear(rows, w13[e])` accepts (the CPU path passes
    oneDNN-packed weights and their matmul). `gated`: w13 holds gate and up rows (else up
    alone). `b13` [E, 2I], `b2` [E, H]: the experts' biases, or None."""
    act_fn = act_and_mul_reference if gated else activation_reference
    T, k = ids.shape
    order, counts = group_by_expert(ids, len(w13))
    tokens = order // k
    rows = x[tokens]
    out = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        seg = rows[start : start + n]
        h = linear(seg, w13[e])
        if b13 is not None:
            h = h + b13[e]
        h = linear(act_fn(h, act), w2[e])
        out[start : start + n] = h if b2 is None else h + b2[e]
        start += n
    out = out * weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, tokens, out)


# -- alignment -------------------------------------------------------------------------------------


def moe_align(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """(sorted_rows int32 [capacity], block_expert int32 [capacity / block_m]).

    sorted_rows lists the flat rows of `ids` (index t * k + j) grouped by expert, each expert's
    run padded to a multiple of `block_m` with the sentinel T * k; block_expert[b] is the expert
    of rows [b * block_m, (b + 1) * block_m), or -1 past the last expert's run. `capacity` is the
    bound T * k + min(T * k, E) * (block_m - 1), rounded up to block_m: fixed by the shapes, so
    nothing here waits for the device."""
    flat = ids.reshape(-1).long()
    n = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[experts]
    dest = (ends - padded)[experts] + rank
    capacity = cdiv(n + min(n, num_experts) * (block_m - 1), block_m) * block_m
    sorted_rows = torch.full((capacity,), n, dtype=torch.int32, device=device)
    sorted_rows[dest] = order.to(torch.int32)
    starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_rows, block_expert


# -- the Triton kernel ---------------------------------------------------------------------------


@jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    rows_ptr,
    block_expert_ptr,
    weight_ptr,
    wscale_ptr,
    srow_ptr,
    bias_ptr,
    N,
    K,
    num_rows,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sr,
    stride_be,
    stride_om,
    A_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    W_E4M3: tl.constexpr,
    SCALE_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[r, n] = sum over k of a[r // A_DIV, k] * w[e, n, k] for the rows r of this block (one
    expert e), times weight[r] when MUL_WEIGHT, plus out's own value when ACCUMULATE. Sentinel
    rows (>= num_rows) are neither read nor written; a block with expert -1 (past the end, or a
    group to skip) returns at once. W_E4M3: w holds e4m3 bytes, decoded in the K loop, and the
    sums are scaled by wscale[e, n]; with SCALE_K > 0 (block FP8, kernels/fp8_block.py) wscale
    holds block scales [E, grid rows, K / SCALE_K] instead and each K tile's partial sums are
    scaled by wscale[e, srow[n], k // SCALE_K] (BLOCK_K divides SCALE_K). HAS_BIAS: bias[e, n]
    is added to the sums (before the weight)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows, mask_m, a_rows, offs_n, mask_n = expert_block(
        rows_ptr, pid_m, pid_n, N, num_rows, A_DIV, BLOCK_M, BLOCK_N
    )
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    if SCALE_K > 0:  # each column's row of block scales in this expert's grid
        srow = tl.load(srow_ptr + offs_n, mask=mask_n, other=0)
        s_rows = wscale_ptr + expert.to(tl.int64) * stride_se + srow.to(tl.int64) * stride_sr
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = x_tile(a_ptr, stride_am, a_rows, mask_m, offs_k, mask_k)
        w = w_tile(w_base, stride_wn, offs_k, mask_k, offs_n, mask_n)
        if W_E4M3:
            w = e4m3_decode(w.to(tl.int32))
        if SCALE_K > 0:
            part = dot_acc(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a, w)
            acc += part * tl.load(s_rows + k0 // SCALE_K, mask=mask_n, other=0.0)[None, :]
        else:
            acc = dot_acc(acc, a, w)
    if W_E4M3 and SCALE_K == 0:
        e_scale = wscale_ptr + expert.to(tl.int64) * stride_se
        acc = acc * tl.load(e_scale + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        e_bias = bias_ptr + expert.to(tl.int64) * stride_be
        acc += tl.load(e_bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    store_rows(
        out_ptr, acc, rows, mask_m, offs_n, mask_n, stride_om, weight_ptr, MUL_WEIGHT, ACCUMULATE
    )


# The pieces both expert-block GEMMs share (this module's and kernels/fused_moe_w4a16.py's):
# program (b, n) computes the rows of block b of `moe_align`'s order, all of one expert, for one
# tile of output columns.


@jit
def expert_block(
    rows_ptr, pid_m, pid_n, N, num_rows,
    A_DIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Block pid_m's rows with their mask (sentinels out), the rows of `a` they read
    (row // A_DIV), and tile pid_n's columns with their mask."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + offs_m)
    mask_m = rows < num_rows
    a_rows = rows // A_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    return rows, mask_m, a_rows, offs_n, mask_n


@jit
def store_rows(
    out_ptr, acc, rows, mask_m, offs_n, mask_n, stride_om, weight_ptr,
    MUL_WEIGHT: tl.constexpr, ACCUMULATE: tl.constexpr,
):  # fmt: skip
    """The block's float32 sums into out's rows `rows` (sentinels skipped), in out's dtype:
    times weight[row] (the router's, float32) when MUL_WEIGHT, plus out's own value when
    ACCUMULATE."""
    if MUL_WEIGHT:
        scale = tl.load(weight_ptr + rows, mask=mask_m, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    mask_out = mask_m[:, None] & mask_n[None, :]
    if ACCUMULATE:
        acc += tl.load(out, mask=mask_out, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_out)


def moe_tiles(num_rows: int, num_experts: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for `num_rows` (tokens x top_k) spread over
    `num_experts`; the reasoning is in the module docstring."""
    per_expert = num_rows / max(1, min(num_experts, num_rows))
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    block_n = 128 if block_m == 64 else 64
    block_k = 32 if dtype == torch.float32 else 64
    return block_m, block_n, block_k, 8 if block_m == 64 else 4


def grouped_gemm(
    a, w, rows, block_expert, weights, num_rows, a_div, tiles, out=None, accumulate=False,
    w_scale=None, bias=None, w_rows=None, scale_k: int = 0,
) -> Tensor:  # fmt: skip
    """One launch of `_moe_gemm_kernel` over the blocks `moe_align` made: out [num_rows, N]
    (new, or `out` itself, added to when `accumulate`) from rows of `a` and each block's
    matrix of `w` [groups, N, K] (any strides, K contiguous). `w_scale` [groups, N]: w holds
    e4m3 bytes (uint8) with these channel scales; with `scale_k` (block FP8) `w_scale` is
    [groups, grid rows, ceil(K / scale_k)] (last dim contiguous) and `w_rows` int32 [N] each
    output row's grid row. `bias` [groups, N] (last dim contiguous): added to each row's
    sums."""
    block_m, block_n, block_k, warps = tiles
    if scale_k and (scale_k % block_k or w_rows is None or w_scale is None):
        raise ValueError(f"grouped_gemm: block scales of {scale_k} columns, tiles of {block_k}")
    n, k = w.shape[1], w.shape[2]
    if w.stride(2) != 1:
        raise ValueError("grouped_gemm reads w with K contiguous")
    if (w_scale is not None) != (w.dtype == torch.uint8):
        raise ValueError("grouped_gemm: e4m3 bytes (uint8) go with w_scale, and only they")
    if out is None:
        out = torch.empty(num_rows, n, dtype=a.dtype, device=a.device)
    grid = (block_expert.numel(), cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a,
        w,
        out,
        rows,
        block_expert,
        weights if weights is not None else a,
        w_scale if w_scale is not None else a,
        w_rows if w_rows is not None else a,
        bias if bias is not None else a,
        n,
        k,
        num_rows,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w_scale.stride(0) if w_scale is not None else 0,
        w_scale.stride(1) if scale_k else 0,
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        A_DIV=a_div,
        MUL_WEIGHT=weights is not None,
        ACCUMULATE=accumulate,
        W_E4M3=w_scale is not None,
        SCALE_K=scale_k,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    return out


def run_experts(
    x, w13, w2, weights, ids, num_experts: int, gemm, act, gated: bool = True, b13=None, b2=None
) -> Tensor:
    """The two grouped GEMMs of a MoE MLP with any weight form: the rows aligned by expert,
    `gemm` (grouped_gemm's signature) for gate/up (up alone when not `gated`), the activation,
    `gemm` for down with the router weight applied, then each token's top-k outputs summed.
    `b13`, `b2`: the experts' biases (grouped_gemm's `bias`), or None."""
    T, k = ids.shape
    num_rows = T * k
    if num_rows == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    tiles = moe_tiles(num_rows, num_experts, x.dtype)
    rows, block_expert = moe_align(ids, num_experts, tiles[0])
    biased = {} if b13 is None else {"bias": b13}
    h = gemm(x, w13, rows, block_expert, None, num_rows, k, tiles, **biased)
    h = act_and_mul(h, act) if gated else activation(h, act)
    scale = weights.reshape(-1).to(torch.float32).contiguous()
    biased = {} if b2 is None else {"bias": b2}
    out = gemm(h, w2, rows, block_expert, scale, num_rows, 1, tiles, **biased)
    return out.view(T, k, -1).sum(dim=1)


def fused_moe(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    weights: Tensor,
    ids: Tensor,
    act="silu",
    gated: bool = True,
    b13: Tensor | None = None,
    b2: Tensor | None = None,
) -> Tensor:
    """The Triton path with `fused_moe_reference`'s contract; x [T, H] in float16, bfloat16 or
    float32 (float32 accumulation), the result in x's dtype. `grouped_gemm` refuses expert
    weights whose rows are not contiguous."""
    return run_experts(x, w13, w2, weights, ids, w13.shape[0], grouped_gemm, act, gated, b13, b2)


@dataclass
class Fp8Experts:
    """One projection of an FP8 checkpoint's experts: e4m3 bytes [E, N, K] (uint8) and float32
    scales [E, N] (a per-tensor scale repeated over its channels)."""

    weight: Tensor
    scale: Tensor

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        """[E, N, K] in `dtype`: each byte's e4m3 value times its channel's scale, in float32."""
        w = self.weight.view(torch.float8_e4m3fn).float() * self.scale.float()[:, :, None]
        return w.to(dtype)


def _fp8_gemm(a, w: Fp8Experts, rows, block_expert, weights, num_rows, a_div, tiles):
    return grouped_gemm(a, w.weight, rows, block_expert, weights, num_rows, a_div, tiles,
                        w_scale=w.scale)  # fmt: skip


def fused_moe_fp8(
    x: Tensor, w13: Fp8Experts, w2: Fp8Experts, weights: Tensor, ids: Tensor, act: str = "silu"
) -> Tensor:
    """The Triton path with `fused_moe_fp8_reference`'s contract (up to the scale applied to
    the sums instead of the weights); x [T, H] in float16, bfloat16 or float32."""
    return run_experts(x, w13, w2, weights, ids, w13.num_experts, _fp8_gemm, act)


def fused_moe_fp8_reference(
    x: Tensor, w13: Fp8Experts, w2: Fp8Experts, weights: Tensor, ids: Tensor, act: str = "silu"
) -> Tensor:
    """The experts dequantized (`Fp8Experts.dequantize`, x's dtype), then `fused_moe_reference`:
    what the engine's dequantize mode computes."""
    return fused_moe_reference(x, w13.dequantize(x.dtype), w2.dequantize(x.dtype), weights, ids,
                               act)  # fmt: skip


@dataclass
class Fp8BlockExperts:
    """One projection of a block-FP8 checkpoint's experts (DeepSeek-V3's): e4m3 bytes
    [E, N, K] (uint8), float32 block scales [E, grid rows, ceil(K / block_k)], and `row_block`
    int32 [N], the grid row of each output row (the same for every expert: gate and up each
    keep their own blocks, kernels/fp8_block.py)."""

    weight: Tensor
    scale: Tensor
    row_block: Tensor
    block_k: int

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        """[E, N, K] in `dtype`: each e4m3 value times its block's scale, in float32."""
        return torch.stack(
            [
                fp8_block_dequantize(w, s, self.row_block, self.block_k, dtype)
                for w, s in zip(self.weight, self.scale)
            ]
        )


def _fp8_block_gemm(a, w: Fp8BlockExperts, rows, block_expert, weights, num_rows, a_div, tiles):
    return grouped_gemm(a, w.weight, rows, block_expert, weights, num_rows, a_div, tiles,
                        w_scale=w.scale, w_rows=w.row_block, scale_k=w.block_k)  # fmt: skip


def fused_moe_fp8_block(
    x: Tensor,
    w13: Fp8BlockExperts,
    w2: Fp8BlockExperts,
    weights: Tensor,
    ids: Tensor,
    act: str = "silu",
) -> Tensor:
    """The Triton path with `fused_moe_fp8_block_reference`'s contract (the block scales applied
    to each K tile's sums instead of the weights); x [T, H] in float16, bfloat16 or float32.
    block_k must be a multiple of the K tile (64; 32 for float32)."""
    return run_experts(x, w13, w2, weights, ids, w13.num_experts, _fp8_block_gemm, act)


def fused_moe_fp8_block_reference(
    x: Tensor,
    w13: Fp8BlockExperts,
    w2: Fp8BlockExperts,
    weights: Tensor,
    ids: Tensor,
    act: str = "silu",
) -> Tensor:
    """The experts dequantized (`Fp8BlockExperts.dequantize`, x's dtype), then
    `fused_moe_reference`: what the engine's dequantize mode computes."""
    return fused_moe_reference(x, w13.dequantize(x.dtype), w2.dequantize(x.dtype), weights, ids,
                               act)  # fmt: skip

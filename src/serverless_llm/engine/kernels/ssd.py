"""Mamba-2's state-space recurrence (the SSD scan of Mamba2, Bamba, Granite 4.0-H, Nemotron-H and
Falcon-H1) over the engine's ragged batch, each request's state kept in a slot: Triton kernels and
their torch reference (what the CPU path runs), same signature.

Per head h (of H, each with a scalar decay A[h] < 0), token by token within a request:

    dt_t = clamp(softplus(dt_t + dt_bias[h]), *dt_limit)   (softplus only when dt_softplus)
    S_t  = exp(dt_t A[h]) S_{t-1} + dt_t x_t B_t^T          S: [P, N] float32
    y_t  = S_t C_t + D[h] x_t

x [T, H, P] is the conv output split into heads, B and C [T, G, N] are shared by the H / G heads
of a group (head h reads group h // (H // G)). Request b's rows are
`[query_start_loc[b], query_start_loc[b+1])`; the first `num_decodes` requests bring one row each
(rows 0 .. num_decodes-1). Its state starts from slot `state_slots[b]` when
`has_initial_state[b]`, else from zeros (whatever the slot holds, NaN included), and its state
after its last row is written back to that slot (float32, in place). Slot 0 may be named by
several padded rows: their writes race, and are never read. Output rows outside every request
are zeros.

The chunked form. Within a chunk of L rows, with a_t = dt_t A and c_t = a_1 + ... + a_t:

    y_l = sum_{s<=l} (C_l . B_s) exp(c_l - c_s) dt_s x_s   (the intra-chunk "attention")
        + exp(c_l) S_0 C_l                                (the state the chunk starts from)
    S_L = exp(c_L) S_0 + sum_s exp(c_L - c_s) dt_s x_s B_s^T

so a chunk is three matrix products and the sequential part is one step per chunk.

Precision, against transformers (5.x `mamba2_chunk_scan` for a prompt and
`mamba2_selective_state_update` for one cached token; Mamba2Mixer, BambaMixer,
GraniteMoeHybridMambaLayer, NemotronHMamba2Mixer and FalconH1Mixer call these same functions when
mamba-ssm is not installed). This reference runs every step in float32 and rounds y once to x's
dtype. transformers' prompt path also computes in float32 (x, B, C, dt after its softplus, A and
the state) except that dt + dt_bias, the softplus and the dt_limit clamp run in the model dtype;
its returned state is float32 and its cache is `zeros_like` of it, so the cached state is float32.
Its one-token path computes dt + bias and the softplus, dt B and dt B x in the model dtype,
exp(dt A) and the state update in float32 (the state stays float32), then rounds the state to the
model dtype before the C contraction, and adds D x in the model dtype. Those are the places where
this reference is more precise in float16/bfloat16 (closer to the exact recurrence, as mamba-ssm's
kernels, which keep all of this in float32). In float32 every one of those casts is the identity,
so the two compute the same formula and differ only in summation order (transformers' chunk of
256 with segment sums; chunk boundaries here; exp(c_l - c_s) from one cumulative sum instead of a
masked cumulative sum of the segment): a few float32 ulps relative, far below the gap between the
two best logits that a greedy token depends on, so greedy tokens are the same.

One difference that is not precision: transformers' one-token path does not apply dt_limit (its
prompt path does); this module clamps every token, decodes included, so a request decoded token
by token equals the same tokens as one prompt chunk. Only models with a lower limit above 0 see
it: Nemotron-H (its mixer uses (time_step_min, inf)), for a decode token whose softplus falls
below time_step_min. The limit (0, inf) (every other family's default) changes nothing after a
softplus.

The reference decodes every decode request in one batched step (states gathered by slot, updated,
scattered back) and runs a prompt chunk in chunks of `REF_CHUNK` rows, one request at a time.

The Triton path: a recurrent-step kernel for the decodes (one program per (request, head, block
of P), the [BP, N] state tile in registers), and a chunked-scan kernel for the prompt chunks (one
program per (request, head, block of P), walking the request's rows CHUNK at a time: the
intra-chunk C B^T product, the contribution of the state carried in, and the state carried out,
all with tl.dot; the state stays in registers from chunk to chunk, so nothing is written between
chunks and a 4k-token prompt is 4096 / CHUNK sequential steps of one chunk each, CHUNK = 32 or 16
by `tile_sizes`). The chunks of one request are not spread over programs: parallelism comes from
requests x heads x blocks of P (128 heads x 2 blocks for the usual P = 64, H = 128 of these
models), which saves the per-chunk state buffers a chunk-parallel scan writes. Both grids come
from shapes and `num_decodes` alone, so the launch reads no device tensor on the host. float32
inputs use IEEE float32 dots; 16-bit inputs multiply C B^T in their own type (products exact in
float32) and the products with a float32 operand (scores x x, C x state, weighted x x B) split
that operand into two 16-bit halves (see `_dot`), so no rounding to 16 bits happens before y.
Triton is imported at the kernel's first launch, never for the reference (see `triton_lazy`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_native
from .triton_lazy import cdiv, jit, next_power_of_2

tl = None  # triton.language, bound at the first launch (see triton_lazy)

# Rows per chunk of the torch reference's prompt path: the fastest measured on 2 CPU threads
# (torch 2.13, ms for chunks of 32 / 64 / 128 / 256): 2048 tokens with H = 32, P = 64, N = 128:
# G = 1 ~40 / 35.9 / 47.4 / 69.9, G = 8 40.3 / 39.0 / 51.5 / 88.6; 512 tokens, H = 24, P = 64,
# N = 128: 7.7 / 6.7 / 8.7 / 12.6; 2048 tokens, H = 8, P = N = 16: 9.2 / 7.1 / 7.4 / 10.7.
REF_CHUNK = 64

# -- torch reference -------------------------------------------------------------------------


def _check(x: Tensor, B: Tensor, C: Tensor, state: Tensor) -> tuple[int, int, int, int, int]:
    """(T, H, P, G, N) after checking the shapes agree."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if H % G:
        raise ValueError(f"ssd_scan: {H} heads do not split into {G} groups")
    if B.shape != (T, G, N) or C.shape != (T, G, N):
        raise ValueError(f"ssd_scan: B {tuple(B.shape)} and C {tuple(C.shape)} != ({T}, {G}, {N})")
    if state.shape[1:] != (H, P, N) or state.dtype != torch.float32:
        raise ValueError(
            f"ssd_scan: state must be float32 [slots, {H}, {P}, {N}], got "
            f"{state.dtype} {tuple(state.shape)}"
        )
    return T, H, P, G, N


def time_steps(
    dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float]
) -> Tensor:
    """dt [T, H] float32: dt + dt_bias, through softplus when asked, clamped to dt_limit."""
    d = dt.float()
    if dt_bias is not None:
        d = d + dt_bias.float()
    if dt_softplus:
        d = F.softplus(d)
    return d.clamp(dt_limit[0], dt_limit[1])


def _decode_ref(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
    state: Tensor, slots: Tensor, has_init: Tensor,
) -> Tensor:  # fmt: skip
    """One step for each of n decode rows: x [n, H, P] float32, dt [n, H] float32 (processed),
    B, C [n, G, N]; the states of `slots` are read (zeros where not `has_init`) and written back.
    Returns y [n, H, P] float32."""
    n, H, P = x.shape
    G, N = B.shape[1:]
    R = H // G
    slots = slots.long()
    h = state.index_select(0, slots)
    if not bool(has_init.all()):  # where, not a product: a slot nobody initialised may hold NaN
        h = torch.where(has_init[:, None, None, None], h, 0.0)
    # In place on the gathered copy: the states dominate a decode step's memory traffic on CPU,
    # so each pass over them counts (decay, then the rank-one update, then the read by C).
    h = h.view(n, G, R, P, N)
    Bf, Cf = B.float(), C.float()
    decay = torch.exp(dt * A).view(n, G, R, 1, 1)
    dx = (dt[:, :, None] * x).view(n, G, R, P, 1)
    h.mul_(decay).addcmul_(dx, Bf[:, :, None, None, :])
    y = (h @ Cf[:, :, None, :, None]).view(n, H, P)
    if D is not None:
        y = y + D.float()[:, None] * x
    state.index_copy_(0, slots, h.view(n, H, P, N))
    return y


def _prefill_ref(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, h: Tensor, chunk: int
) -> tuple[Tensor, Tensor]:
    """One request's rows in chunks: x [n, H, P] float32, dt [n, H] float32 (processed), B, C
    [n, G, N] float32, h [H, P, N] float32 the state before the first row. Returns (y [n, H, P]
    without the D skip, the state after the last row)."""
    n, H, P = x.shape
    G, N = B.shape[1:]
    R = H // G
    y = torch.empty_like(x)
    h = h.view(G, R, P, N)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril_()
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        L = e - s
        cum = (dt[s:e] * A).cumsum(0)  # [L, H], c_l
        xdt = (x[s:e] * dt[s:e, :, None]).view(L, G, R, P)
        Bc, Cc = B[s:e], C[s:e]  # [L, G, N]
        cum_h = cum.t()  # [H, L]
        seg = (cum_h[:, :, None] - cum_h[:, None, :]).masked_fill_(~causal[:L, :L], float("-inf"))
        # scores[g, r, l, s] = (C_l . B_s) exp(c_l - c_s), s <= l
        scores = seg.exp_().view(G, R, L, L) * torch.einsum("lgn,sgn->gls", Cc, Bc)[:, None]
        y_intra = torch.einsum("grls,sgrp->lgrp", scores, xdt)
        y_init = torch.einsum("lgn,grpn->lgrp", Cc, h) * cum.exp().view(L, G, R, 1)
        y[s:e] = (y_intra + y_init).view(L, H, P)
        last = cum[-1]  # [H]
        w = torch.exp(last - cum).view(L, G, R, 1)
        h = h * last.exp().view(G, R, 1, 1) + torch.einsum("lgrp,lgn->grpn", xdt * w, Bc)
    return y, h.reshape(H, P, N)


def ssd_scan_ref(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    state: Tensor,
    query_start_loc: Tensor,
    state_slots: Tensor,
    has_initial_state: Tensor,
    num_decodes: int = 0,
) -> Tensor:
    """The SSD scan of a ragged batch (see the module docstring): x [T, H, P], dt [T, H] (raw),
    A [H] float32, B, C [T, G, N], D and dt_bias [H] or None, state [slots, H, P, N] float32
    (updated in place), query_start_loc [B+1] int32, state_slots [B] int32, has_initial_state
    [B] bool, the first `num_decodes` requests one row each. Returns y [T, H, P] in x's dtype."""
    T, H, P, G, N = _check(x, B, C, state)
    num_reqs = state_slots.shape[0]
    y = torch.zeros(T, H, P, dtype=x.dtype, device=x.device)
    d = time_steps(dt, dt_bias, dt_softplus, dt_limit)
    A = A.float()
    nd = num_decodes
    native = nd and cpu_native.recurrent_kernels()
    if native and native.ssd_decode(x, d, A, B, C, D, state, state_slots, has_initial_state, y, nd):
        pass  # the native kernel (float32 on CPU): each decode's state read and written once
    elif nd:
        yd = _decode_ref(
            x[:nd].float(), d[:nd], A, B[:nd], C[:nd], D, state, state_slots[:nd],
            has_initial_state[:nd],
        )  # fmt: skip
        y[:nd] = yd.to(x.dtype)
    if num_reqs > nd:
        bounds = query_start_loc.tolist()  # the CPU path: reading it costs nothing
        slots = state_slots.tolist()
        has_init = has_initial_state.tolist()
        for r in range(nd, num_reqs):
            s, e, slot = bounds[r], bounds[r + 1], slots[r]
            h0 = state[slot] if has_init[r] else state.new_zeros(H, P, N)
            xr = x[s:e].float()
            yr, h = _prefill_ref(xr, d[s:e], A, B[s:e].float(), C[s:e].float(), h0, REF_CHUNK)
            if D is not None:
                yr = yr + D.float()[:, None] * xr
            y[s:e] = yr.to(x.dtype)
            state[slot] = h
    return y


# -- Triton kernels --------------------------------------------------------------------------


@jit
def _time_step(dt, bias, A_h, dt_min, dt_max, SOFTPLUS: tl.constexpr):
    """(dt, dt * A) in float32 from a raw dt (float32) and its bias (0.0 when there is none)."""
    dt = dt + bias
    if SOFTPLUS:
        # torch's softplus: the identity past 20; below, log1p(exp(x)) written as
        # log(u) * e / (u - 1) with u = 1 + e, exact to a few ulps where 1 + e rounds
        e = tl.exp(dt)
        u = 1.0 + e
        lp = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
        dt = tl.where(dt > 20.0, dt, lp)
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    return dt, dt * A_h


@jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in float32. With IEEE both are float32 (IEEE float32 products). Else
    one operand is float32 and the other in the inputs' 16-bit type: the float32 one is split
    into hi + lo, both in that 16-bit type (22 significant bits for float16, 16 for bfloat16), and
    multiplied natively twice, so the operands take 16-bit shared memory and the products keep
    nearly float32 precision (one 16-bit rounding would lose 5e-4 relative, TF32 likewise)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    if a.dtype == tl.float32:
        hi = a.to(b.dtype)
        lo = (a - hi.to(tl.float32)).to(b.dtype)
        return tl.dot(hi, b) + tl.dot(lo, b)
    hi = b.to(a.dtype)
    lo = (b - hi.to(tl.float32)).to(a.dtype)
    return tl.dot(a, hi) + tl.dot(a, lo)


@jit
def _ssd_decode_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, y_ptr,
    query_start_loc_ptr, state_slots_ptr, has_init_ptr,
    stride_xt, stride_xh, stride_dtt, stride_dth, stride_bt, stride_bg, stride_ct, stride_cg,
    stride_ss, stride_sh, stride_sp, stride_yt, stride_yh,
    P, N, heads_per_group, dt_min, dt_max,
    HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One decode row: program (request, head, block of P)."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    row = tl.load(query_start_loc_ptr + req)
    # a request without a row (never made by the runner) reads and writes nothing; scalar
    # conditions enter masks as bounds (the interpreter refuses a block mask & a scalar one)
    valid = tl.load(query_start_loc_ptr + req + 1) > row
    row = row.to(tl.int64)
    mask_p = offs_p < tl.where(valid, P, 0)
    mask_n = offs_n < tl.where(valid, N, 0)
    mask_pn = mask_p[:, None] & mask_n[None, :]
    slot = tl.load(state_slots_ptr + req).to(tl.int64)
    has_init = tl.load(has_init_ptr + req) != 0
    group = head // heads_per_group

    tile = state_ptr + slot * stride_ss + head * stride_sh
    tile += offs_p[:, None] * stride_sp + offs_n[None, :]
    mask_init = mask_p[:, None] & (offs_n < tl.where(has_init, N, 0))[None, :]
    s = tl.load(tile, mask=mask_init, other=0.0)

    dt = tl.load(dt_ptr + row * stride_dtt + head * stride_dth, mask=valid, other=0.0)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    A_h = tl.load(A_ptr + head).to(tl.float32)
    dt, a = _time_step(dt.to(tl.float32), bias, A_h, dt_min, dt_max, SOFTPLUS)

    x = tl.load(x_ptr + row * stride_xt + head * stride_xh + offs_p, mask=mask_p, other=0.0)
    x = x.to(tl.float32)
    bv = tl.load(B_ptr + row * stride_bt + group * stride_bg + offs_n, mask=mask_n, other=0.0)
    cv = tl.load(C_ptr + row * stride_ct + group * stride_cg + offs_n, mask=mask_n, other=0.0)
    s = s * tl.exp(a) + (dt * x)[:, None] * bv.to(tl.float32)[None, :]
    y = tl.sum(s * cv.to(tl.float32)[None, :], axis=1)
    if HAS_D:
        y += tl.load(D_ptr + head).to(tl.float32) * x
    tl.store(tile, s, mask=mask_pn)
    out = y_ptr + row * stride_yt + head * stride_yh + offs_p
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=mask_p)


@jit
def _ssd_chunk_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, y_ptr,
    query_start_loc_ptr, state_slots_ptr, has_init_ptr,
    stride_xt, stride_xh, stride_dtt, stride_dth, stride_bt, stride_bg, stride_ct, stride_cg,
    stride_ss, stride_sh, stride_sp, stride_yt, stride_yh,
    P, N, heads_per_group, dt_min, dt_max, first_req,
    HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, IEEE: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One prompt chunk: program (request first_req + i, head, block of P), CHUNK rows a step."""
    req = first_req + tl.program_id(0)
    head = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, CHUNK)
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask_pn = mask_p[:, None] & mask_n[None, :]
    start = tl.load(query_start_loc_ptr + req)
    end = tl.load(query_start_loc_ptr + req + 1)
    slot = tl.load(state_slots_ptr + req).to(tl.int64)
    has_init = tl.load(has_init_ptr + req) != 0
    group = head // heads_per_group

    tile = state_ptr + slot * stride_ss + head * stride_sh
    tile += offs_p[:, None] * stride_sp + offs_n[None, :]
    mask_init = mask_p[:, None] & (offs_n < tl.where(has_init, N, 0))[None, :]
    h = tl.load(tile, mask=mask_init, other=0.0)  # [BLOCK_P, BLOCK_N] float32

    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    A_h = tl.load(A_ptr + head).to(tl.float32)
    skip = 0.0
    if HAS_D:
        skip = tl.load(D_ptr + head).to(tl.float32)
    causal = offs_l[:, None] >= offs_l[None, :]
    is_last = offs_l == CHUNK - 1

    for c0 in range(start, end, CHUNK):
        rows = c0 + offs_l
        mask_l = rows < end
        rows = rows.to(tl.int64)
        dt = tl.load(dt_ptr + rows * stride_dtt + head * stride_dth, mask=mask_l, other=0.0)
        dt, a = _time_step(dt.to(tl.float32), bias, A_h, dt_min, dt_max, SOFTPLUS)
        # rows past the end neither decay nor add: the state after them is the last row's
        dt = tl.where(mask_l, dt, 0.0)
        a = tl.where(mask_l, a, 0.0)
        cum = tl.cumsum(a, axis=0)  # [CHUNK], c_l
        cum_last = tl.sum(tl.where(is_last, cum, 0.0), axis=0)

        x = tl.load(
            x_ptr + rows[:, None] * stride_xt + head * stride_xh + offs_p[None, :],
            mask=mask_l[:, None] & mask_p[None, :],
            other=0.0,
        )  # [CHUNK, BLOCK_P], the inputs' type
        mask_ln = mask_l[:, None] & mask_n[None, :]
        Bt = tl.load(
            B_ptr + rows[:, None] * stride_bt + group * stride_bg + offs_n[None, :],
            mask=mask_ln,
            other=0.0,
        )  # [CHUNK, BLOCK_N]
        Ct = tl.load(
            C_ptr + rows[:, None] * stride_ct + group * stride_cg + offs_n[None, :],
            mask=mask_ln,
            other=0.0,
        )

        # intra-chunk: scores[l, s] = (C_l . B_s) exp(c_l - c_s) dt_s for s <= l
        if IEEE:
            cb = tl.dot(Ct, tl.trans(Bt), input_precision="ieee")  # [CHUNK, CHUNK]
        else:
            cb = tl.dot(Ct, tl.trans(Bt))  # 16-bit products are exact in float32
        seg = tl.where(causal, cum[:, None] - cum[None, :], float("-inf"))
        scores = cb * tl.exp(seg) * dt[None, :]
        y = _dot(scores, x, IEEE)  # [CHUNK, BLOCK_P]
        # the carried-in state, decayed to each row: exp(c_l) C_l h^T
        y += tl.exp(cum)[:, None] * _dot(Ct, tl.trans(h), IEEE)
        xf = x.to(tl.float32)
        if HAS_D:
            y += skip * xf
        tl.store(
            y_ptr + rows[:, None] * stride_yt + head * stride_yh + offs_p[None, :],
            y.to(y_ptr.dtype.element_ty),
            mask=mask_l[:, None] & mask_p[None, :],
        )

        # the state after the chunk: exp(c_L) h + sum_s exp(c_L - c_s) dt_s x_s B_s^T
        w = tl.exp(cum_last - cum) * dt  # [CHUNK]
        xw = tl.trans(xf * w[:, None])  # [BLOCK_P, CHUNK]
        h = h * tl.exp(cum_last) + _dot(xw, Bt, IEEE)

    tl.store(tile, h, mask=mask_pn)


def tile_sizes(P: int, N: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_P, BLOCK_N, CHUNK, num_warps) of the prompt kernel and the decode kernel's BLOCK_P:
    N whole (16 at least, as every tl.dot operand dimension). The prompt tiles compile without
    register spills for sm80 and sm90 at P = 64 (tests/kernels/gpu_compile.py
    checks N = 128 and 256 in 16 bits): 32 x 32 up to N = 128, 16 x 16 beyond, with 8 warps (4
    spill at 32 x 32); float32 (IEEE dots, FMA-based, far more registers) 16 x 16, which still
    spills a few hundred bytes. The decode tile keeps the float32 state at 4096 elements."""
    block_n = max(16, next_power_of_2(N))
    decode_p = max(1, min(next_power_of_2(P), 4096 // block_n))
    if dtype != torch.float32 and block_n <= 128:
        block_p, chunk, warps = 32, 32, 8
    else:
        block_p, chunk, warps = 16, 16, 8 if block_n >= 256 else 4
    return min(block_p, max(16, next_power_of_2(P))), block_n, chunk, warps, decode_p


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def ssd_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    state: Tensor,
    query_start_loc: Tensor,
    state_slots: Tensor,
    has_initial_state: Tensor,
    num_decodes: int = 0,
) -> Tensor:
    """The Triton SSD scan, as `ssd_scan_ref` (same arguments and result). x, B and C may be
    strided views (copied only when their last dim is not contiguous), dt any view; the state must
    have a unit stride on N (it is updated in place). Launches without reading device tensors."""
    T, H, P, G, N = _check(x, B, C, state)
    if state.stride(-1) != 1:
        raise ValueError("ssd_scan: the state needs unit stride on its last dim (updated in place)")
    num_reqs = state_slots.shape[0]
    y = torch.zeros(T, H, P, dtype=x.dtype, device=x.device)
    if num_reqs == 0:
        return y
    x, B, C = _unit_last(x), _unit_last(B), _unit_last(C)
    A = A.float().contiguous()
    D_arg = D.contiguous() if D is not None else A  # never read without HAS_D
    bias_arg = dt_bias.contiguous() if dt_bias is not None else A
    block_p, block_n, chunk, warps, decode_p = tile_sizes(P, N, x.dtype)
    common = (
        x, dt, A, B, C, D_arg, bias_arg, state, y, query_start_loc, state_slots, has_initial_state,
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1),
        C.stride(0), C.stride(1), state.stride(0), state.stride(1), state.stride(2),
        y.stride(0), y.stride(1), P, N, H // G, float(dt_limit[0]), float(dt_limit[1]),
    )  # fmt: skip
    flags = dict(HAS_D=D is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus))
    nd = num_decodes
    if nd:
        _ssd_decode_kernel[(nd, H, cdiv(P, decode_p))](
            *common, **flags, BLOCK_P=decode_p, BLOCK_N=block_n, num_warps=4
        )
    if num_reqs > nd:
        _ssd_chunk_scan_kernel[(num_reqs - nd, H, cdiv(P, block_p))](
            *common, nd, **flags, IEEE=x.dtype == torch.float32, CHUNK=chunk,
            BLOCK_P=block_p, BLOCK_N=block_n, num_warps=warps,
        )  # fmt: skip
    return y

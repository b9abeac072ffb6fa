"""Mamba-1's selective scan (the SSM of Mamba, FalconMamba and Jamba's Mamba layers) over the
engine's ragged batch, with each request's state kept in a slot: a Triton kernel and its torch
reference (what the CPU path runs), same signature.

Per channel d of D and state index n of N, token by token within a request:

    dt_t = softplus(delta_t + delta_bias)                  (softplus only when delta_softplus)
    h_t  = exp(dt_t * A) * h_{t-1} + (dt_t * u_t)[:, None] * B_t[None, :]       [D, N]
    y_t  = h_t @ C_t + D * u_t;   y_t *= silu(z_t)

`u` is the causal conv's output, `delta` the dt projection without its bias, `A` = -exp(A_log)
[D, N] float32; B, C [T, N] are shared by every channel. Request b's rows are
`[query_start_loc[b], query_start_loc[b+1])`; its state starts from slot `state_slots[b]` when
`has_initial_state[b]`, else from zeros, and its state after its last row is written back to that
slot (float32, in place). Slot 0 may be named by several padded rows: their writes race, and are
never read.

Precision. All the math runs in float32 (dt, its softplus, exp(dt A), the state, y, the D skip and
the gate) and y is rounded once to u's dtype. transformers (5.x `mamba_selective_scan` for a
prompt and `mamba_selective_state_update` for one cached token, which `MambaMixer` and
`JambaMambaMixer` call when mamba-ssm is not installed) computes exp(dt A), dt u B and the state
in float32 too, and keeps its cached state in float32 (`torch.zeros_like` of the scan's float32
final state), but rounds to the model dtype in between: dt + bias and its softplus are computed in
the model dtype, the state is rounded to the model dtype before the C contraction, silu(z) is
taken in the model dtype, and in the one-token update also D u and the product with the gate. This
reference skips those roundings, so in float16/bfloat16 it is the more precise of the two (closer
to the exact recurrence, as mamba-ssm's CUDA kernels, which also keep everything in float32). In
float32 every one of those casts is the identity, so the two compute the same formula and differ
only in summation order (a few float32 ulps): greedy tokens are the same.

The reference decodes every decode request in one batched step (states gathered by slot, updated,
scattered back). A prompt chunk runs one in-place [D, N] update per token: Mamba-1's per-channel,
per-state decay has no matmul form. Measured on 2 CPU threads, a 512-token prompt with D = 256,
N = 16 (torch 2.13): this per-token loop 2.9 ms; the stable chunked form (the segment sums
exp(A (cs_t - cs_s)) within chunks, state carried between chunks) 34 ms at chunks of 8 and slower
at 16 and 32; the cumulative-product form (h_t = P_t (h_0 + sum dBu_s / P_s)) 12.6 ms at chunks
of 8 and NaN at 16 (1 / P_s overflows). So the loop stays.

The Triton kernel runs one program per (request, block of BD channels): the [BD, N] state tile
stays in registers while the program walks the request's rows, so decodes and prefill chunks share
it and it launches without reading device tensors on the host (the grid comes from shapes only).
Triton is imported at the kernel's first launch, never for the reference (see `triton_lazy`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_native
from .triton_lazy import cdiv, jit, next_power_of_2

tl = None  # triton.language, bound at the first launch (see triton_lazy)

# The reference scans a prompt chunk in blocks of tokens whose [tokens, D, N] float32 buffers
# (exp(dt A) and the states) hold at most this many elements each: 16 MiB.
_SCAN_BLOCK_ELEMS = 1 << 22

# -- torch reference -------------------------------------------------------------------------


def _time_steps(delta: Tensor, delta_bias: Tensor | None, delta_softplus: bool) -> Tensor:
    """dt [T, D] float32: delta + delta_bias, through softplus when asked."""
    dt = delta.float()
    if delta_bias is not None:
        dt = dt + delta_bias.float()
    return F.softplus(dt) if delta_softplus else dt


def _scan_tokens(h: Tensor, dt: Tensor, du: Tensor, A: Tensor, B: Tensor, C: Tensor) -> Tensor:
    """One request's rows from state h [D, N] (updated in place to the state after the last row):
    dt, du = dt * u [L, D] float32, B, C [L, N] float32. Returns h_t @ C_t, [L, D] float32."""
    L, Dn = dt.shape
    N = A.shape[1]
    out = torch.empty(L, Dn, dtype=torch.float32, device=dt.device)
    step = max(1, _SCAN_BLOCK_ELEMS // (Dn * N))
    for s in range(0, L, step):
        e = min(L, s + step)
        decay = torch.exp(dt[s:e, :, None] * A)
        states = du[s:e, :, None] * B[s:e, None, :]  # the input terms, made states in place
        prev = h
        for a, x in zip(decay.unbind(0), states.unbind(0)):
            x.addcmul_(a, prev)
            prev = x
        h.copy_(prev)
        torch.bmm(states, C[s:e, :, None], out=out[s:e, :, None])
    return out


def selective_scan_ref(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    delta_softplus: bool,
    state: Tensor,
    query_start_loc: Tensor,
    state_slots: Tensor,
    has_initial_state: Tensor,
    num_decodes: int = 0,
) -> Tensor:
    """The torch reference of `selective_scan` (the module docstring has the recurrence).

    u, delta, z: [T, D] model dtype (views with any row stride are fine); A: [D, N] float32;
    B, C: [T, N]; D, delta_bias: [D]; state: [num_slots, D, N] float32, updated in place;
    query_start_loc: [B+1] int32; state_slots: [B] int32; has_initial_state: [B] bool; the first
    `num_decodes` requests bring one token each (rows 0 .. num_decodes-1). Returns y [T, D] in u's
    dtype."""
    T, Dn = u.shape
    y = torch.empty(T, Dn, dtype=torch.float32, device=u.device)
    if T:
        A = A.float()
        dt = _time_steps(delta, delta_bias, delta_softplus)
        nd = num_decodes
        # The native kernel (float32 on CPU) reads and writes each decode's state once, in its
        # slot, and applies the D skip and the gate to its rows: the torch code below does rows
        # `first` onwards.
        native = cpu_native.recurrent_kernels()
        first = 0
        if (
            nd
            and native
            and native.selective_scan_decode(
                u, dt, A, B, C, D, z, state, state_slots, has_initial_state, y, nd
            )
        ):
            first = nd
            if nd == T:
                return y
        # The prompt chunks too, token after token in their slots, in one call the threads
        # share (the loop below runs a request at a time, on one thread).
        nreq = state_slots.shape[0]
        if first == nd and nreq > nd and native and native.selective_scan_prefill(
            u, dt, A, B, C, D, z, state, query_start_loc[nd : nreq + 1], state_slots[nd:],
            has_initial_state[nd:], y,
        ):  # fmt: skip
            return y.to(u.dtype)
        uf = u.float()
        du = dt * uf
        Bf, Cf = B.float(), C.float()
        slots = state_slots.long()
        if nd and not first:
            # Every decode at once: gather the states, one step, scatter back.
            h = state.index_select(0, slots[:nd])
            if not bool(has_initial_state[:nd].all()):  # a fresh slot may hold NaN: where
                h = torch.where(has_initial_state[:nd, None, None], h, torch.zeros_like(h))
            # in place on the gathered copy: fewer passes over the states
            h.mul_(torch.exp(dt[:nd, :, None] * A)).addcmul_(du[:nd, :, None], Bf[:nd, None, :])
            y[:nd] = torch.bmm(h, Cf[:nd, :, None])[..., 0]
            state.index_copy_(0, slots[:nd], h)
        starts = query_start_loc.tolist()
        has_init = has_initial_state.tolist()
        for b in range(nd, len(starts) - 1):
            s, e = starts[b], starts[b + 1]
            slot = int(slots[b])
            h = state[slot].clone() if has_init[b] else state.new_zeros(Dn, A.shape[1])
            y[s:e] = _scan_tokens(h, dt[s:e], du[s:e], A, Bf[s:e], Cf[s:e])
            state[slot] = h
        if D is not None:
            y[first:] += uf[first:] * D.float()
        if z is not None:
            y[first:] *= F.silu(z[first:].float())
    return y.to(u.dtype)


# -- Triton kernel ---------------------------------------------------------------------------


@jit
def _selective_scan_kernel(
    u_ptr,
    delta_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    z_ptr,
    delta_bias_ptr,
    state_ptr,
    query_start_loc_ptr,
    state_slots_ptr,
    has_initial_state_ptr,
    y_ptr,
    u_row_stride,
    delta_row_stride,
    A_row_stride,
    B_row_stride,
    C_row_stride,
    z_row_stride,
    y_row_stride,
    state_slot_stride,
    state_row_stride,
    dim,
    dstate,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DELTA_BIAS: tl.constexpr,
    DELTA_SOFTPLUS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    N_PAD: tl.constexpr,
):
    req = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, N_PAD)
    mask_d = offs_d < dim
    mask_n = offs_n < dstate
    mask_dn = mask_d[:, None] & mask_n[None, :]
    start = tl.load(query_start_loc_ptr + req)
    end = tl.load(query_start_loc_ptr + req + 1)
    slot = tl.load(state_slots_ptr + req).to(tl.int64)
    has_init = tl.load(has_initial_state_ptr + req) != 0

    # Padded lanes: A = 0 and B = 0 keep their state at zero; they are never stored.
    A = tl.load(A_ptr + offs_d[:, None] * A_row_stride + offs_n[None, :], mask=mask_dn, other=0.0)
    A = A.to(tl.float32)
    state_tile = (
        state_ptr
        + slot * state_slot_stride
        + offs_d[:, None].to(tl.int64) * state_row_stride
        + offs_n[None, :]
    )
    # No initial state: a mask that loads nothing (a bound, not `& has_init`, which the
    # interpreter turns into an int32 mask).
    init_n = tl.where(has_init, dstate, 0)
    h = tl.load(state_tile, mask=mask_d[:, None] & (offs_n[None, :] < init_n), other=0.0)
    if HAS_D:
        skip = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_DELTA_BIAS:
        bias = tl.load(delta_bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)

    first = start.to(tl.int64)
    for i in range(0, end - start):
        row = first + i  # int64: T times a row stride may pass 2**31
        x = tl.load(u_ptr + row * u_row_stride + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        dt = tl.load(delta_ptr + row * delta_row_stride + offs_d, mask=mask_d, other=0.0)
        dt = dt.to(tl.float32)
        if HAS_DELTA_BIAS:
            dt += bias
        if DELTA_SOFTPLUS:
            # torch's softplus: the identity past 20 (exp would overflow further on)
            dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))))
        b = tl.load(B_ptr + row * B_row_stride + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        c = tl.load(C_ptr + row * C_row_stride + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * b[None, :]
        out = tl.sum(h * c[None, :], axis=1)
        if HAS_D:
            out += skip * x
        if HAS_Z:
            g = tl.load(z_ptr + row * z_row_stride + offs_d, mask=mask_d, other=0.0)
            g = g.to(tl.float32)
            out *= g / (1.0 + tl.exp(-g))
        tl.store(y_ptr + row * y_row_stride + offs_d, out.to(y_ptr.dtype.element_ty), mask=mask_d)
    tl.store(state_tile, h, mask=mask_dn)


def scan_block_d(dim: int, dstate: int) -> int:
    """Channels per program: a [BLOCK_D, N_PAD] tile of about 1024 float32 (64 channels at
    N = 16), small enough to stay in registers and to give a single long prompt (B = 1) many
    programs, since each walks its rows one after another."""
    return max(16, min(next_power_of_2(dim), 1024 // next_power_of_2(dstate)))


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    delta_softplus: bool,
    state: Tensor,
    query_start_loc: Tensor,
    state_slots: Tensor,
    has_initial_state: Tensor,
    num_decodes: int = 0,
) -> Tensor:
    """The Triton selective scan; arguments and result as `selective_scan_ref` (rows may have any
    stride; a last dim without unit stride is copied). `num_decodes` is not needed: each program
    reads its request's rows from query_start_loc, so nothing is read on the host."""
    T, dim = u.shape
    dstate = A.shape[1]
    y = torch.empty(T, dim, dtype=u.dtype, device=u.device)
    num_reqs = state_slots.shape[0]
    if T == 0 or num_reqs == 0:
        return y
    if state.dtype != torch.float32 or state.stride(-1) != 1:
        raise ValueError("selective_scan needs a float32 state with unit stride on N")
    u, delta, B, C = _unit_last(u), _unit_last(delta), _unit_last(B), _unit_last(C)
    A = _unit_last(A.float())
    if z is not None:
        z = _unit_last(z)
    block_d = scan_block_d(dim, dstate)
    n_pad = next_power_of_2(dstate)
    _selective_scan_kernel[(num_reqs, cdiv(dim, block_d))](
        u,
        delta,
        A,
        B,
        C,
        u if D is None else D,  # unused when None
        u if z is None else z,
        u if delta_bias is None else delta_bias,
        state,
        query_start_loc,
        state_slots,
        has_initial_state,
        y,
        u.stride(0),
        delta.stride(0),
        A.stride(0),
        B.stride(0),
        C.stride(0),
        0 if z is None else z.stride(0),
        y.stride(0),
        state.stride(0),
        state.stride(1),
        dim,
        dstate,
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_DELTA_BIAS=delta_bias is not None,
        DELTA_SOFTPLUS=delta_softplus,
        BLOCK_D=block_d,
        N_PAD=n_pad,
        num_warps=4,
    )
    return y

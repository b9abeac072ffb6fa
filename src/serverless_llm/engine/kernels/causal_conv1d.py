"""The short depthwise causal convolution of the hybrid models' recurrent layers (Qwen3-Next /
Qwen3.5 Gated DeltaNet, Mamba-1, Mamba-2, LFM2's short convolution) over the ragged batch, and the
gated RMSNorm those layers apply after their recurrence: Triton kernels and their torch references.

The convolution, per channel c of token t (K taps, `weight` [C, K]):

    out[t, c] = act(bias[c] + sum_{j<K} weight[c, j] * input[t - (K-1) + j, c])

where the inputs before a request's first new token are its previous K-1 inputs, kept in its
state slot `conv_state[slot]` ([C, K-1], oldest first; zeros when `has_initial_state` is False).
After the step the slot holds the request's last K-1 inputs (with the old state's tail shifted
in when the chunk is shorter than K-1). transformers keeps K entries in its conv state and lays
sequences out [batch, C, seq]; here the batch is the flat [T, C] ragged batch and the state keeps
the K-1 entries the next step reads. The math runs in float32, rounded once to x's dtype.

Triton is imported at a kernel's first launch, never for the references (see `triton_lazy`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_native
from .triton_common import row_launch_shape, rows_of
from .triton_lazy import cdiv, jit, next_power_of_2

tl = None  # triton.language, bound at the first launch (see triton_lazy)

ACTIVATIONS = (None, "silu")


def _check_conv_args(x: Tensor, weight: Tensor, conv_state: Tensor, activation: str | None) -> int:
    """K, after checking the shapes agree."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation {activation!r} is not one of {ACTIVATIONS}")
    C, K = weight.shape
    if K < 2:
        raise ValueError(f"causal_conv1d needs a kernel of at least 2 taps, got {K}")
    if x.dim() != 2 or x.shape[1] != C:
        raise ValueError(f"causal_conv1d: x {tuple(x.shape)} does not match weight {(C, K)}")
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (C, K - 1):
        raise ValueError(
            f"causal_conv1d: conv_state {tuple(conv_state.shape)} is not [slots, {C}, {K - 1}]"
        )
    return K


# -- torch reference -------------------------------------------------------------------------


def causal_conv1d_ref(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    query_start_loc: Tensor,
    state_slots: Tensor,
    has_initial_state: Tensor,
    activation: str | None,
    *,
    num_decodes: int = 0,
    max_query_len: int | None = None,
) -> Tensor:
    """The torch reference of `causal_conv1d`; same arguments, same result, `conv_state` updated
    in place. x: [T, C] (any strides); weight [C, K]; bias [C] or None; conv_state
    [num_slots, C, K-1]; query_start_loc [B+1] int32; state_slots [B] int32; has_initial_state
    [B] bool; activation "silu" or None. `num_decodes`: requests 0..num_decodes-1 bring one token
    each (token b is request b's) and are computed together; `max_query_len` is unused here.
    Returns out [T, C] in x's dtype."""
    K = _check_conv_args(x, weight, conv_state, activation)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    w = weight.float()
    b32 = bias.float() if bias is not None else None
    nd = num_decodes
    native = nd and cpu_native.recurrent_kernels()
    if native and native.conv1d_decode(
        x, w, b32, conv_state, state_slots, has_initial_state, activation == "silu", out, nd
    ):
        pass  # the native kernel (float32 on CPU): each decode's state read and written once
    elif nd:
        slots = state_slots[:nd].long()
        init = has_initial_state[:nd].view(nd, 1, 1)
        # where, not a product: a slot's stale contents may be anything, NaN included.
        prev = torch.where(init, conv_state.index_select(0, slots).float(), 0.0)  # [nd, C, K-1]
        window = torch.cat([prev, x[:nd].float().unsqueeze(-1)], dim=-1)  # [nd, C, K]
        y = (window * w).sum(-1)
        if b32 is not None:
            y = y + b32
        out[:nd] = _act(y, activation).to(x.dtype)
        conv_state.index_copy_(0, slots, window[..., 1:].to(conv_state.dtype))
    B = state_slots.shape[0]
    # The prompt chunks in one native call (float32 on CPU), token after token through each
    # request's window as its decodes run, the threads sharing them; else a conv1d a request.
    native = B > nd and cpu_native.recurrent_kernels()
    if native and native.conv1d_prefill(
        x, w, b32, conv_state, query_start_loc[nd : B + 1], state_slots[nd:],
        has_initial_state[nd:], activation == "silu", out,
    ):  # fmt: skip
        return out
    if B > nd:
        starts = query_start_loc.tolist()
        slots = state_slots.tolist()
        inits = has_initial_state.tolist()
        for b in range(nd, B):
            s, e, slot = starts[b], starts[b + 1], slots[b]
            if e <= s:  # an empty entry (a captured verification step's padding)
                continue
            if inits[b]:
                prev = conv_state[slot].float()
            else:
                prev = torch.zeros(w.shape[0], K - 1, device=x.device)
            seq = torch.cat([prev, x[s:e].float().t()], dim=-1)  # [C, K-1+n]
            y = F.conv1d(seq.unsqueeze(0), w.unsqueeze(1), b32, groups=w.shape[0])[0]
            out[s:e] = _act(y, activation).t().to(x.dtype)
            conv_state[slot] = seq[:, -(K - 1) :].to(conv_state.dtype)
    return out


def _act(y: Tensor, activation: str | None) -> Tensor:
    return F.silu(y) if activation == "silu" else y


def gated_rms_norm_ref(
    x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int, norm_before_gate: bool
) -> Tensor:
    """RMSNorm over each group of `group_size` channels of x [..., D], gated by silu(z) (z the
    same shape): norm_before_gate=True is Qwen3-Next's weight * rmsnorm(x) * silu(z), False is
    Mamba-2's weight * rmsnorm(x * silu(z)) (Bamba, NemotronH, Falcon-H1). The casts are
    transformers' (Qwen3NextRMSNormGated, MambaRMSNormGated): statistics in float32, the
    normalised row rounded to x's dtype before the weight multiplies it (in torch's promoted
    dtype), the gate in float32. Returns [..., D] in x's dtype. In float32 on CPU, where the
    native kernels are loaded (`cpu_native.recurrent_kernels`), one native call computes it."""
    native = cpu_native.recurrent_kernels()  # float32 on CPU: one call, the rows in threads
    y = native.gated_rms_norm(x, z, weight, eps, group_size, norm_before_gate) if native else None
    if y is not None:
        return y
    dtype = x.dtype
    gate = F.silu(z.float())
    h = x.float()
    if not norm_before_gate:
        h = h * gate
    groups = h.view(*h.shape[:-1], -1, group_size)
    groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * groups.view(h.shape).to(dtype)
    if norm_before_gate:
        y = y * gate
    return y.to(dtype)


# -- Triton kernels --------------------------------------------------------------------------


@jit
def _causal_conv1d_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    state_ptr,
    out_ptr,
    query_start_loc_ptr,
    slots_ptr,
    init_ptr,
    stride_xt,
    stride_xc,
    stride_wc,
    stride_wk,
    stride_ss,
    stride_sc,
    stride_sk,
    stride_ot,
    n_channels,
    first_request,
    KW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    STATE_PAD: tl.constexpr,
):
    """One program: channels [pid0 * BLOCK_C, +BLOCK_C) of rows [pid2 * BLOCK_T, +BLOCK_T) of
    request first_request + pid1. The tile-0 program of a request also writes its new state;
    no other tile reads the state (BLOCK_T >= KW - 1), so that write races no reader."""
    req = tl.program_id(1) + first_request
    tile = tl.program_id(2)
    start = tl.load(query_start_loc_ptr + req)
    n = tl.load(query_start_loc_ptr + req + 1) - start
    t0 = tile * BLOCK_T
    if t0 >= n and tile > 0:  # past this request's end (the grid covers the longest request)
        return
    start = start.to(tl.int64)
    slot = tl.load(slots_ptr + req).to(tl.int64)
    # Inputs at p < state_end (relative to the first new token) come from the state: all of
    # p < 0 with an initial state, none without (p >= -(KW-1) always). A bound rather than a
    # boolean in the masks, which Triton's interpreter rejects when combined with a scalar.
    state_end = (tl.load(init_ptr + req).to(tl.int32) - 1) * KW
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < n_channels
    rows = t0 + tl.arange(0, BLOCK_T)
    rmask = rows < n
    x_cols = x_ptr + cols[None, :] * stride_xc
    s_cols = state_ptr + slot * stride_ss + cols * stride_sc
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(KW):
        # Input row p (relative to the request's first new token) feeds tap j of row p + KW-1-j;
        # rows before the first new token come from the state (its entry KW-1+p) or are zeros.
        p = rows - (KW - 1) + j
        valid = rmask[:, None] & cmask[None, :]
        from_x = valid & (p >= 0)[:, None]
        v = tl.load(x_cols + (start + p)[:, None] * stride_xt, mask=from_x, other=0.0)
        v = v.to(tl.float32)
        if t0 < KW - 1:
            from_state = valid & (p < state_end)[:, None]
            sp = s_cols[None, :] + (KW - 1 + p)[:, None] * stride_sk
            v += tl.load(sp, mask=from_state, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols * stride_wc + j * stride_wk, mask=cmask, other=0.0)
        acc += w.to(tl.float32)[None, :] * v
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    o_ptr = out_ptr + (start + rows)[:, None] * stride_ot + cols[None, :]
    tl.store(o_ptr, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])
    if tile == 0:
        # New state entry i is entry n + i of [old state (KW-1 entries), the n new inputs].
        i = tl.arange(0, STATE_PAD)
        imask = (i < KW - 1)[None, :] & cmask[:, None]
        q = n + i - (KW - 1)  # index into the new inputs; < 0: old state entry n + i
        xq = tl.load(
            x_ptr + (start + q)[None, :] * stride_xt + cols[:, None] * stride_xc,
            mask=imask & (q >= 0)[None, :],
            other=0.0,
        )
        sq = tl.load(
            s_cols[:, None] + (n + i)[None, :] * stride_sk,
            mask=imask & (q < state_end)[None, :],
            other=0.0,
        )
        new = tl.where((q >= 0)[None, :], xq.to(state_ptr.dtype.element_ty), sq)
        # Every thread's reads of the old state (here and in the taps) finish before any
        # thread overwrites it.
        tl.debug_barrier()
        tl.store(s_cols[:, None] + i[None, :] * stride_sk, new, mask=imask)


# Tiles: decodes are one row each, prefill chunks BLOCK_T rows; channel blocks of BLOCK_C.
DECODE_BLOCK_C = 256
PREFILL_BLOCK_T = 16
PREFILL_BLOCK_C = 128


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    query_start_loc: Tensor,
    state_slots: Tensor,
    has_initial_state: Tensor,
    activation: str | None,
    *,
    num_decodes: int = 0,
    max_query_len: int | None = None,
) -> Tensor:
    """The convolution of the module docstring over the ragged batch, `conv_state` updated in
    place; arguments as `causal_conv1d_ref`. Requests 0..num_decodes-1 (one token each) run in a
    launch of one-row tiles; the others in a launch whose grid covers `max_query_len` tokens per
    request (T - num_decodes when None: no device value is read on the host either way)."""
    K = _check_conv_args(x, weight, conv_state, activation)
    T, C = x.shape
    B = state_slots.shape[0]
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    common = dict(KW=K, HAS_BIAS=bias is not None, SILU=activation == "silu")
    state_pad = next_power_of_2(K - 1)

    def launch(first: int, requests: int, tiles: int, block_t: int, block_c: int, warps: int):
        grid = (cdiv(C, block_c), requests, tiles)
        _causal_conv1d_kernel[grid](
            x,
            weight,
            bias if bias is not None else weight,
            conv_state,
            out,
            query_start_loc,
            state_slots,
            has_initial_state,
            x.stride(0),
            x.stride(1),
            weight.stride(0),
            weight.stride(1),
            conv_state.stride(0),
            conv_state.stride(1),
            conv_state.stride(2),
            out.stride(0),
            C,
            first,
            BLOCK_T=block_t,
            BLOCK_C=block_c,
            STATE_PAD=state_pad,
            num_warps=warps,
            **common,
        )

    nd = min(num_decodes, B)
    if nd:
        block_c = min(DECODE_BLOCK_C, max(32, next_power_of_2(C)))
        launch(0, nd, 1, 1, block_c, 2)
    if B > nd:
        longest = max_query_len if max_query_len is not None else T - nd
        block_t = max(PREFILL_BLOCK_T, next_power_of_2(K - 1))
        block_c = min(PREFILL_BLOCK_C, max(32, next_power_of_2(C)))
        launch(nd, B - nd, max(1, cdiv(longest, block_t)), block_t, block_c, 4)
    return out


@jit
def _gated_rms_norm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_z,
    stride_out,
    group_size,
    eps,
    NORM_BEFORE_GATE: tl.constexpr,
    ROUND_WEIGHTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: group pid1 of row pid0."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < group_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    z = tl.load(z_ptr + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    gate = z / (1.0 + tl.exp(-z))
    h = x.to(tl.float32)
    if not NORM_BEFORE_GATE:
        h = h * gate
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / group_size + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    y = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * normed
    if ROUND_WEIGHTED:  # torch multiplies the weight in x's dtype: round as it does
        y = y.to(x.dtype).to(tl.float32)
    if NORM_BEFORE_GATE:
        y = y * gate
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(
    x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int, norm_before_gate: bool
) -> Tensor:
    """`gated_rms_norm_ref` as one kernel: x, z [..., D] (rows of wider buffers are fine),
    weight [D]; returns [..., D] in x's dtype."""
    D = x.shape[-1]
    if z.shape != x.shape or weight.shape != (D,) or group_size <= 0 or D % group_size:
        raise ValueError(
            f"gated_rms_norm: x {tuple(x.shape)}, z {tuple(z.shape)}, weight "
            f"{tuple(weight.shape)} and group_size {group_size} do not fit"
        )
    x2, z2 = rows_of(x, D), rows_of(z, D)
    rows = x2.shape[0]
    out = torch.empty(rows, D, dtype=x.dtype, device=x.device)
    if rows:
        block, warps = row_launch_shape(group_size)
        _gated_rms_norm_kernel[(rows, D // group_size)](
            x2,
            z2,
            weight,
            out,
            x2.stride(0),
            z2.stride(0),
            out.stride(0),
            group_size,
            eps,
            NORM_BEFORE_GATE=norm_before_gate,
            ROUND_WEIGHTED=torch.result_type(weight, x) == x.dtype,
            BLOCK=block,
            num_warps=warps,
        )
    return out.view(x.shape)

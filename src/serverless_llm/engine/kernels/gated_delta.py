"""The gated delta rule over the engine's ragged batch, each request's state kept in a slot: Gated
DeltaNet (Qwen3-Next, Qwen3.5, OLMo Hybrid; one log decay per head and token) and Kimi Delta
Attention (Kimi Linear; one log decay per head, token and key channel). A torch reference (what
the CPU path runs) and Triton kernels, same signature.

Per value head, with the state S [Dk, Dv] and token by token within a request:

    S   <- diag(exp(g_t)) S                     (g_t a scalar, or a [Dk] vector for Kimi)
    S   <- S + k_t (beta_t (v_t - k_t^T S))^T   (the delta rule: write the correction only)
    o_t  = (scale q_t)^T S

q and k are first L2-normalised in float32 (eps 1e-6) when `use_qk_l2norm`. With Hv value heads
over Hk query/key heads, value head h reads q/k head h // (Hv // Hk), as transformers'
`repeat_interleave` does. Request b's rows are `[query_start_loc[b], query_start_loc[b+1])`; the
first `num_decodes` requests bring one token each. Its state starts from slot `state_slots[b]`
when `has_initial_state[b]`, else from zeros, and its state after its last row is written back to
that slot (float32, in place). Slot 0 may be named by several padded rows: their writes race and
are never read. All the math runs in float32; o is rounded once to v's dtype.

The chunked form (transformers' `torch_chunk_gated_delta_rule`, `chunk_kimi_delta_attention`):
within a chunk of C tokens starting from state S0, with gamma_t the cumulative log decay inside
the chunk, the rows u_t = beta_t (v_t - k_t^T S_{t-1} decayed) that the delta rule writes satisfy
a unit lower-triangular system (I + M) u = beta v - beta (k * exp(gamma)) S0 with
M[i, j] = beta_i sum_d k_i k_j exp(gamma_i - gamma_j) for j < i. Solving it once per chunk gives
U = (I + M)^-1 beta v and W = (I + M)^-1 beta k exp(gamma), so u = U - W S0 (the UT transform);
then o = (q exp(gamma)) S0 + P u with P[i, j] = sum_d q_i k_j exp(gamma_i - gamma_j) for j <= i,
and the state passes on as exp(gamma_C) S0 + (k exp(gamma_C - gamma))^T u.

exp(gamma_i - gamma_j) is taken as one exponent wherever it may exceed 1 in either factor
(exp(-gamma_j) overflows float32 within a chunk once the decays add up past ~88): per head it is
a [C, C] matrix; per channel the reference splits the chunk into sub-blocks of 16, factors the
off-diagonal blocks around each row block's first token (both factors <= 1) and computes the
diagonal blocks directly, and the Triton kernel builds the score matrices column by column.

l2norm: Qwen3-Next multiplies by rsqrt(sum + eps), Kimi divides by sqrt(sum + eps); in float32
they differ by at most ~1.2e-7 on unit-norm vectors (measured), below 1e-6, so one form serves.

Triton: decodes (the first `num_decodes` requests) run `_recurrent_kernel`, one program per
(request, value head, block of Dv) holding its [Dk, BV] state tile in registers while it walks the
request's tokens (correct for a chunk of any length); it launches without reading device tensors
on the host. Prefill requests run the chunked form, in chunks of TRITON_CHUNK = 32 tokens, in two
kernels: `_chunk_prepare_kernel`, one program per (chunk, value head), all in parallel, computes
P, U, W, the decayed q and k and the chunk's decay (the triangular solve by forward substitution
in registers) into float32 scratch tensors; `_chunk_state_kernel`, one program per (request,
value head, block of Dv), walks the request's chunks carrying the state: a 4k-token prompt is
128 sequential steps of small matmuls instead of 4096 token steps. The chunk table is built with
torch ops on the device, so that path launches without a host sync either. Its dots run in
"tf32x3" (three TF32 products: float32 accuracy on tensor cores; plain TF32 would cost ~1e-3
relative in the state). Triton is imported at the first launch, never for the reference (see
`triton_lazy`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import cpu_native
from .triton_lazy import cdiv, jit, next_power_of_2

tl = None  # triton.language, bound at the first launch (see triton_lazy)

CHUNK = 64  # tokens per chunk of the reference's chunked form (transformers' too)
_SUB = 16  # the per-channel reference's sub-blocks (see the module docstring)
_EPS = 1e-6  # the q/k l2norm's eps (transformers', FLA's)
# Prompt chunks of at most this many tokens run the per-token recurrence in the reference: below
# it the chunked form's fixed costs (padding to 64, the triangular solve, the per-channel scores)
# outweigh its matmuls. Measured on 2 CPU threads (torch 2.13, Hv = 32, Dk = Dv = 128), best of
# 30, recurrent vs chunked: per head 16 tokens 3.0 vs 5.1 ms, 24: 4.6 vs 5.0, 32: 6.4 vs 5.2;
# per channel 40 tokens 7.9 vs 11.3 ms, 48: 9.4 vs 11.3, 56: 11.9 vs 11.5.
RECURRENT_MAX = 24
RECURRENT_MAX_PER_CHANNEL = 48
# The Triton chunked path: its chunk, and the parts its kernels split key/value dims into. A
# float32 `tl.dot` operand is held whole in every warp's registers, so a dot contracting over 128
# key dims at once, or a chunk of 64, spills (kilobytes of stack per thread). At Dk = Dv = 128
# these compile for sm80 and sm90 (tests/kernels/gpu_compile.py's compiler) with no spill but
# 104 bytes in sm90's state kernel and 8 in sm80's float32 prepare kernel.
TRITON_CHUNK = 32
_PREPARE_BLOCK = 32  # key/value columns per part in _chunk_prepare_kernel
_PREPARE_WARPS = 4
_STATE_BLOCK_K = 32  # state rows per part in _chunk_state_kernel (at most 4 parts)
_STATE_BLOCK_V = 64  # value dims per _chunk_state_kernel program
_STATE_WARPS = 8
# Past 128 key dims the state kernel spills heavily (sm80: 25 KB at 256): prefill then runs the
# recurrent kernel. Every model served here (Qwen3-Next, Qwen3.5, OLMo Hybrid, Kimi) has 128.
CHUNKED_MAX_DK = 128
_PREPARE_WARPS = 8
_STATE_WARPS = 8
# Past 128 key dims the state kernel spills heavily (sm80: 25 KB at 256): prefill then runs the
# recurrent kernel. Every model served here (Qwen3-Next, Qwen3.5, OLMo Hybrid, Kimi) has 128.
CHUNKED_MAX_DK = 128


# -- torch reference -------------------------------------------------------------------------


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _EPS)


def _prepare_qk(
    q: Tensor, k: Tensor, num_v_heads: int, scale: float, use_qk_l2norm: bool
) -> tuple[Tensor, Tensor]:
    """q, k [T, Hk, Dk] as float32 [T, Hv, Dk]: normalised, repeated per value head, q scaled."""
    q32, k32 = q.float(), k.float()
    if use_qk_l2norm:
        q32, k32 = _l2norm(q32), _l2norm(k32)
    group = num_v_heads // q.shape[1]
    if group > 1:
        q32 = q32.repeat_interleave(group, dim=1)
        k32 = k32.repeat_interleave(group, dim=1)
    return q32 * scale, k32


def _step(
    S: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
) -> tuple[Tensor, Tensor]:
    """One token of the recurrence on states S [..., H, Dk, Dv]: q, k [..., H, Dk], v [..., H, Dv],
    g [..., H] or [..., H, Dk], beta [..., H]. Returns (the new S, o [..., H, Dv])."""
    decay = g.exp()[..., None] if g.dim() == q.dim() else g.exp()[..., None, None]
    S = S * decay
    kv = (k[..., None] * S).sum(-2)
    delta = (v - kv) * beta[..., None]
    S = S + k[..., None] * delta[..., None, :]
    return S, (q[..., None] * S).sum(-2)


def _decode_in_place(S: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """`_step` for n decodes at once, updating S [n, H, Dk, Dv] in place with the fewest passes
    over it (the states dominate a decode step's memory traffic on CPU): with e = exp(g) per
    key row, k^T (e S) and q^T (e S) in one batched product (one read), then S <- e S + k
    delta^T in place (two); the output q^T S' = (q e)^T S + (q . k) delta needs no further
    pass. Returns o [n, H, Dv]."""
    n, H, Dk, Dv = S.shape
    e = g.exp()
    e = e[..., None].expand(n, H, Dk) if g.dim() == q.dim() - 1 else e
    kq = torch.stack([k * e, q * e], dim=-2)  # [n, H, 2, Dk]
    read = kq @ S  # [n, H, 2, Dv]: the old state, decayed, seen by k and by q
    delta = (v - read[..., 0, :]) * beta[..., None]
    S.mul_(e[..., None])
    S.view(n * H, Dk, Dv).baddbmm_(k.reshape(n * H, Dk, 1), delta.reshape(n * H, 1, Dv))
    return read[..., 1, :] + (q * k).sum(-1, keepdim=True) * delta


def _recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor
) -> tuple[Tensor, Tensor]:
    """The per-token loop over one request's L tokens ([L, H, ...] float32, q prepared)."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        S, out[t] = _step(S, q[t], k[t], v[t], g[t], beta[t])
    return out, S


def _by_chunks(x: Tensor, num_chunks: int) -> Tensor:
    """[L, H, *rest] zero-padded to num_chunks * CHUNK rows, as [H, N, CHUNK, *rest]."""
    L = x.shape[0]
    padded = x.new_zeros((num_chunks * CHUNK, *x.shape[1:]))
    padded[:L] = x
    padded = padded.view(num_chunks, CHUNK, *x.shape[1:])
    return padded.movedim(2, 0)


def _channel_scores(a: Tensor, b: Tensor, gc: Tensor, inclusive: bool) -> Tensor:
    """s[i, j] = sum_d a_i b_j exp(gc_i - gc_j) for j < i (j <= i when `inclusive`), else 0:
    a, b, gc [H, N, C, Dk] (gc non-increasing along C), s [H, N, C, C]. Off-diagonal 16-blocks
    factor exp(gc_i - gc_r) exp(gc_r - gc_j) around row block's first token r (each <= 1); the
    diagonal blocks take exp(gc_i - gc_j) directly, one lag at a time."""
    H, N, C, D = a.shape
    nb = C // _SUB
    out = a.new_zeros(H, N, nb, _SUB, C)
    a_b, b_b, g_b = (x.view(H, N, nb, _SUB, D) for x in (a, b, gc))
    for r in range(1, nb):
        ref = g_b[:, :, r, :1]  # [H, N, 1, D]
        a_f = a_b[:, :, r] * (g_b[:, :, r] - ref).exp()
        b_f = b[:, :, : r * _SUB] * (ref - gc[:, :, : r * _SUB]).exp()
        out[:, :, r, :, : r * _SUB] = a_f @ b_f.transpose(-1, -2)
    diag = torch.diagonal(out.view(H, N, nb, _SUB, nb, _SUB), dim1=2, dim2=4)  # [H, N, S, S, nb]
    for lag in range(0 if inclusive else 1, _SUB):
        vals = a_b[:, :, :, lag:] * b_b[:, :, :, : _SUB - lag]
        vals = (vals * (g_b[:, :, :, lag:] - g_b[:, :, :, : _SUB - lag]).exp()).sum(-1)
        band = torch.diagonal(diag, offset=-lag, dim1=2, dim2=3)  # [H, N, nb, S - lag]
        band.copy_(vals)
    return out.view(H, N, C, C)


def _chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor
) -> tuple[Tensor, Tensor]:
    """The chunked form over one request's L tokens ([L, H, ...] float32, q prepared) from state
    S [H, Dk, Dv]: the intra-chunk systems of all chunks at once, then a loop passing the state.
    Returns (o [L, H, Dv], the final state)."""
    L = q.shape[0]
    N = cdiv(L, CHUNK)
    per_channel = g.dim() == 3
    qc, kc, vc, gc, bc = (_by_chunks(x, N) for x in (q, k, v, g, beta))
    gc = gc.cumsum(2)  # padded rows carry g = 0: the last row holds the chunk's total decay
    if per_channel:
        M = _channel_scores(kc, kc, gc, inclusive=False)
        P = _channel_scores(qc, kc, gc, inclusive=True)
        eg = gc.exp()
        q_in = qc * eg
        k_w = kc * eg
        k_out = kc * (gc[:, :, -1:] - gc).exp()
        chunk_decay = gc[:, :, -1].exp()[..., None]  # [H, N, Dk, 1]
    else:
        lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
        diff = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf"))
        decay = diff.exp()
        M = (kc @ kc.transpose(-1, -2) * decay).tril(-1)
        P = qc @ kc.transpose(-1, -2) * decay
        eg = gc.exp()[..., None]
        q_in = qc * eg
        k_w = kc * eg
        k_out = kc * (gc[:, :, -1:] - gc).exp()[..., None]
        chunk_decay = gc[:, :, -1].exp()[..., None, None]  # [H, N, 1, 1]
    A = M * bc[..., None]
    A.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    rhs = torch.cat([vc, k_w], dim=-1) * bc[..., None]
    UW = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    Dv = v.shape[-1]
    U, W = UW[..., :Dv], UW[..., Dv:]
    out = torch.empty_like(U)
    for i in range(N):
        u = U[:, i] - W[:, i] @ S
        out[:, i] = q_in[:, i] @ S + P[:, i] @ u
        S = S * chunk_decay[:, i] + k_out[:, i].transpose(-1, -2) @ u
    return out.movedim(0, 2).reshape(N * CHUNK, *v.shape[1:])[:L], S


def gated_delta_rule_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    query_start_loc: Tensor,
    state_slots: Tensor,
    has_initial_state: Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    num_decodes: int = 0,
) -> Tensor:
    """The torch reference of `gated_delta_rule`. q, k [T, Hk, Dk] (views fine), v [T, Hv, Dv],
    g [T, Hv] or [T, Hv, Dk] (float32 log decays, <= 0), beta [T, Hv], state
    [num_slots, Hv, Dk, Dv] float32 (updated in place); query_start_loc [B+1], state_slots [B]
    int32, has_initial_state [B] bool. Returns o [T, Hv, Dv] in v's dtype (zeros on rows of no
    request). Decodes step all at once; a prompt chunk of more than RECURRENT_MAX tokens
    (RECURRENT_MAX_PER_CHANNEL for a per-channel g) runs the chunked form, shorter ones the
    per-token loop. In float32 on CPU, where the native kernels are loaded
    (`cpu_native.recurrent_kernels`), the decodes and the prompt chunks run in them instead
    (the chunks token after token, all in one call)."""
    _check(q, k, v, g, beta, state, state_slots)
    Hv = v.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    nd, B = num_decodes, state_slots.shape[0]
    # The native kernels (float32 on CPU) read and write each decode's state once, in its slot,
    # and run the prompt chunks token after token in their slots (one call for all of them,
    # shared by the threads: the torch forms below are many small ops a request, on one thread).
    native = cpu_native.recurrent_kernels()
    decodes_done = (
        bool(nd)
        and bool(native)
        and native.gated_delta_decode(
            q, k, v, g, beta, state, state_slots, has_initial_state, scale, use_qk_l2norm, out, nd
        )
    )
    prompts_done = B > nd and bool(native) and native.gated_delta_prefill(
        q, k, v, g, beta, state, query_start_loc[nd : B + 1], state_slots[nd:],
        has_initial_state[nd:], scale, use_qk_l2norm, out,
    )  # fmt: skip
    if (decodes_done or not nd) and (prompts_done or B == nd):
        return out.to(v.dtype)
    nd_torch = 0 if decodes_done else nd
    qp, kp = _prepare_qk(q, k, Hv, scale, use_qk_l2norm)
    v32, g32, b32 = v.float(), g.float(), beta.float()
    if nd_torch:
        slots = state_slots[:nd].long()
        S = state.index_select(0, slots)
        init = has_initial_state[:nd]
        if not bool(init.all()):  # where, not a product: a fresh slot may hold NaN
            S = torch.where(init[:, None, None, None], S, 0.0)
        out[:nd] = _decode_in_place(S, qp[:nd], kp[:nd], v32[:nd], g32[:nd], b32[:nd])
        state.index_copy_(0, slots, S)
    short = RECURRENT_MAX_PER_CHANNEL if g.dim() == 3 else RECURRENT_MAX
    bounds = query_start_loc.tolist()
    slots_list = state_slots.tolist()
    init_list = has_initial_state.tolist()
    for b in range(nd, 0 if prompts_done else len(slots_list)):
        s, e = bounds[b], bounds[b + 1]
        if e <= s:
            continue
        slot = slots_list[b]
        S = state[slot] if init_list[b] else state.new_zeros(state.shape[1:])
        run = _recurrent if e - s <= short else _chunked
        out[s:e], state[slot] = run(qp[s:e], kp[s:e], v32[s:e], g32[s:e], b32[s:e], S)
    return out.to(v.dtype)


def _check(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, slots: Tensor
) -> None:
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != T or Hv % Hk:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if g.shape not in ((T, Hv), (T, Hv, Dk)) or beta.shape != (T, Hv):
        raise ValueError(f"g {tuple(g.shape)} / beta {tuple(beta.shape)} do not fit v's heads")
    if state.shape[1:] != (Hv, Dk, Dv) or state.dtype != torch.float32:
        raise ValueError(
            f"state {tuple(state.shape)} {state.dtype} is not [slots, Hv, Dk, Dv] fp32"
        )
    if slots.dim() != 1:
        raise ValueError("state_slots must be [B]")


# -- Triton kernels --------------------------------------------------------------------------


@jit
def _load_vec(ptr, offs, mask, eps, L2NORM: tl.constexpr):
    """One token's q or k head, [DK_PAD] float32, l2-normalised if asked."""
    x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=0) + eps)
    return x


@jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr,
    query_start_loc_ptr, slots_ptr, init_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_gt, stride_gh, stride_bt, stride_bh,
    stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,
    first_req, group, dk, dv, q_scale, eps,
    L2NORM: tl.constexpr, PER_CHANNEL: tl.constexpr, DK_PAD: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """One program per (request first_req + program 0, value head, block of BV value dims): the
    state tile [DK_PAD, BV] stays in registers while the program walks the request's tokens."""
    b = first_req + tl.program_id(0)
    h = tl.program_id(1)
    hk = h // group
    start = tl.load(query_start_loc_ptr + b)
    end = tl.load(query_start_loc_ptr + b + 1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    init = tl.load(init_ptr + b).to(tl.int32)  # 1: continue from the slot, 0: from zeros
    offs_k = tl.arange(0, DK_PAD)
    mask_k = offs_k < dk
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_v = offs_v < dv
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk
    s_ptrs = s_ptrs + offs_v[None, :]
    # The state is read only with an initial state (a slot may hold anything otherwise); the
    # flag joins the mask through its bound, as a scalar & broadcast trips the interpreter.
    S = tl.load(s_ptrs, mask=(offs_k < dk * init)[:, None] & mask_v[None, :], other=0.0)
    start64 = start.to(tl.int64)
    for t in range(0, end - start):
        row = start64 + t
        qt = _load_vec(q_ptr + row * stride_qt + hk * stride_qh, offs_k, mask_k, eps, L2NORM)
        kt = _load_vec(k_ptr + row * stride_kt + hk * stride_kh, offs_k, mask_k, eps, L2NORM)
        qt = qt * q_scale
        vt = tl.load(v_ptr + row * stride_vt + h * stride_vh + offs_v, mask=mask_v, other=0.0)
        bt = tl.load(beta_ptr + row * stride_bt + h * stride_bh).to(tl.float32)
        if PER_CHANNEL:
            gt = tl.load(g_ptr + row * stride_gt + h * stride_gh + offs_k, mask=mask_k, other=0.0)
            S = S * tl.exp(gt.to(tl.float32))[:, None]
        else:
            S = S * tl.exp(tl.load(g_ptr + row * stride_gt + h * stride_gh).to(tl.float32))
        kv = tl.sum(kt[:, None] * S, axis=0)
        delta = (vt.to(tl.float32) - kv) * bt
        S = S + kt[:, None] * delta[None, :]
        ot = tl.sum(qt[:, None] * S, axis=0)
        o_ptrs = o_ptr + row * stride_ot + h * stride_oh + offs_v
        tl.store(o_ptrs, ot.to(o_ptr.dtype.element_ty), mask=mask_v)
    # A request with no rows this step leaves its slot as it was.
    tl.store(s_ptrs, S, mask=(offs_k < tl.where(end > start, dk, 0))[:, None] & mask_v[None, :])


@jit
def _chunk_part(ptr, stride_t, rows, valid, part, dk, BK: tl.constexpr):
    """Columns part * BK .. of a chunk's rows of one head of q, k or per-channel g (the head's
    offset already in ptr): [CHUNK, BK] float32, zeros outside."""
    offs = part * BK + tl.arange(0, BK)
    mask = valid[:, None] & (offs < dk)[None, :]
    x = tl.load(ptr + rows[:, None] * stride_t + offs[None, :], mask=mask, other=0.0)
    return x.to(tl.float32)


@jit
def _chunk_prepare_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, chunk_start_ptr, chunk_end_ptr,
    u_ptr, w_ptr, qg_ptr, kg_ptr, p_ptr, decay_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_gt, stride_gh, stride_bt, stride_bh,
    group, dk, dv, q_scale, eps,
    L2NORM: tl.constexpr, PER_CHANNEL: tl.constexpr, CHUNK: tl.constexpr,
    BK: tl.constexpr, NK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
):  # fmt: skip
    """One program per (chunk slot, value head): everything of the chunk that does not need the
    state, stored at its tokens' rows of the float32 scratch tensors (each [T, Hv, width],
    contiguous): U [Dv] and W [Dk] (the UT transform), Qg = scale q exp(gamma) and
    Kg = k exp(gamma_last - gamma) [Dk], P [CHUNK]; and exp(gamma_last) [Dk] at the chunk slot's
    row of `decay` [slots, Hv, Dk]. An empty slot (end == start) stores nothing there but its
    decay row, which nobody reads. Key dims are taken in NK parts of BK columns and value dims in
    NV parts of BV (re-read from memory): a float32 dot operand lives whole in every warp's
    registers, and one spanning 128 dims spills."""
    ci = tl.program_id(0)
    c0 = tl.load(chunk_start_ptr + ci)
    n = tl.load(chunk_end_ptr + ci) - c0
    h = tl.program_id(1)
    num_v_heads = tl.num_programs(1)
    rows = tl.arange(0, CHUNK)
    valid = rows < n
    trow = c0.to(tl.int64) + rows
    q_ptr += (h // group) * stride_qh
    k_ptr += (h // group) * stride_kh
    g_ptr += h * stride_gh
    beta = tl.load(beta_ptr + trow * stride_bt + h * stride_bh, mask=valid, other=0.0)
    beta = beta.to(tl.float32)
    strictly_lower = rows[:, None] > rows[None, :]
    lower = rows[:, None] >= rows[None, :]
    is_last = rows == CHUNK - 1  # rows past the end add 0: the last row holds the chunk's total
    # The q/k row norms (a sum over every part), q's with the scale folded in.
    q_norm = tl.zeros([CHUNK], tl.float32) + q_scale
    k_norm = tl.zeros([CHUNK], tl.float32) + 1.0
    if L2NORM:
        q_sq = tl.zeros([CHUNK], tl.float32)
        k_sq = tl.zeros([CHUNK], tl.float32)
        for part in range(NK):
            q = _chunk_part(q_ptr, stride_qt, trow, valid, part, dk, BK)
            k = _chunk_part(k_ptr, stride_kt, trow, valid, part, dk, BK)
            q_sq += tl.sum(q * q, axis=1)
            k_sq += tl.sum(k * k, axis=1)
        q_norm = q_scale * tl.rsqrt(q_sq + eps)
        k_norm = tl.rsqrt(k_sq + eps)
    gam_h = tl.zeros([CHUNK], tl.float32)  # per head: gamma of each row
    if not PER_CHANNEL:
        G = tl.load(g_ptr + trow * stride_gt, mask=valid, other=0.0)
        gam_h = tl.cumsum(G.to(tl.float32), axis=0)
    # The scores: M[i, j] = k_i . k_j exp(gamma_i - gamma_j) below the diagonal, P[i, j] the same
    # with q_i on and below it.
    M = tl.zeros([CHUNK, CHUNK], tl.float32)
    P = tl.zeros([CHUNK, CHUNK], tl.float32)
    for part in range(NK):
        q = _chunk_part(q_ptr, stride_qt, trow, valid, part, dk, BK) * q_norm[:, None]
        k = _chunk_part(k_ptr, stride_kt, trow, valid, part, dk, BK) * k_norm[:, None]
        if PER_CHANNEL:
            gam = tl.cumsum(_chunk_part(g_ptr, stride_gt, trow, valid, part, dk, BK), axis=0)
            # Column j at a time: exp(gamma_i - gamma_j) as one exponent per channel, masked to
            # i >= j before the exp (above the diagonal it would overflow).
            for j in range(0, n):
                at_j = rows[:, None] == j
                kj = tl.sum(tl.where(at_j, k, 0.0), axis=0)
                gj = tl.sum(tl.where(at_j, gam, 0.0), axis=0)
                ek = tl.exp(tl.where(rows[:, None] >= j, gam - gj[None, :], float("-inf")))
                ek = ek * kj[None, :]
                col = rows[None, :] == j
                M += tl.where(col, tl.sum(k * ek, axis=1)[:, None], 0.0)
                P += tl.where(col, tl.sum(q * ek, axis=1)[:, None], 0.0)
        else:
            M = tl.dot(k, tl.trans(k), M, input_precision="tf32x3")
            P = tl.dot(q, tl.trans(k), P, input_precision="tf32x3")
    if not PER_CHANNEL:
        pair_decay = tl.exp(tl.where(lower, gam_h[:, None] - gam_h[None, :], float("-inf")))
        M = M * pair_decay
        P = P * pair_decay
    M = tl.where(strictly_lower, M, 0.0) * beta[:, None]
    P = tl.where(lower, P, 0.0)
    p_rows = (trow * num_v_heads + h) * CHUNK
    tl.store(p_ptr + p_rows[:, None] + rows[None, :], P, mask=valid[:, None])
    # (I + M)^-1 by forward substitution: row i is e_i - sum_{j<i} M[i, j] (row j), M with the
    # rows' beta. Rows past i are still e_i's, where M[i, :] is 0.
    Tinv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, n):
        at_i = rows[:, None] == i
        m_i = tl.sum(tl.where(at_i, M, 0.0), axis=0)
        row_i = tl.where(rows == i, 1.0, 0.0) - tl.sum(m_i[:, None] * Tinv, axis=0)
        Tinv = tl.where(at_i, row_i[None, :], Tinv)
    # Per key part: W = Tinv (beta k exp(gamma)), Qg, Kg and the chunk's decay.
    k_rows = (trow * num_v_heads + h) * dk
    for part in range(NK):
        offs_k = part * BK + tl.arange(0, BK)
        mask_k = offs_k < dk
        mask_qk = valid[:, None] & mask_k[None, :]
        q = _chunk_part(q_ptr, stride_qt, trow, valid, part, dk, BK) * q_norm[:, None]
        k = _chunk_part(k_ptr, stride_kt, trow, valid, part, dk, BK) * k_norm[:, None]
        if PER_CHANNEL:
            gam = tl.cumsum(_chunk_part(g_ptr, stride_gt, trow, valid, part, dk, BK), axis=0)
            total = tl.sum(tl.where(is_last[:, None], gam, 0.0), axis=0)
            eg = tl.exp(gam)
            Qg = q * eg
            Kg = k * tl.exp(total[None, :] - gam)
            K_w = k * eg * beta[:, None]
            decay = tl.exp(total)
        else:
            total = tl.sum(tl.where(is_last, gam_h, 0.0), axis=0)
            eg = tl.exp(gam_h)
            Qg = q * eg[:, None]
            Kg = k * tl.exp(total - gam_h)[:, None]
            K_w = k * (eg * beta)[:, None]
            decay = tl.zeros([BK], tl.float32) + tl.exp(total)
        offs = k_rows[:, None] + offs_k[None, :]
        tl.store(qg_ptr + offs, Qg, mask=mask_qk)
        tl.store(kg_ptr + offs, Kg, mask=mask_qk)
        tl.store(w_ptr + offs, tl.dot(Tinv, K_w, input_precision="tf32x3"), mask=mask_qk)
        decay_row = (ci.to(tl.int64) * num_v_heads + h) * dk
        tl.store(decay_ptr + decay_row + offs_k, decay, mask=mask_k)
    # Per value part: U = Tinv (beta v).
    v_rows = (trow * num_v_heads + h) * dv
    for part in range(NV):
        offs_v = part * BV + tl.arange(0, BV)
        mask_rv = valid[:, None] & (offs_v < dv)[None, :]
        V = tl.load(v_ptr + trow[:, None] * stride_vt + h * stride_vh + offs_v[None, :],
                    mask=mask_rv, other=0.0)  # fmt: skip
        U = tl.dot(Tinv, V.to(tl.float32) * beta[:, None], input_precision="tf32x3")
        tl.store(u_ptr + v_rows[:, None] + offs_v[None, :], U, mask=mask_rv)


@jit
def _state_load(s_ptrs, stride_sk, part, dk_read, dv, offs_v, BK: tl.constexpr):
    """Rows part * BK .. of a [Dk, BV] state tile (zeros past dk_read: 0 without a state)."""
    offs_k = part * BK + tl.arange(0, BK)
    mask = (offs_k < dk_read)[:, None] & (offs_v < dv)[None, :]
    return tl.load(s_ptrs + offs_k[:, None] * stride_sk, mask=mask, other=0.0)


@jit
def _state_store(s_ptrs, stride_sk, part, S, dk, dv, offs_v, BK: tl.constexpr):
    offs_k = part * BK + tl.arange(0, BK)
    mask = (offs_k < dk)[:, None] & (offs_v < dv)[None, :]
    tl.store(s_ptrs + offs_k[:, None] * stride_sk, S, mask=mask)


@jit
def _state_dot(x_ptr, k_row, valid, part, dk, S, acc, BK: tl.constexpr):
    """acc + X @ S for one [BK, BV] state part: X the [CHUNK, BK] columns part * BK .. of the
    scratch rows `x_ptr + k_row`."""
    offs_k = part * BK + tl.arange(0, BK)
    x = tl.load(x_ptr + k_row + offs_k[None, :], mask=valid[:, None] & (offs_k < dk)[None, :],
                other=0.0)  # fmt: skip
    return tl.dot(x, S, acc, input_precision="tf32x3")


@jit
def _state_update(kg_ptr, decay_ptr, k_row, valid, part, dk, S, u, BK: tl.constexpr):
    """decay S + Kg^T u for one [BK, BV] state part."""
    offs_k = part * BK + tl.arange(0, BK)
    mask_k = offs_k < dk
    kg = tl.load(kg_ptr + k_row + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                 other=0.0)  # fmt: skip
    decay = tl.load(decay_ptr + offs_k, mask=mask_k, other=0.0)
    return tl.dot(tl.trans(kg), u, S * decay[:, None], input_precision="tf32x3")


@jit
def _chunk_state_kernel(
    u_ptr, w_ptr, qg_ptr, kg_ptr, p_ptr, decay_ptr, state_ptr, o_ptr,
    query_start_loc_ptr, slots_ptr, init_ptr, first_chunk_ptr,
    stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,
    first_req, dk, dv,
    CHUNK: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """One program per (request first_req + program 0, value head, block of BV value dims): walks
    the request's chunks with its [Dk, BV] state in registers, from what `_chunk_prepare_kernel`
    stored: u = U - W S; o = Qg S + P u; S <- decay S + Kg^T u. The state is held in NK (1, 2
    or 4) parts of [BK, BV] rows: a float32 dot operand lives in every warp's registers whole,
    and one contracting over 128 key dims at once spills."""
    r = tl.program_id(0)
    b = first_req + r
    h = tl.program_id(1)
    num_v_heads = tl.num_programs(1)
    start = tl.load(query_start_loc_ptr + b)
    end = tl.load(query_start_loc_ptr + b + 1)
    first_chunk = tl.load(first_chunk_ptr + r).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    # The state is read only with an initial state (a slot may hold anything otherwise): rows
    # below dk * init, init 1 to continue from the slot, 0 to start from zeros.
    dk_read = dk * tl.load(init_ptr + b).to(tl.int32)
    rows = tl.arange(0, CHUNK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + offs_v[None, :]
    S0 = _state_load(s_ptrs, stride_sk, 0, dk_read, dv, offs_v, BK)
    S1 = S0
    S2 = S0
    S3 = S0
    if NK >= 2:
        S1 = _state_load(s_ptrs, stride_sk, 1, dk_read, dv, offs_v, BK)
    if NK >= 4:
        S2 = _state_load(s_ptrs, stride_sk, 2, dk_read, dv, offs_v, BK)
        S3 = _state_load(s_ptrs, stride_sk, 3, dk_read, dv, offs_v, BK)
    # The request's rows of the scratch tensors, then int32 offsets within them.
    row0 = start.to(tl.int64) * num_v_heads + h
    w_ptr += row0 * dk
    qg_ptr += row0 * dk
    kg_ptr += row0 * dk
    u_ptr += row0 * dv
    p_ptr += row0 * CHUNK
    o_ptr += start.to(tl.int64) * stride_ot + h * stride_oh
    decay_ptr += (first_chunk * num_v_heads + h) * dk
    for c in range(0, end - start, CHUNK):
        valid = rows < end - start - c
        tok = c + rows
        mask_ov = valid[:, None] & (offs_v < dv)[None, :]
        k_row = (tok * num_v_heads * dk)[:, None]
        U = tl.load(u_ptr + (tok * num_v_heads * dv)[:, None] + offs_v[None, :], mask=mask_ov,
                    other=0.0)  # fmt: skip
        WS = _state_dot(w_ptr, k_row, valid, 0, dk, S0, tl.zeros([CHUNK, BV], tl.float32), BK)
        if NK >= 2:
            WS = _state_dot(w_ptr, k_row, valid, 1, dk, S1, WS, BK)
        if NK >= 4:
            WS = _state_dot(w_ptr, k_row, valid, 2, dk, S2, WS, BK)
            WS = _state_dot(w_ptr, k_row, valid, 3, dk, S3, WS, BK)
        u = U - WS
        P = tl.load(p_ptr + (tok * num_v_heads * CHUNK)[:, None] + rows[None, :],
                    mask=valid[:, None], other=0.0)  # fmt: skip
        o = tl.dot(P, u, input_precision="tf32x3")
        o = _state_dot(qg_ptr, k_row, valid, 0, dk, S0, o, BK)
        if NK >= 2:
            o = _state_dot(qg_ptr, k_row, valid, 1, dk, S1, o, BK)
        if NK >= 4:
            o = _state_dot(qg_ptr, k_row, valid, 2, dk, S2, o, BK)
            o = _state_dot(qg_ptr, k_row, valid, 3, dk, S3, o, BK)
        o_ptrs = o_ptr + tok[:, None] * stride_ot + offs_v[None, :]
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mask_ov)
        chunk_decay = decay_ptr + (c // CHUNK) * num_v_heads * dk
        S0 = _state_update(kg_ptr, chunk_decay, k_row, valid, 0, dk, S0, u, BK)
        if NK >= 2:
            S1 = _state_update(kg_ptr, chunk_decay, k_row, valid, 1, dk, S1, u, BK)
        if NK >= 4:
            S2 = _state_update(kg_ptr, chunk_decay, k_row, valid, 2, dk, S2, u, BK)
            S3 = _state_update(kg_ptr, chunk_decay, k_row, valid, 3, dk, S3, u, BK)
    dk_write = tl.where(end > start, dk, 0)  # a request with no rows leaves its slot as it was
    _state_store(s_ptrs, stride_sk, 0, S0, dk_write, dv, offs_v, BK)
    if NK >= 2:
        _state_store(s_ptrs, stride_sk, 1, S1, dk_write, dv, offs_v, BK)
    if NK >= 4:
        _state_store(s_ptrs, stride_sk, 2, S2, dk_write, dv, offs_v, BK)
        _state_store(s_ptrs, stride_sk, 3, S3, dk_write, dv, offs_v, BK)


def _unit_last(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _recurrent_block_v(dk_pad: int, dv: int) -> int:
    """BV of the recurrent kernel: a [Dk, BV] tile of at most 4096 floats (32 per thread at 4
    warps), so a decode of few requests still spreads over many programs."""
    return min(next_power_of_2(dv), max(16, 4096 // dk_pad))


def _launch_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, o: Tensor,
    query_start_loc: Tensor, state_slots: Tensor, has_initial_state: Tensor,
    scale: float, use_qk_l2norm: bool, first_req: int, num_reqs: int, block_v: int | None = None,
) -> None:  # fmt: skip
    """`_recurrent_kernel` over requests first_req .. first_req + num_reqs - 1 (any lengths)."""
    Hk, Dk = q.shape[1:]
    Hv, Dv = v.shape[1:]
    dk_pad = max(16, next_power_of_2(Dk))
    bv = block_v or _recurrent_block_v(dk_pad, Dv)
    per_channel = g.dim() == 3
    _recurrent_kernel[(num_reqs, Hv, cdiv(Dv, bv))](
        q, k, v, g, beta, state, o,
        query_start_loc, state_slots, has_initial_state,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), state.stride(2), o.stride(0), o.stride(1),
        first_req, Hv // Hk, Dk, Dv, scale, _EPS,
        L2NORM=use_qk_l2norm, PER_CHANNEL=per_channel, DK_PAD=dk_pad, BV=bv,
        num_warps=max(1, min(4, dk_pad * bv // 1024)),
    )  # fmt: skip


def _chunk_table(
    query_start_loc: Tensor, first_req: int, T: int, chunk: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The chunks of `chunk` tokens of requests first_req .. B-1, each request's counted from its
    first row: (start, end, first) int32, start/end per chunk slot, first the slot of each
    request's first chunk. Built on the device from shapes alone (no host sync): the slots,
    cdiv(those requests' tokens, chunk) + their count, bound the number of chunks; the unused
    ones are empty (end == start)."""
    qsl = query_start_loc.long()
    starts, ends = qsl[first_req:-1], qsl[first_req + 1 :]
    num_reqs = starts.shape[0]
    counts = (ends - starts).clamp_(min=0).add_(chunk - 1).div_(chunk, rounding_mode="floor")
    last = counts.cumsum(0)
    first = last - counts
    slots = cdiv(max(T - first_req, 0), chunk) + num_reqs
    ids = torch.arange(slots, device=qsl.device)
    req = torch.searchsorted(last, ids, right=True).clamp_(max=num_reqs - 1)
    chunk_start = starts[req] + (ids - first[req]) * chunk
    chunk_end = torch.minimum(chunk_start + chunk, ends[req])
    chunk_end = torch.where(ids < last[-1], chunk_end, chunk_start)
    return chunk_start.int(), chunk_end.int(), first.int()


def _prepare_config(dk: int, dv: int) -> dict:
    """The constexprs of `_chunk_prepare_kernel` (bar L2NORM, PER_CHANNEL) at head dims dk, dv."""
    dk_pad, dv_pad = max(16, next_power_of_2(dk)), max(16, next_power_of_2(dv))
    bk, bv = min(dk_pad, _PREPARE_BLOCK), min(dv_pad, _PREPARE_BLOCK)
    return dict(CHUNK=TRITON_CHUNK, BK=bk, NK=dk_pad // bk, BV=bv, NV=dv_pad // bv)


def _state_config(dk: int, dv: int) -> dict:
    """The constexprs of `_chunk_state_kernel` at head dims dk, dv: its state in 1, 2 or 4
    parts of BK rows."""
    dk_pad, dv_pad = max(16, next_power_of_2(dk)), max(16, next_power_of_2(dv))
    bk = max(dk_pad // 4, min(dk_pad, _STATE_BLOCK_K))
    return dict(CHUNK=TRITON_CHUNK, BK=bk, NK=dk_pad // bk, BV=min(dv_pad, _STATE_BLOCK_V))


def _launch_chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, o: Tensor,
    query_start_loc: Tensor, state_slots: Tensor, has_initial_state: Tensor,
    scale: float, use_qk_l2norm: bool, first_req: int, block_v: int | None = None,
) -> None:  # fmt: skip
    """The chunked form over requests first_req .. B-1 (any lengths): `_chunk_prepare_kernel`
    over every chunk of TRITON_CHUNK tokens, then `_chunk_state_kernel` per request. Its float32
    scratch holds Dv + 3 Dk + TRITON_CHUNK values per token and value head (2.2 KB at
    Dk = Dv = 128: 290 MB for 4096 tokens of 32 heads), freed when it returns."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    num_reqs = state_slots.shape[0] - first_req
    C = TRITON_CHUNK
    if T * Hv * max(Dk, Dv, C) >= 2**31:  # the state kernel's offsets within a request are int32
        raise ValueError(f"{T} tokens of {Hv} heads are past the chunked kernels' int32 offsets")
    chunk_start, chunk_end, first_chunk = _chunk_table(query_start_loc, first_req, T, C)
    f32 = dict(dtype=torch.float32, device=v.device)
    U = torch.empty((T, Hv, Dv), **f32)
    W, Qg, Kg = (torch.empty((T, Hv, Dk), **f32) for _ in range(3))
    P = torch.empty((T, Hv, C), **f32)
    decay = torch.empty((chunk_start.shape[0], Hv, Dk), **f32)
    _chunk_prepare_kernel[(chunk_start.shape[0], Hv)](
        q, k, v, g, beta, chunk_start, chunk_end, U, W, Qg, Kg, P, decay,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        Hv // Hk, Dk, Dv, scale, _EPS,
        L2NORM=use_qk_l2norm, PER_CHANNEL=g.dim() == 3, **_prepare_config(Dk, Dv),
        num_warps=_PREPARE_WARPS,
    )  # fmt: skip
    cfg = _state_config(Dk, Dv)
    if block_v:
        cfg["BV"] = block_v
    _chunk_state_kernel[(num_reqs, Hv, cdiv(Dv, cfg["BV"]))](
        U, W, Qg, Kg, P, decay, state, o,
        query_start_loc, state_slots, has_initial_state, first_chunk,
        state.stride(0), state.stride(1), state.stride(2), o.stride(0), o.stride(1),
        first_req, Dk, Dv,
        **cfg, num_warps=_STATE_WARPS,
    )  # fmt: skip


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    query_start_loc: Tensor,
    state_slots: Tensor,
    has_initial_state: Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    num_decodes: int = 0,
) -> Tensor:
    """The gated delta rule on the GPU; arguments and result as `gated_delta_rule_ref` (rows of no
    request are left unwritten). Decodes run the recurrent kernel, prefill requests the chunked
    kernels; neither reads a device tensor on the host."""
    _check(q, k, v, g, beta, state, state_slots)
    if state.stride(-1) != 1:
        raise ValueError("gated_delta_rule updates the state in place: it needs unit stride on Dv")
    q, k, v, g = (_unit_last(x) for x in (q, k, v, g))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    B = state_slots.shape[0]
    if q.shape[0] == 0 or B == 0:
        return o
    args = (q, k, v, g, beta, state, o, query_start_loc, state_slots, has_initial_state)
    if num_decodes:
        _launch_recurrent(*args, scale, use_qk_l2norm, 0, num_decodes)
    if B > num_decodes:
        if q.shape[-1] <= CHUNKED_MAX_DK:
            _launch_chunked(*args, scale, use_qk_l2norm, num_decodes)
        else:
            _launch_recurrent(*args, scale, use_qk_l2norm, num_decodes, B - num_decodes)
    return o

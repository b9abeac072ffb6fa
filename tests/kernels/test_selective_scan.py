"""Mamba-1's selective scan: the torch reference against transformers and against the per-token
definition, the Triton kernel (interpreted without CUDA) against the reference.

Against transformers: transformers 5.x has no `slow_forward` any more; `MambaMixer.forward` and
`JambaMambaMixer.forward` call two module-level torch functions for the scan itself (when
mamba-ssm is not installed): `mamba_selective_scan` for a prompt (from a zero state, returning the
final state) and `mamba_selective_state_update` for one cached token (state updated in place).
The test calls those pieces directly (unwrapped from the hub-kernel decorator, so it is always the
torch code), fed the tensors the mixers build: dt without its bias, the float32 bias, A =
-exp(A_log), D as float32 for the prompt and as the parameter for the token. A request with an
initial state is checked against the token-by-token updates that follow transformers' prompt
scan, both through the reference's prefill path (one chunk) and its batched decode path.

Tolerances: float32 atol = rtol = 2e-5 on y and the state (same formula, other summation orders).
The Triton kernel in float16: both round y once from float32, so atol = rtol = 2e-3 (one fp16 ulp
plus the sums' order); its float32 state to 1e-5.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.jamba import modeling_jamba
from transformers.models.mamba import modeling_mamba

from serverless_llm.engine.kernels import selective_scan as selective_scan_module
from serverless_llm.engine.kernels.selective_scan import selective_scan, selective_scan_ref
from tests.kernels.batch import DEVICE

TOL32 = dict(atol=2e-5, rtol=2e-5)
TOL = {torch.float32: TOL32, torch.float16: dict(atol=2e-3, rtol=2e-3)}
HF_MODULES = {"mamba": modeling_mamba, "jamba": modeling_jamba}


def _hf(module, name):
    """transformers' torch function, past the decorator that may route it to mamba-ssm."""
    return inspect.unwrap(getattr(module, name))


def _params(dim, dstate, g, device="cpu"):
    """A = -exp(A_log) with the S4D-real init (-1 .. -N) perturbed; D, delta_bias float32."""
    a_log = torch.log(torch.arange(1, dstate + 1).float()).expand(dim, dstate)
    A = -torch.exp(a_log + 0.1 * torch.randn(dim, dstate, generator=g))
    D = 1 + 0.5 * torch.randn(dim, generator=g)
    bias = 0.5 * torch.randn(dim, generator=g) - 1.0
    return A.to(device), D.to(device), bias.to(device)


def _tokens(T, dim, dstate, g, dtype, device="cpu"):
    """u, delta, z [T, D] and B, C [T, N]: u a column slice of a wider tensor and B, C views into
    one [T, R + 2N] projection, as the mixer produces them."""
    wide = torch.randn(T, 2 * dim, generator=g)
    proj = torch.randn(T, 3 + 2 * dstate, generator=g)
    delta = 0.7 * torch.randn(T, dim, generator=g)
    z = torch.randn(T, dim, generator=g)
    wide, proj, delta, z = (t.to(device, dtype) for t in (wide, proj, delta, z))
    u = wide[:, dim:]
    B, C = proj[:, 3 : 3 + dstate], proj[:, 3 + dstate :]
    return u, delta, B, C, z


def _single(L, init, dim=8, dstate=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    A, D, bias = _params(dim, dstate, g)
    u, delta, B, C, z = _tokens(L, dim, dstate, g, torch.float32)
    state = torch.randn(3, dim, dstate, generator=g)
    meta = dict(
        query_start_loc=torch.tensor([0, L], dtype=torch.int32),
        state_slots=torch.tensor([2], dtype=torch.int32),
        has_initial_state=torch.tensor([init]),
    )
    return (A, D, bias), (u, delta, B, C, z), state, meta


# -- the reference against transformers -------------------------------------------------------


@pytest.mark.parametrize("family", list(HF_MODULES))
def test_prompt_matches_transformers(family):
    """A prompt from a zero state (whatever its slot held): transformers' prompt scan."""
    (A, D, bias), (u, delta, B, C, z), state, meta = _single(9, False)
    scan = _hf(HF_MODULES[family], "mamba_selective_scan")
    y_hf, h_hf = scan(
        u.T[None], delta.T[None], A, B.T[None], C.T[None], D=D.float(), z=z.T[None],
        delta_bias=bias, delta_softplus=True, return_last_state=True,
    )  # fmt: skip
    assert h_hf.dtype == torch.float32  # transformers caches this state as it comes: float32
    y = selective_scan_ref(u, delta, A, B, C, D, z, bias, True, state, **meta)
    torch.testing.assert_close(y, y_hf[0].T, **TOL32)
    torch.testing.assert_close(state[2], h_hf[0], **TOL32)


@pytest.mark.parametrize("family", list(HF_MODULES))
@pytest.mark.parametrize("path", ["chunk", "decodes"])
def test_continuation_matches_transformers(family, path):
    """A prompt of 5 tokens through transformers' scan, then 4 more tokens through its one-token
    update from the cached state; the reference continues from the same state in its slot,
    either as one prefill chunk of 4 or as 4 decode steps (the batched decode path, with another
    decode request beside it)."""
    module = HF_MODULES[family]
    scan, update = _hf(module, "mamba_selective_scan"), _hf(module, "mamba_selective_state_update")
    (A, D, bias), (u, delta, B, C, z), state, _ = _single(9, True, seed=1)
    _, h = scan(
        u[:5].T[None], delta[:5].T[None], A, B[:5].T[None], C[:5].T[None], D=D.float(),
        z=z[:5].T[None], delta_bias=bias, delta_softplus=True, return_last_state=True,
    )  # fmt: skip
    state[2] = h[0]
    ys = []
    for t in range(5, 9):
        ys.append(update(h, u[t][None], delta[t][None], A, B[t][None], C[t][None], D, bias, True,
                         z=z[t][None])[0])  # fmt: skip
    y_hf = torch.stack(ys)
    if path == "chunk":
        meta = dict(
            query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
            state_slots=torch.tensor([2], dtype=torch.int32),
            has_initial_state=torch.tensor([True]),
        )
        y = selective_scan_ref(
            u[5:], delta[5:], A, B[5:], C[5:], D, z[5:], bias, True, state, **meta
        )
    else:
        y = []
        meta = dict(
            query_start_loc=torch.arange(3, dtype=torch.int32),
            state_slots=torch.tensor([1, 2], dtype=torch.int32),
            has_initial_state=torch.tensor([False, True]),
            num_decodes=2,
        )
        for t in range(5, 9):
            rows = [0, t]  # request 0's row is any token: only request 1 is compared
            out = selective_scan_ref(u[rows], delta[rows], A, B[rows], C[rows], D, z[rows], bias,
                                     True, state, **meta)  # fmt: skip
            y.append(out[1])
        y = torch.stack(y)
    torch.testing.assert_close(y, y_hf, **TOL32)
    torch.testing.assert_close(state[2], h[0], **TOL32)


# -- the reference against the definition -----------------------------------------------------


def _definition(u, delta, A, B, C, D, z, bias, softplus, state, qsl, slots, init):
    """The per-token recurrence in float64, one request and one token at a time."""
    y = torch.zeros(u.shape, dtype=torch.float64)
    final = state.double().clone()
    for b in range(len(slots)):
        h = state[slots[b]].double() if init[b] else torch.zeros(A.shape, dtype=torch.float64)
        for t in range(qsl[b], qsl[b + 1]):
            dt = delta[t].double() + (0 if bias is None else bias.double())
            dt = F.softplus(dt) if softplus else dt
            h = (
                torch.exp(dt[:, None] * A.double()) * h
                + (dt * u[t].double())[:, None] * B[t].double()[None, :]
            )
            yt = h @ C[t].double()
            if D is not None:
                yt = yt + D.double() * u[t].double()
            if z is not None:
                yt = yt * F.silu(z[t].double())
            y[t] = yt
        final[slots[b]] = h
    return y, final


def _ragged(lens, inits, dim, dstate, dtype, seed, device=DEVICE, padded_slot0=0):
    """A batch of requests with these token counts (decodes, count 1, first) and initial-state
    flags, slots shuffled over 1..; `padded_slot0` more one-token decode rows on slot 0 first."""
    g = torch.Generator().manual_seed(seed)
    lens = [1] * padded_slot0 + list(lens)
    inits = [True] * padded_slot0 + list(inits)
    num_slots = len(lens) + 3
    slots = [0] * padded_slot0 + (
        torch.randperm(num_slots - 1, generator=g)[: len(lens) - padded_slot0] + 1
    ).tolist()
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    A, D, bias = _params(dim, dstate, g, device)
    u, delta, B, C, z = _tokens(qsl[-1], dim, dstate, g, dtype, device)
    state = torch.randn(num_slots, dim, dstate, generator=g).to(device)
    meta = dict(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        state_slots=torch.tensor(slots, dtype=torch.int32, device=device),
        has_initial_state=torch.tensor(inits, device=device),
    )
    return (A, D, bias), (u, delta, B, C, z), state, meta, (qsl, slots, inits)


# Two decodes (one starting, one continuing), then prefill chunks: a whole prompt, a continued
# chunk, a single-token chunk.
LENS, INITS, DECODES = [1, 1, 6, 5, 1], [True, False, False, True, True], 2


@pytest.mark.parametrize("blocks", [False, True], ids=["one_block", "token_blocks"])
@pytest.mark.parametrize("softplus", [True, False], ids=["softplus", "raw"])
@pytest.mark.parametrize("extras", ["all", "none"])
def test_reference_matches_definition(extras, softplus, blocks, monkeypatch):
    """`token_blocks`: the prompt scan's buffers bounded to 2 tokens, so chunks are scanned in
    blocks with the state carried between them."""
    if blocks:
        monkeypatch.setattr(selective_scan_module, "_SCAN_BLOCK_ELEMS", 2 * 8 * 4)
    (A, D, bias), (u, delta, B, C, z), state, meta, (qsl, slots, inits) = _ragged(
        LENS, INITS, 8, 4, torch.float32, seed=3, device="cpu"
    )
    if extras == "none":
        D = z = bias = None
    if not softplus:
        delta = delta.abs()  # the step itself, positive
    want_y, want_state = _definition(
        u, delta, A, B, C, D, z, bias, softplus, state, qsl, slots, inits
    )
    y = selective_scan_ref(u, delta, A, B, C, D, z, bias, softplus, state, **meta,
                           num_decodes=DECODES)  # fmt: skip
    torch.testing.assert_close(y.double(), want_y, **TOL32)
    torch.testing.assert_close(state.double(), want_state, **TOL32)


def test_reference_is_closer_than_transformers_in_bfloat16():
    """The module docstring's claim: transformers' bfloat16 roundings (dt, the state before C,
    silu(z)) move y further from the exact recurrence than the reference's single rounding."""
    (A, D, bias), (u, delta, B, C, z), state, meta = _single(64, False, dim=32, dstate=16)
    u, delta, B, C, z = (t.bfloat16() for t in (u, delta, B, C, z))
    exact, _ = _definition(u, delta, A, B, C, D, z, bias, True, state, [0, 64], [2], [False])
    y_hf = _hf(modeling_jamba, "mamba_selective_scan")(
        u.T[None], delta.T[None], A, B.T[None], C.T[None], D=D.float(), z=z.T[None],
        delta_bias=bias, delta_softplus=True,
    )[0].T.to(torch.bfloat16)  # fmt: skip
    y = selective_scan_ref(u, delta, A, B, C, D, z, bias, True, state, **meta)
    err_ref = (y.double() - exact).abs().mean()
    err_hf = (y_hf.double() - exact).abs().mean()
    assert err_ref < err_hf


# -- the Triton kernel against the reference --------------------------------------------------


def _run_both(lens, inits, decodes, dtype, extras, dim=32, dstate=16, seed=0, padded_slot0=0):
    pytest.importorskip("triton")
    (A, D, bias), (u, delta, B, C, z), state, meta, _ = _ragged(
        lens, inits, dim, dstate, dtype, seed, padded_slot0=padded_slot0
    )
    if extras == "none":
        D = z = bias = None
    elif extras == "model_dtype":  # D and the bias as parameters in the model dtype
        D, bias = D.to(dtype), bias.to(dtype)
    state_ref = state.clone()
    args = (u, delta, A, B, C, D, z, bias, True)
    want = selective_scan_ref(*args, state_ref, **meta, num_decodes=decodes + padded_slot0)
    got = selective_scan(*args, state, **meta, num_decodes=decodes + padded_slot0)
    return got, want, state, state_ref


@pytest.mark.parametrize("extras", ["all", "none", "model_dtype"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_matches_reference(dtype, extras):
    got, want, state, state_ref = _run_both(LENS, INITS, DECODES, dtype, extras)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(state, state_ref, atol=1e-5, rtol=1e-5)


def test_triton_ragged_shapes():
    """Channels and state sizes that are not the block's: masked lanes in D and in N."""
    got, want, state, state_ref = _run_both(
        [1, 4, 3], [True, True, False], 1, torch.float32, "all", dim=40, dstate=12, seed=5
    )
    torch.testing.assert_close(got, want, **TOL32)
    torch.testing.assert_close(state, state_ref, atol=1e-5, rtol=1e-5)


def test_triton_decode_only():
    """A decode-only batch (what a captured decode step launches)."""
    got, want, state, state_ref = _run_both([1, 1, 1], [True, False, True], 3, torch.float16, "all")
    torch.testing.assert_close(got, want, **TOL[torch.float16])
    torch.testing.assert_close(state, state_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_chunks_equal_one_pass(impl):
    """One 16-token prompt in chunks of 1, 7 and 8 (each continuing from the slot) gives the same
    output and final state as one pass."""
    if impl == "triton":
        pytest.importorskip("triton")
    fn = selective_scan if impl == "triton" else selective_scan_ref
    g = torch.Generator().manual_seed(7)
    A, D, bias = _params(32, 16, g, DEVICE)
    u, delta, B, C, z = _tokens(16, 32, 16, g, torch.float32, DEVICE)
    state = torch.randn(4, 32, 16, generator=g).to(DEVICE)
    chunked = state.clone()

    def run(st, s, e, init):
        meta = dict(
            query_start_loc=torch.tensor([0, e - s], dtype=torch.int32, device=DEVICE),
            state_slots=torch.tensor([3], dtype=torch.int32, device=DEVICE),
            has_initial_state=torch.tensor([init], device=DEVICE),
        )
        return fn(u[s:e], delta[s:e], A, B[s:e], C[s:e], D, z[s:e], bias, True, st, **meta)

    whole = run(state, 0, 16, False)
    parts = torch.cat(
        [run(chunked, 0, 1, False), run(chunked, 1, 8, True), run(chunked, 8, 16, True)]
    )
    torch.testing.assert_close(parts, whole, **TOL32)
    torch.testing.assert_close(chunked, state, **TOL32)
    assert not torch.equal(state[3], torch.zeros_like(state[3]))


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_padded_rows_share_slot_zero(impl):
    """Three padded decode rows on slot 0 beside real requests: no crash, and the real requests'
    outputs and states are those of the batch without the padding."""
    if impl == "triton":
        pytest.importorskip("triton")
    fn = selective_scan if impl == "triton" else selective_scan_ref
    (A, D, bias), (u, delta, B, C, z), state, meta, _ = _ragged(
        [1, 5], [True, False], 32, 16, torch.float32, seed=9, padded_slot0=3
    )
    alone = state.clone()
    meta_alone = dict(
        query_start_loc=meta["query_start_loc"][3:] - 3,
        state_slots=meta["state_slots"][3:],
        has_initial_state=meta["has_initial_state"][3:],
    )
    y = fn(u, delta, A, B, C, D, z, bias, True, state, **meta, num_decodes=4)
    y_alone = fn(u[3:], delta[3:], A, B[3:], C[3:], D, z[3:], bias, True, alone, **meta_alone,
                 num_decodes=1)  # fmt: skip
    torch.testing.assert_close(y[3:], y_alone, **TOL32)
    torch.testing.assert_close(state[1:], alone[1:], **TOL32)
    assert torch.isfinite(y[:3]).all()


def test_softplus_large_and_small_steps():
    """Steps far past softplus' threshold (20; where exp overflows) and far below zero."""
    pytest.importorskip("triton")
    (A, D, bias), (u, delta, B, C, z), state, meta, _ = _ragged(
        [1, 3], [True, False], 32, 16, torch.float32, seed=11
    )
    delta = delta.clone()
    delta[0, :8] = 100.0  # exp overflows float32 here: softplus must not take it
    delta[1, 8:16] = -30.0
    state_ref = state.clone()
    want = selective_scan_ref(u, delta, A, B, C, D, z, None, True, state_ref, **meta, num_decodes=1)
    got = selective_scan(u, delta, A, B, C, D, z, None, True, state, **meta, num_decodes=1)
    torch.testing.assert_close(got, want, **TOL32)
    torch.testing.assert_close(state, state_ref, atol=1e-5, rtol=1e-5)
    assert math.isfinite(got.abs().max().item())

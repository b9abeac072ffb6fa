"""Mamba-2's SSD scan (kernels/ssd.py): the torch reference against transformers and against the
per-token definition, the Triton kernels (interpreted without a GPU) against the reference.

Against transformers nothing is reimplemented: the test calls the two functions the mixers
themselves call for the scan when mamba-ssm is not installed, `mamba2_chunk_scan` (a prompt, with
or without an initial state, returning the final state) and `mamba2_selective_state_update` (one
cached token, state updated in place), taken from each family's modeling module (Mamba2, Bamba,
GraniteMoeHybrid, Nemotron-H, Falcon-H1: the same code copied per family), unwrapped from the
hub-kernel decorator so the torch code runs whatever is installed, and fed the arguments and the
shapes the mixers feed them (dt_softplus=True, dt and D expanded over P for one token).

Tolerances. float32: the reference and transformers differ in summation order only (chunks of
16 against the reference's 64 here, exp of differences of one cumulative sum against segment
sums), so atol = rtol = 1e-5 relative to values of a few units. float16 against transformers:
transformers rounds dt + dt_bias and its softplus to float16 (prompt), and in the one-token update
also dt B x, the state before the C contraction and D x, the reference does not (see the module
docstring), so 5e-3 (2e-3 seen). Triton against the reference: float32 1e-4 (IEEE dots on a GPU,
another summation order); float16 5e-3 with outputs of a few units (1.2e-4 seen interpreted): the
reference rounds once, the kernel once too; on a GPU its float32 operands enter 16-bit dots as two
16-bit halves (22 significant bits for float16).
"""

from __future__ import annotations

import importlib
import inspect
import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from serverless_llm.engine.kernels import ssd  # noqa: E402
from serverless_llm.engine.kernels.ssd import ssd_scan, ssd_scan_ref  # noqa: E402
from tests.kernels.batch import DEVICE  # noqa: E402

H, P, N = 4, 16, 16
NO_LIMIT = (0.0, math.inf)
LIMIT = (0.05, 0.6)
FAMILIES = ("mamba2", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1")
TRITON_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=5e-3, rtol=5e-3)}


def _inputs(T: int, G: int, dtype: torch.dtype, seed: int = 0, with_d: bool = True):
    """x (a strided view into a wider projection, as the mixer's split gives it), raw dt, A, B,
    C, D and dt_bias for T rows; dt + dt_bias lands around softplus^-1 of 0.02 .. 1."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(T, H * P + 8, generator=g)
    x = wide.to(DEVICE, dtype)[:, 8:].view(T, H, P)
    dt = (torch.randn(T, H, generator=g) * 1.5).to(DEVICE, dtype)
    dt_bias = (torch.rand(H, generator=g) * 2 - 3).to(DEVICE, dtype)
    A = -torch.exp(torch.rand(H, generator=g) * 2 - 1).to(DEVICE)  # -exp(A_log), float32
    B = (torch.randn(T, G, N, generator=g) * 0.5).to(DEVICE, dtype)
    C = (torch.randn(T, G, N, generator=g) * 0.5).to(DEVICE, dtype)
    D = torch.randn(H, generator=g).to(DEVICE, dtype) if with_d else None
    return x, dt, A, B, C, D, dt_bias


def _states(num_slots: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_slots, H, P, N, generator=g) * 0.5).to(DEVICE)


def _meta(lens: list[int], slots: list[int], init: list[bool]):
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return (
        qsl.to(DEVICE),
        torch.tensor(slots, dtype=torch.int32, device=DEVICE),
        torch.tensor(init, dtype=torch.bool, device=DEVICE),
    )


def _per_token(x, dt, A, B, C, D, dt_bias, softplus, limit, h):
    """The definition, one token at a time in float64: rows of one request, h [H, P, N] the
    state before them. Returns (y [n, H, P], the state after)."""
    f = torch.float64
    d = dt.to(f) + (dt_bias.to(f) if dt_bias is not None else 0.0)
    d = (F.softplus(d) if softplus else d).clamp(*limit)
    heads_per_group = H // B.shape[1]
    Bh = B.to(f).repeat_interleave(heads_per_group, 1)  # [n, H, N]: head h reads group h // R
    Ch = C.to(f).repeat_interleave(heads_per_group, 1)
    h = h.to(f)
    ys = []
    for t in range(x.shape[0]):
        xt = x[t].to(f)  # [H, P]
        decay = torch.exp(d[t] * A.to(f))[:, None, None]
        h = decay * h + (d[t][:, None] * xt)[:, :, None] * Bh[t][:, None, :]
        y = (h @ Ch[t][:, :, None])[..., 0]
        if D is not None:
            y = y + D.to(f)[:, None] * xt
        ys.append(y)
    return torch.stack(ys), h


def _transformers(family: str):
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return inspect.unwrap(mod.mamba2_chunk_scan), inspect.unwrap(mod.mamba2_selective_state_update)


# -- the reference against transformers --------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("initial", [False, True], ids=["fresh", "initial"])
@pytest.mark.parametrize("family", FAMILIES)
def test_reference_matches_transformers_prompt(family, initial, dtype):
    """One 45-row prompt (transformers in chunks of 16, so padded chunks too), G = 2, with the
    dt limit of Nemotron-H's kind; output and final state."""
    chunk_scan, _ = _transformers(family)
    n, G = 45, 2
    x, dt, A, B, C, D, bias = _inputs(n, G, dtype, seed=3)
    state = _states(4)
    h0 = state[2].clone()
    qsl, slots, init = _meta([n], [2], [initial])
    y = ssd_scan_ref(x, dt, A, B, C, D, bias, True, LIMIT, state, qsl, slots, init)
    y_tf, h_tf = chunk_scan(
        x[None], dt[None], A, B[None], C[None], chunk_size=16, D=D, dt_bias=bias,
        initial_states=h0[None] if initial else None, dt_softplus=True, dt_limit=LIMIT,
        return_final_states=True,
    )  # fmt: skip
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(y.float(), y_tf[0].float(), **tol)
    torch.testing.assert_close(state[2], h_tf[0], **tol)
    assert y.dtype == dtype and h_tf.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_reference_matches_transformers_decode(family, dtype):
    """Three cached tokens in one batch (G = 2), from the slots' states: output and new states."""
    _, state_update = _transformers(family)
    b, G = 3, 2
    x, dt, A, B, C, D, bias = _inputs(b, G, dtype, seed=4)
    state = _states(6)
    qsl, slots, init = _meta([1] * b, [5, 1, 3], [True] * b)
    h_tf = state[[5, 1, 3]].clone()
    y = ssd_scan_ref(x, dt, A, B, C, D, bias, True, NO_LIMIT, state, qsl, slots, init, b)
    y_tf = state_update(
        h_tf, x, dt[:, :, None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N), B, C,
        D[:, None].expand(-1, P), dt_bias=bias[:, None].expand(-1, P), dt_softplus=True,
    )  # fmt: skip
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(y.float(), y_tf.float(), **tol)
    torch.testing.assert_close(state[[5, 1, 3]], h_tf, **tol)


# -- the reference against the definition -----------------------------------------------------

# (rows, slot, has an initial state) per request, decodes first
RAGGED = [(1, 3, True), (1, 6, False), (1, 1, True), (5, 2, False), (150, 7, True), (13, 4, True)]
NUM_DECODES = 3


def _ragged(G, dtype, with_d, seed=0, pad_rows=2):
    lens = [r[0] for r in RAGGED]
    x, dt, A, B, C, D, bias = _inputs(sum(lens) + pad_rows, G, dtype, seed=seed, with_d=with_d)
    qsl, slots, init = _meta(lens, [r[1] for r in RAGGED], [r[2] for r in RAGGED])
    state = _states(9, seed=seed + 1)
    # a fresh request's slot holds garbage, NaN included: it must not be read
    state[6] = float("nan")
    state[2, 0, 0, 0] = float("nan")
    return (x, dt, A, B, C, D, bias), state, (qsl, slots, init)


@pytest.mark.parametrize("chunk", [8, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize(
    "G, with_d, limit", [(1, True, LIMIT), (2, False, NO_LIMIT), (2, True, NO_LIMIT)]
)
def test_reference_matches_definition(G, with_d, limit, chunk, monkeypatch):
    """A ragged batch of decodes and prompts (one longer than a chunk) with states in and out:
    every row and every written slot equal the per-token recurrence."""
    monkeypatch.setattr(ssd, "REF_CHUNK", chunk)
    (x, dt, A, B, C, D, bias), state, (qsl, slots, init) = _ragged(G, torch.float32, with_d)
    before = state.clone()
    y = ssd_scan_ref(x, dt, A, B, C, D, bias, True, limit, state, qsl, slots, init, NUM_DECODES)
    bounds = qsl.tolist()
    for r, (_, slot, has_init) in enumerate(RAGGED):
        s, e = bounds[r], bounds[r + 1]
        h0 = before[slot] if has_init else torch.zeros(H, P, N, device=DEVICE)
        y_def, h_def = _per_token(
            x[s:e], dt[s:e], A, B[s:e], C[s:e], D, bias, True, limit, h0.clone()
        )
        torch.testing.assert_close(y[s:e].double(), y_def, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state[slot].double(), h_def, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[bounds[-1] :], torch.zeros_like(y[bounds[-1] :]))  # padding rows
    untouched = [i for i in range(9) if i not in {r[1] for r in RAGGED}]
    assert torch.equal(state[untouched], before[untouched])


# -- Triton against the reference -------------------------------------------------------------


@pytest.mark.parametrize(
    "G, with_d, limit",
    [(1, True, LIMIT), (2, False, NO_LIMIT), (2, True, LIMIT), (1, False, NO_LIMIT)],
    ids=["g1-D-limit", "g2-noD-nolimit", "g2-D-limit", "g1-noD-nolimit"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_matches_reference(dtype, G, with_d, limit):
    """The ragged batch (3 decodes, prompts of 5, 150 and 13 rows: 150 spans three kernel chunks;
    fresh slots holding NaN; two padding rows) through both paths: y and every slot."""
    (x, dt, A, B, C, D, bias), state, meta = _ragged(G, dtype, with_d, seed=5)
    s_ref, s_tri = state.clone(), state.clone()
    y_ref = ssd_scan_ref(x, dt, A, B, C, D, bias, True, limit, s_ref, *meta, NUM_DECODES)
    y_tri = ssd_scan(x, dt, A, B, C, D, bias, True, limit, s_tri, *meta, NUM_DECODES)
    assert y_tri.dtype == dtype
    torch.testing.assert_close(y_tri, y_ref, **TRITON_TOL[dtype])
    torch.testing.assert_close(s_tri, s_ref, equal_nan=True, **TRITON_TOL[torch.float32])
    assert torch.isfinite(y_tri).all()


def test_triton_without_softplus_or_bias():
    """dt used as given (dt_softplus False, no dt_bias): the positive raw dt of a float32
    batch of one decode and one prompt."""
    x, dt, A, B, C, D, _ = _inputs(41, 2, torch.float32, seed=8)
    dt = dt.abs() * 0.3
    meta = _meta([1, 40], [1, 2], [True, False])
    s_ref, s_tri = _states(3), _states(3)
    y_ref = ssd_scan_ref(x, dt, A, B, C, D, None, False, NO_LIMIT, s_ref, *meta, 1)
    y_tri = ssd_scan(x, dt, A, B, C, D, None, False, NO_LIMIT, s_tri, *meta, 1)
    torch.testing.assert_close(y_tri, y_ref, **TRITON_TOL[torch.float32])
    torch.testing.assert_close(s_tri, s_ref, **TRITON_TOL[torch.float32])


@pytest.mark.parametrize("first_as_decode", [False, True], ids=["prefill1", "decode1"])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_split_request_equals_one_pass(impl, first_as_decode):
    """A 90-row prompt in one pass, and split into steps of 1, 7 and 82 rows (the first one
    as a prompt chunk or as a decode, each later step carrying the slot's state in, beside
    another request): the same rows and the same final state."""
    fn = ssd_scan if impl == "triton" else ssd_scan_ref
    n, G = 90, 2
    x, dt, A, B, C, D, bias = _inputs(n, G, torch.float32, seed=9)
    other = _inputs(6, G, torch.float32, seed=10)
    one = _states(4)
    y_one = fn(x, dt, A, B, C, D, bias, True, LIMIT, one, *_meta([n], [3], [False]))
    split = _states(4)
    split[3] = float("nan")  # the slot's garbage before the request starts
    ys = []
    s = 0
    for step, size in enumerate((1, 7, 82)):
        # this request's rows, then 6 rows of another request (slot 1)
        cat = [
            torch.cat([a[s : s + size], b]) for a, b in zip((x, dt, B, C), other[:2] + other[3:5])
        ]
        xs, dts, Bs, Cs = cat
        nd = 1 if (first_as_decode and step == 0) else 0
        meta = _meta([size, 6], [3, 1], [step > 0, True])
        y = fn(xs, dts, A, Bs, Cs, D, bias, True, LIMIT, split, *meta, nd)
        ys.append(y[:size])
        s += size
    torch.testing.assert_close(torch.cat(ys), y_one, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split[3], one[3], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_padded_rows_share_slot_zero(impl):
    """A captured decode step's shape: two real decodes and four padding rows on slot 0 (with
    and without an initial state, slot 0 holding NaN), then a prompt: nothing crashes, the real
    rows and slots equal the same requests run alone."""
    fn = ssd_scan if impl == "triton" else ssd_scan_ref
    x, dt, A, B, C, D, bias = _inputs(6 + 9, 1, torch.float16, seed=11)
    state = _states(4)
    state[0] = float("nan")
    alone = state.clone()
    lens = [1] * 6 + [9]
    slots = [2, 0, 0, 0, 3, 0, 1]
    init = [True, True, False, False, True, True, False]
    y = fn(x, dt, A, B, C, D, bias, True, NO_LIMIT, state, *_meta(lens, slots, init), 6)
    real = [0, 4, 6]  # rows of the requests on slots 2, 3 and 1
    rows = [0, 4, *range(6, 15)]
    y_alone = fn(
        x[rows], dt[rows], A, B[rows], C[rows], D, bias, True, NO_LIMIT, alone,
        *_meta([1, 1, 9], [slots[i] for i in real], [init[i] for i in real]), 2,
    )  # fmt: skip
    torch.testing.assert_close(y[rows], y_alone, **TRITON_TOL[torch.float16])
    torch.testing.assert_close(state[1:], alone[1:], **TRITON_TOL[torch.float32])

"""The native CPU decodes of the recurrent layers (kernels/cpu_native.c: gated_delta_decode_f32,
ssd_decode_f32, selective_scan_decode_f32, conv1d_decode_f32) against the torch decodes of their
references (gated_delta_rule_ref, ssd_scan_ref, selective_scan_ref, causal_conv1d_ref with
`cpu_native.torch_decodes()`), through the references themselves: random batches of decodes
with continuing and fresh requests (a fresh request's slot full of NaN, which must never be
read), padded rows on slot 0 (several, with and without an initial state), decodes followed by a
prompt chunk (which the torch code still runs), odd sizes, GQA, per-head and per-channel decay,
strided views as the layers pass them. Every test also checks that the native kernel ran (or, for
inputs it does not take, that it declined and the torch code ran).

Tolerance: both sides run the same operations in the same order in float32 but sum in other
orders (and the native exp is within a few ulps of torch's), so outputs and states agree to
~1e-6 of their magnitude: asserted as max |a - b| <= 2e-6 * max |b| (+ 1e-7)."""

from __future__ import annotations

import pytest
import torch

from serverless_llm.engine.kernels import cpu_native
from serverless_llm.engine.kernels.causal_conv1d import causal_conv1d_ref, gated_rms_norm_ref
from serverless_llm.engine.kernels.gated_delta import gated_delta_rule_ref
from serverless_llm.engine.kernels.selective_scan import selective_scan_ref
from serverless_llm.engine.kernels.ssd import ssd_scan_ref

NUM_SLOTS = 40


@pytest.fixture(scope="module")
def kernels():
    k = cpu_native.load()
    if k is None:
        pytest.skip("the native CPU kernels cannot be built here (no C compiler?)")
    return k


@pytest.fixture
def calls(kernels, monkeypatch):
    """The native decode methods' return values, recorded as the references call them."""
    seen: dict[str, list[bool]] = {}
    names = ("gated_delta_decode", "gated_delta_prefill", "ssd_decode", "selective_scan_decode")
    for name in (*names, "selective_scan_prefill", "conv1d_decode", "conv1d_prefill"):
        method = getattr(kernels, name)

        def spy(*args, _method=method, _name=name, **kw):
            done = _method(*args, **kw)
            seen.setdefault(_name, []).append(done)
            return done

        monkeypatch.setattr(kernels, name, spy)
    return seen


def step(g: torch.Generator, num_decodes: int, pad: int, prompt: int = 0):
    """A step's request table: `num_decodes` decodes on distinct slots (about a third fresh),
    then `pad` padded rows on slot 0 (alternately with and without an initial state), then one
    prompt chunk of `prompt` tokens (if any, continuing). Returns (T, query_start_loc,
    state_slots, has_initial_state, num_decodes incl. padding, fresh slots)."""
    slots = (torch.randperm(NUM_SLOTS - 1, generator=g)[: num_decodes + 1] + 1).tolist()
    fresh = torch.rand(num_decodes, generator=g) < 0.35
    init = [not bool(f) for f in fresh] + [i % 2 == 1 for i in range(pad)]
    req_slots = slots[:num_decodes] + [0] * pad
    lens = [1] * (num_decodes + pad)
    if prompt:
        req_slots.append(slots[num_decodes])
        init.append(True)
        lens.append(prompt)
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    fresh_slots = [s for s, f in zip(slots, fresh.tolist()) if f]
    return (
        int(qsl[-1]),
        qsl,
        torch.tensor(req_slots, dtype=torch.int32),
        torch.tensor(init),
        num_decodes + pad,
        fresh_slots,
    )


def states(g: torch.Generator, shape: tuple[int, ...], fresh: list[int]) -> torch.Tensor:
    s = torch.randn(NUM_SLOTS, *shape, generator=g)
    s[fresh] = float("nan")  # a fresh request's slot: whatever it holds must not be read
    return s


def run_both(fn, state: torch.Tensor):
    """fn(state) with the torch decodes and with the native ones, each on its own copy of the
    state: ((out, state) torch, (out, state) native)."""
    ref_state, nat_state = state.clone(), state.clone()
    with cpu_native.torch_decodes():
        ref = fn(ref_state)
    nat = fn(nat_state)
    return (ref, ref_state), (nat, nat_state)


def assert_agree(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    assert not want.isnan().any(), f"{what}: the torch side has NaN (a test problem)"
    err = (got - want).abs().max().item()
    bound = 2e-6 * want.abs().max().item() + 1e-7
    assert err <= bound, f"{what}: differs by {err:.3g} (bound {bound:.3g})"


def check(ref, nat, rows: int, what: str) -> None:
    """Outputs of rows [0, rows) and every slot but the scratch slot 0 agree."""
    (out_r, st_r), (out_n, st_n) = ref, nat
    if rows:
        assert_agree(out_n[:rows], out_r[:rows], f"{what}: output")
    assert_agree(st_n[1:], st_r[1:], f"{what}: states")


def real_rows(qsl: torch.Tensor, nd: int, pad: int) -> list[int]:
    """The rows whose results are read: the real decodes and the prompt's, not the padding."""
    return list(range(nd - pad)) + list(range(nd, int(qsl[-1])))


# -- gated delta rule -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hk, hv, dk, dv, per_channel, l2norm",
    [
        (2, 4, 16, 16, False, True),
        (2, 4, 16, 16, True, True),
        (1, 3, 7, 5, False, True),  # odd sizes, GQA 3
        (1, 3, 7, 5, True, False),
        (4, 8, 64, 64, False, True),  # Qwen3.5-like heads
        (2, 2, 33, 17, True, True),
    ],
)
@pytest.mark.parametrize("prompt", [0, 5])
def test_gated_delta_decode(kernels, calls, hk, hv, dk, dv, per_channel, l2norm, prompt):
    g = torch.Generator().manual_seed(hk * 100 + dk + prompt)
    T, qsl, slots, init, nd, fresh = step(g, 9, 3, prompt)
    # q, k, v as views of one conv output row, as the layer splits it
    qkv = torch.randn(T, 2 * hk * dk + hv * dv, generator=g)
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(T, hk, dk), k.view(T, hk, dk), v.view(T, hv, dv)
    gshape = (T, hv, dk) if per_channel else (T, hv)
    gl = -torch.rand(gshape, generator=g) * 2
    beta = torch.rand(T, hv, generator=g)
    state = states(g, (hv, dk, dv), fresh)
    scale = None if l2norm else 0.2

    def fn(st):
        return gated_delta_rule_ref(
            q, k, v, gl, beta, st, qsl, slots, init, scale, l2norm, num_decodes=nd
        )

    ref, nat = run_both(fn, state)
    rows = real_rows(qsl, nd, 3)
    check((ref[0][rows], ref[1]), (nat[0][rows], nat[1]), len(rows), "gated delta")
    assert calls["gated_delta_decode"] == [True]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "hk, hv, dk, dv, per_channel, l2norm",
    [(2, 4, 16, 16, False, True), (1, 3, 7, 5, True, False), (4, 8, 64, 64, False, True)],
)
def test_gated_delta_prompt_chunks(kernels, calls, hk, hv, dk, dv, per_channel, l2norm, threads):
    """Prompt chunks after two decodes (gated_delta_prefill_f32, token after token) against the
    torch forms: chunks of 1-24 tokens (its per-token loop) and 25-70 (its chunked form; 48
    and more for a per-channel g), fresh (slot full of NaN) and continuing, an empty entry."""
    g = torch.Generator().manual_seed(hk * 10 + dk + threads)
    lens = [1, 1, 1, 5, 0, 24, 25, 70, 3]  # two decodes, then the chunks
    fresh_flags = [False, True, True, False, False, True, False, True, False]
    nd = 2
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    T = int(qsl[-1])
    slots = torch.tensor([3, 5, 7, 9, 11, 13, 15, 17, 19], dtype=torch.int32)
    init = torch.tensor([not f for f in fresh_flags])
    qkv = torch.randn(T, 2 * hk * dk + hv * dv, generator=g)
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(T, hk, dk), k.view(T, hk, dk), v.view(T, hv, dv)
    gl = -torch.rand((T, hv, dk) if per_channel else (T, hv), generator=g) * 0.5
    beta = torch.rand(T, hv, generator=g)
    state = states(g, (hv, dk, dv), [s for s, f in zip(slots.tolist(), fresh_flags) if f])
    scale = None if l2norm else 0.2

    def fn(st):
        return gated_delta_rule_ref(
            q, k, v, gl, beta, st, qsl, slots, init, scale, l2norm, num_decodes=nd
        )

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref, nat = run_both(fn, state)
    finally:
        torch.set_num_threads(old)
    check(ref, nat, T, "gated delta prompts")
    assert calls["gated_delta_decode"] == [True] and calls["gated_delta_prefill"] == [True]


def test_gated_delta_state_read_once_decay_applies(kernels, calls):
    """Two steps in a row (the second continuing every request): the native states carry."""
    g = torch.Generator().manual_seed(7)
    n, hk, hv, d = 6, 2, 4, 16
    qsl = torch.arange(n + 1, dtype=torch.int32)
    slots = torch.arange(1, n + 1, dtype=torch.int32)
    state = torch.full((NUM_SLOTS, hv, d, d), float("nan"))
    ref_state, nat_state = state.clone(), state.clone()
    for first in (True, False):
        init = torch.full((n,), not first)
        args = [torch.randn(n, hk, d, generator=g), torch.randn(n, hk, d, generator=g)]
        args += [torch.randn(n, hv, d, generator=g), -torch.rand(n, hv, generator=g)]
        args += [torch.rand(n, hv, generator=g)]
        with cpu_native.torch_decodes():
            want = gated_delta_rule_ref(*args, ref_state, qsl, slots, init, num_decodes=n)
        got = gated_delta_rule_ref(*args, nat_state, qsl, slots, init, num_decodes=n)
        assert_agree(got, want, "output")
        assert_agree(nat_state[1 : n + 1], ref_state[1 : n + 1], "states")
    assert calls["gated_delta_decode"] == [True, True]


def test_gated_delta_declines_half_precision(kernels, calls):
    """float16 activations: the native kernel declines and the torch code runs (same result)."""
    g = torch.Generator().manual_seed(3)
    T, qsl, slots, init, nd, fresh = step(g, 4, 1)
    q, k = torch.randn(T, 1, 8, generator=g).half(), torch.randn(T, 1, 8, generator=g).half()
    v = torch.randn(T, 2, 8, generator=g).half()
    gl, beta = -torch.rand(T, 2, generator=g), torch.rand(T, 2, generator=g).half()
    state = states(g, (2, 8, 8), fresh)

    def fn(st):
        return gated_delta_rule_ref(q, k, v, gl, beta, st, qsl, slots, init, num_decodes=nd)

    ref, nat = run_both(fn, state)
    assert torch.equal(ref[0], nat[0]) and torch.equal(ref[1][1:], nat[1][1:])
    assert calls["gated_delta_decode"] == [False]


def test_torch_decodes_turns_the_kernels_off(kernels, calls):
    assert cpu_native.recurrent_kernels() is kernels
    with cpu_native.torch_decodes():
        assert cpu_native.recurrent_kernels() is None
    assert cpu_native.recurrent_kernels() is kernels


# -- SSD (Mamba-2) ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "H, G, P, N, with_d, limit",
    [
        (4, 2, 8, 16, True, (0.0, float("inf"))),
        (3, 1, 5, 7, False, (0.0, float("inf"))),  # odd sizes
        (6, 3, 3, 9, True, (0.05, 2.0)),  # a dt limit that bites
        (24, 1, 64, 64, True, (0.0, float("inf"))),  # Mamba-2 heads
    ],
)
@pytest.mark.parametrize("prompt", [0, 6])
def test_ssd_decode(kernels, calls, H, G, P, N, with_d, limit, prompt):
    g = torch.Generator().manual_seed(H * 10 + N + prompt)
    T, qsl, slots, init, nd, fresh = step(g, 8, 2, prompt)
    # x, B, C as views of the conv output, as the mixer splits it
    xbc = torch.randn(T, H * P + 2 * G * N, generator=g)
    x, B, C = xbc.split([H * P, G * N, G * N], dim=-1)
    x, B, C = x.view(T, H, P), B.view(T, G, N), C.view(T, G, N)
    dt = torch.randn(T, H, generator=g)
    A = -torch.rand(H, generator=g) * 3 - 0.1
    D = torch.randn(H, generator=g) if with_d else None
    dt_bias = torch.randn(H, generator=g) * 0.5
    state = states(g, (H, P, N), fresh)

    def fn(st):
        return ssd_scan_ref(
            x, dt, A, B, C, D, dt_bias, True, limit, st, qsl, slots, init, num_decodes=nd
        )

    ref, nat = run_both(fn, state)
    rows = real_rows(qsl, nd, 2)
    check((ref[0][rows], ref[1]), (nat[0][rows], nat[1]), len(rows), "ssd")
    assert calls["ssd_decode"] == [True]


# -- selective scan (Mamba-1) -----------------------------------------------------------------


@pytest.mark.parametrize(
    "Dn, N, with_d, with_z, softplus",
    [
        (70, 16, True, True, True),  # channels past one task's 64, not a multiple
        (5, 3, False, False, True),  # odd sizes
        (33, 7, True, False, False),  # no softplus: dt (and dt A) of either sign
        (1536, 16, True, True, True),  # Mamba-1 / Jamba channels
    ],
)
@pytest.mark.parametrize("prompt", [0, 4])
def test_selective_scan_decode(kernels, calls, Dn, N, with_d, with_z, softplus, prompt):
    g = torch.Generator().manual_seed(Dn + N + prompt)
    T, qsl, slots, init, nd, fresh = step(g, 8, 2, prompt)
    xz = torch.randn(T, 2 * Dn, generator=g)
    u = xz[:, :Dn].contiguous()  # the conv's output
    z = xz[:, Dn:] if with_z else None  # a column slice of the projection
    proj = torch.randn(T, 3 + 2 * N, generator=g)
    B, C = proj[:, 3 : 3 + N], proj[:, 3 + N :]
    delta = 0.7 * torch.randn(T, Dn, generator=g)
    A = -torch.exp(
        torch.log(torch.arange(1, N + 1).float()) + 0.1 * torch.randn(Dn, N, generator=g)
    )
    D = torch.randn(Dn, generator=g) if with_d else None
    bias = 0.5 * torch.randn(Dn, generator=g) - 1.0
    state = states(g, (Dn, N), fresh)

    def fn(st):
        return selective_scan_ref(
            u, delta, A, B, C, D, z, bias, softplus, st, qsl, slots, init, num_decodes=nd
        )

    ref, nat = run_both(fn, state)
    rows = real_rows(qsl, nd, 2)
    check((ref[0][rows], ref[1]), (nat[0][rows], nat[1]), len(rows), "selective scan")
    assert calls["selective_scan_decode"] == [True]


# -- causal conv1d ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "C, K, with_bias, activation",
    [
        (33, 4, True, "silu"),
        (8, 2, False, None),  # a state of one column
        (5, 3, True, None),
        (2304, 4, False, "silu"),  # Mamba-1 / Qwen3.5-like channels
    ],
)
@pytest.mark.parametrize("prompt", [0, 2, 7])
def test_conv1d_decode(kernels, calls, C, K, with_bias, activation, prompt):
    g = torch.Generator().manual_seed(C + K + prompt)
    T, qsl, slots, init, nd, fresh = step(g, 8, 3, prompt)
    x = torch.randn(T, C + 5, generator=g)[:, 2 : C + 2]  # a column slice of the projection
    w = torch.randn(C, K, generator=g)
    bias = torch.randn(C, generator=g) if with_bias else None
    state = states(g, (C, K - 1), fresh)

    def fn(st):
        return causal_conv1d_ref(x, w, bias, st, qsl, slots, init, activation, num_decodes=nd)

    ref, nat = run_both(fn, state)
    rows = real_rows(qsl, nd, 3)
    check((ref[0][rows], ref[1]), (nat[0][rows], nat[1]), len(rows), "conv1d")
    assert calls["conv1d_decode"] == [True]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "C, K, with_bias, activation",
    [(70, 4, True, "silu"), (200, 3, False, None), (48, 7, True, None)],
)
def test_conv1d_prompt_chunks(kernels, calls, C, K, with_bias, activation, threads):
    """Prompt chunks after two decodes (conv1d_prefill_f32, token after token through each
    window, channels in blocks of 64) against the torch conv1d a request: chunks shorter and
    longer than the window, fresh (slot full of NaN) and continuing, an empty entry."""
    g = torch.Generator().manual_seed(C + K + threads)
    lens = [1, 1, 1, 2, 0, 9, 40, 3]
    fresh_flags = [False, True, True, False, False, True, False, False]
    nd = 2
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    T = int(qsl[-1])
    slots = torch.tensor([3, 5, 7, 9, 11, 13, 15, 17], dtype=torch.int32)
    init = torch.tensor([not f for f in fresh_flags])
    x = torch.randn(T, C + 5, generator=g)[:, 2 : C + 2]  # a column slice of the projection
    w = torch.randn(C, K, generator=g)
    bias = torch.randn(C, generator=g) if with_bias else None
    state = states(g, (C, K - 1), [s for s, f in zip(slots.tolist(), fresh_flags) if f])

    def fn(st):
        return causal_conv1d_ref(x, w, bias, st, qsl, slots, init, activation, num_decodes=nd)

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref, nat = run_both(fn, state)
    finally:
        torch.set_num_threads(old)
    check(ref, nat, T, "conv1d prompts")
    assert calls["conv1d_decode"] == [True] and calls["conv1d_prefill"] == [True]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "rows, heads, D, group, before",
    [(32, 8, 64, 64, True), (200, 4, 32, 32, True), (7, 0, 96, 32, False), (40, 0, 256, 64, False)],
)
def test_gated_rms_norm(kernels, monkeypatch, rows, heads, D, group, before, threads):
    """gated_rms_norm_f32 against the torch ops of `gated_rms_norm_ref`: Gated DeltaNet's form
    (x [T, heads, D], the gate a view into the projection's rows) and Mamba-2's (x [T, D],
    several groups a row), one and two threads."""
    g = torch.Generator().manual_seed(rows + D)
    shape = (rows, heads, D) if heads else (rows, D)
    width = (heads or 1) * D
    x = torch.randn(shape, generator=g) * 3
    z = torch.randn(rows, 2 * width + 5, generator=g)[:, 5 : 5 + width].view(shape)
    w = torch.randn(D, generator=g)
    ran = []
    method = kernels.gated_rms_norm

    def spy(*args, **kw):
        out = method(*args, **kw)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(kernels, "gated_rms_norm", spy)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with cpu_native.torch_decodes():
            want = gated_rms_norm_ref(x, z, w, 1e-6, group, before)
        got = gated_rms_norm_ref(x, z, w, 1e-6, group, before)
    finally:
        torch.set_num_threads(old)
    assert ran == [True]
    assert_agree(got, want, "gated rms norm")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("Dn, N, gate", [(40, 16, True), (300, 8, False)])
def test_selective_scan_prompt_chunks(kernels, calls, Dn, N, gate, threads):
    """Mamba-1's prompt chunks after two decodes (selective_scan_prefill_f32, token after token,
    the D skip and the gate included) against the torch loop a request: chunks of 1-30 tokens,
    fresh (slot full of NaN) and continuing, an empty entry."""
    g = torch.Generator().manual_seed(Dn + N + threads)
    lens = [1, 1, 1, 4, 0, 30, 2]
    fresh_flags = [False, True, True, False, False, True, False]
    nd = 2
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    T = int(qsl[-1])
    slots = torch.tensor([3, 5, 7, 9, 11, 13, 15], dtype=torch.int32)
    init = torch.tensor([not f for f in fresh_flags])
    proj = torch.randn(T, 3 * Dn + 4, generator=g)
    u, delta, z = proj[:, :Dn], proj[:, Dn : 2 * Dn], proj[:, 2 * Dn : 3 * Dn]
    BC = torch.randn(T, 2 * N, generator=g)
    A = -torch.rand(Dn, N, generator=g) * 2
    D = torch.randn(Dn, generator=g)
    bias = torch.randn(Dn, generator=g) * 0.1
    state = states(g, (Dn, N), [s for s, f in zip(slots.tolist(), fresh_flags) if f])

    def fn(st):
        return selective_scan_ref(
            u, delta, A, BC[:, :N], BC[:, N:], D, z if gate else None, bias, True, st, qsl,
            slots, init, num_decodes=nd,
        )  # fmt: skip

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref, nat = run_both(fn, state)
    finally:
        torch.set_num_threads(old)
    check(ref, nat, T, "selective scan prompts")
    assert calls["selective_scan_decode"] == [True]
    assert calls["selective_scan_prefill"] == [True]

"""The recurrent kernels in the shape of a captured verification step (engine/decode_capture.py):
the step's requests of 1 .. q rows first, then padding entries of one row each while rows are
left and of none after, all in the scratch slot 0 without an initial state, no request told a
decode and the grid sized for q rows. Per kernel (the causal convolution, the gated delta rule
per head and per channel, the SSD scan, the selective scan), reference and Triton (interpreted
without a GPU): the real rows' outputs and the real slots' states equal those of the same
requests run without the padding entries (empty entries included: no crash, nothing written
outside slot 0), and Triton agrees with the reference on the padded step."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm.engine.kernels.causal_conv1d import causal_conv1d, causal_conv1d_ref  # noqa: E402
from serverless_llm.engine.kernels.gated_delta import gated_delta_rule, gated_delta_rule_ref  # noqa: E402
from serverless_llm.engine.kernels.selective_scan import selective_scan, selective_scan_ref  # noqa: E402
from serverless_llm.engine.kernels.ssd import ssd_scan, ssd_scan_ref  # noqa: E402
from tests.kernels.batch import DEVICE  # noqa: E402

QUERY_LENS = [1, 1, 4, 2, 3]  # the step's requests (one-row ones first, as the runner orders)
SLOTS = [3, 1, 6, 2, 5]
INITS = [True, False, True, True, False]
BUCKET = 16  # rows 0..10 real, 11..15 padding: entries 5..9 one row each, 10..15 empty
LONGEST = 4
NUM_SLOTS = 8


def _entries(padded: bool):
    lens, slots, inits = list(QUERY_LENS), list(SLOTS), list(INITS)
    if padded:
        rows = sum(lens)
        lens += [1] * (BUCKET - rows) + [0] * (BUCKET - len(lens) - (BUCKET - rows))
        slots += [0] * (BUCKET - len(slots))
        inits += [False] * (BUCKET - len(inits))
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    return (
        torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        torch.tensor(slots, dtype=torch.int32, device=DEVICE),
        torch.tensor(inits, dtype=torch.bool, device=DEVICE),
    )


def _check(run, state: torch.Tensor) -> None:
    """`run(state, meta, padded, triton)` -> output rows; checks the module docstring's claims."""
    real = sum(QUERY_LENS)
    eager_state = state.clone()
    want = run(eager_state, _entries(False), padded=False, triton=False)[:real]
    for triton in (False, True):
        s = state.clone()
        got = run(s, _entries(True), padded=True, triton=triton)[:real]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(s[1:], eager_state[1:], atol=2e-5, rtol=2e-5)


def _rand(g, *shape):
    return torch.randn(*shape, generator=g).to(DEVICE)


@pytest.mark.parametrize("K", [3, 4])
def test_causal_conv1d(K):
    g = torch.Generator().manual_seed(K)
    C = 24
    x, w, b = _rand(g, BUCKET, C), _rand(g, C, K) * 0.5, _rand(g, C)

    def run(state, meta, padded, triton):
        fn = causal_conv1d if triton else causal_conv1d_ref
        rows = BUCKET if padded else sum(QUERY_LENS)
        kw = dict(num_decodes=0, max_query_len=LONGEST) if padded else dict(num_decodes=2)
        return fn(x[:rows], w, b, state, *meta, "silu", **kw)

    _check(run, _rand(g, NUM_SLOTS, C, K - 1))


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
def test_gated_delta_rule(per_channel):
    g = torch.Generator().manual_seed(7)
    Hk, Hv, D = 1, 2, 16
    q, k, v = _rand(g, BUCKET, Hk, D), _rand(g, BUCKET, Hk, D), _rand(g, BUCKET, Hv, D)
    decay = -torch.rand(BUCKET, Hv, *((D,) if per_channel else ()), generator=g).to(DEVICE)
    beta = torch.rand(BUCKET, Hv, generator=g).to(DEVICE)

    def run(state, meta, padded, triton):
        fn = gated_delta_rule if triton else gated_delta_rule_ref
        n = BUCKET if padded else sum(QUERY_LENS)
        args = (q[:n], k[:n], v[:n], decay[:n], beta[:n], state, *meta)
        return fn(*args, num_decodes=0 if padded else 2)

    _check(run, _rand(g, NUM_SLOTS, Hv, D, D) * 0.1)


def test_ssd_scan():
    g = torch.Generator().manual_seed(8)
    H, P, G, N = 2, 16, 1, 16
    x, dt = _rand(g, BUCKET, H, P), _rand(g, BUCKET, H)
    B, C = _rand(g, BUCKET, G, N), _rand(g, BUCKET, G, N)
    A, D, bias = -torch.rand(H, generator=g).to(DEVICE), _rand(g, H), _rand(g, H)

    def run(state, meta, padded, triton):
        fn = ssd_scan if triton else ssd_scan_ref
        n = BUCKET if padded else sum(QUERY_LENS)
        args = (x[:n], dt[:n], A, B[:n], C[:n], D, bias, True, (0.0, float("inf")), state)
        return fn(*args, *meta, num_decodes=0 if padded else 2)

    _check(run, _rand(g, NUM_SLOTS, H, P, N) * 0.1)


def test_selective_scan():
    g = torch.Generator().manual_seed(9)
    Dn, N = 16, 8
    u, delta, z = _rand(g, BUCKET, Dn), _rand(g, BUCKET, Dn), _rand(g, BUCKET, Dn)
    B, C = _rand(g, BUCKET, N), _rand(g, BUCKET, N)
    A, D, bias = -torch.rand(Dn, N, generator=g).to(DEVICE), _rand(g, Dn), _rand(g, Dn)

    def run(state, meta, padded, triton):
        fn = selective_scan if triton else selective_scan_ref
        n = BUCKET if padded else sum(QUERY_LENS)
        args = (u[:n], delta[:n], A, B[:n], C[:n], D, z[:n], bias, True, state)
        return fn(*args, *meta, num_decodes=0 if padded else 2)

    _check(run, _rand(g, NUM_SLOTS, Dn, N) * 0.1)

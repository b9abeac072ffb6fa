"""The gated delta rule (Gated DeltaNet's per-head decay, Kimi Delta Attention's per-channel one):
the torch reference against transformers' own torch functions and against the per-token
definition written here in float64, and the Triton kernels (interpreted without a GPU) against
the reference on ragged batches of decodes and prefill chunks, with states carried in and out of
their slots."""

from __future__ import annotations

import pytest
import torch

from serverless_llm.engine.kernels import gated_delta as gd
from tests.kernels.batch import DEVICE


def make_batch(
    lens: list[int],
    inits: list[bool],
    *,
    hk: int,
    hv: int,
    dk: int,
    dv: int,
    per_channel: bool,
    dtype: torch.dtype = torch.float32,
    beta_max: float = 1.0,
    decay_max: float = 1.0,
    seed: int = 0,
    slots: list[int] | None = None,
) -> dict:
    """Keyword arguments of `gated_delta_rule` for requests of `lens` tokens (decodes first), q and
    k strided views of one fused projection, each request in its own slot (1..) unless `slots`
    says otherwise; the state filled with noise, slots nobody uses included."""
    gen = torch.Generator().manual_seed(seed)
    T, B = sum(lens), len(lens)
    fused = torch.randn(T, 2 * hk * dk + 8, generator=gen).to(dtype)
    q = fused[:, : hk * dk].view(T, hk, dk)
    k = fused[:, hk * dk : 2 * hk * dk].view(T, hk, dk)
    v = torch.randn(T, hv, dv, generator=gen).to(dtype)
    g_shape = (T, hv, dk) if per_channel else (T, hv)
    g = -torch.rand(g_shape, generator=gen) * decay_max
    beta = torch.rand(T, hv, generator=gen) * beta_max
    if slots is None:
        slots = (torch.randperm(B + 2, generator=gen)[:B] + 1).tolist()
    state = torch.randn(max(slots) + 2, hv, dk, dv, generator=gen) * 0.5
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, state=state, query_start_loc=qsl)
    args |= dict(state_slots=torch.tensor(slots, dtype=torch.int32))
    args["has_initial_state"] = torch.tensor(inits)
    return {name: t.to(DEVICE) for name, t in args.items()}


def clone_state(args: dict) -> dict:
    return {**args, "state": args["state"].clone()}


def definition(q, k, v, g, beta, S, scale, l2norm=True):
    """The per-token recurrence of one request in float64, head by head: q, k [L, Hk, Dk], v
    [L, Hv, Dv], g [L, Hv] or [L, Hv, Dk], beta [L, Hv], S [Hv, Dk, Dv]. Kimi's l2norm form
    (x / sqrt(sum + eps)); Qwen3-Next's rsqrt form agrees to ~1e-7."""
    q, k, v, g, beta, S = (x.detach().cpu().double() for x in (q, k, v, g, beta, S))
    S = S.clone()
    L, Hk, _ = q.shape
    Hv = v.shape[1]
    o = torch.zeros(L, Hv, v.shape[2], dtype=torch.float64)
    for t in range(L):
        for h in range(Hv):
            qt, kt = q[t, h // (Hv // Hk)], k[t, h // (Hv // Hk)]
            if l2norm:
                qt = qt / torch.sqrt((qt * qt).sum() + 1e-6)
                kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
            decay = g[t, h].exp()
            S[h] = S[h] * (decay[:, None] if decay.dim() else decay)
            S[h] = S[h] + torch.outer(kt, beta[t, h] * (v[t, h] - kt @ S[h]))
            o[t, h] = (qt * scale) @ S[h]
    return o, S


def check_against_definition(args, out, state_after, scale=None, l2norm=True, atol=2e-5):
    """Every request's rows of `out` and its slot in `state_after` equal the definition run
    from its slot in args["state"] (or zeros); slots nobody names are unchanged."""
    qsl = args["query_start_loc"].tolist()
    slots = args["state_slots"].tolist()
    dk = args["q"].shape[-1]
    scale = dk**-0.5 if scale is None else scale
    for b, slot in enumerate(slots):
        s, e = qsl[b], qsl[b + 1]
        S0 = args["state"][slot]
        if not args["has_initial_state"][b]:
            S0 = torch.zeros_like(S0)
        rows = [args[n][s:e] for n in ("q", "k", "v", "g", "beta")]
        o_ref, S_ref = definition(*rows, S0, scale, l2norm)
        torch.testing.assert_close(out[s:e].cpu().double(), o_ref, atol=atol, rtol=atol)
        torch.testing.assert_close(state_after[slot].cpu().double(), S_ref, atol=atol, rtol=atol)
    untouched = [i for i in range(args["state"].shape[0]) if i not in slots]
    torch.testing.assert_close(state_after[untouched], args["state"][untouched], atol=0, rtol=0)


# -- the reference ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_next", "kimi"])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("length", [9, 150])  # the per-token path, and three chunks of 64
def test_reference_matches_transformers(family, with_state, length):
    """One sequence through the reference equals transformers' chunked and recurrent torch
    functions (output and final state). Qwen3-Next with Hv = 2 Hk (repeat_interleave); Kimi Delta
    Attention has as many key as value heads there."""
    if family == "kimi":
        from transformers.models.kimi_linear.modeling_kimi_linear import (
            chunk_kimi_delta_attention as chunked,
        )
        from transformers.models.kimi_linear.modeling_kimi_linear import (
            recurrent_kimi_delta_attention as recurrent,
        )
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import (
            torch_chunk_gated_delta_rule as chunked,
        )
        from transformers.models.qwen3_next.modeling_qwen3_next import (
            torch_recurrent_gated_delta_rule as recurrent,
        )
    kimi = family == "kimi"
    hk, hv = (2, 2) if kimi else (1, 2)
    args = make_batch(
        [length], [with_state], hk=hk, hv=hv, dk=32, dv=16, per_channel=kimi, decay_max=2.0
    )
    args = {n: t.cpu() for n, t in args.items()}
    slot = args["state_slots"][0]
    S0 = args["state"][slot].clone()[None] if with_state else None
    after = clone_state(args)
    out = gd.gated_delta_rule_ref(**after)
    batch = [args[n][None] for n in ("q", "k", "v", "g", "beta")]
    for fn in (chunked, recurrent):
        kw = dict(initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        o_hf, S_hf = fn(*batch, **kw)
        torch.testing.assert_close(out, o_hf[0], atol=2e-6, rtol=2e-5)
        torch.testing.assert_close(after["state"][slot], S_hf[0], atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("per_channel", [False, True])
def test_reference_matches_definition(per_channel):
    """A ragged batch (three decodes, prompt chunks of 5, 40, 70 and 130 tokens, states in and
    out), GQA, large per-channel decays (a chunk's cumulative decay reaches -128: exp(-gamma_j)
    alone would overflow), beta up to 2 (OLMo Hybrid's negative eigenvalues)."""
    args = make_batch(
        [1, 1, 1, 5, 40, 70, 130],
        [True, False, True, True, False, True, False],
        hk=1,
        hv=2,
        dk=16,
        dv=8,
        per_channel=per_channel,
        beta_max=2.0,
        decay_max=4.0 if per_channel else 1.0,
        seed=1,
    )
    after = clone_state(args)
    out = gd.gated_delta_rule_ref(**after, num_decodes=3)
    check_against_definition(args, out, after["state"])


def test_reference_options():
    """No l2norm and a given scale, through both the per-token and the chunked paths."""
    args = make_batch([1, 20, 90], [True, True, False], hk=2, hv=4, dk=8, dv=8, per_channel=False)
    args["q"] = args["q"] * 0.1
    args["k"] = args["k"] * 0.1  # unnormalised keys must keep |k|^2 beta < 2 to stay stable
    after = clone_state(args)
    out = gd.gated_delta_rule_ref(**after, scale=0.3, use_qk_l2norm=False, num_decodes=1)
    check_against_definition(args, out, after["state"], scale=0.3, l2norm=False)


# -- the Triton kernels ----------------------------------------------------------------------

triton_cases = [
    # (per_channel, dtype, hk, hv, dk, dv)
    (False, torch.float32, 1, 2, 32, 16),
    (False, torch.float16, 2, 4, 16, 32),
    (True, torch.float32, 2, 2, 32, 32),
    (True, torch.float16, 1, 2, 16, 16),
    (False, torch.bfloat16, 1, 2, 16, 16),
]


def tolerance(dtype: torch.dtype) -> dict:
    return {
        torch.float32: dict(atol=1e-4, rtol=1e-4),
        torch.float16: dict(atol=2e-3, rtol=2e-3),
        torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
    }[dtype]


def assert_matches_reference(args: dict, num_decodes: int, launch=None) -> None:
    """`gated_delta_rule` (or `launch`) against the reference on the same batch: the rows of
    every request and every slot of the state."""
    pytest.importorskip("triton")
    ref_args, tri_args = clone_state(args), clone_state(args)
    o_ref = gd.gated_delta_rule_ref(**ref_args, num_decodes=num_decodes)
    if launch is None:
        o_tri = gd.gated_delta_rule(**tri_args, num_decodes=num_decodes)
    else:
        o_tri = launch(tri_args)
    rows = int(args["query_start_loc"][-1])
    tol = tolerance(args["v"].dtype)
    torch.testing.assert_close(o_tri[:rows].float(), o_ref[:rows].float(), **tol)
    torch.testing.assert_close(tri_args["state"], ref_args["state"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("per_channel, dtype, hk, hv, dk, dv", triton_cases)
def test_triton_matches_reference(per_channel, dtype, hk, hv, dk, dv):
    """Three decodes, then prompt chunks of 45 (two Triton chunks), 0 and 6 tokens, with and
    without a state; beta in the model dtype; per-channel decays whose sum over a chunk of 32
    reaches about -128 (exp(-gamma_j) alone overflows float32)."""
    args = make_batch(
        [1, 1, 1, 45, 0, 6],
        [True, False, True, True, False, False],
        hk=hk,
        hv=hv,
        dk=dk,
        dv=dv,
        per_channel=per_channel,
        dtype=dtype,
        decay_max=8.0 if per_channel else 1.0,
        seed=2,
    )
    args["beta"] = args["beta"].to(dtype)
    assert_matches_reference(args, num_decodes=3)


def test_triton_options():
    """No l2norm, a given scale and beta up to 2, decodes only, then prefill only."""
    pytest.importorskip("triton")
    for lens, nd in (([1, 1], 2), ([3, 40], 0)):
        args = make_batch(lens, [True, True], hk=1, hv=2, dk=16, dv=16, per_channel=False,
                          beta_max=2.0, seed=3)  # fmt: skip
        args = {**args, "q": args["q"] * 0.1, "k": args["k"] * 0.1}
        ref_args, tri_args = clone_state(args), clone_state(args)
        kw = dict(scale=0.4, use_qk_l2norm=False, num_decodes=nd)
        o_ref = gd.gated_delta_rule_ref(**ref_args, **kw)
        o_tri = gd.gated_delta_rule(**tri_args, **kw)
        torch.testing.assert_close(o_tri, o_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(tri_args["state"], ref_args["state"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("per_channel", [False, True])
def test_recurrent_kernel_serves_any_chunk(per_channel):
    """The recurrent kernel alone over decodes and prompt chunks (several Dv blocks)."""
    args = make_batch(
        [1, 1, 30, 5],
        [True, False, True, False],
        hk=1,
        hv=2,
        dk=16,
        dv=32,
        per_channel=per_channel,
        seed=4,
    )

    def launch(a):
        o = torch.empty_like(a["v"])
        names = ("q", "k", "v", "g", "beta", "state")
        rest = ("query_start_loc", "state_slots", "has_initial_state")
        gd._launch_recurrent(
            *(a[n] for n in names), o, *(a[n] for n in rest), 16**-0.5, True, 0, 4, block_v=16
        )
        return o

    assert_matches_reference(args, num_decodes=2, launch=launch)


@pytest.mark.parametrize("per_channel", [False, True])
def test_split_request_equals_one_pass(per_channel):
    """A 75-token prompt in one pass, and in chunks of 1, 7 and 67 (continuing from the slot,
    beside a decode of another request each step): same output and final state."""
    pytest.importorskip("triton")
    args = make_batch(
        [1, 75], [True, False], hk=1, hv=2, dk=16, dv=16, per_channel=per_channel, seed=5
    )
    whole = clone_state(args)
    o_whole = gd.gated_delta_rule(**whole, num_decodes=1)
    state = args["state"].clone()
    outs = []
    first = True
    for s, e in ((0, 1), (1, 8), (8, 75)):
        rows = torch.cat([torch.tensor([0]), torch.arange(1 + s, 1 + e)]).to(DEVICE)
        step = {n: args[n][rows] for n in ("q", "k", "v", "g", "beta")}
        step["query_start_loc"] = torch.tensor([0, 1, 1 + e - s], dtype=torch.int32).to(DEVICE)
        step["state_slots"] = args["state_slots"]
        step["has_initial_state"] = torch.tensor([True, not first]).to(DEVICE)
        # The decode row repeats each step from the same state: reset its slot.
        decode_slot = int(args["state_slots"][0])
        state[decode_slot] = args["state"][decode_slot]
        outs.append(gd.gated_delta_rule(**step, state=state, num_decodes=1)[1:])
        first = False
    torch.testing.assert_close(torch.cat(outs), o_whole[1:], atol=2e-5, rtol=2e-5)
    slot = int(args["state_slots"][1])
    torch.testing.assert_close(state[slot], whole["state"][slot], atol=2e-5, rtol=2e-5)


def test_padded_rows_share_slot_zero():
    """A captured decode step's padding: several rows on slot 0 (with and without a state),
    beside real decodes and a prompt chunk: no crash, the real requests still right."""
    pytest.importorskip("triton")
    args = make_batch(
        [1, 1, 1, 1, 1, 12],
        [True, True, False, True, False, True],
        hk=1,
        hv=2,
        dk=16,
        dv=16,
        per_channel=False,
        slots=[3, 0, 0, 1, 0, 2],
        seed=6,
    )
    ref_args, tri_args = clone_state(args), clone_state(args)
    o_ref = gd.gated_delta_rule_ref(**ref_args, num_decodes=5)
    o_tri = gd.gated_delta_rule(**tri_args, num_decodes=5)
    real_rows = torch.tensor([0, 3, *range(5, 17)])
    torch.testing.assert_close(o_tri[real_rows], o_ref[real_rows], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(tri_args["state"][1:], ref_args["state"][1:], atol=1e-4, rtol=1e-4)
    assert torch.isfinite(tri_args["state"][0]).all()

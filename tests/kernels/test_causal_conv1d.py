"""The recurrent layers' causal convolution and gated RMSNorm (kernels/causal_conv1d.py).

- The torch references against transformers' own functions and classes (Qwen3-Next's
  causal_conv1d_fn / causal_conv1d_update, Qwen3NextRMSNormGated, Mamba-2's MambaRMSNormGated),
  one sequence at a time, with and without an initial state.
- The convolution reference against its per-token definition, on a ragged batch.
- The Triton kernels (interpreted without a GPU) against the references in float32 and float16,
  on ragged batches mixing decodes and prefill chunks that start or continue, states carried in
  and out, x a column slice of a wider projection.
- Chunked carry: one request fed in chunks of 1, 2, 7 and the rest gives the output and final
  state of one pass (K = 2, 3, 4).
- Slot 0 shared by padded rows does not crash and leaves the real requests' results alone.

Tolerances: the kernels and the references both compute in float32 and round where they do;
only the summation order differs (float32 1e-5; 16-bit one ulp, and at most 5% of the elements
differ at all, which a missing or extra rounding step would exceed). States are copies of
inputs: exact. bfloat16 runs on a GPU only (the interpreter gets bf16 conversions wrong).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextRMSNormGated,
    causal_conv1d_fn,
    causal_conv1d_update,
)

pytest.importorskip("triton")

from serverless_llm.engine.kernels.causal_conv1d import (  # noqa: E402
    causal_conv1d,
    causal_conv1d_ref,
    gated_rms_norm,
    gated_rms_norm_ref,
)
from tests.kernels.batch import DEVICE  # noqa: E402

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
DTYPE_IDS = ["fp32", "fp16", "bf16"][: len(DTYPES)]
NUM_SLOTS = 9


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, **TOL[got.dtype])
    if got.dtype != torch.float32:
        assert (got != want).float().mean().item() <= 0.05


def _rand(g: torch.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def _conv_params(C: int, K: int, dtype, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = _rand(g, C, K, dtype=dtype) * 0.5
    b = _rand(g, C, dtype=dtype) if bias else None
    return g, weight, b


def _ragged(query_lens: list[int], slots: list[int], inits: list[bool]):
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return (
        qsl.to(DEVICE),
        torch.tensor(slots, dtype=torch.int32, device=DEVICE),
        torch.tensor(inits, dtype=torch.bool, device=DEVICE),
    )


def _wide_x(g, T: int, C: int, dtype) -> torch.Tensor:
    """x as the layers see it: a column slice of a wider projection (row stride > C)."""
    return _rand(g, T, C + 13, dtype=dtype)[:, 5 : 5 + C]


# -- the references against transformers ----------------------------------------------------


@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 6])
@pytest.mark.parametrize("initial", [False, True], ids=["fresh", "continued"])
def test_conv_ref_matches_transformers(initial, n, K):
    """One request of n tokens: without a state transformers' causal_conv1d_fn; with one its
    causal_conv1d_update, whose state keeps K entries (ours keeps the last K-1)."""
    C = 6
    g, weight, bias = _conv_params(C, K, torch.float32, seed=n + 10 * K)
    x = _rand(g, n, C)
    hf_state = _rand(g, 1, C, K)
    conv_state = _rand(g, NUM_SLOTS, C, K - 1)
    conv_state[3] = hf_state[0, :, 1:]
    meta = _ragged([n], [3], [initial])
    got = causal_conv1d_ref(x, weight, bias, conv_state, *meta, "silu")
    seq = x.t().unsqueeze(0)  # transformers' [batch, C, seq]
    if initial:
        want = causal_conv1d_update(seq, hf_state, weight, bias, "silu")
        want_state = hf_state[0, :, 1:]
    else:
        want = causal_conv1d_fn(seq, weight, bias, activation="silu")
        padded = torch.cat([torch.zeros(C, K - 1, device=DEVICE), x.t()], dim=-1)
        want_state = padded[:, -(K - 1) :]
    torch.testing.assert_close(got, want[0].t(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(conv_state[3], want_state, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "norm_before_gate,group",
    [(True, 16), (False, 48), (False, 16)],
    ids=["qwen3next", "mamba2", "mamba2-groups"],
)
def test_gated_norm_ref_matches_transformers(norm_before_gate, group, dtype):
    """Qwen3NextRMSNormGated normalises each head (its hidden size is the head dim: our group);
    MambaRMSNormGated gates first, over `group_size` channels."""
    D = 48
    g = torch.Generator().manual_seed(group)
    x = (torch.randn(5, D, generator=g) * 2).to(DEVICE, dtype)
    z = torch.randn(5, D, generator=g).to(DEVICE, dtype)
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(DEVICE)
    if norm_before_gate:
        module = Qwen3NextRMSNormGated(group, eps=1e-6)
        with torch.no_grad():
            module.weight.copy_(w[:group])
        module = module.to(DEVICE, dtype)
        w = module.weight.detach().repeat(D // group)
        want = module(x.view(5, D // group, group), z.view(5, D // group, group)).view(5, D)
    else:
        module = MambaRMSNormGated(D, group_size=group, eps=1e-6)
        with torch.no_grad():
            module.weight.copy_(w)
        module = module.to(DEVICE, dtype)
        w = module.weight.detach()
        want = module(x, z)
    got = gated_rms_norm_ref(x, z, w, 1e-6, group, norm_before_gate)
    assert got.dtype == want.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:  # the same operations in the same order: within one bf16 rounding
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-8)


# -- the convolution reference against its definition ----------------------------------------


def _conv_by_token(x, weight, bias, conv_state, query_lens, slots, inits, activation):
    """The definition: a window of the last K-1 inputs per request, one token at a time."""
    K = weight.shape[1]
    out = torch.empty(x.shape, dtype=torch.float32)
    states = {}
    t = 0
    for n, slot, init in zip(query_lens, slots, inits):
        window = [
            conv_state[slot, :, i].float() if init else torch.zeros(x.shape[1])
            for i in range(K - 1)
        ]
        for _ in range(n):
            window.append(x[t].float())
            y = sum(weight[:, j].float() * window[j] for j in range(K))
            if bias is not None:
                y = y + bias.float()
            out[t] = torch.nn.functional.silu(y) if activation == "silu" else y
            window.pop(0)
            t += 1
        states[slot] = torch.stack(window, dim=-1)
    return out, states


# Two decodes (one a brand-new one-token prompt), then prefill chunks: shorter than K-1 and
# continued, fresh, continued and long.
BATCH = ([1, 1, 2, 5, 1, 9], [4, 2, 7, 1, 5, 8], [True, False, True, False, True, True])


@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("num_decodes", [0, 2])
def test_conv_ref_matches_definition(num_decodes, activation, K):
    query_lens, slots, inits = BATCH
    C = 5
    g, weight, bias = _conv_params(C, K, torch.float32, bias=activation is None, seed=K)
    x = _wide_x(g, sum(query_lens), C, torch.float32)
    conv_state = _rand(g, NUM_SLOTS, C, K - 1)
    want, want_states = _conv_by_token(
        x.cpu(), weight.cpu(), None if bias is None else bias.cpu(), conv_state.cpu(),
        query_lens, slots, inits, activation,
    )  # fmt: skip
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    before = conv_state[untouched].clone()
    meta = _ragged(query_lens, slots, inits)
    got = causal_conv1d_ref(x, weight, bias, conv_state, *meta, activation, num_decodes=num_decodes)
    torch.testing.assert_close(got.cpu(), want, atol=1e-6, rtol=1e-6)
    for slot, state in want_states.items():
        torch.testing.assert_close(conv_state[slot].cpu(), state, atol=0, rtol=0)
    assert torch.equal(conv_state[untouched], before)


# -- Triton against the reference ------------------------------------------------------------


def _run_both(x, weight, bias, conv_state, meta, activation, **kw):
    ref_state = conv_state.clone()
    want = causal_conv1d_ref(x, weight, bias, ref_state, *meta, activation, **kw)
    got = causal_conv1d(x, weight, bias, conv_state, *meta, activation, **kw)
    return got, want, ref_state


@pytest.mark.parametrize(
    "K,C,activation", [(4, 40, "silu"), (3, 24, None), (2, 17, "silu"), (4, 150, "silu")]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_conv_triton_matches_ref(dtype, K, C, activation):
    """A mixed ragged batch; C = 150 spans two prefill channel blocks."""
    query_lens, slots, inits = BATCH
    g, weight, bias = _conv_params(C, K, dtype, bias=activation == "silu", seed=C)
    x = _wide_x(g, sum(query_lens), C, dtype)
    conv_state = _rand(g, NUM_SLOTS, C, K - 1, dtype=dtype)
    meta = _ragged(query_lens, slots, inits)
    for kw in (dict(num_decodes=2, max_query_len=9), dict(num_decodes=0)):
        state = conv_state.clone()
        got, want, ref_state = _run_both(x, weight, bias, state, meta, activation, **kw)
        assert got.dtype == dtype
        _assert_close(got, want)
        assert torch.equal(state, ref_state), kw


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_conv_triton_decode_only(dtype):
    """The captured decode step's shape: every request one token, told by num_decodes, the state
    a strided view (a slice of a wider per-slot buffer)."""
    C, K, B = 70, 4, 5
    g, weight, bias = _conv_params(C, K, dtype, seed=3)
    x = _wide_x(g, B, C, dtype)
    conv_state = _rand(g, NUM_SLOTS, C + 6, K - 1, dtype=dtype)[:, 3 : 3 + C]
    meta = _ragged([1] * B, [3, 1, 6, 2, 8], [True, True, False, True, True])
    got, want, ref_state = _run_both(x, weight, bias, conv_state, meta, "silu", num_decodes=B)
    _assert_close(got, want)
    assert torch.equal(conv_state, ref_state)


@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_conv_chunked_carry(impl, K):
    """Chunks of 1, 2, 7 and the rest (the 1 runs as a decode) equal one pass."""
    fn = causal_conv1d_ref if impl == "ref" else causal_conv1d
    C, n = 12, 21
    g, weight, bias = _conv_params(C, K, torch.float32, seed=K + 20)
    x = _rand(g, n, C)
    garbage = torch.full((NUM_SLOTS, C, K - 1), float("nan"), device=DEVICE)
    whole_state = garbage.clone()
    whole = fn(x, weight, bias, whole_state, *_ragged([n], [2], [False]), "silu")
    state = garbage.clone()
    outs, t = [], 0
    for i, size in enumerate([1, 2, 7, n - 10]):
        meta = _ragged([size], [2], [i > 0])
        outs.append(
            fn(x[t : t + size], weight, bias, state, *meta, "silu", num_decodes=int(size == 1))
        )
        t += size
    torch.testing.assert_close(torch.cat(outs), whole, atol=1e-6, rtol=1e-6)
    assert torch.equal(state[2], whole_state[2])
    assert torch.equal(state[2], x[-(K - 1) :].t())


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_conv_padded_rows_share_slot_zero(impl):
    """A captured step's padded rows all point at scratch slot 0: no crash, real rows exact."""
    fn = causal_conv1d_ref if impl == "ref" else causal_conv1d
    C, K = 9, 4
    g, weight, bias = _conv_params(C, K, torch.float32, seed=5)
    x = _rand(g, 6, C)
    conv_state = _rand(g, NUM_SLOTS, C, K - 1)
    real_state = conv_state.clone()
    meta = _ragged([1] * 6, [3, 5, 0, 0, 0, 0], [True, True, False, True, False, True])
    out = fn(x, weight, bias, conv_state, *meta, "silu", num_decodes=6)
    real = causal_conv1d_ref(
        x[:2], weight, bias, real_state, *_ragged([1, 1], [3, 5], [True, True]), "silu"
    )
    torch.testing.assert_close(out[:2], real, atol=1e-6, rtol=1e-6)
    assert torch.equal(conv_state[1:], real_state[1:])


# -- gated RMSNorm: Triton against the reference ---------------------------------------------


@pytest.mark.parametrize(
    "shape,group",
    [((7, 64), 64), ((7, 64), 16), ((5, 72), 24), ((3, 4, 32), 32)],
    ids=["whole-row", "groups", "odd-groups", "per-head-3d"],
)
@pytest.mark.parametrize(
    "norm_before_gate", [True, False], ids=["norm-then-gate", "gate-then-norm"]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gated_norm_triton_matches_ref(dtype, norm_before_gate, shape, group):
    g = torch.Generator().manual_seed(sum(shape) + group)
    D = shape[-1]
    # x and z as rows of one wider projection output (row stride > D).
    buf = (torch.randn(*shape[:-1], 2 * D + 8, generator=g) * 2).to(DEVICE, dtype)
    x, z = buf[..., :D], buf[..., D + 8 :]
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(DEVICE, dtype)
    got = gated_rms_norm(x, z, w, 1e-6, group, norm_before_gate)
    want = gated_rms_norm_ref(x, z, w, 1e-6, group, norm_before_gate)
    assert got.shape == want.shape == x.shape and got.dtype == dtype
    _assert_close(got, want)


def test_gated_norm_triton_float32_weight_on_fp16():
    """An fp32 weight on fp16 activations: the product stays float32 until the final rounding."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, generator=g).to(DEVICE, torch.float16)
    z = torch.randn(4, 32, generator=g).to(DEVICE, torch.float16)
    w = (1 + 0.3 * torch.randn(32, generator=g)).to(DEVICE)
    for before in (True, False):
        got = gated_rms_norm(x, z, w, 1e-5, 32, before)
        want = gated_rms_norm_ref(x, z, w, 1e-5, 32, before)
        assert got.dtype == torch.float16
        _assert_close(got, want)


def test_bad_arguments():
    w = torch.randn(8, 4)
    state = torch.zeros(2, 8, 3)
    meta = _ragged([2], [1], [False])
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_ref(torch.randn(2, 8), w, None, state, *meta, "gelu")
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d(torch.randn(2, 8), w, None, torch.zeros(2, 8, 4), *meta, None)
    with pytest.raises(ValueError, match="group_size"):
        gated_rms_norm(torch.randn(2, 12), torch.randn(2, 12), torch.ones(12), 1e-6, 5, True)

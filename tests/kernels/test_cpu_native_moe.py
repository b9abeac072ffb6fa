"""A sparse block's experts in one native call (kernels/cpu_native.c moe_experts_f32, through
layers/moe.py's Experts on the CPU float32 path) against fused_moe_reference: bit for bit when the
reference runs the same native GEMM and activation per expert (the call only moves the grouping,
the gathers and the weighted sum into C, in the reference's order), and within float32 rounding
of the plain torch reference. Token counts from one to a prefill's, top 1 to 3 of up to 8
experts (some receiving no token), gated and plain experts, a strided input, one and two
threads."""

from __future__ import annotations

import pytest
import torch

import serverless_llm.engine.kernels.fused_moe as fused_moe
from serverless_llm.engine.kernels import cpu_native
from serverless_llm.engine.kernels.activation import ACT_CODES
from serverless_llm.engine.layers.moe import Experts


@pytest.fixture(scope="module")
def kernels():
    k = cpu_native.load()
    if k is None:
        pytest.skip("the native CPU kernels cannot be built here (no C compiler?)")
    return k


def experts_module(kernels, g, E, H, inter, act, gated):
    ex = Experts(E, H, inter, act, use_kernels=False, gated=gated)
    with torch.no_grad():
        ex.w13.weight.copy_(torch.randn(ex.w13.weight.shape, generator=g) * 0.1)
        ex.w2.weight.copy_(torch.randn(ex.w2.weight.shape, generator=g) * 0.1)
    stacked = ex.w13.weight.detach().clone(), ex.w2.weight.detach().clone()
    ex.pack_for_cpu(kernels)
    return ex, stacked


CASES = [
    # tokens, hidden, intermediate, experts, top k, gated, act
    (32, 64, 48, 8, 2, True, "silu"),
    (1, 32, 16, 8, 2, True, "silu"),
    (5, 96, 40, 4, 1, True, "gelu"),
    (40, 64, 80, 8, 3, False, "relu"),
    (300, 48, 32, 6, 2, True, "gelu_pytorch_tanh"),
]


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_experts_in_one_native_call(kernels, case, threads, chunked, monkeypatch):
    """`chunked`: the scratch bound set so low that the tokens go 3 at a time (a long
    prompt's case): the same bits."""
    T, H, inter, E, k, gated, act = case
    if chunked:
        monkeypatch.setattr(cpu_native, "MOE_WORK_BYTES", 3 * 4 * k * (2 * H + 3 * inter))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(T * 31 + E)
        ex, (w13, w2) = experts_module(kernels, g, E, H, inter, act, gated)
        assert ex.native_call is not None
        x = torch.randn(T, H + 3, generator=g)[:, :H]  # rows with a stride, as a view
        logits = torch.randn(T, E, generator=g)
        logits[:, 0] -= 100.0  # expert 0 never chosen: an empty group
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)

        called = []
        method = kernels.moe_experts

        def spy(*args, **kw):
            called.append(True)
            return method(*args, **kw)

        monkeypatch.setattr(kernels, "moe_experts", spy)
        got = ex(x, weights, ids)
        assert called, "the native call did not run"

        # The reference with the same GEMM (each expert's panels) and the native activation.
        code = ACT_CODES[act]

        def linear(rows, w):
            return kernels.linear(rows.contiguous(), cpu_native.pack_panels(w), None, w.shape[0])

        monkeypatch.setattr(
            fused_moe, "act_and_mul_reference", lambda h, a: kernels.activation(h, code, True)
        )
        monkeypatch.setattr(
            fused_moe, "activation_reference", lambda h, a: kernels.activation(h, code, False)
        )
        same_ops = fused_moe.fused_moe_reference(x, w13, w2, weights, ids, act, linear, gated)
        assert torch.equal(got, same_ops)
        monkeypatch.undo()

        plain = fused_moe.fused_moe_reference(x, w13, w2, weights, ids, act, gated=gated)
        assert (got - plain).abs().max() <= 2e-6 * plain.abs().max() + 1e-7
    finally:
        torch.set_num_threads(old)


def test_biased_or_clamped_experts_keep_the_per_expert_path(kernels):
    """Experts the call does not take (biases; gpt-oss's clamped SwiGLU) keep their GEMM per
    expert in torch glue."""
    from serverless_llm.engine.kernels.activation import ClampedSwiGLU

    biased = Experts(4, 32, 16, "silu", use_kernels=False, bias=True)
    biased.pack_for_cpu(kernels)
    clamped = Experts(4, 32, 16, ClampedSwiGLU(1.702, 7.0), use_kernels=False)
    clamped.pack_for_cpu(kernels)
    assert biased.native_call is None and clamped.native_call is None
    assert biased.packed is not None and clamped.packed is not None

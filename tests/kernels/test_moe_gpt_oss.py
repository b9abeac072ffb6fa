"""gpt-oss's experts (issue 37 item 5): the clamped SwiGLU (`ClampedSwiGLU`: gate clamped above
at `limit`, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)) and a bias per expert
and projection. The reference against transformers' own experts module on the same weights;
the Triton gated activation kernel and the fused MoE kernel with biases (interpreted on CPU)
against the reference, float32 and float16.
"""

from __future__ import annotations

import pytest
import torch
import transformers

pytest.importorskip("triton")

from serverless_llm.engine.kernels.activation import (  # noqa: E402
    ClampedSwiGLU,
    act_and_mul,
    act_and_mul_reference,
)
from serverless_llm.engine.kernels.fused_moe import fused_moe, fused_moe_reference  # noqa: E402
from serverless_llm.engine.layers.moe import route  # noqa: E402
from tests.kernels.batch import DEVICE  # noqa: E402

SWIGLU = ClampedSwiGLU(alpha=1.702, limit=7.0)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


@DTYPES
def test_clamped_swiglu_kernel_matches_reference(dtype):
    g = torch.Generator().manual_seed(0)
    # values on both sides of the limits (|x| up to ~20 against 7)
    x = (torch.randn(37, 2 * 72, generator=g) * 8).to(dtype).to(DEVICE)
    got = act_and_mul(x, SWIGLU)
    want = act_and_mul_reference(x, SWIGLU)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=4e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # the clamps bite: unclamped silu-style math differs
    gate, up = x.float().chunk(2, dim=-1)
    free = (up + 1) * gate * torch.sigmoid(1.702 * gate)
    assert not torch.allclose(free, want.float(), atol=1.0)


def _experts(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 3 / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    b13 = torch.randn(experts, 2 * inter, generator=g)
    b2 = torch.randn(experts, hidden, generator=g)
    router_w = torch.randn(experts, hidden, generator=g)
    router_b = torch.randn(experts, generator=g)
    return x, w13, w2, b13, b2, router_w, router_b


def test_reference_matches_transformers_experts():
    """The router (a linear with bias, top-k of the logits, softmax over those k) and the experts
    (biases, clamped SwiGLU) against transformers' GptOssMLP with the same weights; its fused
    gate_up_proj [E, H, 2I] interleaves gate and up columns, which our [gate | up] rows undo."""
    E, H, inter, k, T = 6, 32, 24, 2, 11
    x, w13, w2, b13, b2, router_w, router_b = _experts(T, E, k, H, inter, seed=1)
    config = transformers.GptOssConfig(
        hidden_size=H,
        intermediate_size=inter,
        num_local_experts=E,
        num_experts_per_tok=k,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    config._experts_implementation = "eager"
    mlp = transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP(config).float()
    gate_up = torch.empty(E, 2 * inter, H)
    gate_up[:, 0::2], gate_up[:, 1::2] = w13[:, :inter], w13[:, inter:]
    bias = torch.empty(E, 2 * inter)
    bias[:, 0::2], bias[:, 1::2] = b13[:, :inter], b13[:, inter:]
    with torch.no_grad():
        mlp.router.weight.copy_(router_w)
        mlp.router.bias.copy_(router_b)
        mlp.experts.gate_up_proj.copy_(gate_up.transpose(1, 2))
        mlp.experts.gate_up_proj_bias.copy_(bias)
        mlp.experts.down_proj.copy_(w2.transpose(1, 2))
        mlp.experts.down_proj_bias.copy_(b2)
        want, _ = mlp(x[None])
    logits = torch.nn.functional.linear(x, router_w, router_b)
    weights, ids = route(logits, k, "topk_softmax", False)
    got = fused_moe_reference(x, w13, w2, weights, ids, SWIGLU, b13=b13, b2=b2)
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)


@DTYPES
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (13, 8, 4), (40, 4, 2)])
def test_fused_moe_with_biases_matches_reference(dtype, tokens, experts, top_k):
    x, w13, w2, b13, b2, router_w, router_b = _experts(tokens, experts, top_k, 48, 40, seed=2)
    weights, ids = route(x @ router_w.T + router_b, top_k, "topk_softmax", False)
    args = [t.to(dtype).to(DEVICE) for t in (x, w13, w2)]
    biases = [t.to(dtype).to(DEVICE) for t in (b13, b2)]
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    got = fused_moe(*args, weights, ids, SWIGLU, True, *biases)
    want = fused_moe_reference(*args, weights, ids, SWIGLU, b13=biases[0], b2=biases[1])
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # the biases count
    plain = fused_moe_reference(*args, weights, ids, SWIGLU)
    assert not torch.allclose(plain.float(), want.float(), atol=1e-2)

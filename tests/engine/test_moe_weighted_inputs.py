"""Llama 4's routing: the top-k logits through a sigmoid, and the weight applied to each chosen
expert's input (not its output), checked against the per-token definition."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from serverless_llm.engine.layers.moe import Experts, experts_on_weighted_inputs, route


def _expert(w13, w2, e, x):
    gate, up = F.linear(x, w13[e]).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2[e])


def test_topk_sigmoid_routing():
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.1], [-0.3, 0.7, 0.6, -2.0]])
    weights, ids = route(logits, 2, "topk_sigmoid", False)
    assert ids.tolist() == [[2, 0], [1, 2]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[2.0, 0.5], [0.7, 0.6]])))


def test_weighted_inputs_equal_the_definition():
    torch.manual_seed(0)
    E, H, inter, T = 4, 8, 6, 5
    experts = Experts(E, H, inter, "silu", use_kernels=False)
    with torch.no_grad():
        experts.w13.weight.normal_()
        experts.w2.weight.normal_()
    x = torch.randn(T, H)
    for k in (1, 2):
        weights, ids = route(torch.randn(T, E), k, "topk_sigmoid", False)
        got = experts_on_weighted_inputs(experts, x, weights, ids)
        w13, w2 = experts.w13.weight, experts.w2.weight
        want = torch.stack(
            [
                sum(_expert(w13, w2, int(ids[t, j]), x[t] * weights[t, j]) for j in range(k))
                for t in range(T)
            ]
        )
        torch.testing.assert_close(got, want)

"""Mixture-of-experts: the router's choice and the experts' stacked weights.

A sparse MLP block sends each token to `top_k` of `num_experts` gated MLPs and sums their outputs
weighted by the router. The experts' weights are stacked, one tensor for all experts' [gate | up]
rows (`w13`, [E, 2 * I, H]) and one for their down projections (`w2`, [E, H, I]), so the loader
fills each expert's slice in place and a kernel reads any expert by index.

`route` turns router logits into (weights, expert ids) the way each family's transformers code
does; `experts_forward` is the torch path: tokens grouped by expert, one matmul pair per expert
that received any (the CPU path, and the reference the Triton kernel is tested against).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROUTINGS = ("softmax_topk", "topk_softmax")


def route(
    logits: torch.Tensor, top_k: int, routing: str, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k] int64) from router logits [T, E].

    - "softmax_topk" (Mixtral, Qwen-MoE, OLMoE): softmax over all experts in float32, the top k
      probabilities, divided by their sum when `renormalize` (Mixtral always; Qwen/OLMoE by
      `norm_topk_prob`).
    - "topk_softmax" (Granite-MoE): the top k logits, softmax over those k."""
    if routing == "softmax_topk":
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    if routing == "topk_softmax":
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    raise ValueError(f"unknown MoE routing {routing!r}; known: {', '.join(ROUTINGS)}")


class StackedWeight(nn.Module):
    """One parameter `weight` [num_experts, out, in]: every expert's matrix of one projection."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The (token, slot) pairs of `ids` [T, k] in expert order, as flat indices into ids.view(-1)
    (stable: a token's rows keep their token order within an expert), and each expert's count."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


def experts_forward(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k], any float dtype
    ids: torch.Tensor,  # [T, k]
    act_and_mul,
) -> torch.Tensor:
    """sum over each token's k experts of weight * down(act(gate(x)) * up(x)), in x's dtype.

    The token rows are gathered in expert order and each expert with any row runs two matmuls on
    its contiguous segment; experts that received no token cost nothing. Each expert's output is
    scaled by its router weight (in x's dtype, as transformers does) and the k outputs of a token
    are summed in expert order."""
    T, k = ids.shape
    order, counts = group_by_expert(ids, w13.shape[0])
    tokens = order // k
    rows = x[tokens]
    out = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        seg = rows[start : start + n]
        out[start : start + n] = F.linear(act_and_mul(F.linear(seg, w13[e])), w2[e])
        start += n
    out = out * weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, tokens, out)

"""Mixture-of-experts: the router's choice and the experts' stacked weights.

A sparse MLP block sends each token to `top_k` of `num_experts` gated MLPs and sums their outputs
weighted by the router. The experts' weights are stacked, one tensor for all experts' [gate | up]
rows (`w13`, [E, 2 * I, H]) and one for their down projections (`w2`, [E, H, I]), so the loader
fills each expert's slice in place and a kernel reads any expert by index.

`route` turns router logits into (weights, expert ids) the way each family's transformers code
does; `experts_forward` runs the experts by the Triton grouped GEMM or its torch reference
(tokens grouped by expert, one matmul pair per expert that received any: the CPU path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.fused_moe import fused_moe, fused_moe_reference

ROUTINGS = ("softmax_topk", "topk_softmax", "sparsemixer")


def route(
    logits: torch.Tensor,
    top_k: int,
    routing: str,
    renormalize: bool | float,
    jitter_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k] int64) from router logits [T, E].

    - "softmax_topk" (Mixtral, Qwen-MoE, OLMoE, DBRX): softmax over all experts in float32, the
      top k probabilities, divided by their sum when `renormalize` is True (Mixtral always;
      Qwen/OLMoE by `norm_topk_prob`), or by their p-norm when it is a number p (DBRX's
      `moe_normalize_expert_weights`; p = 1 is the sum).
    - "topk_softmax" (Granite-MoE): the top k logits, softmax over those k.
    - "sparsemixer" (PhiMoE), at inference, always two experts (top_k must be 2): the best
      expert, weighted by its share of a softmax over the experts whose logit is within a
      relative `2 * jitter_eps` of the best, (best - logit) / max(|logit|, best) <= 2 * eps;
      then the best of the rest, weighted the same way against the second-best logit, with the
      first expert left out of its softmax. transformers' training-time Gumbel sampling and
      gradient estimate do not change these inference values."""
    if routing == "softmax_topk":
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            p = float(renormalize)  # True: 1, the sum
            if p == 1:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            else:
                weights = weights / torch.norm(weights, p=p, dim=-1, keepdim=True)
        return weights, ids
    if routing == "topk_softmax":
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    if routing == "sparsemixer":
        if top_k != 2:
            raise ValueError(f"sparsemixer routing picks 2 experts, not {top_k}")
        return _sparsemixer(logits.float(), jitter_eps)
    raise ValueError(f"unknown MoE routing {routing!r}; known: {', '.join(ROUTINGS)}")


def _sparsemixer(scores: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's `sparsemixer` with training=False: two rounds of (best expert, its weight)."""
    weights, ids = [], []
    masked = scores
    for _ in range(2):
        top, idx = masked.max(dim=-1, keepdim=True)
        factor = scores.abs().clamp(min=top)
        gates = masked.masked_fill((top - scores) / factor > 2 * eps, float("-inf"))
        weights.append(torch.softmax(gates, dim=-1).gather(-1, idx))
        ids.append(idx)
        masked = scores.scatter(-1, idx, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)


class StackedWeight(nn.Module):
    """One parameter `weight` [num_experts, out, in]: every expert's matrix of one projection."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))


def experts_forward(
    x, w13, w2, weights, ids, act: str, use_kernels: bool, linear=F.linear
) -> torch.Tensor:
    """The experts' weighted sum for each token: the Triton grouped GEMM when `use_kernels`,
    else its torch reference (kernels/fused_moe.py), whose matmuls are `linear` (per-expert
    packed weights on CPU)."""
    if use_kernels:
        return fused_moe(x, w13, w2, weights, ids, act)
    return fused_moe_reference(x, w13, w2, weights, ids, act, linear)

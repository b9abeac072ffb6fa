"""Log-probabilities reported with tokens: of each sampled token, of each prompt token, and of
the top-k alternatives at each position.

They are the model's own distribution (log-softmax of the raw logits, vLLM's default
`logprobs_mode`), before penalties, temperature or truncation: what a client compares across
requests and what `best_of` ranks by.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .ops import block_topk, row_logsumexp

__all__ = [
    "PendingLogprobs",
    "TokenLogprob",
    "finish_logprobs",
    "prepare_logprobs",
    "prompt_logprobs",
]

# Prompt positions turned into logits at once: bounds the [chunk, vocab] temporaries.
PROMPT_CHUNK = 256


@dataclass(slots=True)
class TokenLogprob:
    """One position: the token there, its logprob, its rank (1 = most likely; None when it is
    not among the top tokens computed and the rank was not needed), and the top tokens."""

    token_id: int
    logprob: float
    rank: int | None
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class PendingLogprobs:
    """What `prepare_logprobs` keeps for `finish_logprobs`."""

    raw: torch.Tensor  # [rows, V] raw logits of the rows that asked
    lse: torch.Tensor  # [rows] their log-normaliser
    rows: torch.Tensor
    top_values: list[list[float]] | None
    top_ids: list[list[int]] | None


# Sampled-token logprobs come in two steps around the draw: the normaliser and the top-k before
# the sampler changes the logits in place, the sampled token's logprob after. Only the
# log-normaliser is needed (logprob = logit - lse), never a full log_softmax.


def prepare_logprobs(logits: torch.Tensor, rows: list[int], k: int, copy: bool) -> PendingLogprobs:
    """Normaliser and top-k of `rows` of the raw logits. `copy`: the sampler will change
    `logits` in place, so keep the raw rows."""
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    if len(rows) == logits.shape[0]:
        raw = logits.clone() if copy else logits
    else:
        raw = logits.index_select(0, index)
    lse = row_logsumexp(raw)
    top_values = top_ids = None
    if k > 0:
        values, ids = block_topk(raw, k)
        top_values, top_ids = (values - lse.unsqueeze(1)).tolist(), ids.tolist()
    return PendingLogprobs(raw, lse, index, top_values, top_ids)


def finish_logprobs(
    pending: PendingLogprobs,
    tokens: torch.Tensor,
    token_list: list[int],
    rows: list[int],
    top_counts: list[int],
    num_rows: int,
) -> list[TokenLogprob | None]:
    """Per batch row (None where not asked): the sampled token's logprob, its rank when it is
    among the top k, and the top k."""
    chosen = tokens.index_select(0, pending.rows).unsqueeze(1)
    values = (pending.raw.gather(1, chosen).squeeze(1) - pending.lse).tolist()
    out: list[TokenLogprob | None] = [None] * num_rows
    for j, (row, k) in enumerate(zip(rows, top_counts)):
        ids = pending.top_ids[j][:k] if k else []
        vals = pending.top_values[j][:k] if k else []
        token = token_list[row]
        rank = ids.index(token) + 1 if token in ids else None
        out[row] = TokenLogprob(token, values[j], rank, ids, vals)
    return out


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: list[int],
    k: int,
) -> list[TokenLogprob]:
    """Logprobs of `targets[i]` under the logits of `hidden[i]` (the position before it), with
    its rank and the top k, computed PROMPT_CHUNK positions at a time. A tensor-parallel rank
    other than 0 gets None from `compute_logits` (it took part in the gather): nothing to score."""
    out: list[TokenLogprob] = []
    device = hidden.device
    for start in range(0, len(targets), PROMPT_CHUNK):
        h = hidden[start : start + PROMPT_CHUNK]
        tgt = torch.tensor(targets[start : start + PROMPT_CHUNK], dtype=torch.int64, device=device)
        logits = compute_logits(h)
        if logits is None:
            continue
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        chosen = log_probs.gather(1, tgt.unsqueeze(1))
        ranks = ((log_probs > chosen).sum(dim=-1) + 1).tolist()
        values = chosen.squeeze(1).tolist()
        if k > 0:
            top = log_probs.topk(k, dim=-1)
            top_vals, top_ids = top.values.tolist(), top.indices.tolist()
        else:
            top_vals = top_ids = [[] for _ in values]
        ids = tgt.tolist()
        for j in range(len(values)):
            out.append(TokenLogprob(ids[j], values[j], ranks[j], top_ids[j], top_vals[j]))
    return out

"""Verifying speculative drafts of requests that sample (issue 40, item 2): rejection sampling
that keeps every sampling parameter's meaning and a seed's output.

A request with k drafts d_0 .. d_{k-1} has k + 1 rows of logits from the verifying pass; row j
scores the position after d_0 .. d_{j-1}. Each row is sampled by the ordinary sampler with the
request's state as it would be had those drafts been accepted (`RequestSamplingState.ahead`:
the repetition, frequency and presence penalties count them; min_tokens counts them), so row j's
distribution p_j is exactly the one plain decoding would draw from at that position: logit_bias,
allowed_token_ids, penalties, temperature, top-k/top-p/min-p and the other truncations, all
applied by the same code.

The draft proposers here are deterministic (q is one-hot on d_j), for which rejection sampling
reads: accept d_j with probability p_j(d_j); on reject draw from the residual max(p_j - q, 0)
renormalised, which is p_j without d_j; after k accepted drafts draw one more from p_k. We draw
it with one uniform u_j per row: y_j = the sampler's inverse-CDF draw from p_j at u_j, accept d_j
when y_j == d_j (probability p_j(d_j)), and on reject emit y_j, which is then distributed as p_j
given y_j != d_j: the residual. So the tokens kept are y_0 .. y_a, a the first row whose draw is
not its draft (or k), each y_j the very draw plain decoding makes from p_j with u_j.

Seeds: a seeded request draws u_j from its own generator, one uniform per emitted token in
order, as plain decoding does; the uniforms of rows past the kept run are given back (the
generator is rewound to just after the kept ones). So a seeded request's output does not depend
on what was proposed, nor on the batch: it is the output of plain seeded decoding, up to the
rounding of the verifying pass's logits (several query rows in one pass instead of one per
step), which can move a draw that lies within rounding of a boundary of the inverse CDF.

Guided decoding: a request with a grammar gets its mask at each draft row from its matcher
advanced through the drafts before that row, and the matcher is rolled back afterwards (the
step's update advances it by the tokens kept). A draft the grammar refuses cannot be drawn at
its row, so the rows after it are left unmasked: their draws are never kept.

Logprobs are the sampler's, per row: the raw logprobs of each kept token at its position, as
plain decoding reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..request import Request
from .logprobs import TokenLogprob
from .sampler import Sampler, SamplingBatch
from .structured.bitmask import allocate_bitmask

__all__ = ["DraftRun", "accept_run", "verify_sampled"]


@dataclass
class DraftRun:
    """One request's drafts in a verifying step (its rows are 1 + len(drafts))."""

    request: Request
    drafts: list[int]


@dataclass
class _DraftRow:
    """What SamplingBatch.build reads of a request, for one of its draft rows."""

    sampling: object  # the RequestSamplingState with the drafts before the row counted
    output_token_ids: range  # only its length is read (min_tokens)
    grammar: _GrammarAt | None = None
    grammar_open: bool = False


@dataclass
class _GrammarAt:
    """A grammar's completeness at a draft row (what SamplingBatch.build asks of it)."""

    completed: bool

    def is_completed(self) -> bool:
        return self.completed


def _grammar_masks(
    run: DraftRun, rows: list[_DraftRow], masks: torch.Tensor, first: int, mask_rows: list[int]
) -> None:
    """Each draft row's grammar mask: the matcher advanced through the drafts before the row,
    then rolled back to where it was (the step's update advances it by the kept tokens). A
    draft the grammar refuses ends the masked rows: its row's mask excludes it, so the draws of
    the rows after it are never kept."""
    grammar = run.request.grammar
    advanced = 0
    try:
        for j, row in enumerate(rows):
            grammar.fill_bitmask(masks, first + j)
            mask_rows.append(first + j)
            row.grammar, row.grammar_open = _GrammarAt(grammar.is_completed()), True
            if j == len(run.drafts) or grammar.is_terminated():
                break
            if not grammar.accept_token(run.drafts[j]):
                break
            advanced += 1
    finally:
        grammar.rollback(advanced)


def accept_run(drafts: list[int], drawn: list[int]) -> list[int]:
    """The tokens a verified run keeps: the draws up to and including the first that is not
    its row's draft (all of them when every draft matches). len(drawn) == len(drafts) + 1."""
    a = 0
    while a < len(drafts) and drafts[a] == drawn[a]:
        a += 1
    return drawn[: a + 1]


def verify_sampled(
    sampler: Sampler,
    logits: torch.Tensor,
    runs: list[DraftRun],
    vocab_size: int,
    device: torch.device,
) -> list[tuple[list[int], list[TokenLogprob | None] | None]]:
    """Per run, the tokens it keeps and their logprobs (None where not asked). `logits`:
    [sum(1 + len(drafts)), V], each run's rows in order; modified in place."""
    rows: list[_DraftRow] = []
    masks = None
    mask_rows: list[int] = []
    for run in runs:
        state = run.request.sampling
        n = len(run.request.output_token_ids)
        first = len(rows)
        rows.append(_DraftRow(state, range(n)))
        for j, tok in enumerate(run.drafts):
            state = state.ahead([tok])
            rows.append(_DraftRow(state, range(n + j + 1)))
        if run.request.grammar is not None:
            if masks is None:
                masks = allocate_bitmask(sum(len(r.drafts) + 1 for r in runs), vocab_size)
            _grammar_masks(run, rows[first:], masks, first, mask_rows)
    batch = SamplingBatch.build(rows, vocab_size, device)
    if mask_rows:
        batch.set_grammar(masks, mask_rows)
    generators = [run.request.sampling.generator for run in runs]
    saved = [None if g is None else g.get_state() for g in generators]
    out = sampler(logits, batch)
    results = []
    first = 0
    for run, g, state in zip(runs, generators, saved):
        count = len(run.drafts) + 1
        kept = accept_run(run.drafts, out.token_ids[first : first + count])
        lps = out.logprobs[first : first + len(kept)] if out.logprobs else None
        if lps is not None and all(lp is None for lp in lps):
            lps = None
        if g is not None and run.request.sampling.mode != "greedy" and len(kept) < count:
            # Give back the uniforms of the rows past the kept run (greedy rows draw none).
            g.set_state(state)
            for _ in kept:
                torch.rand(1, generator=g)
        results.append((kept, lps))
        first += count
    return results

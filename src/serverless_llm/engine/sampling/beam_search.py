"""Beam search as transformers runs it (`generate(num_beams=w, do_sample=False)`), one step at a
time, so the engine can drive it with the logprobs its sampler already computes.

Each step every live beam offers its most likely next tokens (raw log-softmax, the engine's
logprobs); the search keeps transformers' rules exactly:

- candidates are the K = max(2, 1 + #stop ids) * w best (beam, token) pairs by cumulative
  logprob, where the stop ids are EOS (unless ignore_eos) and stop_token_ids; K > w leaves at
  least w candidates that do not end, so w beams always run on;
- the w best candidates that do not end become the next beams (the search starts from the prompt
  alone, which is transformers' first beam; its others start at -1e9 and never win);
- a candidate that ends (a stop id, or the last allowed token) becomes a finished hypothesis only
  when it is among the w best candidates; its score is the cumulative logprob divided by
  (generated tokens, the stop token included) ** length_penalty; the w best hypotheses are kept;
- the search stops at max_tokens, or, once w hypotheses are kept, when `early_stopping` is True,
  or when the best running beam cannot beat the worst kept hypothesis: its cumulative logprob
  divided by (tokens generated so far) ** length_penalty (False and True), or by max_tokens **
  length_penalty when early_stopping is "never" and length_penalty > 0;
- min_tokens masks the stop ids (-inf) while fewer tokens are out, as `min_new_tokens` does.

The arithmetic is float32 through torch, as in transformers, so scores and comparisons round
the same way. The results are the n best hypotheses, best first (`num_return_sequences`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .logprobs import TokenLogprob
from .params import SamplingParams

if TYPE_CHECKING:
    from ..stop_rule import StopRule

__all__ = [
    "Beam",
    "BeamSearch",
    "BeamSearchParams",
    "Hypothesis",
    "length_factor",
    "num_candidates",
]


def length_factor(length: int, length_penalty: float) -> float:
    """length ** length_penalty, what a score is divided by. A penalty so large that the power
    overflows a float gives inf (every score divides down to 0, the limit) instead of raising
    OverflowError: length_penalty has no upper bound, as in vLLM and transformers."""
    try:
        return float(length) ** length_penalty
    except OverflowError:
        return math.inf


def num_candidates(width: int, num_stop_ids: int) -> int:
    """transformers' `beams_to_keep`: enough candidates that w of them do not end."""
    return max(2, 1 + num_stop_ids) * width


@dataclass(kw_only=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams` (for `LLM.beam_search`), plus transformers' early_stopping.
    Checked as the SamplingParams they become."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            use_beam_search=True,
            n=self.beam_width,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            early_stopping=self.early_stopping,
        )


@dataclass(slots=True)
class Beam:
    """A running beam: its output so far and its cumulative logprob (float32, as transformers
    accumulates it)."""

    token_ids: list[int]
    score: float
    logprobs: list[TokenLogprob] | None = None  # when the request asked for logprobs
    parent: int = 0  # index of the beam it extends, among the previous step's live beams


@dataclass(slots=True)
class Hypothesis:
    """A finished sequence: `score` is the length-penalised one the search ranks by."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop" or "length"
    stop_reason: int | None  # the stop token id; None for EOS and for length
    logprobs: list[TokenLogprob] | None = None


class BeamSearch:
    """The state of one prompt's search. `step` takes each live beam's top tokens and returns
    whether the search is over; `live` are the beams to run next, `best(n)` the results."""

    def __init__(
        self,
        *,
        width: int,
        stop_rule: StopRule,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        logprobs: int | None = None,
    ) -> None:
        """`stop_rule`: which tokens end a hypothesis, and its most output tokens (its
        max_output must be set). `logprobs`: top tokens to report per output token (None: keep
        no logprobs)."""
        assert stop_rule.max_output is not None, "a beam search needs a length limit"
        self.width = width
        self.rule = stop_rule
        self.max_new_tokens = stop_rule.max_output
        self.stop_ids = stop_rule.stop_ids
        self.min_tokens = stop_rule.min_tokens
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.top_logprobs = logprobs
        self.num_candidates = num_candidates(width, len(self.stop_ids))
        self.live: list[Beam] = [Beam([], 0.0, [] if logprobs is not None else None)]
        self.finished: list[Hypothesis] = []  # the w best, best first
        self.num_generated = 0
        self.done = False

    @property
    def tokens_per_beam(self) -> int:
        """How many top tokens each beam must offer per step: K, plus the stop ids when
        min_tokens may mask them, and at least the logprobs asked for."""
        k = self.num_candidates + (len(self.stop_ids) if self.min_tokens > 0 else 0)
        return max(k, self.top_logprobs or 0)

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]

    def step(self, tops: Sequence[TokenLogprob]) -> bool:
        """One step: `tops[b]` holds live beam b's top tokens (ids and raw logprobs, most likely
        first). Updates the beams and hypotheses; returns True when the search is over."""
        assert not self.done and len(tops) == len(self.live)
        g = self.num_generated + 1  # output length of every candidate
        masked = self.rule.masked_ids(self.num_generated)
        parents: list[int] = []
        ranks: list[int] = []
        tokens: list[int] = []
        values: list[float] = []
        for b, top in enumerate(tops):
            for r, (token, value) in enumerate(zip(top.top_ids, top.top_logprobs)):
                if token not in masked:
                    parents.append(b)
                    ranks.append(r)
                    tokens.append(token)
                    values.append(value)
        scores = torch.tensor([beam.score for beam in self.live], dtype=torch.float32)
        acc = torch.tensor(values, dtype=torch.float32) + scores[torch.tensor(parents)]
        # Sorted best first; ties keep beam order, then rank order (transformers' flat index).
        order = torch.sort(acc, descending=True, stable=True).indices[: self.num_candidates]
        order_list = order.tolist()
        acc_list = acc.tolist()
        ends = [self.rule.check(tokens[i], g) is not None for i in order_list]

        new_live: list[Beam] = []
        for pos, i in enumerate(order_list):
            if not ends[pos] and len(new_live) < self.width:
                new_live.append(self._extend(parents[i], ranks[i], tops, acc_list[i]))

        eligible = [pos for pos in range(min(self.width, len(order_list))) if ends[pos]]
        if eligible:
            lp = self.length_penalty
            chosen = order[torch.tensor(eligible)]
            penalised = (acc[chosen] / length_factor(g, lp)).tolist()
            added = []
            for pos, score in zip(eligible, penalised):
                i = order_list[pos]
                beam = self._extend(parents[i], ranks[i], tops, acc_list[i])
                added.append(self._hypothesis(beam, score))
            # Kept hypotheses first, so a tie keeps the older one (transformers' concatenation).
            merged = sorted(self.finished + added, key=lambda h: -h.score)
            self.finished = merged[: self.width]

        self.num_generated = g
        self.live = new_live
        self.done = all(ends) or self._cannot_improve()
        if not self.done and self.early_stopping is True:
            self.done = len(self.finished) == self.width
        return self.done

    # -- helpers ----------------------------------------------------------------------------

    def _extend(self, parent: int, rank: int, tops: Sequence[TokenLogprob], score: float) -> Beam:
        beam = self.live[parent]
        top = tops[parent]
        token = top.top_ids[rank]
        logprobs = None
        if beam.logprobs is not None:
            k = self.top_logprobs or 0
            entry = TokenLogprob(
                token, top.top_logprobs[rank], rank + 1, top.top_ids[:k], top.top_logprobs[:k]
            )
            logprobs = [*beam.logprobs, entry]
        return Beam([*beam.token_ids, token], score, logprobs, parent)

    def _hypothesis(self, beam: Beam, score: float) -> Hypothesis:
        stop = self.rule.check(beam.token_ids[-1], len(beam.token_ids))
        return Hypothesis(
            beam.token_ids, beam.score, score, stop.reason.value, stop.stop_reason, beam.logprobs
        )

    def _cannot_improve(self) -> bool:
        """transformers' early-stop heuristic: with w hypotheses kept, can the best running beam
        still beat the worst of them?"""
        if len(self.finished) < self.width or not self.live:
            return False
        lp = self.length_penalty
        if self.early_stopping == "never" and lp > 0.0:
            length = self.max_new_tokens
        else:
            length = self.num_generated
        best = torch.tensor([self.live[0].score], dtype=torch.float32) / length_factor(length, lp)
        worst = torch.tensor([self.finished[-1].score], dtype=torch.float32)
        return not bool(best[0] > worst[0])

"""The one stop rule: when a request's output ends, and why (vLLM's rules).

Everything that needs to know which tokens end a request reads it here: the step's update
(`StopRule.check`, for every appended token, one or several per step), the output's text path
(a stop string found in the released text goes through `check` too), beam search (which
candidates end a hypothesis), the min_tokens mask (`masked_ids`) and the request check that
min_tokens leaves something to sample.

The rule, in order:
- once `min_tokens` are out, EOS (unless ignore_eos) or a stop token id ends the request with
  "stop"; the token itself is the stop, so its text is not output (unless
  include_stop_str_in_output); before that they are masked, so they cannot be sampled;
- a stop string in the text (once `min_tokens` are out) ends it with "stop";
- reaching the most output tokens it may have (max_tokens, or what max_model_len leaves) ends it
  with "length".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .request import FinishReason
from .sampling.params import SamplingParams


@dataclass(frozen=True, slots=True)
class Stop:
    reason: FinishReason
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS, length
    by_token: bool = False  # the token itself stopped the request: its text is not output


@dataclass(frozen=True, slots=True)
class StopRule:
    eos_ids: frozenset[int]  # empty with ignore_eos
    stop_token_ids: frozenset[int]
    min_tokens: int = 0
    max_output: int | None = None  # the most output tokens; None: no limit here

    @classmethod
    def of(
        cls, params: SamplingParams, eos_token_ids: Iterable[int], max_output: int | None
    ) -> StopRule:
        return cls(
            frozenset() if params.ignore_eos else frozenset(eos_token_ids),
            frozenset(params.stop_token_ids),
            params.min_tokens,
            max_output,
        )

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every token id that ends the output (once min_tokens are out)."""
        return self.eos_ids | self.stop_token_ids

    def masked_ids(self, num_output: int) -> frozenset[int]:
        """The ids that may not be sampled after `num_output` output tokens."""
        return self.stop_ids if num_output < self.min_tokens else frozenset()

    def strings_active(self, num_output: int) -> bool:
        """Whether a stop string in the text ends the output after `num_output` tokens."""
        return num_output >= self.min_tokens

    def check(self, token: int, num_output: int, stop_string: str | None = None) -> Stop | None:
        """The verdict after output token number `num_output` (counting it) is `token`, and
        `stop_string` was found in the text it released (None: none, or not looked for)."""
        if num_output >= self.min_tokens:
            if token in self.eos_ids:
                return Stop(FinishReason.STOP, None, by_token=True)
            if token in self.stop_token_ids:
                return Stop(FinishReason.STOP, token, by_token=True)
        if stop_string is not None:
            return Stop(FinishReason.STOP, stop_string)
        if self.max_output is not None and num_output >= self.max_output:
            return Stop(FinishReason.LENGTH)
        return None

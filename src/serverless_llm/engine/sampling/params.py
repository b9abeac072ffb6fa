"""Sampling parameters of one request, validated on construction.

Names and defaults follow vLLM's `SamplingParams`, so users moving over find what they know.
This is the minimal set of the engine core; the sampler is written so each new parameter adds
a tensor to `SamplingBatch` and one transform, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the parameter and the range."""


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to max_model_len
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means off
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int)
            or isinstance(self.max_tokens, bool)
            or self.max_tokens < 1
        ):
            raise SamplingParamsError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
            )
        if self.temperature < 0.0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise SamplingParamsError(
                f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}"
            )
        if self.top_k == 0:
            self.top_k = -1
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
        ):
            raise SamplingParamsError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
            )
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

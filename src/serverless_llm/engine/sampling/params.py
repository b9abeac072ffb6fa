"""Sampling parameters of one request, validated on construction.

Names, defaults and meanings follow vLLM's `SamplingParams`, plus Aphrodite's extra samplers
(top_a, tfs, eta_cutoff, epsilon_cutoff, typical_p, smoothing_factor, smoothing_curve), so users
moving over find what they know. Every check names the parameter and the allowed range.

The engine runs one sequence per request: `n` and `best_of` are honoured by whoever fans a
prompt out into requests (`LLM.generate`, the API layers), with `sequence_params`. Beam search
is the exception: one request runs all its beams (see beam_search.py, and the engine's beam_runner.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from ..errors import SamplingParamsError, StructuredOutputError
from .structured.spec import StructuredOutputSpec

T = TypeVar("T")

# vLLM's default --max-logprobs: the most top tokens a request may ask for per position.
MAX_LOGPROBS = 20
# OpenAI's (and vLLM's) range for logit_bias values.
LOGIT_BIAS_LIMIT = 100.0
# Below this a temperature means greedy, as in vLLM.
GREEDY_EPS = 1e-5
# Beam search ranks by the model's own logprobs, so greedy is the only temperature it takes;
# the routes give it to a beam search request that leaves temperature unset.
BEAM_SEARCH_TEMPERATURE = 0.0
# Parameters beam search cannot honour: each must keep its default, the value that means "not
# used" (vLLM refuses top_p and top_k; the others would be just as silently ignored).
_BEAM_SEARCH_UNUSED = (
    "top_p",
    "top_k",
    "min_p",
    "top_a",
    "tfs",
    "eta_cutoff",
    "epsilon_cutoff",
    "typical_p",
    "smoothing_factor",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "stop",
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


@dataclass(kw_only=True)
class SamplingParams:
    """See docs/sampling.md for each parameter's exact definition and the order they apply in."""

    n: int = 1
    best_of: int | None = None  # None: n; otherwise generate best_of, return the n most likely
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means off
    min_p: float = 0.0
    top_a: float = 0.0
    tfs: float = 1.0
    eta_cutoff: float = 0.0  # in units of 1e-4, as in Aphrodite
    epsilon_cutoff: float = 0.0  # in units of 1e-4, as in Aphrodite
    typical_p: float = 1.0
    smoothing_factor: float = 0.0
    smoothing_curve: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top tokens per generated token (the sampled one always)
    prompt_logprobs: int | None = None  # top tokens per prompt token
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens
    # Beam search (vLLM's older names): best_of (else n) beams, the n best returned.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"
    # Structured output (vLLM's names; see docs/structured_output.md). At most one constraint:
    # the guided_* fields, OpenAI's response_format, or vLLM's structured_outputs /
    # guided_decoding (a dict, a StructuredOutputsParams, or a ready StructuredOutputSpec).
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_decoding: Any = None
    # The constraint starts once the output contains these token ids (a reasoning model's end
    # of thinking, `</think>`): what comes before is free. Empty: from the first token.
    structured_after: tuple[int, ...] = ()
    # The validated constraint the fields above ask for (None: free text). Derived.
    structured: StructuredOutputSpec | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_structured()
        self._check_counts()
        self._check_sampling()
        self._check_stops()
        self._check_token_params()
        self._check_beam_search()

    # -- validation -------------------------------------------------------------------------

    def _check_structured(self) -> None:
        after = self.structured_after
        if not isinstance(after, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in after
        ):
            raise SamplingParamsError(
                "structured_after must be a tuple of token ids", "structured_after"
            )
        so, gd = self.structured_outputs, self.guided_decoding
        if isinstance(so, StructuredOutputsParams):
            so = so.to_dict()
        if isinstance(gd, StructuredOutputsParams):
            gd = gd.to_dict()
        fields = dict(
            guided_json=self.guided_json,
            guided_regex=self.guided_regex,
            guided_choice=self.guided_choice,
            guided_grammar=self.guided_grammar,
            guided_whitespace_pattern=self.guided_whitespace_pattern,
            guided_decoding_backend=self.guided_decoding_backend,
            response_format=self.response_format,
            guided_decoding=gd,
        )
        try:
            if isinstance(so, StructuredOutputSpec):
                given = [k for k, v in fields.items() if v is not None]
                given = [k for k in given if k != "guided_decoding_backend"]
                if given:
                    raise StructuredOutputError(
                        f"only one structured output constraint may be given, got "
                        f"structured_outputs and {given[0]}",
                        given[0],
                    )
                self.structured = so
            else:
                self.structured = StructuredOutputSpec.from_request(**fields, structured_outputs=so)
        except StructuredOutputError as e:
            message = str(e) if e.param in str(e) else f"{e.param}: {e}"
            raise SamplingParamsError(message, e.param) from None

    def _check_counts(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise SamplingParamsError(f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise SamplingParamsError(
                f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}"
            )
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise SamplingParamsError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise SamplingParamsError(
                f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise SamplingParamsError(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or t < 1):
            raise SamplingParamsError(f"truncate_prompt_tokens must be an integer >= 1, got {t!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise SamplingParamsError(f"seed must be an integer, got {self.seed!r}")

    def _check_sampling(self) -> None:
        # (name, lowest, lowest allowed?, highest, highest allowed?) for the float parameters.
        ranges = (
            ("presence_penalty", -2.0, True, 2.0, True),
            ("frequency_penalty", -2.0, True, 2.0, True),
            ("repetition_penalty", 0.0, False, math.inf, False),
            ("temperature", 0.0, True, math.inf, False),
            ("top_p", 0.0, False, 1.0, True),
            ("min_p", 0.0, True, 1.0, True),
            ("top_a", 0.0, True, math.inf, False),
            ("tfs", 0.0, False, 1.0, True),
            ("eta_cutoff", 0.0, True, math.inf, False),
            ("epsilon_cutoff", 0.0, True, 1000.0, True),
            ("typical_p", 0.0, False, 1.0, True),
            ("smoothing_factor", 0.0, True, math.inf, False),
            ("smoothing_curve", 1.0, True, math.inf, False),
        )
        for name, lo, lo_in, hi, hi_in in ranges:
            value = getattr(self, name)
            ok = _is_real(value) and (value >= lo if lo_in else value > lo)
            ok = ok and (value <= hi if hi_in else value < hi)
            if not ok:
                left = "[" if lo_in else "("
                right = "]" if hi_in and hi != math.inf else ")"
                top = "inf" if hi == math.inf else f"{hi:g}"
                raise SamplingParamsError(
                    f"{name} must be a number in {left}{lo:g}, {top}{right}, got {value!r}"
                )
            setattr(self, name, float(value))
        if not _is_int(self.top_k) or self.top_k < -1:
            raise SamplingParamsError(
                f"top_k must be -1 or 0 (off) or an integer >= 1, got {self.top_k!r}"
            )
        if self.top_k == 0:
            self.top_k = -1

    def _check_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise SamplingParamsError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(not s for s in stop):
            raise SamplingParamsError("stop must not contain an empty string")
        self.stop = list(dict.fromkeys(stop))
        ids = self.stop_token_ids if self.stop_token_ids is not None else []
        if not isinstance(ids, (list, tuple)) or any(not _is_int(t) or t < 0 for t in ids):
            raise SamplingParamsError(
                f"stop_token_ids must be a list of non-negative integers, got {ids!r}"
            )
        self.stop_token_ids = list(ids)

    def _check_token_params(self) -> None:
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise SamplingParamsError(
                    f"logit_bias must map token ids to numbers, got {type(bias).__name__}"
                )
            parsed: dict[int, float] = {}
            for key, value in bias.items():
                try:
                    token = int(key)
                except (TypeError, ValueError):
                    token = -1
                if token < 0 or isinstance(key, (bool, float)):
                    raise SamplingParamsError(
                        f"logit_bias keys must be token ids (integers >= 0), got {key!r}"
                    )
                if not _is_real(value) or abs(value) > LOGIT_BIAS_LIMIT:
                    raise SamplingParamsError(
                        f"logit_bias values must be numbers in [-100, 100], got {value!r} "
                        f"for token {key}"
                    )
                parsed[token] = float(value)
            self.logit_bias = parsed or None
        allowed = self.allowed_token_ids
        if allowed is not None:
            if (
                not isinstance(allowed, (list, tuple))
                or not allowed
                or any(not _is_int(t) or t < 0 for t in allowed)
            ):
                raise SamplingParamsError(
                    "allowed_token_ids must be a non-empty list of non-negative integers, "
                    f"got {allowed!r}"
                )
            self.allowed_token_ids = list(dict.fromkeys(allowed))

    def _check_beam_search(self) -> None:
        """vLLM's rules: length_penalty and early_stopping mean nothing without beam search, and
        beam search ranks by the model's own logprobs, so any parameter that would change the
        distribution is refused rather than silently ignored."""
        if not isinstance(self.use_beam_search, bool):
            raise SamplingParamsError(
                f"use_beam_search must be a boolean, got {self.use_beam_search!r}"
            )
        if not _is_real(self.length_penalty):
            raise SamplingParamsError(
                f"length_penalty must be a finite number, got {self.length_penalty!r}"
            )
        self.length_penalty = float(self.length_penalty)
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise SamplingParamsError(
                f"early_stopping must be true, false or 'never', got {self.early_stopping!r}"
            )
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise SamplingParamsError(
                    "length_penalty is not effective and must be the default value of 1.0 "
                    "when not using beam search"
                )
            if self.early_stopping is not False:
                raise SamplingParamsError(
                    "early_stopping is not effective and must be false when not using beam search"
                )
            return
        if self.structured is not None:
            raise SamplingParamsError(
                f"{self.structured.param} is not supported with beam search (use sampling, "
                "n or best_of, for structured output)",
                self.structured.param,
            )
        if not self.greedy:
            raise SamplingParamsError(
                f"temperature must be 0 when using beam search, got {self.temperature:g}"
            )
        for name in _BEAM_SEARCH_UNUSED:
            value, neutral = getattr(self, name), SAMPLING_DEFAULTS[name]
            if value != neutral and not (neutral is None and not value):
                shown = "unset" if neutral is None else neutral
                raise SamplingParamsError(
                    f"{name} must be {shown} when using beam search (beam search ranks by the "
                    f"model's own logprobs), got {value!r}",
                    name,
                )

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids given as parameters must exist in the model's vocabulary."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("logit_bias", list(self.logit_bias or ())),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise SamplingParamsError(
                    f"{name}: token id {bad[0]} is out of range (the vocabulary has "
                    f"{vocab_size} tokens: ids 0 to {vocab_size - 1})",
                    name,
                )

    # -- derived ----------------------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def num_sequences(self) -> int:
        """How many sequences a prompt runs: best_of when given, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def ranks_by_logprob(self) -> bool:
        """Whether the n results are picked from more candidates by cumulative logprob (beam
        search picks its own, by length-penalised score)."""
        return self.num_sequences > self.n and not self.use_beam_search

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def truncates(self) -> bool:
        """Whether any sampler removes tokens (so sampling draws from a truncated set)."""
        return (
            self.top_k > 0
            or self.top_p < 1.0
            or self.min_p > 0.0
            or self.top_a > 0.0
            or self.tfs < 1.0
            or self.eta_cutoff > 0.0
            or self.epsilon_cutoff > 0.0
            or self.typical_p < 1.0
        )


# Each parameter's default, read from the dataclass above: the routes fill the fields a request
# leaves unset from here and restate none, so a default changed above changes on every route.
SAMPLING_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        f.name: f.default
        for f in dataclasses.fields(SamplingParams)
        if f.init and f.default is not dataclasses.MISSING
    }
)


@dataclass
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams` (and, as `GuidedDecodingParams`, its older name): one
    constraint for `SamplingParams(structured_outputs=...)`."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, False)}


GuidedDecodingParams = StructuredOutputsParams


def sequence_params(
    params: SamplingParams, prompt_logprobs_once: bool = True
) -> list[SamplingParams]:
    """One engine request's parameters per sequence of a prompt (best_of of them, else n; one
    for beam search, whose request returns its n sequences together).

    Sequence i samples with seed + i (vLLM's rule), so seeded sequences differ from each other
    and the whole result is reproducible; seeds wrap into torch's range. When best_of > n, every
    sequence tracks its cumulative logprob (logprobs=0 if none were asked for) so the best n can
    be picked; callers hide logprobs nobody asked for. Only the first sequence computes
    prompt_logprobs, unless `prompt_logprobs_once` is False (each streamed choice needs them).
    """
    if params.use_beam_search:
        return [params]  # one engine request runs every beam
    count = params.num_sequences
    base = dataclasses.replace(params, n=1, best_of=None)
    if params.ranks_by_logprob and base.logprobs is None:
        base = dataclasses.replace(base, logprobs=0)
    if count == 1:
        return [base]
    # The prompt is the same for every sequence: its logprobs are computed once, by the first.
    rest = base
    if base.prompt_logprobs is not None and prompt_logprobs_once:
        rest = dataclasses.replace(base, prompt_logprobs=None)
    out = [base]
    for i in range(1, count):
        if params.seed is None:
            out.append(rest)
            continue
        seed = params.seed + i
        if seed > 2**64 - 1:
            seed -= 2**64
        out.append(dataclasses.replace(rest, seed=seed))
    return out


def choose_sequences(
    results: Sequence[T], cumulative_logprob: Callable[[T], float | None], params: SamplingParams
) -> list[T]:
    """The results of one prompt's sequences to return: all of them in order, or, when
    best_of > n, the n with the highest cumulative logprob, best first (ties keep the earlier
    sequence first, so the choice is deterministic)."""
    if not params.ranks_by_logprob:
        return list(results)

    def key(i: int) -> tuple[float, int]:
        value = cumulative_logprob(results[i])
        return (math.inf if value is None else -value, i)

    return [results[i] for i in sorted(range(len(results)), key=key)[: params.n]]

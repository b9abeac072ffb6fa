"""From a job's `sampling_params` dict (vLLM's names, and Aphrodite's extra samplers) to the
engine's SamplingParams.

The one place that knows which sampling parameters the native route honours. Every name is
declared in `VLLMSamplingParams` with its type and default (the engine's own, for the names
the engine has), so an ill-typed value is an error naming the parameter. A name the engine's
`SamplingParams` also has is passed through (and range-checked there); any other known name is
accepted at its default and refused otherwise ("'bad_words' is not supported yet"), never
ignored. A name neither vLLM nor Aphrodite has is an error ("unknown sampling parameter 'x'").
When the engine gains a parameter under that name, it passes through here without a change.
Every error is the engine's SamplingParamsError, naming the parameter.

`n` and `best_of` are carried in the SamplingParams; callers fan a prompt out into engine
requests with `sequence_params` (sequence i gets seed + i, as in vLLM). With `use_beam_search`,
an unset temperature means 0 (beam search refuses any other), so `{"use_beam_search": true,
"n": 3}` is enough.

`temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty` left out take the model's
defaults where it has them (`defaults`: its generation_config.json, as vLLM's
`--generation-config auto`), except under beam search, which takes none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine import (
    BEAM_SEARCH_TEMPERATURE,
    SAMPLING_DEFAULTS,
    SamplingParams,
    SamplingParamsError,
)
from .errors import describe_validation_error
from .json_types import WholeInt

__all__ = [
    "ParsedSampling",
    "VLLMSamplingParams",
    "build_sampling_params",
    "parse_sampling_params",
]

# The engine's defaults: a parameter the engine has defaults to the engine's value (restated
# nowhere here).
_D = SAMPLING_DEFAULTS


class VLLMSamplingParams(BaseModel):
    """vLLM's SamplingParams names (including the older beam-search ones and the guided-decoding
    extras users send on the native route) and Aphrodite's samplers, with their defaults. JSON
    types only: strict, so "0.5" is not a number and 1 is not a bool (a whole float such as 2.0
    is an integer, as JSON has it: api.json_types)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    # Honoured (n and best_of by fan-out; the rest by the engine's SamplingParams, which checks
    # the ranges).
    # Their upper bound is the endpoint's MAX_N (api.limits).
    n: WholeInt = Field(_D["n"], ge=1)
    best_of: WholeInt | None = Field(_D["best_of"], ge=1)
    max_tokens: WholeInt | None = None  # None: not given (the route's default, which may be capped)
    min_tokens: WholeInt = _D["min_tokens"]
    temperature: float = _D["temperature"]
    top_p: float = _D["top_p"]
    top_k: WholeInt = _D["top_k"]
    min_p: float = _D["min_p"]
    top_a: float = _D["top_a"]
    tfs: float = _D["tfs"]
    eta_cutoff: float = _D["eta_cutoff"]
    epsilon_cutoff: float = _D["epsilon_cutoff"]
    typical_p: float = _D["typical_p"]
    smoothing_factor: float = _D["smoothing_factor"]
    smoothing_curve: float = _D["smoothing_curve"]
    presence_penalty: float = _D["presence_penalty"]
    frequency_penalty: float = _D["frequency_penalty"]
    repetition_penalty: float = _D["repetition_penalty"]
    logit_bias: dict[str, float] | None = _D["logit_bias"]
    allowed_token_ids: list[WholeInt] | None = _D["allowed_token_ids"]
    seed: WholeInt | None = Field(_D["seed"], ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = _D["stop"]
    stop_token_ids: list[WholeInt] | None = None
    include_stop_str_in_output: bool = _D["include_stop_str_in_output"]
    ignore_eos: bool = _D["ignore_eos"]
    logprobs: WholeInt | None = _D["logprobs"]
    prompt_logprobs: WholeInt | None = _D["prompt_logprobs"]
    skip_special_tokens: bool = _D["skip_special_tokens"]
    spaces_between_special_tokens: bool = _D["spaces_between_special_tokens"]
    truncate_prompt_tokens: WholeInt | None = _D["truncate_prompt_tokens"]
    use_beam_search: bool = _D["use_beam_search"]
    length_penalty: float = _D["length_penalty"]
    early_stopping: bool | str = _D["early_stopping"]
    # Structured output (validated by the engine's SamplingParams; see structured_output.md).
    guided_decoding: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    response_format: dict[str, Any] | None = None
    # Names the engine does not honour yet: accepted at their defaults only.
    bad_words: list[str] | None = None
    detokenize: bool = True
    logits_processors: list[Any] | None = None
    extra_args: dict[str, Any] | None = None


@dataclass(frozen=True)
class ParsedSampling:
    params: SamplingParams  # n and best_of included
    n: int
    max_tokens_given: bool  # False: max_tokens is the caller's default (it may cap it)


def _engine_fields() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _is_default(name: str, value: Any) -> bool:
    """Whether `value` asks for nothing beyond vLLM's default (an empty list or dict is the
    same as none)."""
    default = VLLMSamplingParams.model_fields[name].default
    if value == default:
        return True
    return default is None and value in ("", [], {})


def parse_sampling_params(
    raw: Any, *, default_max_tokens: int, defaults: Mapping[str, Any] | None = None
) -> ParsedSampling:
    """Validates `raw` (a job's `sampling_params`) and builds the engine's parameters.
    `defaults`: the model's sampling defaults, for the parameters `raw` leaves out."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SamplingParamsError(
            f"sampling_params must be an object, got {type(raw).__name__}", "sampling_params"
        )
    unknown = [k for k in raw if k not in VLLMSamplingParams.model_fields]
    if unknown:
        raise SamplingParamsError(f"unknown sampling parameter '{unknown[0]}'", str(unknown[0]))
    try:
        parsed = VLLMSamplingParams.model_validate(raw)
    except ValidationError as e:
        path, message = describe_validation_error(e, prefix="sampling_params")
        name = path.removeprefix("sampling_params.").split(".")[0].split("[")[0]
        raise SamplingParamsError(message, name) from None

    given = parsed.model_fields_set
    engine_fields = _engine_fields()
    kwargs: dict[str, Any] = {}
    for name in VLLMSamplingParams.model_fields:
        if name not in given:
            continue
        value = getattr(parsed, name)
        if name not in engine_fields:
            if not _is_default(name, value):
                raise SamplingParamsError(f"'{name}' is not supported yet", name)
            continue
        if value is None and name != "max_tokens":
            continue  # the engine's own default
        if name == "stop" and isinstance(value, str):
            value = [value]
        kwargs[name] = value
    if parsed.use_beam_search and "temperature" not in given:
        kwargs["temperature"] = BEAM_SEARCH_TEMPERATURE
    if defaults and not parsed.use_beam_search:
        for name, value in defaults.items():
            kwargs.setdefault(name, value)
    max_tokens_given = "max_tokens" in given
    if not max_tokens_given:
        kwargs["max_tokens"] = default_max_tokens
    params = SamplingParams(**kwargs)  # SamplingParamsError naming the parameter
    return ParsedSampling(params=params, n=parsed.n, max_tokens_given=max_tokens_given)


def build_sampling_params(
    raw: Any, *, default_max_tokens: int, defaults: Mapping[str, Any] | None = None
) -> SamplingParams:
    """The engine's SamplingParams for `raw` (n and best_of included)."""
    return parse_sampling_params(
        raw, default_max_tokens=default_max_tokens, defaults=defaults
    ).params

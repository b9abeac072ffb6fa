"""From a job's `sampling_params` dict (vLLM's names) to the engine's SamplingParams.

The one place that knows which vLLM sampling parameters the engine honours. Every vLLM name is
declared in `VLLMSamplingParams` with its type and default, so an ill-typed value is an error
naming the parameter. A name the engine's `SamplingParams` also has is passed through; any other
vLLM name is accepted at its default and refused otherwise ("'min_p' is not supported yet"), never
ignored. A name vLLM does not have is an error ("unknown sampling parameter 'x'"). When the engine
gains a parameter under vLLM's name, it passes through here without a change.

`n` is not an engine parameter: callers fan out `n` engine requests (choice i gets seed + i, so
seeded choices differ, as in vLLM).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.sampling.params import SamplingParams, SamplingParamsError
from .errors import describe_validation_error

__all__ = [
    "MAX_N",
    "ParsedSampling",
    "SamplingParamError",
    "VLLMSamplingParams",
    "build_sampling_params",
    "parse_sampling_params",
]

# Most choices one request may ask for: each is a full engine request, so a huge n would
# monopolise the worker.
MAX_N = 128


class SamplingParamError(ValueError):
    """A sampling parameter is unknown, ill-typed, out of range or not supported yet; `param`
    names it and str() is the message for the client."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class VLLMSamplingParams(BaseModel):
    """vLLM's SamplingParams names (including the older beam-search ones and the guided-decoding
    extras users send on the native route), with vLLM's defaults. JSON types only: strict, so
    "0.5" is not a number and 1 is not a bool."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    # Honoured now (n by fan-out; the rest by the engine's SamplingParams).
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM names the engine does not honour yet: accepted at their defaults only.
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    guided_decoding: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    logits_processors: list[Any] | None = None
    extra_args: dict[str, Any] | None = None


# Handled by the caller, not by SamplingParams.
_CALLER_FIELDS = frozenset({"n", "best_of"})


@dataclass(frozen=True)
class ParsedSampling:
    params: SamplingParams
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


def parse_sampling_params(raw: Any, *, default_max_tokens: int) -> ParsedSampling:
    """Validates `raw` (a job's `sampling_params`) and builds the engine's parameters."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SamplingParamError(
            "sampling_params", f"sampling_params must be an object, got {type(raw).__name__}"
        )
    unknown = [k for k in raw if k not in VLLMSamplingParams.model_fields]
    if unknown:
        raise SamplingParamError(str(unknown[0]), f"unknown sampling parameter '{unknown[0]}'")
    try:
        parsed = VLLMSamplingParams.model_validate(raw)
    except ValidationError as e:
        path, message = describe_validation_error(e, prefix="sampling_params")
        name = path.removeprefix("sampling_params.").split(".")[0].split("[")[0]
        raise SamplingParamError(name, message) from None

    given = parsed.model_fields_set
    if parsed.best_of is not None and parsed.best_of != parsed.n:
        if parsed.best_of < parsed.n:
            raise SamplingParamError(
                "best_of", f"best_of must be >= n ({parsed.n}), got {parsed.best_of}"
            )
        raise SamplingParamError("best_of", "'best_of' is not supported yet")

    engine_fields = _engine_fields()
    kwargs: dict[str, Any] = {}
    for name in VLLMSamplingParams.model_fields:
        if name in _CALLER_FIELDS or name not in given:
            continue
        value = getattr(parsed, name)
        if name not in engine_fields:
            if not _is_default(name, value):
                raise SamplingParamError(name, f"'{name}' is not supported yet")
            continue
        if value is None and name != "max_tokens":
            continue  # the engine's own default
        if name == "stop" and isinstance(value, str):
            value = [value]
        kwargs[name] = value
    max_tokens_given = "max_tokens" in given
    if not max_tokens_given:
        kwargs["max_tokens"] = default_max_tokens
    try:
        params = SamplingParams(**kwargs)
    except SamplingParamsError as e:
        message = str(e)
        raise SamplingParamError(message.split(" ", 1)[0], message) from None
    return ParsedSampling(params=params, n=parsed.n, max_tokens_given=max_tokens_given)


def build_sampling_params(raw: Any, *, default_max_tokens: int) -> SamplingParams:
    """The engine's SamplingParams for `raw`. `n` is validated but not part of the result:
    use `parse_sampling_params` to fan out n requests."""
    return parse_sampling_params(raw, default_max_tokens=default_max_tokens).params

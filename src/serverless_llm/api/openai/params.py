"""Request -> SamplingParams, one function per route, and the fields the engine cannot honour yet.

This is the one place that knows which request fields reach the engine. A field the engine does
not implement yet is rejected when set to anything but its neutral value, never dropped: a
client asking for a JSON schema and quietly getting none is worse than an error. Ranges are
checked by the engine's SamplingParams, whose errors name the parameter; a field left unset
takes the engine's default (SAMPLING_DEFAULTS), restated nowhere here, or for temperature,
top_p, top_k, min_p and repetition_penalty the model's (its generation_config.json, as vLLM's
`--generation-config auto`; `defaults`, from the engine's ModelInfo).

Beam search (`use_beam_search`, `length_penalty`, `early_stopping`) runs best_of (else n) beams
and returns the n best. A temperature left unset means 0 with it (the only one it takes), as
vLLM's beam search ignores temperature; one set above 0 is refused. The model's sampling
defaults do not apply to beam search (it takes none of those parameters).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from serverless_llm.engine import (
    BEAM_SEARCH_TEMPERATURE,
    SAMPLING_DEFAULTS,
    SamplingParams,
    any_whitespace_of,
    resolve_backend,
)

from .errors import OpenAIServingError, unsupported
from .protocol import ChatCompletionRequest, CompletionRequest

# field -> the values that mean "not used" (so accepting them changes nothing).
_UNSUPPORTED_COMMON: dict[str, tuple[Any, ...]] = {
    "bad_words": (None, []),
}
_UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
}
_UNSUPPORTED_COMPLETION: dict[str, tuple[Any, ...]] = {}


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # Types are compared too: `True == 1.0` and `0 == False` in Python.
    return any(
        value is None if v is None else (type(value) is type(v) and value == v) for v in neutral
    )


def _reject_unsupported(request: Any, table: dict[str, tuple[Any, ...]]) -> None:
    for field, neutral in table.items():
        if not _is_neutral(getattr(request, field), neutral):
            raise unsupported(field)


def _check_shared(request: ChatCompletionRequest | CompletionRequest) -> None:
    _reject_unsupported(request, _UNSUPPORTED_COMMON)
    if request.best_of is not None:
        if request.best_of < request.num_choices:
            raise OpenAIServingError.bad_request(
                f"best_of ({request.best_of}) must be at least n ({request.num_choices}).",
                "best_of",
                "invalid_value",
            )
        if request.best_of > request.num_choices and request.stream and not request.use_beam_search:
            raise OpenAIServingError.bad_request(
                f"best_of ({request.best_of}) greater than n ({request.num_choices}) cannot be "
                "streamed: the best sequences are known only at the end.",
                "best_of",
                "invalid_value",
            )
    if request.stream and request.prompt_logprobs is not None:
        raise OpenAIServingError.bad_request(
            "prompt_logprobs are not available when stream is true.",
            "prompt_logprobs",
            "invalid_value",
        )
    if request.stream_options is not None and not request.stream:
        raise OpenAIServingError.bad_request(
            "stream_options can only be set when stream is true.", "stream_options", "invalid_value"
        )


def _common_params(
    request: ChatCompletionRequest | CompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    structured: Any = None,
    defaults: Mapping[str, Any] | None = None,
) -> SamplingParams:
    """`max_tokens=None` lets the engine generate up to max_model_len minus the prompt. Fields
    left null (or out) mean the model's default where `defaults` has one, else the engine's,
    as in OpenAI's API. Out-of-range values raise the engine's SamplingParamsError, naming the
    field (a 400, api.errors)."""
    model = {} if request.use_beam_search or defaults is None else defaults

    def value(name: str) -> Any:
        v = getattr(request, name)
        if v is None or name not in request.model_fields_set:
            return model.get(name, SAMPLING_DEFAULTS[name])
        return v

    temperature = request.temperature
    if temperature is None:
        temperature = BEAM_SEARCH_TEMPERATURE if request.use_beam_search else value("temperature")
    top_p = float(value("top_p"))
    if top_p == 0.0 and not request.use_beam_search:
        # The nucleus of mass 0 is the most likely token alone, whatever the temperature:
        # greedy decoding, which is how the engine is asked for it. (Beam search, which takes
        # no top_p, gets the engine's error naming it.)
        temperature, top_p = 0.0, 1.0
    return SamplingParams(
        n=request.num_choices,
        best_of=request.best_of,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        temperature=float(temperature),
        top_p=top_p,
        top_k=value("top_k"),
        min_p=float(value("min_p")),
        top_a=float(value("top_a")),
        tfs=float(value("tfs")),
        eta_cutoff=float(value("eta_cutoff")),
        epsilon_cutoff=float(value("epsilon_cutoff")),
        typical_p=float(value("typical_p")),
        smoothing_factor=float(value("smoothing_factor")),
        smoothing_curve=float(value("smoothing_curve")),
        presence_penalty=float(value("presence_penalty")),
        frequency_penalty=float(value("frequency_penalty")),
        repetition_penalty=float(value("repetition_penalty")),
        logit_bias=request.logit_bias or None,
        allowed_token_ids=request.allowed_token_ids,
        seed=request.seed,
        stop=request.stop,
        stop_token_ids=list(request.stop_token_ids or ()),
        include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        truncate_prompt_tokens=request.truncate_prompt_tokens,
        use_beam_search=request.use_beam_search,
        length_penalty=request.length_penalty,
        early_stopping=request.early_stopping,
        **_structured_fields(request, structured),
    )


def _structured_fields(request: Any, structured: Any) -> dict[str, Any]:
    """The structured-output fields for SamplingParams (which validates them). `structured`:
    a ready StructuredOutputSpec (a tool_choice's), exclusive with the request's own fields."""
    fields = {
        name: getattr(request, name)
        for name in (
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "guided_whitespace_pattern",
            "guided_decoding_backend",
            "response_format",
            "structured_outputs",
            "guided_decoding",
        )
    }
    if structured is not None:
        given = [k for k, v in fields.items() if v is not None and k != "guided_decoding_backend"]
        if given and not (
            given == ["response_format"] and fields["response_format"] == {"type": "text"}
        ):
            raise OpenAIServingError.bad_request(
                f"tool_choice constrains the output to a tool call and cannot be combined with "
                f"{given[0]}.",
                "tool_choice",
                "invalid_value",
            )
        backend = fields["guided_decoding_backend"]
        if backend is not None or fields["guided_whitespace_pattern"] is not None:
            # The request's backend options and whitespace pattern apply to the tool's JSON
            # (StructuredOutputError naming the field when they are bad).
            name, options = resolve_backend(backend)
            structured = dataclasses.replace(
                structured,
                backend=name,
                any_whitespace=any_whitespace_of(options),
                whitespace_pattern=fields["guided_whitespace_pattern"],
            )
        return {"structured_outputs": structured}
    return fields


def chat_sampling_params(
    request: ChatCompletionRequest,
    structured: Any = None,
    defaults: Mapping[str, Any] | None = None,
) -> SamplingParams:
    """Chat's `logprobs: true` with `top_logprobs: k` is the engine's logprobs=k. Raises
    OpenAIServingError for fields the engine cannot honour yet. `structured`: the spec a
    named or required tool_choice asks for. `defaults`: the model's sampling defaults."""
    _check_shared(request)
    _reject_unsupported(request, _UNSUPPORTED_CHAT)
    top = request.top_logprobs
    if top and not request.logprobs:
        raise OpenAIServingError.bad_request(
            "top_logprobs requires logprobs to be true.", "top_logprobs", "invalid_value"
        )
    logprobs = (top or 0) if request.logprobs else None
    return _common_params(
        request, request.output_limit, logprobs, request.prompt_logprobs, structured, defaults
    )


def completion_sampling_params(
    request: CompletionRequest, defaults: Mapping[str, Any] | None = None
) -> SamplingParams:
    """Completions' `logprobs: k`; with `echo` the prompt's logprobs are needed too (at least
    k of them). Raises OpenAIServingError for fields the engine cannot honour yet.
    `defaults`: the model's sampling defaults."""
    _check_shared(request)
    _reject_unsupported(request, _UNSUPPORTED_COMPLETION)
    prompt_logprobs = request.prompt_logprobs
    if request.echo and request.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
    max_tokens = request.output_limit
    if max_tokens == 0:
        if not request.echo:
            raise OpenAIServingError.bad_request(
                "max_tokens must be at least 1; 0 is taken only with echo (the prompt and its "
                "log-probabilities, nothing generated).",
                "max_tokens",
                "invalid_value",
            )
        if request.min_tokens:
            raise OpenAIServingError.bad_request(
                f"min_tokens ({request.min_tokens}) cannot be more than max_tokens (0).",
                "min_tokens",
                "invalid_value",
            )
        # The engine scores the prompt while it makes one token, which the formatter drops
        # (prompt_only): what legacy OpenAI and vLLM answer to lm-evaluation-harness's
        # log-likelihood requests.
        max_tokens = 1
    return _common_params(request, max_tokens, request.logprobs, prompt_logprobs, defaults=defaults)


def prompt_only(request: CompletionRequest) -> bool:
    """Whether a completions request asks for its echoed prompt alone (echo, max_tokens 0)."""
    return bool(request.echo) and request.output_limit == 0

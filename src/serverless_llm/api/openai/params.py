"""Request -> SamplingParams, one function per route, and the fields the engine cannot honour yet.

This is the one place that knows which request fields reach the engine. A field the engine does
not implement yet is rejected when set to anything but its neutral value, never dropped: a
client asking for stop strings or a JSON schema and quietly getting neither is worse than an
error. When the engine learns a parameter, its entry leaves `_UNSUPPORTED_*` and it gets mapped
in `_common_params`.
"""

from __future__ import annotations

from typing import Any

from serverless_llm.engine.sampling.params import SamplingParams

from .errors import OpenAIServingError, unsupported
from .protocol import SEED_MAX, ChatCompletionRequest, CompletionRequest

# field -> the values that mean "not used" (so accepting them changes nothing).
_UNSUPPORTED_COMMON: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0.0),
    "presence_penalty": (None, 0.0),
    "logit_bias": (None, {}),
    "stop": (None, "", []),
    "use_beam_search": (False,),
    "min_p": (None, 0.0),
    "repetition_penalty": (None, 1.0),
    "length_penalty": (1.0,),
    "early_stopping": (False,),
    "include_stop_str_in_output": (False,),
    "min_tokens": (0,),
    "prompt_logprobs": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "priority": (0,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "structured_outputs": (None,),
}
_UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
}
_UNSUPPORTED_COMPLETION: dict[str, tuple[Any, ...]] = {
    "logprobs": (None,),
    "suffix": (None, ""),
}


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
    fmt = request.response_format
    if fmt is not None and fmt != {"type": "text"}:
        kind = fmt.get("type")
        raise unsupported("response_format", f"only {{'type': 'text'}} is, got type {kind!r}")
    if request.best_of is not None:
        if request.best_of < request.num_choices:
            raise OpenAIServingError.bad_request(
                f"best_of ({request.best_of}) must be at least n ({request.num_choices}).",
                "best_of",
                "invalid_value",
            )
        if request.best_of > request.num_choices:
            raise unsupported("best_of", "best_of greater than n")
    if request.stream_options is not None and not request.stream:
        raise OpenAIServingError.bad_request(
            "stream_options can only be set when stream is true.", "stream_options", "invalid_value"
        )


def _common_params(
    request: ChatCompletionRequest | CompletionRequest, max_tokens: int | None
) -> SamplingParams:
    """`max_tokens=None` lets the engine generate up to max_model_len minus the prompt."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else float(request.temperature),
        top_p=1.0 if request.top_p is None else float(request.top_p),
        top_k=-1 if request.top_k is None else request.top_k,
        seed=request.seed,
        stop_token_ids=list(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
    )


def chat_sampling_params(request: ChatCompletionRequest) -> SamplingParams:
    """Raises OpenAIServingError for fields the engine cannot honour yet."""
    _check_shared(request)
    _reject_unsupported(request, _UNSUPPORTED_CHAT)
    return _common_params(request, request.output_limit)


def completion_sampling_params(request: CompletionRequest) -> SamplingParams:
    """Raises OpenAIServingError for fields the engine cannot honour yet."""
    _check_shared(request)
    _reject_unsupported(request, _UNSUPPORTED_COMPLETION)
    return _common_params(request, request.output_limit)


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index` of a prompt samples with `seed + index`, so the n choices differ from each
    other and the whole response is reproducible (vLLM's rule for n > 1). Wraps at 2**64,
    the top of torch's seed range."""
    if seed is None:
        return None
    value = seed + index
    return value - 2**64 if value > SEED_MAX else value

"""Request and response models of the OpenAI routes (pydantic v2).

Requests are validated strictly, as OpenAI does: `"5"` is not an integer, `1` is not a boolean,
NaN is not a temperature, and an unknown field is an error rather than something silently
dropped (a typo such as `temprature` would otherwise change nothing and go unnoticed). Fields
that the engine cannot honour yet are still declared, so their shapes are checked; `params.py`
rejects non-default values with a clear "not supported yet".

Field names and defaults follow OpenAI's API, then vLLM's and Aphrodite's extra parameters (sent
at the top level of the body; the OpenAI client merges `extra_body` there). Completions'
`logprobs` goes up to 20 (vLLM's default --max-logprobs; OpenAI stops at 5).

The response models document the shapes and are used for the one-off responses; stream chunks
are built as plain dicts on the hot path (`chat.py`, `completions.py`) with the same fields, on
the frame `ResponseFormatter` gives them.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from serverless_llm.engine import SAMPLING_DEFAULTS as _D

from ..json_types import WholeInt

# torch generators take seeds in this range.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1

Role = Literal["system", "developer", "user", "assistant", "tool"]


def _check_content(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        for j, part in enumerate(value):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ValueError(f"content part {j} must be an object with a string 'type'")
        return value
    raise ValueError("must be a string or a list of content parts")


def _check_stop(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("must be a string or a list of strings")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _check_prompt(value: Any) -> Any:
    """One of OpenAI's four prompt forms: str, list[str], list[int], list[list[int]]."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if not value:
            raise ValueError("must not be an empty list")
        if all(isinstance(p, str) for p in value) or _is_token_ids(value):
            return value
        if all(_is_token_ids(p) for p in value):
            return value
    raise ValueError(
        "must be a string, a list of strings, a list of token ids or a list of token-id lists"
    )


def _check_str_or_object(value: Any) -> Any:
    if value is None or isinstance(value, (str, dict)):
        return value
    raise ValueError("must be a string or an object")


def _check_early_stopping(value: Any) -> Any:
    if isinstance(value, bool) or value == "never":
        return value
    raise ValueError("must be true, false or 'never'")


Content = Annotated[Any, AfterValidator(_check_content)]
EarlyStopping = Annotated[Any, AfterValidator(_check_early_stopping)]
Stop = Annotated[Any, AfterValidator(_check_stop)]
Prompt = Annotated[Any, AfterValidator(_check_prompt)]
StrOrObject = Annotated[Any, AfterValidator(_check_str_or_object)]
Seed = Annotated[WholeInt, Field(ge=SEED_MIN, le=SEED_MAX)]
TokenId = Annotated[WholeInt, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = False
    # vLLM: usage in every chunk, not only in the final one.
    continuous_usage_stats: bool | None = False
    # OpenAI pads chunks with random text against side channels; this server adds no padding,
    # so the flag changes nothing either way.
    include_obfuscation: bool | None = None


class ChatMessage(BaseModel):
    """A message as the chat template sees it. Keys beyond OpenAI's (some templates read
    `reasoning_content`, for one) are passed through to the template, not dropped."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: Role
    content: Content = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _ModerationMode(_Strict):
    mode: Literal["score", "block"]


class _ModerationPolicy(_Strict):
    input: _ModerationMode | None = None
    output: _ModerationMode | None = None


class Moderation(_Strict):
    model: str
    policy: _ModerationPolicy | None = None


class PromptCacheOptions(_Strict):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class ChatRouteExtras(_Strict):
    """vLLM's extra sampling parameters, taken at the top level of a request of another shape
    (Responses, Anthropic's Messages) and passed to the chat route under the same names, which
    checks them again."""

    seed: Seed | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    min_tokens: WholeInt | None = None
    skip_special_tokens: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: WholeInt | None = None


CHAT_ROUTE_EXTRAS = tuple(ChatRouteExtras.model_fields)


class _SamplingRequest(_Strict):
    """Fields chat and completions share: OpenAI's, then vLLM's extra sampling parameters.
    A sampling parameter's default is the engine's (SAMPLING_DEFAULTS)."""

    model: str | None = None
    frequency_penalty: float | None = Field(
        _D["frequency_penalty"], ge=-2.0, le=2.0, allow_inf_nan=False
    )
    logit_bias: dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None = None
    max_tokens: WholeInt | None = Field(None, ge=1)
    n: WholeInt | None = Field(_D["n"], ge=1)  # at most the endpoint's MAX_N (api.limits)
    presence_penalty: float | None = Field(
        _D["presence_penalty"], ge=-2.0, le=2.0, allow_inf_nan=False
    )
    seed: Seed | None = None
    stop: Stop = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    # 0 keeps only the most likely token: greedy, whatever the temperature (params.py).
    top_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    user: str | None = None
    # OpenAI bookkeeping that changes nothing about the output.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # OpenAI's hosted moderation and prompt-cache controls: shapes checked, then ignored (no
    # moderation model runs here; the prefix cache needs no breakpoints and keeps what fits).
    moderation: Moderation | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None

    # vLLM's extra sampling parameters.
    best_of: WholeInt | None = Field(None, ge=1)  # at most MAX_N
    use_beam_search: bool = _D["use_beam_search"]
    top_k: WholeInt | None = Field(None, ge=-1)
    min_p: float | None = Field(_D["min_p"], ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(_D["repetition_penalty"], gt=0.0, allow_inf_nan=False)
    # Aphrodite's samplers (ranges checked by the engine's SamplingParams).
    top_a: float | None = Field(_D["top_a"], allow_inf_nan=False)
    tfs: float | None = Field(_D["tfs"], allow_inf_nan=False)
    eta_cutoff: float | None = Field(_D["eta_cutoff"], allow_inf_nan=False)
    epsilon_cutoff: float | None = Field(_D["epsilon_cutoff"], allow_inf_nan=False)
    typical_p: float | None = Field(_D["typical_p"], allow_inf_nan=False)
    smoothing_factor: float | None = Field(_D["smoothing_factor"], allow_inf_nan=False)
    smoothing_curve: float | None = Field(_D["smoothing_curve"], allow_inf_nan=False)
    length_penalty: float = Field(_D["length_penalty"], allow_inf_nan=False)
    early_stopping: EarlyStopping = _D["early_stopping"]
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = _D["include_stop_str_in_output"]
    ignore_eos: bool = _D["ignore_eos"]
    min_tokens: WholeInt = Field(_D["min_tokens"], ge=0)
    skip_special_tokens: bool = _D["skip_special_tokens"]
    spaces_between_special_tokens: bool = _D["spaces_between_special_tokens"]
    truncate_prompt_tokens: WholeInt | None = Field(None, ge=1)
    prompt_logprobs: WholeInt | None = Field(None, ge=0, le=20)
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    priority: WholeInt = 0

    # vLLM's structured output (guided decoding).
    response_format: dict[str, Any] | None = None
    guided_json: StrOrObject = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_decoding: dict[str, Any] | None = None

    @property
    def num_choices(self) -> int:
        return self.n if self.n is not None else _D["n"]


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: WholeInt | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: WholeInt | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrOrObject = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: StrOrObject = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    # "xhigh" and "max" reach a template or harmony as "high", the most any open model takes.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None

    # vLLM's chat extras.
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The chat template already writes BOS and friends, so none are added by default.
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def output_limit(self) -> int | None:
        """max_completion_tokens is OpenAI's newer name for max_tokens; it wins when both are
        set, as OpenAI's own precedence."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class CompletionRequest(_SamplingRequest):
    prompt: Prompt = Field()
    # 0 only with echo: the prompt's log-probabilities alone (params.py, completions.py).
    max_tokens: WholeInt | None = Field(None, ge=0)
    echo: bool | None = False
    logprobs: WholeInt | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    # A plain prompt is raw text, so BOS (and whatever else the tokenizer adds) belongs in it.
    add_special_tokens: bool = True

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens


# -- responses -------------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ChatResponseMessage(_Response):
    role: str
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    # vLLM's: the stop token id (or string) that ended the choice, None for EOS or length.
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    """Also the shape of each stream chunk: OpenAI uses one object for both."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "serverless-llm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ResponseFormatter:
    """What chat's and completions' formatters share: the frame of every response and chunk of
    one request, as a plain dict (a chunk is built once per token, so not as a model above).

    A subclass names its chunks' `object_name` and fills in the choices.
    """

    object_name: str

    def __init__(self, response_id: str, created: int, model: str) -> None:
        self.response_id = response_id
        self.created = created
        self.model = model

    def _chunk(
        self,
        choices: list[dict[str, Any]],
        usage: dict[str, int] | None = None,
        *,
        object_name: str | None = None,
    ) -> dict[str, Any]:
        """A chunk (or, with `object_name`, a response) holding `choices`, and `usage` if any."""
        chunk = {
            "id": self.response_id,
            "object": object_name or self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def _delta_chunk(
        self,
        index: int,
        key: str,
        content: Any,
        logprobs: dict[str, Any] | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
        usage: dict[str, int] | None,
    ) -> dict[str, Any] | None:
        """The chunk of one choice's step, its new `content` under `key` ("delta", "text");
        None when the step has nothing to send."""
        if not content and finish_reason is None and usage is None and logprobs is None:
            return None  # a token whose text is still held back (part of a character)
        choice: dict[str, Any] = {
            "index": index,
            key: content,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return self._chunk([choice], usage)

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """The closing chunk of `include_usage`: no choices, the request's usage."""
        return self._chunk([], usage)


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo

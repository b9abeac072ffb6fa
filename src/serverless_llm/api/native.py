"""The native route: worker-vllm's job schema in, batches of token text out.

Input: `prompt` or `messages` (rendered with the chat template; `apply_chat_template: true`
wraps a prompt as one user message), `sampling_params` (vLLM's and Aphrodite's names, see
`api.sampling`) and `stream`. A vision-language model takes images as `image_url` content parts
of `messages` (as on the OpenAI chat route), or, with `prompt`, as vLLM's offline API takes
them: `multi_modal_data: {"image": <URL or data URL, or a list of them>}`, the prompt text
carrying the model's image placeholder once per image (with `apply_chat_template`, the template
places them: the images come before the prompt in the one user message). Every yielded item is

    {"choices": [{"tokens": ["Hel", "lo"]}, ...], "usage": {"input": 12, "output": 3}}

with one choice per `n` and `usage.output` the running total over all choices. Streamed, each
item holds the next stream batch of tokens (one text piece per token, possibly "" while a
character is incomplete or text is held back because it may start a stop string; batch sizes
from `BatchSizes`, counted over all choices together, as worker-vllm did); otherwise one item
holds each choice's whole text.

With `logprobs: k` each choice also carries `"logprobs"`: one object per generated token (in a
stream, per token of that item), `{"token_id", "token", "logprob", "top_logprobs": [{"token_id",
"token", "logprob"}, ...k]}`, and `"cumulative_logprob"`, the sum so far. With
`prompt_logprobs: k` the first item carries `"prompt_logprobs"`: None for the first prompt
token, then the same objects with a `"rank"`. `best_of > n` runs best_of sequences and returns
the n with the highest cumulative logprob (not streamable: the best are known at the end).
`use_beam_search` returns its n beams together when the search ends: streamed, they come as one
item holding every choice's whole text.

A gpt-oss model (api/openai/harmony.py) renders `messages` (and `apply_chat_template`'s one
user message) with harmony instead of its chat template, stops at `<|return|>` or `<|call|>`,
and answers with the final answer only: the schema has no field for reasoning or tool calls, so
the analysis channel and messages to a tool are dropped from the text (streamed, their tokens
come as "" pieces; `usage` and `logprobs` still count every token). A plain `prompt` stays raw
text in and out. A chat job may set `reasoning_effort` (low, medium, high: harmony's system
message; another model's template variable) and `chat_template_kwargs` (the template's
variables, vLLM's field; harmony reads reasoning_effort and model_identity there).

Any failure is yielded as `{"error": "<message>"}`, once, and ends the job; the engine requests
are aborted when this generator closes, so nothing is left holding KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..engine import (
    EngineClient,
    EngineOutput,
    LoRARequest,
    MultiModalInput,
    PreparedPrompt,
    SamplingParams,
    SamplingParamsError,
    apply_chat_template,
    chat_template_source,
    sequence_params,
)
from .batching import BatchSizes, batch_stream
from .errors import REQUEST_ERRORS, NativeJobError, describe_validation_error, native_error
from .json_types import WholeInt
from .limits import RequestLimits
from .logprobs import TokenDecoder, native_logprobs
from .lora import LoRAAdapters
from .media import ImageRef, MediaConfig, check_image_count, load_images
from .multimodal import ContentForm, content_format, count_image_parts, message_content
from .native_sampling import VLLMSamplingParams, parse_sampling_params
from .offload import prepare
from .openai.harmony import (
    HarmonyParser,
    HarmonyPromptError,
    load_encoding,
    render_prompt,
    speaks_harmony,
    stop_ids,
)
from .results import SequenceResult, choice_outputs, gather_results
from .streams import merge_streams

__all__ = ["DEFAULT_MAX_TOKENS", "ChatMessage", "NativeRequest", "NativeServing"]

logger = logging.getLogger(__name__)

# worker-vllm raised vLLM's default of 16 after users kept getting cut-off answers.
DEFAULT_MAX_TOKENS = 100


class ChatMessage(BaseModel):
    """One chat message; extra keys (name, tool_calls, ...) are passed to the template."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None


class NativeRequest(BaseModel):
    """A native job's input, without the stream batch knobs (those are shared with OpenAI jobs
    and parsed by `worker.job_input`)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    apply_chat_template: bool = False
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    # A served LoRA adapter's name (LORA_MODULES), or the model's own; unset: the model.
    model: str | None = None
    # Lower is served first, as vLLM's (SCHEDULING_POLICY=priority; otherwise only 0 goes).
    priority: WholeInt = 0
    # vLLM's offline form: {"image": URL | [URL, ...]} with `prompt` (vision-language models).
    multi_modal_data: dict[str, Any] | None = None
    # A chat's reasoning effort: gpt-oss's harmony system message (`Reasoning: ...`, default
    # medium); another model's chat template gets it as its `reasoning_effort` variable.
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # Variables for the chat template, as vLLM's chat_template_kwargs (harmony reads
    # `reasoning_effort` and `model_identity` from them; the top-level field wins).
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _needs_input(self) -> NativeRequest:
        if self.prompt is None and self.messages is None:
            raise ValueError("the job needs 'prompt' or 'messages'")
        if self.multi_modal_data is not None and self.prompt is None:
            raise ValueError(
                "multi_modal_data goes with 'prompt'; in 'messages', give images as image_url "
                "content parts"
            )
        if self.messages is None and not self.apply_chat_template:
            for name in ("reasoning_effort", "chat_template_kwargs"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name} applies to chat jobs: give 'messages', or set "
                        "apply_chat_template with 'prompt'"
                    )
        return self

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's variables: chat_template_kwargs, with `reasoning_effort`."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}

    @classmethod
    def parse(cls, data: dict[str, Any]) -> NativeRequest:
        """Validates a job input, raising NativeJobError with a message naming the field."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            errors = e.errors(include_url=False)
            if errors and errors[0]["type"] == "value_error" and not errors[0]["loc"]:
                raise NativeJobError(errors[0]["msg"].removeprefix("Value error, ")) from None
            path, message = describe_validation_error(e)
            if errors and errors[0]["type"] == "extra_forbidden":
                message = f"unknown input field '{path}'"
                if path in _SAMPLING_NAMES:
                    message += f" (sampling parameters go in sampling_params: {{'{path}': ...}})"
            raise NativeJobError(message) from None


# The reasoning efforts a native job may ask for (harmony's three levels).
_EFFORTS = ("low", "medium", "high")

# Top-level keys that belong in sampling_params: a hint for a common mistake.
_SAMPLING_NAMES = frozenset(VLLMSamplingParams.model_fields)


class NativeServing:
    """Serves native jobs on one AsyncEngine."""

    def __init__(
        self,
        engine: EngineClient,
        *,
        chat_template: str | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        log_requests: bool = False,
        limits: RequestLimits | None = None,
        served_model_name: str | None = None,
        model_aliases: Sequence[str] = (),
        lora_modules: Sequence[LoRARequest] = (),
        media: MediaConfig | None = None,
        harmony: bool | None = None,
    ) -> None:
        """`lora_modules`: the adapters a job may name in `model` (besides
        `served_model_name` and `model_aliases`, the model itself). `media`: how a
        vision-language model's images are loaded (api.media). `harmony`: whether the model speaks gpt-oss's harmony format
        (None: a gpt-oss config, as on the OpenAI routes)."""
        self.engine = engine
        if harmony is None:
            harmony = speaks_harmony(getattr(engine, "model_config", None))
        self.harmony: Any = load_encoding() if harmony else None
        self.media = media or MediaConfig()
        info = getattr(engine, "model_info", None)
        self.image_input = bool(getattr(info, "image_input", False))
        self.image_placeholder: str | None = getattr(info, "image_placeholder", None)
        # The model's sampling defaults (generation_config.json) for parameters a job leaves out.
        defaults = getattr(info, "sampling_defaults", None)
        self.sampling_defaults: dict[str, Any] = dict(getattr(defaults, "values", None) or {})
        self.served_model_name = served_model_name
        self.model_names = tuple(n for n in dict.fromkeys([served_model_name, *model_aliases]) if n)
        # Shared with the OpenAI routes, which may change it at runtime (api/lora.py).
        self.loras = (
            lora_modules if isinstance(lora_modules, LoRAAdapters) else LoRAAdapters(lora_modules)
        )
        self.limits = limits or RequestLimits()
        self.chat_template = chat_template
        self.default_max_tokens = default_max_tokens
        self.log_requests = log_requests
        self._ids = itertools.count()

    async def handle(
        self, request: NativeRequest, batch: BatchSizes, job_id: str = "job"
    ) -> AsyncIterator[dict[str, Any]]:
        """Yields the job's items, or one `{"error": ...}`. Only CancelledError escapes."""
        try:
            async with aclosing(self._generate(request, batch, job_id)) as items:
                async for item in items:
                    yield item
        except asyncio.CancelledError:
            raise
        except REQUEST_ERRORS as e:
            yield native_error(str(e))
        except Exception as e:  # a bug or an engine failure: the job fails, the worker serves on
            logger.exception("native job %s failed", job_id)
            yield native_error(f"generation failed: {type(e).__name__}: {e}")

    # -- the pieces -------------------------------------------------------------------------

    def _prepare(
        self, request: NativeRequest
    ) -> tuple[SamplingParams, PreparedPrompt] | _PendingImages:
        """Limits, template, tokenizer and parameters: run off the event loop (see
        api.offload). A prompt with images comes back as what remains to be done once they are
        loaded (its parameters already checked)."""
        self._check_limits(request)
        self._parse_params(request)  # a bad parameter fails before any image is fetched
        prompt = self._prompt(request)
        if isinstance(prompt, _PendingImages):
            return prompt
        return self._sampling(request, prompt)

    def _check_limits(self, request: NativeRequest) -> None:
        """The request's size against the limits, before any tokenizing (see api.limits)."""
        if request.prompt is not None:
            self.limits.check_prompt_chars(len(request.prompt), "prompt")
        if request.messages is not None:
            self.limits.check_messages([m.model_dump(exclude_none=True) for m in request.messages])
        raw = request.sampling_params or {}
        self.limits.check_sampling(
            n=raw.get("n"),
            best_of=raw.get("best_of"),
            stop=raw.get("stop"),
            logit_bias=raw.get("logit_bias"),
        )

    def _prompt(self, request: NativeRequest) -> str | list[int] | _PendingImages:
        """The prompt for the engine to prepare: the text itself, or a chat's token ids; or,
        with images, the text and the images to load."""
        tokenizer = self.engine.tokenizer
        if request.multi_modal_data is not None:
            pending = self._prompt_with_images(request)
            if pending is not None:
                return pending
        if request.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in request.messages]
            if self.image_input:
                refs: list[ImageRef] = []
                check_image_count(count_image_parts(messages), self.media, "messages")
                form = self._content_form()
                for i, m in enumerate(messages):
                    if m.get("content") is not None:
                        m["content"] = message_content(
                            m["content"], f"messages[{i}].content", form, refs
                        )
                if refs:
                    text = self._render(messages, request)
                    return _PendingImages(text, refs, add_special_tokens=False)
            elif count_image_parts(messages):
                # Refused by the same rule as the chat route's (a text model takes no images).
                for i, m in enumerate(messages):
                    if isinstance(m.get("content"), list):
                        message_content(m["content"], f"messages[{i}].content", ContentForm(), [])
        elif request.apply_chat_template:
            messages = [{"role": "user", "content": request.prompt}]
        else:
            return request.prompt
        if self._harmony_chat(request):
            options = request.chat_template_kwargs or {}
            effort = options.get("reasoning_effort")
            if request.reasoning_effort is None and effort not in (None, *_EFFORTS):
                raise NativeJobError(
                    "chat_template_kwargs.reasoning_effort must be 'low', 'medium' or 'high', "
                    f"got {effort!r}"
                )
            try:
                return render_prompt(
                    messages, reasoning_effort=request.reasoning_effort, options=options
                ).token_ids
            except HarmonyPromptError as e:
                raise NativeJobError(str(e)) from None
        text = self._render(messages, request)
        # The template writes its own special tokens (BOS included); adding them again would
        # double them.
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise NativeJobError("the chat prompt is empty")
        return list(ids)

    def _harmony_chat(self, request: NativeRequest) -> bool:
        """Whether the job is a chat rendered with harmony (a gpt-oss model's messages)."""
        return self.harmony is not None and (
            request.messages is not None
            or (request.apply_chat_template and request.multi_modal_data is None)
        )

    def _render(self, messages: list[dict[str, Any]], request: NativeRequest) -> str:
        return apply_chat_template(
            self.engine.tokenizer,
            messages,
            chat_template=self.chat_template,
            chat_template_kwargs=request.template_kwargs(),
        )

    def _content_form(self) -> ContentForm:
        source = chat_template_source(self.engine.tokenizer, self.chat_template)
        return ContentForm(
            images=True,
            part_lists=content_format(source) == "openai",
            placeholder=self.image_placeholder,
        )

    def _prompt_with_images(self, request: NativeRequest) -> _PendingImages | None:
        """`prompt` with `multi_modal_data` (vLLM's offline form); None when it names no
        image."""
        data = request.multi_modal_data or {}
        for key in data:
            if key != "image":
                raise NativeJobError(
                    f"multi_modal_data.{key}: {key} inputs are not supported (images only)"
                )
        value = data.get("image")
        if value is None or value == []:
            return None
        if not self.image_input:
            raise NativeJobError(
                "multi_modal_data.image: this model does not take images (serve a "
                "vision-language model)"
            )
        if isinstance(value, str):
            refs = [ImageRef(value, "multi_modal_data.image")]
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            refs = [ImageRef(v, f"multi_modal_data.image[{i}]") for i, v in enumerate(value)]
        else:
            raise NativeJobError(
                "multi_modal_data.image must be an image URL (http(s) or data URL) or a list "
                "of them"
            )
        check_image_count(len(refs), self.media, "multi_modal_data.image")
        prompt = request.prompt or ""
        if not request.apply_chat_template:
            # The prompt carries the model's placeholders itself, as vLLM's offline API expects.
            return _PendingImages(prompt, refs, add_special_tokens=True)
        form = self._content_form()
        parts: list[Any] = [{"type": "image_url", "image_url": r.url} for r in refs]
        content = message_content([*parts, {"type": "text", "text": prompt}], "prompt", form, [])
        text = self._render([{"role": "user", "content": content}], request)
        return _PendingImages(text, refs, add_special_tokens=False)

    def _parse_params(self, request: NativeRequest):
        parsed = parse_sampling_params(
            request.sampling_params,
            default_max_tokens=self.default_max_tokens,
            defaults=self.sampling_defaults,
        )
        params = parsed.params
        if request.stream and params.ranks_by_logprob:
            raise SamplingParamsError(
                f"best_of ({params.best_of}) > n ({params.n}) cannot be streamed: the best "
                "sequences are known only at the end; set stream to false or best_of to n",
                "best_of",
            )
        return parsed

    def _sampling(
        self, request: NativeRequest, prompt: str | list[int] | MultiModalInput
    ) -> tuple[SamplingParams, PreparedPrompt]:
        """The job's sampling parameters and its prompt as the model will see it (truncated
        as asked and checked against max_model_len before any engine request exists: the
        engine validates it once, here; a prompt with images is processed here, so its
        images count towards the context)."""
        parsed = self._parse_params(request)
        params = parsed.params
        if self._harmony_chat(request):  # the assistant's turn ends at <|return|> or <|call|>
            stops = [t for t in stop_ids(self.harmony) if t not in params.stop_token_ids]
            params = dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *stops])
        if parsed.max_tokens_given:
            return params, self.engine.prepare_prompt(prompt, params)
        # The default is a convenience, not a demand: it shrinks to what fits.
        unbounded = dataclasses.replace(params, max_tokens=None)
        prepared = self.engine.prepare_prompt(prompt, unbounded)
        room = self.engine.max_model_len - len(prepared.token_ids)
        if room < params.max_tokens:
            params = dataclasses.replace(
                params, max_tokens=room, min_tokens=min(params.min_tokens, room)
            )
        return params, prepared.with_max_tokens(params.max_tokens)

    def _lora_of(self, model: str | None) -> LoRARequest | None:
        if model is None or model == self.served_model_name or model in self.model_names:
            return None
        if model in self.loras:
            return self.loras[model]
        names = [n for n in (self.served_model_name, *self.loras) if n]
        raise NativeJobError(f"unknown model {model!r}: this worker serves {', '.join(names)}")

    async def _generate(
        self, request: NativeRequest, batch: BatchSizes, job_id: str
    ) -> AsyncIterator[dict[str, Any]]:
        lora = self._lora_of(request.model)
        if request.priority:
            self.engine.check_priority(request.priority)
        first = await prepare(self._prepare, request)
        if isinstance(first, _PendingImages):
            images = await load_images(first.refs, self.media)
            mm = MultiModalInput(first.text, images, first.add_special_tokens)
            first = await prepare(self._sampling, request, mm)
        params, prepared = first
        prepared = await self.engine.prepare(prepared, params, lora)
        num_input = len(prepared.token_ids)
        if self.log_requests:
            logger.info(
                "job %s: native, %d prompt tokens, n=%d, stream=%s, %s",
                job_id,
                num_input,
                params.n,
                request.stream,
                params,
            )
        seq = next(self._ids)
        streams = [
            self.engine.generate(prepared, p, f"{job_id}#{seq}.{i}", priority=request.priority)
            for i, p in enumerate(sequence_params(params))
        ]
        harmony = self.harmony if self._harmony_chat(request) else None
        view = _ChoiceView(params, TokenDecoder(self.engine.tokenizer), harmony)

        if not request.stream:
            chosen, (prompt_logprobs,) = await gather_results(streams, 1, params)
            item: dict[str, Any] = {
                "choices": [view.whole(r) for r in chosen],
                "usage": {"input": num_input, "output": sum(r.num_tokens for r in chosen)},
            }
            view.add_prompt_logprobs(item, prompt_logprobs)
            yield item
            return

        num_output = 0
        n = params.n
        async with (
            aclosing(merge_streams(streams)) as merged,
            aclosing(
                batch_stream(merged, batch, weight=lambda item: len(item[1].new_token_ids))
            ) as batches,
        ):
            async for group in batches:
                choices: list[dict[str, Any]] = [view.empty() for _ in range(n)]
                prompt_lp = None
                for i, out in group:
                    for j, choice_out in choice_outputs(i, out, params):
                        if choice_out.new_token_ids:  # an abort's final output carries no token
                            view.extend(j, choices[j], choice_out)
                            num_output += len(choice_out.new_token_ids)
                        if choice_out.prompt_logprobs is not None:
                            prompt_lp = choice_out.prompt_logprobs
                item = {"choices": choices, "usage": {"input": num_input, "output": num_output}}
                view.add_prompt_logprobs(item, prompt_lp)
                yield item


@dataclass
class _PendingImages:
    """A prompt whose images are still to load: its text (one placeholder per image) and the
    images' references, in order."""

    text: str
    refs: list[ImageRef]
    add_special_tokens: bool


class _ChoiceView:
    """Shapes choices for what the job asked (logprobs only when asked for)."""

    def __init__(self, params: SamplingParams, decoder: TokenDecoder, harmony: Any = None) -> None:
        """`harmony`: the encoding of a gpt-oss chat's outputs, whose text is the final answer
        (each choice read by its own parser; tool calls and reasoning dropped)."""
        self.top = params.logprobs
        self.prompt_top = params.prompt_logprobs
        self.decoder = decoder
        self.harmony = harmony
        self._readers: dict[int, HarmonyParser] = {}

    def _reader(self) -> HarmonyParser:
        return HarmonyParser(self.harmony, calls=False)

    def empty(self) -> dict[str, Any]:
        choice: dict[str, Any] = {"tokens": []}
        if self.top is not None:
            choice["logprobs"] = []
        return choice

    def extend(self, index: int, choice: dict[str, Any], out: EngineOutput) -> None:
        text = out.new_text
        if self.harmony is not None:
            reader = self._readers.get(index)
            if reader is None:
                reader = self._readers[index] = self._reader()
            delta = reader.feed(out.new_token_ids) or {}
            text = delta.get("content", "")
        choice["tokens"].append(text)
        if self.top is not None and out.logprobs:
            choice["logprobs"].extend(native_logprobs(out.logprobs, self.top, self.decoder))
            choice["cumulative_logprob"] = out.cumulative_logprob

    def whole(self, seq: SequenceResult) -> dict[str, Any]:
        text = seq.text
        if self.harmony is not None:
            text = self._reader().parse(seq.token_ids).content or ""
        choice: dict[str, Any] = {"tokens": [text]}
        if self.top is not None:
            choice["logprobs"] = native_logprobs(seq.logprobs, self.top, self.decoder)
            choice["cumulative_logprob"] = seq.cumulative_logprob
        return choice

    def add_prompt_logprobs(self, item: dict[str, Any], entries: list | None) -> None:
        if self.prompt_top is not None and entries is not None:
            item["prompt_logprobs"] = native_logprobs(
                entries, self.prompt_top, self.decoder, with_rank=True
            )

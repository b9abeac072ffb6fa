"""The OpenAI routes over one AsyncEngine: what a worker job with `openai_route` runs.

`OpenAIServing.handle(route, body, batch)` is an async generator, so a job streams whatever the
route produces:

- not streamed: one response dict (OpenAI's shape) or one error dict;
- streamed with `raw_output` (RAW_OPENAI_OUTPUT, the default): strings of concatenated SSE
  events, `data: {json}\\n\\n` each, the last string ending with `data: [DONE]\\n\\n` (framed
  by `sse`);
- streamed without `raw_output`: lists of chunk dicts (no [DONE] marker).

Stream chunks are grouped by the geometric batch sizes (1, 3, 9, 27, 50, ... tokens a yield)
so the first token leaves at once and a long answer costs few messages, and within a yield each
choice's text is one chunk (`coalesce_chunks`): a client parses one event per batch, not one per
token. Beam search knows its
choices only when it ends (as in vLLM): streamed, each choice comes whole in one chunk.

Errors never raise: `handle` yields one error dict (`{"error": {...}}`, see errors.py; its HTTP
status from `http_status`) and stops. That holds mid-stream too, after strings have gone out.
Cancellation does propagate: closing the generator or cancelling its task aborts every engine
request of the job, which frees their KV blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote

from pydantic import BaseModel, ValidationError

from serverless_llm.engine import (
    ContextLengthError,
    EngineClient,
    EngineDeadError,
    EngineOutput,
    InvalidRequestError,
    LoRARequest,
    MultiModalInput,
    PreparedPrompt,
    SamplingParams,
    StructuredOutputSpec,
    chat_template_source,
    sequence_params,
)

from .. import anthropic  # (a module: api/anthropic.py imports this package's parts too)
from ..batching import BatchSizes, batch_stream
from ..errors import REQUEST_ERRORS
from ..limits import RequestLimitError, RequestLimits, string_chars
from ..logprobs import TokenDecoder, merge_completion_logprobs
from ..lora import LoadLoRAAdapterRequest, LoRAAdapters, LoRAUpdateError, UnloadLoRAAdapterRequest
from ..media import ImageRef, MediaConfig, check_image_count, load_images
from ..multimodal import ContentForm, content_format, count_image_parts, rename_param
from ..offload import prepare
from ..results import choice_outputs, gather_results
from ..streams import merge_streams
from .chat import (
    ChatFormatter,
    echo_text,
    render_chat_prompt,
    render_chat_text,
    template_messages,
)
from .completions import CompletionFormatter, tokenize_prompts
from .embeddings import create_embedding
from .errors import (
    INVALID_REQUEST,
    SERVER_ERROR,
    OpenAIServingError,
    internal_error,
    is_error,
    model_not_found,
    openai_error,
    request_error,
    validation_error,
)
from .harmony import (
    HarmonyParser,
    HarmonyPromptError,
    final_header_ids,
    load_encoding,
    message_start_id,
    prompt_header,
    render_prompt,
    speaks_harmony,
    stop_ids,
)
from .models import list_models, retrieve_model
from .params import chat_sampling_params, completion_sampling_params, prompt_only
from .pooling_routes import POOLING_KINDS, create_pooling_response
from .protocol import ChatCompletionRequest, CompletionRequest
from .reasoning import END as REASONING_END
from .reasoning import REASONING_PARSERS, ReasoningParser, detect_reasoning_parser
from .response_store import MemoryResponseStore, ResponseStore, ResponseStoreError
from .responses import (
    ResponseFormatter,
    ResponsesRequest,
    history_of,
    input_items_page,
    response_deleted,
    response_not_found,
    to_chat_body,
)
from .sse import SSE_DONE, sse_events
from .tokenization import detokenize, tokenize
from .tool_parsers import (
    ToolChoice,
    ToolParser,
    detect_tool_parser,
    get_tool_parser,
    parser_for_tool_choice,
    resolve_tool_choice,
    tool_choice_spec,
    validate_tools,
)
from .tool_parsers.default_prompt import DEFAULT_TOOL_PARSER, template_renders_tools

logger = logging.getLogger(__name__)

ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/models",
    "/rerank",
    "/score",
    "/classify",
    "/pooling",
)
# vLLM's utility routes (served at the root by vLLM; here under either prefix too).
UTILITY_ROUTES = ("tokenize", "detokenize", "version", "metrics")
# vLLM's runtime LoRA routes (ALLOW_RUNTIME_LORA_UPDATING; api/lora.py).
LORA_ROUTES = ("load_lora_adapter", "unload_lora_adapter")


def parse_route(route: Any) -> tuple[str, str | None]:
    """Maps a route to (kind, argument). `/v1/chat/completions`, `v1/chat/completions`,
    `/chat/completions` and `/openai/v1/chat/completions` are the same route: jobs are written
    by hand, and the prefix carries no information."""
    if isinstance(route, str):
        path = route.strip().split("?", 1)[0].strip("/")
        for prefix in ("openai/", "v1/"):
            if path.startswith(prefix):
                path = path[len(prefix) :]
        if path in UTILITY_ROUTES or path in LORA_ROUTES:
            return path, None
        if path == "chat/completions":
            return "chat", None
        if path == "messages":  # Anthropic's Messages API (api/anthropic.py)
            return "messages", None
        if path == "messages/count_tokens":
            return "count_tokens", None
        if path == "completions":
            return "completions", None
        if path == "embeddings":
            return "embeddings", None
        if path == "v2/rerank":  # vLLM's Cohere v2 spelling
            path = "rerank"
        if path in POOLING_KINDS:  # vLLM's /rerank, /score, /classify, /pooling
            return path, None
        if path == "responses":
            return "responses", None
        if path.startswith("responses/"):  # a stored response, or its input items
            rest = path[len("responses/") :]
            if rest.endswith("/input_items"):
                return "response_items", unquote(rest[: -len("/input_items")])
            if rest and "/" not in rest:
                return "response", unquote(rest)
        if path == "models":
            return "models", None
        if path.startswith("models/") and len(path) > len("models/"):
            return "model", unquote(path[len("models/") :])
    raise OpenAIServingError(
        openai_error(
            f"Invalid URL: no route {route!r}; the OpenAI routes are {', '.join(ROUTES)} "
            "(and /v1/models/{model}, /v1/responses/{id}, /v1/responses/{id}/input_items).",
            INVALID_REQUEST,
            "openai_route",
            "unknown_url",
            404,
        )
    )


def coalesce_chunks(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One yield's chunks with each choice's consecutive plain-text chunks merged into one.

    A stream yield carries a batch of tokens (1, 3, 9, 27, 50, ...); sending that batch as one
    chunk per choice instead of one per token gives the client one event to parse where it had
    fifty, with the same text, logprobs (lists concatenated), finish reason and usage (the
    latest) in the end. Chat deltas of content merge, and so do deltas of reasoning_content,
    never one kind into the other. Chunks that carry a role or tool calls, completions chunks
    with reasoning, and chunks without exactly one choice (the usage chunk), are left as they
    are; nothing merges past a finish reason.
    """
    out: list[dict[str, Any]] = []
    last: dict[int, dict[str, Any]] = {}  # choice index -> its mergeable chunk in `out`
    for chunk in chunks:
        choices = chunk["choices"]
        choice = choices[0] if len(choices) == 1 else None
        key = _text_key(choice)
        if choice is None or key is None:
            out.append(chunk)
            for c in choices:  # later text must not jump ahead of this chunk
                last.pop(c.get("index"), None)
            continue
        index = choice["index"]
        prev = last.get(index)
        if prev is not None and _merge_into(prev, chunk, key):
            continue
        chunk = {**chunk, "choices": [dict(choice)]}
        if key == "delta":
            chunk["choices"][0]["delta"] = dict(choice["delta"])
        out.append(chunk)
        last[index] = chunk
    return out


def _text_key(choice: dict[str, Any] | None) -> str | None:
    """ "text" (completions) or "delta" (chat, content only); None where it must not merge."""
    if choice is None:
        return None
    if "text" in choice:
        return None if "reasoning_content" in choice else "text"
    delta = choice.get("delta")
    if isinstance(delta, dict) and (
        set(delta) <= {"content"} or set(delta) == {"reasoning_content"}
    ):
        return "delta"
    return None


def _merge_into(prev: dict[str, Any], chunk: dict[str, Any], key: str) -> bool:
    p, c = prev["choices"][0], chunk["choices"][0]
    if p["finish_reason"] is not None or (p["logprobs"] is None) != (c["logprobs"] is None):
        return False
    if key == "text":
        p["text"] += c["text"]
        if c["logprobs"] is not None:
            p["logprobs"] = merge_completion_logprobs([p["logprobs"], c["logprobs"]])
    else:
        if p["delta"] and c["delta"] and set(p["delta"]) != set(c["delta"]):
            return False  # reasoning and content stay in their order
        for name in ("reasoning_content", "content"):
            if name in c["delta"]:
                p["delta"][name] = p["delta"].get(name, "") + c["delta"][name]
        if c["logprobs"] is not None:
            content = p["logprobs"]["content"] + c["logprobs"]["content"]
            p["logprobs"] = {**p["logprobs"], "content": content}  # `refusal` kept
    p["finish_reason"] = c["finish_reason"]
    if "stop_reason" in c:
        p["stop_reason"] = c["stop_reason"]
    if "usage" in chunk:
        prev["usage"] = chunk["usage"]
    return True


def _context_length_message(e: ContextLengthError, what: str) -> str:
    """OpenAI's wording of a context-length error."""
    limit, n = e.max_model_len, e.num_prompt_tokens
    if e.max_tokens is None:
        return (
            f"This model's maximum context length is {limit} tokens. However, your {what} "
            f"resulted in {n} tokens, which leaves no room for the completion. "
            f"Please reduce the length of the {what}."
        )
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{n + e.max_tokens} tokens ({n} in the {what}, {e.max_tokens} in the "
        f"completion). Please reduce the length of the {what} or completion."
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class _PendingImages:
    """A chat whose messages carry images: the rendered text (one placeholder per image, as
    the template wrote them) and the images' references, in order."""

    text: str
    refs: list[ImageRef]
    add_special_tokens: bool


@dataclass
class _Plan:
    """A validated request: prompts x sequences engine requests and how to shape their outputs."""

    response_id: str
    prompts: list[PreparedPrompt]  # validated once; their grammar and adapter added by `_prepare`
    params: SamplingParams  # as asked (n, best_of, logprobs)
    sequences: list[SamplingParams]  # one engine request of each prompt per entry (best_of)
    stream: bool
    include_usage: bool
    continuous_usage: bool
    formatter: ChatFormatter | CompletionFormatter
    lora: LoRARequest | None = None  # the adapter the request's `model` names
    priority: int = 0  # lower served first (SCHEDULING_POLICY=priority)
    # A prompt with images: its rendered text and image references, prepared (into `prompts`)
    # once the images are loaded, off the preparation thread (`OpenAIServing._load_images`).
    images: _PendingImages | None = None

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


class OpenAIServing:
    """Serves /v1/chat/completions, /v1/completions and /v1/models from one engine."""

    def __init__(
        self,
        engine: EngineClient,
        *,
        served_model_name: str,
        response_role: str = "assistant",
        chat_template: str | None = None,
        raw_output: bool = True,
        model_aliases: Sequence[str] = (),
        unlisted_aliases: Sequence[str] = (),
        enable_auto_tool_choice: bool = False,
        tool_call_parser: str | None = None,
        limits: RequestLimits | None = None,
        reasoning_parser: str | None = None,
        structured_in_reasoning: bool = False,
        lora_modules: Sequence[LoRARequest] = (),
        media: MediaConfig | None = None,
        harmony: bool | None = None,
        metrics: Callable[[], str] | None = None,
        version: str = "",
        response_store: ResponseStore | None = None,
    ) -> None:
        """`model_aliases`: further names requests may use, listed by /v1/models after
        `served_model_name` (SERVED_MODEL_NAME's other names); `unlisted_aliases`: names
        requests may use that /v1/models does not list (MODEL_NAME as written, so both it and
        OPENAI_SERVED_MODEL_NAME_OVERRIDE work); responses echo the name the request used.
        `enable_auto_tool_choice` / `tool_call_parser`: ENABLE_AUTO_TOOL_CHOICE and
        TOOL_CALL_PARSER (a registered parser name; plugins are loaded before).
        `limits`: what one request may ask for (api.limits).
        `structured_in_reasoning`: a request's structured output constrains the reasoning
        too (STRUCTURED_OUTPUTS_ENABLE_IN_REASONING); off, it starts after `</think>`.
        `lora_modules`: the adapters served (LORA_MODULES); a request whose `model` is an
        adapter's name runs with it, and /v1/models lists them after the base model.
        `media`: how a vision-language model's request images are loaded (LIMIT_MM_PER_PROMPT,
        MAX_IMAGE_BYTES, ...; api.media).
        `harmony`: whether the model speaks gpt-oss's harmony format (None: a gpt-oss config,
        as vLLM decides; see harmony.py).
        `metrics`: renders the worker's Prometheus metrics (/metrics; None: ENABLE_METRICS
        off); `version`: what /version answers.
        `response_store`: where /v1/responses keeps responses (response_store.py; default: a
        bounded store in this process)."""
        self.engine = engine
        self.metrics, self.version = metrics, version
        self.response_store: ResponseStore = (
            MemoryResponseStore() if response_store is None else response_store
        )
        self.limits = limits or RequestLimits()
        self.media = media or MediaConfig()
        info = getattr(engine, "model_info", None)
        self.image_input = bool(getattr(info, "image_input", False))
        # Sampling defaults from the model's generation_config.json (vLLM's
        # --generation-config auto), for the parameters a request leaves unset.
        defaults = getattr(info, "sampling_defaults", None)
        self.sampling_defaults: dict[str, Any] = dict(getattr(defaults, "values", None) or {})
        # The text standing for one image, for a template that reads content as a string (the
        # engine may name it; without it such a template cannot take images).
        self.image_placeholder: str | None = getattr(info, "image_placeholder", None)
        self.chat_template = chat_template
        tokenizer = getattr(engine, "tokenizer", None)
        template = chat_template_source(tokenizer, chat_template)
        # A gpt-oss model speaks harmony (api/openai/harmony.py): its prompts, tool calls and
        # reasoning are the library's, whatever the template, parsers and TOOL_CALL_PARSER say.
        if harmony is None:
            harmony = speaks_harmony(getattr(engine, "model_config", None))
        self.harmony: Any = load_encoding() if harmony else None
        self.auto_tool_parser: type[ToolParser] | None = None
        self.auto_tool_unavailable: str | None = None  # why `"auto"` is refused, when it is
        self.describe_tools = False  # the template ignores tools: ours describes them
        if not enable_auto_tool_choice:
            self.auto_tool_unavailable = (
                '"auto" tool choice is off on this worker (ENABLE_AUTO_TOOL_CHOICE=false)'
            )
        elif tool_call_parser is None and self.harmony is None:
            tool_call_parser = self._auto_tool_parser_name(tokenizer, template)
        if tool_call_parser and self.harmony is None:
            self.auto_tool_parser = get_tool_parser(tool_call_parser)
        self.enable_auto_tool_choice = enable_auto_tool_choice and (
            self.auto_tool_parser is not None or self.harmony is not None
        )
        if self.harmony is not None:
            reasoning_parser = None
            logger.info(
                "chat format: harmony (gpt-oss): prompts rendered by openai-harmony, outputs "
                "parsed into reasoning_content, tool_calls and content"
            )
        if reasoning_parser == "auto":
            reasoning_parser = detect_reasoning_parser(template)
            if reasoning_parser is not None:
                logger.info("reasoning: parser %r, from the chat template", reasoning_parser)
        self.reasoning_parser: type[ReasoningParser] | None = (
            REASONING_PARSERS[reasoning_parser] if reasoning_parser not in (None, "none") else None
        )
        self.structured_in_reasoning = structured_in_reasoning
        self._reasoning_end_ids: tuple[int, ...] | None = None
        self.served_model_name = served_model_name
        self.model_names: tuple[str, ...] = tuple(
            dict.fromkeys([served_model_name, *(a for a in model_aliases if a)])
        )
        self.unlisted_names: tuple[str, ...] = tuple(
            a for a in dict.fromkeys(unlisted_aliases) if a and a not in self.model_names
        )
        # Shared with the native route and changed by the runtime LoRA routes (api/lora.py).
        self.loras = (
            lora_modules if isinstance(lora_modules, LoRAAdapters) else LoRAAdapters(lora_modules)
        )
        self.response_role = response_role
        self.raw_output = raw_output
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.created = int(time.time())

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def _auto_tool_parser_name(self, tokenizer: Any, template: str) -> str | None:
        """TOOL_CALL_PARSER unset: the format the chat template teaches; the default prompt's
        format where the template ignores tools; else None (auto off, and why)."""
        name = detect_tool_parser(template)
        if name is not None:
            logger.info("tools: tool-call parser %r, from the chat template", name)
            return name
        if tokenizer is not None and not template_renders_tools(tokenizer, self.chat_template):
            self.describe_tools = True
            logger.info(
                "tools: the chat template ignores tools; they are described in a system "
                "message and calls read as %r",
                DEFAULT_TOOL_PARSER,
            )
            return DEFAULT_TOOL_PARSER
        self.auto_tool_unavailable = (
            '"auto" tool choice needs a TOOL_CALL_PARSER: this model\'s chat template '
            "shows no tool-call format the worker recognises"
        )
        logger.warning(
            "tools: no tool-call format found in the chat template; tool_choice "
            '"auto" is off (set TOOL_CALL_PARSER to turn it on)'
        )
        return None

    # -- entry point ------------------------------------------------------------------------

    async def handle(
        self, route: str, body: Any, batch: BatchSizes | None = None, method: str | None = None
    ) -> AsyncIterator[Any]:
        """Runs one OpenAI request; see the module docstring for what it yields. `method`: the
        HTTP method, where a route has several (GET or DELETE /v1/responses/{id}); None: the
        route's usual one."""
        try:
            kind, arg = parse_route(route)
            if kind in ("messages", "count_tokens"):  # in Anthropic's shapes, errors included
                run = anthropic.handle_messages(self, kind, body, batch or BatchSizes())
                async with aclosing(run) as items:
                    async for item in items:
                        yield item
                return
            if kind in UTILITY_ROUTES:
                yield await self._utility(kind, body)
                return
            if kind in LORA_ROUTES:
                yield await self._lora_update(kind, body)
                return
            if kind in ("response", "response_items"):
                yield await self._stored_response(kind, arg or "", method, route)
                return
            if kind == "embeddings":
                yield await create_embedding(self, body)
                return
            if kind in POOLING_KINDS:
                yield await create_pooling_response(self, kind, body)
                return
            if kind in ("chat", "completions", "responses") and self._embeds_only():
                task = self.engine.task
                routes = {
                    "embed": "/v1/embeddings (and /score, /rerank, /pooling)",
                    "classify": "/classify (and /pooling; /score, /rerank with one label)",
                    "score": "/score, /rerank (and /classify, /pooling)",
                }.get(task, "the pooling routes")
                raise OpenAIServingError.bad_request(
                    f"This model is served for {task} (TASK={task}): generation routes are "
                    f"off; use {routes}, or start the worker with TASK=generate.",
                    None,
                    "model_not_generative",
                )
            if kind == "models":
                yield list_models(
                    self.model_names, self.created, self.max_model_len, self._adapter_cards()
                )
                return
            if kind == "model":
                yield retrieve_model(
                    arg or "",
                    self.model_names + self.unlisted_names,
                    self.created,
                    self.max_model_len,
                    self._adapter_cards(),
                )
                return
            # Parsing, the chat template and the tokenizer run off the event loop.
            responses: ResponseFormatter | None = None
            if kind == "responses":
                history = await self._history(body)
                plan, responses = await prepare(self._responses_plan, body, history)
            elif kind == "chat":
                plan = await prepare(self._chat_plan, body)
            else:
                plan = await prepare(self._completion_plan, body)
            if plan.images is not None:
                await self._load_images(plan)
            await self._prepare(plan)
        except Exception as exc:
            yield self._error_from(exc)
            return
        if responses is not None:
            if plan.stream:
                run = self._responses_stream(plan, responses, batch or BatchSizes())
            else:
                run = self._responses_complete(plan, responses)
        elif plan.stream:
            run = self._stream(plan, batch or BatchSizes())
        else:
            run = self._complete(plan)
        async with aclosing(run) as items:
            async for item in items:
                yield item

    async def _load_images(self, plan: _Plan) -> None:
        """A chat with images: the images loaded (concurrently, in threads; a bad one is the
        request's 400 naming its part), then the prompt processed by the engine (the model's
        processor expands each image's placeholder) and fitted, on the preparation thread."""
        pending = plan.images
        assert pending is not None
        images = await load_images(pending.refs, self.media)
        mm = MultiModalInput(pending.text, images, pending.add_special_tokens)
        prepared = await prepare(self._prepare_prompt, mm, plan.params, "messages")
        plan.prompts = [prepared]
        plan.images = None
        after = self._structured_after(plan.params, prepared.token_ids)
        if after:
            plan.params = dataclasses.replace(plan.params, structured_after=after)
            plan.sequences = sequence_params(plan.params)

    async def _prepare(self, plan: _Plan) -> None:
        """Completes the plan's prompts before anything streams: the grammar compiled (an
        invalid schema, regex or grammar is the request's 400) and the adapter read, once for
        every sequence of every prompt; the engine then checks none of it again."""
        plan.prompts = [await self.engine.prepare(p, plan.params, plan.lora) for p in plan.prompts]

    async def _utility(self, kind: str, body: Any) -> dict[str, Any] | str:
        """/tokenize, /detokenize (tokenization.py), /version, and /metrics: the Prometheus
        text itself, a string (the devserver answers it as text/plain)."""
        if kind == "tokenize":
            return await prepare(tokenize, self, body)
        if kind == "detokenize":
            return await prepare(detokenize, self, body)
        if kind == "version":
            return {"version": self.version}
        if self.metrics is None:
            raise OpenAIServingError(
                openai_error(
                    "Metrics are off on this worker (ENABLE_METRICS=false).",
                    INVALID_REQUEST,
                    "openai_route",
                    "unknown_url",
                    404,
                )
            )
        return self.metrics()

    # -- request -> plan --------------------------------------------------------------------

    @staticmethod
    def _parse(model_cls: type[BaseModel], body: Any) -> Any:
        if not isinstance(body, dict):
            raise OpenAIServingError.bad_request(
                f"The request body must be a JSON object, got {type(body).__name__}.",
                None,
                "invalid_type",
            )
        try:
            # Jobs can be built in Python, so check the body is JSON at all (no sets, bytes,
            # objects, NaN or cycles) before the schema does.
            json.dumps(body, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise OpenAIServingError.bad_request(
                f"The request body is not valid JSON: {e}.", None, "invalid_json"
            ) from e
        try:
            return model_cls.model_validate(body)
        except ValidationError as e:
            raise OpenAIServingError(validation_error(e)) from e

    def _embeds_only(self) -> bool:
        """The model serves pooling only (TASK embed, classify or score): no generation."""
        return getattr(self.engine, "task", "generate") != "generate"

    def _check_model(self, model: str | None) -> str:
        """The name to put in responses; a name this worker does not serve is OpenAI's 404.
        A missing or empty name means the served model, as in vLLM."""
        if not model:
            return self.served_model_name
        if model in self.model_names or model in self.unlisted_names or model in self.loras:
            return model
        raise OpenAIServingError(model_not_found(model))

    async def _lora_update(self, kind: str, body: Any) -> str:
        """vLLM's runtime LoRA routes: its plain-text success line, or OpenAIServingError (the
        routes off: 404 saying how to turn them on; a bad body or adapter: 400; an unknown
        name to unload: 404)."""
        try:
            self.loras.check_allowed()
            if kind == "load_lora_adapter":
                load: LoadLoRAAdapterRequest = self._parse(LoadLoRAAdapterRequest, body)
                await self.loras.load(
                    self.engine,
                    load.lora_name,
                    load.lora_path,
                    reserved=self.model_names + self.unlisted_names,
                    replace=load.load_inplace,
                )
                return f"Success: LoRA adapter '{load.lora_name}' added successfully."
            unload: UnloadLoRAAdapterRequest = self._parse(UnloadLoRAAdapterRequest, body)
            await self.loras.unload(self.engine, unload.lora_name)
            return f"Success: LoRA adapter '{unload.lora_name}' removed successfully."
        except LoRAUpdateError as e:
            raise OpenAIServingError(
                openai_error(str(e), INVALID_REQUEST, e.param, None, e.status)
            ) from None

    def _priority(self, priority: int) -> int:
        """The request's priority, refused (400 naming `priority` and SCHEDULING_POLICY) unless
        the engine schedules by priority; 0, every request's, always goes."""
        if priority:
            self.engine.check_priority(priority)
        return priority

    def _adapter_cards(self) -> list[tuple[str, str, str]]:
        """(name, root, parent) of each served adapter, vLLM's model cards for them."""
        return [
            (r.lora_name, r.lora_path, r.base_model_name or self.served_model_name)
            for r in self.loras.values()
        ]

    def _prepare_prompt(
        self, prompt: list[int] | MultiModalInput, params: SamplingParams, param: str
    ) -> PreparedPrompt:
        """The prompt validated once by the engine: truncate_prompt_tokens applied (keep the
        last k) and the context length checked, before any engine request exists, so a job
        fails whole instead of partly queued. A prompt with images is processed here (its
        placeholders expanded), so its images count towards the context."""
        try:
            return self.engine.prepare_prompt(prompt, params)
        except ContextLengthError as e:
            message = _context_length_message(e, "messages" if param == "messages" else "prompt")
            raise OpenAIServingError.bad_request(
                message, param, "context_length_exceeded"
            ) from None
        except InvalidRequestError as e:
            if isinstance(prompt, MultiModalInput):
                raise OpenAIServingError.bad_request(str(e), e.param or param) from None
            raise OpenAIServingError.bad_request(
                f"Invalid value for '{param}': the prompt is empty (it encodes to no tokens).",
                param,
                "invalid_value",
            ) from None

    def _check_limits(self, body: Any, chat: bool) -> None:
        """The request's size against the limits (api.limits), on the body as sent: before the
        schema, the template or the tokenizer spend anything on it. A value of the wrong type
        is left for the schema to name."""
        if not isinstance(body, dict):
            return
        try:
            if chat:
                self.limits.check_messages(body.get("messages"))
                self.limits.check_tools(body.get("tools"))
            else:
                self.limits.check_prompts(body.get("prompt"))
                self.limits.check_prompt_chars(string_chars(body.get("prompt")), "prompt")
            self.limits.check_sampling(
                n=body.get("n"),
                best_of=body.get("best_of"),
                stop=body.get("stop"),
                logit_bias=body.get("logit_bias"),
            )
        except RequestLimitError as e:
            # Here, not in `handle`: a Responses request renames the field (_responses_plan).
            raise OpenAIServingError(request_error(e)) from None

    def _chat_plan(self, body: Any, renames: dict[str, str] | None = None) -> _Plan:
        """`renames`: how a Responses request names the chat body's message fields."""
        self._check_limits(body, chat=True)
        request: ChatCompletionRequest = self._parse(ChatCompletionRequest, body)
        model = self._check_model(request.model)
        tools = validate_tools(request.tools)
        choice = resolve_tool_choice(
            tools,
            request.tool_choice,
            auto_enabled=self.enable_auto_tool_choice,
            why_not=self.auto_tool_unavailable,
        )
        parallel = request.parallel_tool_calls is not False
        make_parser = None
        make_harmony: Callable[[], HarmonyParser] | None = None
        pending: _PendingImages | None = None
        prompts: list[PreparedPrompt] = []
        if self.harmony is not None:
            params, ids, make_harmony = self._harmony_chat(request, tools, choice, renames)
        else:
            params = chat_sampling_params(
                request, tool_choice_spec(tools, choice, parallel), self.sampling_defaults
            )
        if self.harmony is None and (
            choice.mode != "none" and not (choice.mode == "auto" and self.auto_tool_parser is None)
        ):
            auto = self.auto_tool_parser

            def make_parser() -> ToolParser | None:
                return parser_for_tool_choice(choice, auto, tools)

            if choice.mode == "auto" and auto.needs_special_tokens:
                params = dataclasses.replace(params, skip_special_tokens=False)
        params.check_vocab(self.vocab_size)
        # Only where the model must decide to call: named and required calls are forced by the
        # grammar, as in vLLM, and the description costs hundreds of tokens.
        describe = self.describe_tools and choice.mode == "auto"
        if self.harmony is not None:
            prompts = [self._prepare_prompt(ids, params, "messages")]
        elif self.image_input:
            # Counted on the messages as sent, before the template or any fetch.
            check_image_count(
                count_image_parts(request.messages),
                self.media,
                rename_param("messages", renames or {}),
            )
            refs: list[ImageRef] = []
            text = render_chat_text(
                request,
                self.tokenizer,
                self.chat_template,
                tools,
                describe,
                form=self._content_form(request.chat_template),
                images=refs,
                renames=renames,
            )
            if refs:
                pending = _PendingImages(text, refs, request.add_special_tokens)
            else:
                ids = self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
                prompts = [self._prepare_prompt(list(ids), params, "messages")]
        else:
            ids = render_chat_prompt(
                request, self.tokenizer, self.chat_template, tools, describe, renames=renames
            )
            prompts = [self._prepare_prompt(ids, params, "messages")]
        if prompts:
            after = self._structured_after(params, prompts[0].token_ids)
            if after:
                params = dataclasses.replace(params, structured_after=after)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        options = request.stream_options
        formatter = ChatFormatter(
            response_id,
            int(time.time()),
            model,
            self.response_role,
            echo_text(request, self.response_role),
            top_logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            prompt_logprobs=request.prompt_logprobs,
            decoder=TokenDecoder(self.tokenizer),
            tool_parser=make_parser,
            tool_mode=choice.mode,
            parallel_tool_calls=parallel,
            # Per request: DeepSeek V3.1 thinks only when its `thinking` kwarg is set.
            reasoning_parser=(
                functools.partial(self.reasoning_parser, request.chat_template_kwargs)
                if self.reasoning_parser is not None
                else None
            ),
            harmony=make_harmony,
        )
        return _Plan(
            response_id=response_id,
            prompts=prompts,
            params=params,
            sequences=sequence_params(params),
            stream=bool(request.stream),
            include_usage=bool(options and options.include_usage),
            continuous_usage=bool(options and options.continuous_usage_stats),
            formatter=formatter,
            lora=self.loras.get(model),
            priority=self._priority(request.priority),
            images=pending,
        )

    def _harmony_chat(
        self,
        request: ChatCompletionRequest,
        tools: list[dict[str, Any]],
        choice: ToolChoice,
        renames: dict[str, str] | None,
    ) -> tuple[SamplingParams, list[int], Callable[[], HarmonyParser]]:
        """A gpt-oss chat: its sampling parameters, its harmony prompt and the factory of its
        output parsers. The turn ends at `<|return|>` or `<|call|>`. A named tool choice ends
        the prompt inside that function's call header, so the model writes only the arguments,
        constrained to the function's parameters; "required" ends it at `to=functions.` (the
        model writes a name, then arguments constrained to any tool's parameters, after
        `<|message|>`). Other structured output (response_format, guided_*) constrains the
        final answer, from `<|channel|>final<|message|>` on."""
        enc = self.harmony
        call: str | None = None
        spec: StructuredOutputSpec | None = None
        after: tuple[int, ...] = ()
        if choice.mode == "named" or (choice.mode == "required" and len(tools) == 1):
            named = (
                choice
                if choice.mode == "named"
                else ToolChoice("named", tools[0]["function"]["name"])
            )
            call = named.name
            spec = tool_choice_spec(tools, named)
        elif choice.mode == "required":
            call = ""
            schemas = [
                t["function"].get("parameters") or {"type": "object", "properties": {}}
                for t in tools
            ]
            spec = StructuredOutputSpec(json={"anyOf": schemas}, param="tool_choice")
            after = (message_start_id(enc),)
        params = chat_sampling_params(request, spec, self.sampling_defaults)
        if params.structured is not None and spec is None:
            after = final_header_ids(enc)
        stops = [t for t in stop_ids(enc) if t not in params.stop_token_ids]
        params = dataclasses.replace(
            params, stop_token_ids=[*params.stop_token_ids, *stops], structured_after=after
        )
        messages = template_messages(request.messages, ContentForm(), [], renames)
        for item, message in zip(messages, request.messages):
            if message.tool_calls:  # arguments as sent (the template gets them as objects)
                item["tool_calls"] = message.tool_calls
        try:
            prompt = render_prompt(
                messages,
                tools=tools if choice.mode != "none" else None,
                reasoning_effort=request.reasoning_effort,
                options=request.chat_template_kwargs,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                call=call,
            )
        except HarmonyPromptError as e:
            param = rename_param(e.param, renames or {}) if e.param else None
            raise OpenAIServingError.bad_request(str(e), param, "invalid_value") from None
        calls = choice.mode != "none"

        def make_harmony() -> HarmonyParser:
            return HarmonyParser(enc, header=prompt.header, calls=calls)

        return params, prompt.token_ids, make_harmony

    def _content_form(self, request_template: str | None) -> ContentForm:
        """How a vision-language model's message content reaches the template in effect."""
        source = chat_template_source(self.tokenizer, request_template or self.chat_template)
        return ContentForm(
            images=True,
            part_lists=content_format(source) == "openai",
            placeholder=self.image_placeholder,
        )

    def _responses_plan(
        self, body: Any, history: list[dict[str, Any]] | None = None
    ) -> tuple[_Plan, ResponseFormatter]:
        """A Responses request is answered by the chat route (see responses.py); `history`:
        the items of the stored response it continues (previous_response_id)."""
        request: ResponsesRequest = self._parse(ResponsesRequest, body)
        renames: dict[str, str] = {}
        try:
            plan = self._chat_plan(to_chat_body(request, renames, history), renames)
        except OpenAIServingError as e:
            info = e.error.get("error") or {}
            if info.get("param") == "messages":  # the context-length error: say it as asked
                info["param"] = "input"
                info["message"] = str(info.get("message", "")).replace("messages", "input")
            raise
        plan.include_usage = True  # the closing event carries the usage
        tokenizer = self.tokenizer

        def count_tokens(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False))

        model = plan.formatter.model
        return plan, ResponseFormatter(request, model, count_tokens, history)

    # -- stored responses -------------------------------------------------------------------

    async def _history(self, body: Any) -> list[dict[str, Any]] | None:
        """The items the stored response `previous_response_id` names continues with; 404 when
        it is not stored. (A badly typed id is left to the request's validation.)"""
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        if not isinstance(previous, str) or not previous:
            return None
        record = await self._store_call(self.response_store.get(previous))
        if record is None:
            raise OpenAIServingError(response_not_found(previous, "previous_response_id"))
        return history_of(record)

    async def _stored_response(
        self, kind: str, response_id: str, method: str | None, route: str
    ) -> dict[str, Any]:
        """GET /v1/responses/{id} (the Response), DELETE /v1/responses/{id}, GET
        /v1/responses/{id}/input_items (a page of its input items)."""
        method = (method or "GET").upper()
        allowed = ("GET", "DELETE") if kind == "response" else ("GET",)
        if method not in allowed:
            raise OpenAIServingError(
                openai_error(
                    f"Method {method} is not allowed on {route!r}: use {' or '.join(allowed)}.",
                    INVALID_REQUEST,
                    "openai_method",
                    "method_not_allowed",
                    400,
                )
            )
        store = self.response_store
        if method == "DELETE":
            if not await self._store_call(store.delete(response_id)):
                raise OpenAIServingError(response_not_found(response_id))
            return response_deleted(response_id)
        record = await self._store_call(store.get(response_id))
        if record is None:
            raise OpenAIServingError(response_not_found(response_id))
        if kind == "response":
            return record["response"]
        query = dict(parse_qsl(route.partition("?")[2], keep_blank_values=True))
        return input_items_page(record, query)

    async def _keep(self, fmt: ResponseFormatter, response: dict[str, Any]) -> str | None:
        """Stores `response` unless the request said `store: false`; the error's message when
        the store failed."""
        if fmt.request.store is False:
            return None
        try:
            await self.response_store.put(response["id"], fmt.stored_record(response))
        except ResponseStoreError as e:
            logger.error("%s", e)
            return f"the response was generated but could not be stored: {e}"
        return None

    @staticmethod
    async def _store_call(aw: Any) -> Any:
        try:
            return await aw
        except ResponseStoreError as e:
            logger.error("%s", e)
            raise OpenAIServingError(openai_error(str(e), status=503)) from e

    def _structured_after(self, params: SamplingParams, prompt_ids: list[int]) -> tuple[int, ...]:
        """The tokens after which a reasoning model's structured output starts: `</think>`'s,
        unless there is no constraint, no reasoning parser, STRUCTURED_OUTPUTS_ENABLE_IN_REASONING
        is on, or the prompt already closed the thinking (Qwen 3 with thinking off ends its
        prompt with an empty `<think></think>` block, and the model then writes only the
        answer). A parser whose reasoning ends otherwise (Granite's "Here is my response:")
        is constrained from the first token: the model answers without thinking."""
        if (
            params.structured is None
            or self.reasoning_parser is None
            or self.structured_in_reasoning
            or REASONING_END not in self.reasoning_parser.ends
        ):
            return ()
        tokenizer = self.tokenizer
        tail = tokenizer.decode(prompt_ids[-16:], skip_special_tokens=False).rstrip()
        if tail.endswith(REASONING_END):
            return ()
        if self._reasoning_end_ids is None:  # once: the tokenizer does not change
            self._reasoning_end_ids = tuple(
                tokenizer.encode(REASONING_END, add_special_tokens=False)
            )
        return self._reasoning_end_ids

    def _completion_plan(self, body: Any) -> _Plan:
        self._check_limits(body, chat=False)
        request: CompletionRequest = self._parse(CompletionRequest, body)
        model = self._check_model(request.model)
        params = completion_sampling_params(request, self.sampling_defaults)
        params.check_vocab(self.vocab_size)
        inputs = tokenize_prompts(request, self.tokenizer, self.vocab_size)
        prompts: list[PreparedPrompt] = []
        echo: list[str] | None = [] if request.echo else None
        for param, prompt in inputs:
            prepared = self._prepare_prompt(prompt.token_ids, params, param)
            ids = prepared.token_ids
            prompts.append(prepared)
            if echo is not None:
                if prompt.text is not None and len(ids) == len(prompt.token_ids):
                    echo.append(prompt.text)
                else:  # token ids, or a truncated prompt: echo what the model saw
                    echo.append(self.tokenizer.decode(ids, skip_special_tokens=False))
        harmony = self._harmony_completions(prompts)
        if harmony is not None:
            stops = [t for t in stop_ids(self.harmony) if t not in params.stop_token_ids]
            params = dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *stops])
        response_id = f"cmpl-{uuid.uuid4().hex}"
        options = request.stream_options
        formatter = CompletionFormatter(
            response_id,
            int(time.time()),
            model,
            echo,
            request.num_choices,
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
            prompt_ids=[p.token_ids for p in prompts],
            decoder=TokenDecoder(self.tokenizer),
            harmony=harmony,
            prompt_only=prompt_only(request),
        )
        return _Plan(
            response_id=response_id,
            prompts=prompts,
            params=params,
            # A streamed echo with logprobs opens each choice with the prompt's logprobs.
            sequences=sequence_params(
                params, prompt_logprobs_once=not (request.stream and request.echo)
            ),
            stream=bool(request.stream),
            include_usage=bool(options and options.include_usage),
            continuous_usage=bool(options and options.continuous_usage_stats),
            formatter=formatter,
            lora=self.loras.get(model),
            priority=self._priority(request.priority),
        )

    def _harmony_completions(
        self, prompts: list[PreparedPrompt]
    ) -> list[Callable[[], HarmonyParser] | None] | None:
        """A gpt-oss model's completions: for each prompt that ends inside an assistant
        message (a harmony prompt, `...<|start|>assistant`), the factory of its output parsers;
        None when no prompt does (plain text in, plain text out)."""
        if self.harmony is None:
            return None
        enc = self.harmony
        out: list[Callable[[], HarmonyParser] | None] = []
        for p in prompts:
            header = prompt_header(enc, p.token_ids)
            if header is None:
                out.append(None)
                continue

            def make(header: list[int] = header) -> HarmonyParser:
                return HarmonyParser(enc, header=header, calls=False)

            out.append(make)
        return out if any(f is not None for f in out) else None

    # -- plan -> outputs --------------------------------------------------------------------

    def _engine_streams(self, plan: _Plan) -> list[AsyncIterator[EngineOutput]]:
        """One engine request per sequence of each prompt, with ids derived from the response
        id (unique). Stream p * len(sequences) + i is sequence i of prompt p."""
        count = len(plan.sequences)
        return [
            self.engine.generate(
                prepared, seq, f"{plan.response_id}-{p * count + i}", priority=plan.priority
            )
            for p, prepared in enumerate(plan.prompts)
            for i, seq in enumerate(plan.sequences)
        ]

    async def _complete(self, plan: _Plan) -> AsyncIterator[Any]:
        try:
            chosen, prompt_logprobs = await gather_results(
                self._engine_streams(plan), len(plan.prompts), plan.params
            )
        except Exception as exc:
            yield self._error_from(exc)
            return
        usage = _usage(
            sum(len(p.token_ids) for p in plan.prompts), sum(r.num_tokens for r in chosen)
        )
        yield plan.formatter.response(chosen, prompt_logprobs, usage)

    async def _stream(self, plan: _Plan, batch: BatchSizes) -> AsyncIterator[Any]:
        """Chunks of each batch of tokens (see BatchSizes) go out together; the batch that ends
        the last choice goes out with the closing events (usage, [DONE])."""
        async with aclosing(self._stream_chunks(plan, batch)) as parts:
            async for chunks, last in parts:
                if isinstance(chunks, dict):  # an error
                    yield chunks
                elif not self.raw_output:
                    if chunks or not last:
                        yield chunks
                elif last:
                    yield sse_events(chunks) + SSE_DONE
                else:
                    yield sse_events(chunks)

    async def _responses_complete(self, plan: _Plan, fmt: ResponseFormatter) -> AsyncIterator[Any]:
        async with aclosing(self._complete(plan)) as items:
            async for item in items:
                if is_error(item):
                    yield item
                    continue
                response = fmt.from_chat(item)
                failed = await self._keep(fmt, response)
                yield response if failed is None else openai_error(failed, status=503)

    async def _responses_stream(
        self, plan: _Plan, fmt: ResponseFormatter, batch: BatchSizes
    ) -> AsyncIterator[Any]:
        """The Responses events: `response.created` at once, then one yield per batch of
        tokens, as on chat."""
        yield self._emit_events(fmt.start())
        kept = False
        async with aclosing(self._stream_chunks(plan, batch)) as parts:
            async for chunks, _ in parts:
                events = fmt.fail(chunks) if isinstance(chunks, dict) else fmt.feed(chunks)
                if fmt.final is not None and not kept:  # the closing batch: stored first
                    kept = True
                    failed = await self._keep(fmt, fmt.final)
                    if failed is not None:
                        events = fmt.store_failed(events, failed)
                if events:
                    yield self._emit_events(events)

    def _emit_events(self, events: list[dict[str, Any]]) -> Any:
        return sse_events(events) if self.raw_output else events

    async def _stream_chunks(
        self, plan: _Plan, batch: BatchSizes
    ) -> AsyncIterator[tuple[list[dict[str, Any]] | dict[str, Any], bool]]:
        """(chunks, last) for each batch of tokens, the chunks coalesced, the last batch with
        the usage chunk; or (error dict, True) once, after which nothing follows."""
        fmt = plan.formatter
        n = plan.n
        prompt_lens = [len(p.token_ids) for p in plan.prompts]
        remaining = plan.num_choices
        generated = [0] * plan.num_choices
        pending: list[dict[str, Any]] = []
        for k in range(plan.num_choices):
            for chunk in fmt.head_chunks(k):
                if plan.continuous_usage:
                    chunk["usage"] = _usage(prompt_lens[k // n], 0)
                pending.append(chunk)
        try:
            async with (
                aclosing(merge_streams(self._engine_streams(plan))) as outputs,
                aclosing(
                    batch_stream(outputs, batch, weight=lambda item: len(item[1].new_token_ids))
                ) as batches,
            ):
                async for group in batches:
                    for stream, engine_out in group:
                        for k, out in choice_outputs(stream, engine_out, plan.params):
                            usage = None
                            if plan.continuous_usage:
                                usage = _usage(prompt_lens[k // n], out.num_output_tokens)
                            chunk = fmt.delta_chunk(k, out, usage)
                            if chunk is not None:
                                pending.append(chunk)
                            if out.finished:
                                generated[k] = out.num_output_tokens
                                remaining -= 1
                    if remaining == 0:
                        break  # the rest goes out with the closing events below
                    yield coalesce_chunks(pending), False
                    pending = []
        except Exception as exc:
            yield self._error_from(exc), True
            return
        if plan.include_usage:
            pending.append(fmt.usage_chunk(_usage(sum(prompt_lens), sum(generated))))
        yield coalesce_chunks(pending), True

    # -- errors -----------------------------------------------------------------------------

    @staticmethod
    def _error_from(exc: Exception) -> dict:
        if isinstance(exc, OpenAIServingError):
            return exc.error
        if isinstance(exc, REQUEST_ERRORS):
            return request_error(exc)
        if isinstance(exc, EngineDeadError):
            logger.error("OpenAI request failed in the engine: %s", exc)
            return openai_error(str(exc), SERVER_ERROR, None, None, 500)
        logger.exception("OpenAI request failed")
        return internal_error(exc)

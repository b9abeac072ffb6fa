"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API as a view of the chat route.

A Messages request is translated into a chat-completions body (`to_chat_body`): `system` becomes
the system message; user turns' `tool_result` blocks become tool messages (in their order) and
their text and image blocks the user message; assistant turns' `tool_use` blocks become the
turn's `tool_calls` and `thinking` blocks its `reasoning_content`; a last assistant turn is
continued (`continue_final_message`), as Anthropic's prefill; tools take chat's nested shape,
`tool_choice` auto/any/tool/none becomes "auto"/"required"/a named function/"none" (and
`disable_parallel_tool_use` `parallel_tool_calls: false`); `stop_sequences` become `stop`;
`thinking` switches the template's `enable_thinking`; `output_config.format` becomes
`response_format` and `output_config.effort` `reasoning_effort`. The chat route then does what
it does anyway: template, tools, grammar, the same tool and reasoning parsers, sampling.

`MessageFormatter` turns its answer back into a Message (reasoning -> `thinking` block, content ->
`text` block, calls -> `tool_use` blocks), or, streamed, its chunks into Anthropic's event
sequence: `message_start`, `ping`, then per block `content_block_start`,
`content_block_delta`s (`thinking_delta`, `text_delta`, `input_json_delta`),
`content_block_stop`, then `message_delta` (stop reason and usage) and `message_stop`. An error
after the stream began is an `error` event. Every error is Anthropic's shape:
`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`.

`max_tokens` is required, as Anthropic's. A `max_tokens` beyond what the context leaves after the
prompt is cut to fit, and a turn stopped there ends with `model_context_window_exceeded` (what
Anthropic's newer models do), so clients that always ask for large limits still work.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from pydantic import Field

from serverless_llm.engine import sequence_params

from .batching import BatchSizes
from .offload import prepare
from .openai.errors import ErrorDict, OpenAIServingError, http_status, is_error
from .openai.protocol import CHAT_ROUTE_EXTRAS, ChatRouteExtras, _Strict
from .openai.sse import sse_events

if TYPE_CHECKING:
    from .openai.serving import OpenAIServing, _Plan

__all__ = [
    "CountTokensRequest",
    "MessageFormatter",
    "MessagesRequest",
    "anthropic_error",
    "handle_messages",
    "to_chat_body",
]

# vLLM's extra sampling parameters are taken at the top level of a Messages body too (the
# `anthropic` client sends them with `extra_body`) and passed to the chat route as they are.
PASSTHROUGH = CHAT_ROUTE_EXTRAS

# Anthropic's error types by HTTP status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


class _MessagesBase(_Strict):
    """What a Messages request and a count_tokens request share."""

    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # Prompt caching is automatic here (the prefix cache): cache_control marks change nothing.
    cache_control: dict[str, Any] | None = None
    # Refused when set: they need Anthropic's servers.
    mcp_servers: list[Any] | None = None
    context_management: dict[str, Any] | None = None
    container: str | dict[str, Any] | None = None
    # Platform features and bookkeeping that change nothing about the output here.
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None


class MessagesRequest(_MessagesBase, ChatRouteExtras):
    """The body of POST /v1/messages: Anthropic's fields, then vLLM's extra sampling
    parameters."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None



class CountTokensRequest(_MessagesBase):
    """The body of POST /v1/messages/count_tokens: the prompt's fields, no sampling."""

    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# -- errors ----------------------------------------------------------------------------------


def anthropic_error(error: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI error dict (what the chat route and the serving layer produce) in Anthropic's
    shape, with the same HTTP status. The message names the field at fault, as OpenAI's
    `param` did."""
    status = http_status(error)
    info = error.get("error") if isinstance(error.get("error"), dict) else {}
    message = str(info.get("message") or "the request failed")
    param = info.get("param")
    if param and f"'{param}'" not in message and param not in message:
        message = f"{param}: {message}"
    default = "api_error" if status >= 500 else "invalid_request_error"
    out = ErrorDict(
        type="error", error={"type": _ERROR_TYPES.get(status, default), "message": message}
    )
    out.status = status
    return out


def _bad(message: str) -> OpenAIServingError:
    return OpenAIServingError.bad_request(message, None, "invalid_value")


# -- request -> chat body --------------------------------------------------------------------


def to_chat_body(
    request: MessagesRequest | CountTokensRequest, renames: dict[str, str] | None = None
) -> dict[str, Any]:
    """The chat-completions body that answers `request` (its `max_tokens` left out: the caller
    fits it to the context); a request this server cannot honour is a 400 naming the field.
    `renames` (filled in when given): chat message fields by the Messages names errors use."""
    for name in ("mcp_servers", "context_management", "container"):
        if getattr(request, name) is not None:
            raise _bad(f"{name}: not supported by this server (it runs no Anthropic tools).")
    names: dict[str, str] = {}
    body: dict[str, Any] = {"model": request.model, "messages": _messages(request, names)}
    if renames is not None:
        renames.update(names)
    if request.messages and request.messages[-1].get("role") == "assistant":
        # Anthropic's prefill: the answer continues the last assistant turn.
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    if request.tools:
        body["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        body["tool_choice"], parallel = _chat_tool_choice(request.tool_choice)
        if parallel is False:
            body["parallel_tool_calls"] = False
    kwargs = dict(getattr(request, "chat_template_kwargs", None) or {})
    thinking = _thinking(request)
    if thinking is not None and not {"enable_thinking", "thinking"} & kwargs.keys():
        # Qwen3/GLM templates read `enable_thinking`; DeepSeek V3.1's and Granite's `thinking`.
        # A request that set either itself keeps its own choice.
        kwargs.update(enable_thinking=thinking, thinking=thinking)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    if getattr(request, "chat_template", None) is not None:
        body["chat_template"] = request.chat_template
    _output_config(request.output_config, body)
    if isinstance(request, MessagesRequest):
        for name in ("temperature", "top_p", "top_k", "stream"):
            value = getattr(request, name)
            if value is not None:
                body[name] = value
        if request.stop_sequences:
            body["stop"] = request.stop_sequences
        for name in PASSTHROUGH:
            value = getattr(request, name)
            if value is not None and name not in ("chat_template", "chat_template_kwargs"):
                body[name] = value
    return body


def _thinking(request: MessagesRequest | CountTokensRequest) -> bool | None:
    """Whether the request turns the template's thinking on or off (None: leave the model's
    default). `budget_tokens` is checked as Anthropic does but not enforced: the model thinks
    until it closes its thinking or reaches max_tokens."""
    thinking = request.thinking
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return True
    if kind != "enabled":
        raise _bad("thinking.type: one of 'enabled', 'adaptive', 'disabled'.")
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise _bad("thinking.budget_tokens: a positive integer is required with type 'enabled'.")
    if isinstance(request, MessagesRequest) and budget >= request.max_tokens:
        raise _bad("max_tokens must be greater than thinking.budget_tokens.")
    return True


def _output_config(config: dict[str, Any] | None, body: dict[str, Any]) -> None:
    if not config:
        return
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise _bad("output_config.format: {'type': 'json_schema', 'schema': {...}}.")
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise _bad("output_config.format.schema: a JSON schema object.")
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema},
        }
    effort = config.get("effort")
    if effort is not None:
        if effort not in _EFFORTS:
            raise _bad("output_config.effort: one of low, medium, high, xhigh, max.")
        body["reasoning_effort"] = _EFFORTS[effort]


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}: a string or a list of content blocks.")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _bad(f"{where}.{j}: a content block object with a 'type'.")
    return content


def _text_of(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}.text: a string.")
    return text


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block as chat's image_url part."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise _bad(f"{where}.source: media_type and data strings.")
        url = f"data:{media};base64,{data}"
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise _bad(f"{where}.source: a base64 or url image source (this server keeps no files).")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{where}.tool_use_id: the id of the tool_use block it answers.")
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _bad(f"{where}.content.{j}: tool results carry text blocks only here.")
            texts.append(_text_of(part, f"{where}.content.{j}"))
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise _bad(f"{where}.content: a string or a list of text blocks.")
    if block.get("is_error"):
        # Chat templates have no field for a failed call: the model reads it in the text.
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _messages(
    request: MessagesRequest | CountTokensRequest, names: dict[str, str]
) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    system = request.system
    if isinstance(system, list):
        texts = []
        for j, block in enumerate(system):
            if not isinstance(block, dict) or block.get("type") != "text":
                raise _bad(f"system.{j}: a text block.")
            texts.append(_text_of(block, f"system.{j}"))
        system = "\n".join(texts)
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        where = f"messages.{i}"
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role: 'user' or 'assistant'.")
        if "content" not in message:
            raise _bad(f"{where}.content: Field required.")
        blocks = _blocks(message["content"], f"{where}.content")
        if role == "user":
            parts: list[dict[str, Any]] = []

            def flush(parts: list[dict[str, Any]] = parts, i: int = i) -> None:
                if not parts:
                    return
                names[f"messages[{len(messages)}].content"] = f"messages[{i}].content"
                if all(p["type"] == "text" for p in parts):
                    messages.append(
                        {"role": "user", "content": "\n".join(p["text"] for p in parts)}
                    )
                else:
                    messages.append({"role": "user", "content": list(parts)})
                parts.clear()

            for j, block in enumerate(blocks):
                at, kind = f"{where}.content.{j}", block["type"]
                if kind == "text":
                    parts.append({"type": "text", "text": _text_of(block, at)})
                elif kind == "image":
                    parts.append(_image_part(block, at))
                elif kind == "tool_result":
                    flush()
                    messages.append(_tool_result(block, at))
                else:
                    raise _bad(f"{at}: content blocks of type '{kind}' are not supported here.")
            flush()
            if not blocks:
                messages.append({"role": "user", "content": ""})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for j, block in enumerate(blocks):
            at, kind = f"{where}.content.{j}", block["type"]
            if kind == "text":
                texts.append(_text_of(block, at))
            elif kind == "tool_use":
                name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
                if not isinstance(name, str) or not isinstance(call_id, str):
                    raise _bad(f"{at}: a tool_use block needs an id and a name.")
                if not isinstance(args, dict):
                    raise _bad(f"{at}.input: an object.")
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args)},
                    }
                )
            elif kind == "thinking":
                if isinstance(block.get("thinking"), str):
                    reasoning.append(block["thinking"])
            elif kind == "redacted_thinking":
                continue  # nothing a local model can read
            else:
                raise _bad(f"{at}: content blocks of type '{kind}' are not supported here.")
        item: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            item["tool_calls"] = calls
        if reasoning:
            item["reasoning_content"] = "\n".join(reasoning)
        messages.append(item)
    return messages


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    where = f"tools.{i}"
    if tool.get("type") not in (None, "custom"):
        raise _bad(
            f"{where}.type: '{tool.get('type')}' is one of Anthropic's server tools, which this "
            "server does not run; describe it as a custom tool (name, description, input_schema)."
        )
    name, schema = tool.get("name"), tool.get("input_schema")
    if not isinstance(name, str):
        raise _bad(f"{where}.name: Field required.")
    if not isinstance(schema, dict):
        raise _bad(f"{where}.input_schema: a JSON schema object is required.")
    function: dict[str, Any] = {"name": name, "parameters": schema}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict[str, Any]) -> tuple[Any, bool | None]:
    """(chat's tool_choice, False when parallel calls are turned off)."""
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise _bad("tool_choice.name: required with type 'tool'.")
        return {"type": "function", "function": {"name": name}}, parallel
    raise _bad("tool_choice.type: one of 'auto', 'any', 'tool', 'none'.")


# -- chat answer -> Message ------------------------------------------------------------------


def _arguments(text: str) -> dict[str, Any]:
    """A call's JSON arguments as tool_use `input` (a call cut off by max_tokens: {})."""
    try:
        value = json.loads(text) if text else {}
    except (ValueError, RecursionError):  # RecursionError: nested too deep to read
        return {}
    return value if isinstance(value, dict) else {}


class MessageFormatter:
    """Builds the Message, or the stream's events, of one request from the chat route's answer.

    `clamped`: max_tokens was cut to the context, so a turn stopped by length ended there
    (`model_context_window_exceeded`) rather than at max_tokens. `omit_thinking`: the request
    asked for `display: "omitted"` (thinking blocks with no text)."""

    def __init__(
        self,
        model: str,
        stop_sequences: list[str] | None,
        *,
        clamped: bool = False,
        omit_thinking: bool = False,
    ) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.stop_sequences = stop_sequences or []
        self.clamped = clamped
        self.omit_thinking = omit_thinking
        self.input_tokens = 0
        # Streaming state.
        self._blocks: list[dict[str, Any]] = []  # the blocks opened so far
        self._open: int | None = None  # the index of the block deltas go to
        self._calls: dict[int, int] = {}  # chat tool-call index -> block index
        self._finish: tuple[str | None, Any] = (None, None)
        self._called = False

    def _stop(self, finish_reason: str | None, stop_reason: Any, called: bool) -> tuple[str, Any]:
        """(stop_reason, stop_sequence) for the chat choice's finish."""
        if called:
            return "tool_use", None
        if finish_reason == "length":
            return ("model_context_window_exceeded" if self.clamped else "max_tokens"), None
        if isinstance(stop_reason, str) and stop_reason in self.stop_sequences:
            return "stop_sequence", stop_reason
        return "end_turn", None

    def _usage(self, output_tokens: int) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }

    def _message(self, content: list[dict[str, Any]], stop: tuple[Any, Any], usage: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage,
        }

    def _thinking_block(self, text: str) -> dict[str, Any]:
        return {"type": "thinking", "thinking": "" if self.omit_thinking else text, "signature": ""}

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The Message for a chat.completion answer."""
        choice = chat["choices"][0]
        message = choice["message"]
        self.input_tokens = chat["usage"]["prompt_tokens"]
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append(self._thinking_block(message["reasoning_content"]))
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        calls = message.get("tool_calls") or []
        for call in calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": call["function"]["name"],
                    "input": _arguments(call["function"]["arguments"]),
                }
            )
        stop = self._stop(choice["finish_reason"], choice.get("stop_reason"), bool(calls))
        return self._message(content, stop, self._usage(chat["usage"]["completion_tokens"]))

    # The event stream.

    def start(self, input_tokens: int) -> list[dict[str, Any]]:
        """The events that open the stream, before any token."""
        self.input_tokens = input_tokens
        head = self._message([], (None, None), self._usage(0))
        return [{"type": "message_start", "message": head}, {"type": "ping"}]

    def feed(self, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The events of one batch of chat chunks; the usage chunk closes the stream."""
        events: list[dict[str, Any]] = []
        for chunk in chunks:
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    events += self._text("thinking", delta["reasoning_content"])
                if delta.get("content"):
                    events += self._text("text", delta["content"])
                for call in delta.get("tool_calls") or ():
                    events += self._call(call)
                if choice.get("finish_reason") is not None:
                    self._finish = (choice["finish_reason"], choice.get("stop_reason"))
            if not chunk["choices"] and "usage" in chunk:
                events += self._close(chunk["usage"]["completion_tokens"])
        return _merged(events)

    def fail(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """An error after the stream began: Anthropic's `error` event, which ends it."""
        return [dict(anthropic_error(error))]

    def _start_block(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._stop_block()
        self._blocks.append(block)
        self._open = len(self._blocks) - 1
        return events + [
            {"type": "content_block_start", "index": self._open, "content_block": block}
        ]

    def _stop_block(self) -> list[dict[str, Any]]:
        index, self._open = self._open, None
        return [] if index is None else [{"type": "content_block_stop", "index": index}]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._blocks[self._open]["type"] != kind:
            block = self._thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
            events += self._start_block(block)
        if kind == "thinking":
            if self.omit_thinking:
                return events
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "text_delta", "text": text}
        events.append({"type": "content_block_delta", "index": self._open, "delta": delta})
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        function = call.get("function") or {}
        key = call.get("index", 0)
        if key not in self._calls:
            self._called = True
            block = {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
                "name": function.get("name", ""),
                "input": {},
            }
            events += self._start_block(block)
            self._calls[key] = len(self._blocks) - 1
        index = self._calls[key]
        if function.get("arguments"):
            if self._open != index:  # not expected: a parser goes back to an earlier call
                return events
            delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        return events

    def _close(self, output_tokens: int) -> list[dict[str, Any]]:
        stop = self._stop(*self._finish, self._called)
        return self._stop_block() + [
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                "usage": {"output_tokens": output_tokens},
            },
            {"type": "message_stop"},
        ]


def _merged(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive deltas of one block in a batch merged into one event (a batch of tokens is
    one event, as on the OpenAI routes)."""
    out: list[dict[str, Any]] = []
    fields = {
        "text_delta": "text",
        "thinking_delta": "thinking",
        "input_json_delta": "partial_json",
    }
    for event in events:
        prev = out[-1] if out else None
        if (
            prev is not None
            and event["type"] == "content_block_delta"
            and prev["type"] == "content_block_delta"
            and prev["index"] == event["index"]
            and prev["delta"]["type"] == event["delta"]["type"]
        ):
            name = fields[event["delta"]["type"]]
            prev["delta"] = {**prev["delta"], name: prev["delta"][name] + event["delta"][name]}
            continue
        out.append(event)
    return out


# -- serving ---------------------------------------------------------------------------------


def _parse(serving: OpenAIServing, kind: str, body: Any) -> MessagesRequest | CountTokensRequest:
    model_cls = MessagesRequest if kind == "messages" else CountTokensRequest
    return serving._parse(model_cls, body)


def _plan(serving: OpenAIServing, kind: str, body: Any) -> tuple[_Plan, Any]:
    """(the chat plan, the parsed request); runs on the preparation thread."""
    request = _parse(serving, kind, body)
    if (request.tool_choice or {}).get("type") == "auto" and not serving.enable_auto_tool_choice:
        why = serving.auto_tool_unavailable or '"auto" tool choice is off on this worker'
        raise _bad(
            f"tool_choice: {why}; use {{'type': 'any'}} or {{'type': 'tool', 'name': ...}}, "
            "which the grammar forces with any model."
        )
    renames: dict[str, str] = {}
    plan = serving._chat_plan(to_chat_body(request, renames), renames)
    return plan, request


def _fit_max_tokens(plan: _Plan, requested: int, max_model_len: int) -> bool:
    """Sets the plan's output limit to `requested`, or to the room the prompt leaves when that
    is less; True when it was cut."""
    prompt = plan.prompts[0]
    limit = min(requested, max(1, max_model_len - len(prompt.token_ids)))
    plan.prompts = [prompt.with_max_tokens(limit)]
    plan.params = dataclasses.replace(plan.params, max_tokens=limit)
    plan.sequences = sequence_params(plan.params)
    return limit < requested


async def handle_messages(
    serving: OpenAIServing, kind: str, body: Any, batch: BatchSizes
) -> AsyncIterator[Any]:
    """Runs one /v1/messages (`kind` "messages") or /v1/messages/count_tokens ("count_tokens")
    request on the chat route of `serving`; yields what `OpenAIServing.handle` yields for chat,
    in Anthropic's shapes (errors included)."""
    try:
        plan, request = await prepare(_plan, serving, kind, body)
        if plan.images is not None:
            await serving._load_images(plan)
        if kind == "count_tokens":
            yield {"input_tokens": len(plan.prompts[0].token_ids)}
            return
        assert isinstance(request, MessagesRequest)
        clamped = _fit_max_tokens(plan, request.max_tokens, serving.max_model_len)
        await serving._prepare(plan)
    except Exception as exc:
        yield anthropic_error(serving._error_from(exc))
        return
    thinking = request.thinking or {}
    fmt = MessageFormatter(
        plan.formatter.model,
        request.stop_sequences,
        clamped=clamped,
        omit_thinking=thinking.get("display") == "omitted",
    )
    if not plan.stream:
        async with aclosing(serving._complete(plan)) as items:
            async for item in items:
                yield anthropic_error(item) if is_error(item) else fmt.from_chat(item)
        return
    plan.include_usage = True  # the closing events carry the usage

    def emit(events: list[dict[str, Any]]) -> Any:
        return sse_events(events) if serving.raw_output else events

    yield emit(fmt.start(len(plan.prompts[0].token_ids)))
    async with aclosing(serving._stream_chunks(plan, batch)) as parts:
        async for chunks, _ in parts:
            events = fmt.fail(chunks) if isinstance(chunks, dict) else fmt.feed(chunks)
            if events:
                yield emit(events)

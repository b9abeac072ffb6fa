"""/v1/responses: OpenAI's Responses API as a view of the chat route.

A Responses request is translated into a chat-completions body (`to_chat_body`): `instructions`
become the system message, `input` items become messages (function calls join the assistant
turn they belong to, their outputs become tool messages, reasoning items the next assistant
turn's `reasoning_content`), function tools and `tool_choice` take chat's nested shape,
`text.format` becomes `response_format`, `max_output_tokens` the completion limit and
`reasoning.effort` the `reasoning_effort`. The chat route then does everything it does anyway:
template, tools, grammar, reasoning split, sampling. `ResponseFormatter` turns its answer back
into a Response object, or, streamed, its chunks into the Responses event sequence
(`response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`, ..., `response.completed`).

Responses are kept (`store`, true by default as on OpenAI) in a response store
(response_store.py: in this process, bounded, or in Redis shared by an endpoint's workers): the
Response object and the input items it answered. `previous_response_id` continues a stored
response: its input items and its output come before the new request's input (its
`instructions` do not carry over, as on OpenAI). GET /v1/responses/{id} returns a stored
Response, DELETE removes it, GET /v1/responses/{id}/input_items lists its input items; an id
not stored (never, `store: false`, evicted, expired, deleted) is a 404.
`conversation`, `item_reference` input items, `background` and stored `prompt` templates are
still a clear 400: a client keeps a conversation by `previous_response_id` or by sending the
output items back as input, which is what the Agents SDK does without a server-side store.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field

from ..json_types import WholeInt
from .errors import INVALID_REQUEST, OpenAIServingError, openai_error
from .protocol import (
    CHAT_ROUTE_EXTRAS,
    ChatRouteExtras,
    Moderation,
    PromptCacheOptions,
    Stop,
    StreamOptions,
)

# A Responses request's own fields are checked here; these are passed to the chat route under
# the same name (vLLM's extra sampling parameters, accepted on /v1/responses as on chat).
PASSTHROUGH = ("stop", "top_k", *CHAT_ROUTE_EXTRAS)

_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")
_ROLES = ("user", "system", "developer", "assistant")
_DELTAS = frozenset(
    {
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.function_call_arguments.delta",
    }
)
_EFFORTS = {"none": "none", "minimal": "minimal", "low": "low", "medium": "medium"}


class ResponsesRequest(ChatRouteExtras):
    """The body of POST /v1/responses: OpenAI's fields (every one the official client can send,
    so none is an unknown-field error), then vLLM's extra sampling parameters."""

    model: str | None = None
    input: str | list[Any] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: WholeInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)  # 0: greedy
    top_logprobs: WholeInt | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: WholeInt | None = Field(None, ge=1)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    store: bool | None = None  # unset: true
    previous_response_id: str | None = Field(None, min_length=1)
    # Refused when set (see the module docstring).
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    # Bookkeeping and platform features that change nothing about the output here.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    context_management: list[dict[str, Any]] | None = None
    moderation: Moderation | None = None  # shapes as chat's (protocol.py)
    image: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None

    # vLLM's extras beyond ChatRouteExtras', checked again by the chat route.
    stop: Stop = None
    top_k: WholeInt | None = None


def _bad(message: str, param: str | None, code: str = "invalid_value") -> OpenAIServingError:
    return OpenAIServingError.bad_request(message, param, code)


def _unsupported(message: str, param: str) -> OpenAIServingError:
    return OpenAIServingError(
        openai_error(message, INVALID_REQUEST, param, "unsupported_parameter", 400)
    )


# -- request -> chat body ------------------------------------------------------------------


def to_chat_body(
    request: ResponsesRequest,
    renames: dict[str, str] | None = None,
    history: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The chat-completions body that answers `request`; a request this server cannot honour
    is a 400 naming the Responses parameter. `renames` (filled in when given): the chat body's
    message fields that carry parts, by the Responses names the chat route's errors use.
    `history`: the items of the response `previous_response_id` names (`history_of`), which
    come before the request's own input."""
    _refuse_stored_state(request)
    names: dict[str, str] = {"messages": "input"}
    body: dict[str, Any] = {"messages": _messages(request, names, history or [])}
    if renames is not None:
        renames.update(names)
    for name in ("model", "temperature", "top_p", "parallel_tool_calls", "stream"):
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    for name in PASSTHROUGH:
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    if request.max_output_tokens is not None:
        body["max_completion_tokens"] = request.max_output_tokens
    if request.tools:
        body["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        body["tool_choice"], allowed = _chat_tool_choice(request.tool_choice)
        if allowed is not None and "tools" in body:
            body["tools"] = [t for t in body["tools"] if t["function"]["name"] in allowed]
    if request.max_tool_calls == 1:
        body["parallel_tool_calls"] = False
    elif request.max_tool_calls is not None:
        raise _unsupported(
            "max_tool_calls above 1 is not supported: use 1, or parallel_tool_calls.",
            "max_tool_calls",
        )
    response_format = _response_format(request.text)
    forced_call = body.get("tool_choice") == "required" or isinstance(body.get("tool_choice"), dict)
    # A turn forced to call a tool writes no message for `text.format` to shape (the Agents SDK
    # sends both when an agent has tools and an output type), so the format waits for a turn
    # that can answer.
    if response_format is not None and not (forced_call and body.get("tools")):
        body["response_format"] = response_format
    effort = (request.reasoning or {}).get("effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise _bad("Invalid value for 'reasoning.effort': a string.", "reasoning.effort")
        if effort not in _EFFORTS and effort not in ("high", "xhigh", "max"):
            raise _bad(
                "Invalid value for 'reasoning.effort': one of none, minimal, low, medium, "
                "high, xhigh, max.",
                "reasoning.effort",
            )
        body["reasoning_effort"] = _EFFORTS.get(effort, "high")
    if request.top_logprobs is not None or "message.output_text.logprobs" in (
        request.include or ()
    ):
        body["logprobs"] = True
        body["top_logprobs"] = request.top_logprobs or 0
    return body


def _refuse_stored_state(request: ResponsesRequest) -> None:
    if request.conversation is not None:
        raise _unsupported(
            "conversation is not supported: this server keeps responses, not conversations; "
            "continue a conversation with previous_response_id.",
            "conversation",
        )
    if request.background:
        raise _unsupported(
            "background responses are not supported: use stream=true instead.",
            "background",
        )
    if request.prompt is not None:
        raise _unsupported(
            "stored prompt templates are not supported: send 'instructions' and 'input'.",
            "prompt",
        )


def _text(content: Any, param: str) -> str:
    """The text of a message's (or an output's) content: a string, or the text of its parts
    joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(
            f"Invalid value for '{param}': a string or a list of content parts.",
            param,
            "invalid_type",
        )
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            text = part.get("text")
        elif kind == "refusal":
            text = part.get("refusal")
        elif kind in _MEDIA_PARTS:
            raise _unsupported(_media_refusal(kind), where)
        else:
            raise _bad(
                f"Invalid value for '{where}': a content part with a 'type' such as 'input_text'.",
                where,
            )
        if not isinstance(text, str):
            raise _bad(f"Invalid value for '{where}': its text must be a string.", where)
        texts.append(text)
    return "\n".join(texts)


def _media_refusal(kind: str) -> str:
    if kind == "input_image":
        return "input_image parts are taken in user, system and developer messages only."
    return f"content parts of type '{kind}' are not supported: this server takes text and images."


def _has_images(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") == "input_image" for p in content
    )


def _parts(content: list[Any], param: str) -> list[dict[str, Any]]:
    """Content with images as chat parts, one for each part in the same order (so the chat
    route's errors name the same index): input_image -> image_url, text kinds -> text."""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            if part.get("file_id") is not None:
                raise _unsupported(
                    "input_image parts with a file_id are not supported: this server keeps no "
                    "files; send the image as image_url (an http(s) URL or a data URL).",
                    f"{where}.file_id",
                )
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise _bad(
                    f"Invalid value for '{where}.image_url': an http(s) URL or a data URL "
                    "(data:image/png;base64,...).",
                    f"{where}.image_url",
                )
            image = {"url": url}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        elif kind in _MEDIA_PARTS:
            raise _unsupported(_media_refusal(kind), where)
        elif kind in _TEXT_PARTS or kind == "refusal":
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise _bad(f"Invalid value for '{where}': its text must be a string.", where)
            parts.append({"type": "text", "text": text})
        else:
            raise _bad(
                f"Invalid value for '{where}': a content part with a 'type' such as 'input_text'.",
                where,
            )
    return parts


_STATUSES = ("in_progress", "completed", "incomplete")


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_status(value: Any) -> bool:
    return value in _STATUSES


def _is_phase(value: Any) -> bool:
    return value in ("commentary", "final_answer")


def _is_caller(value: Any) -> bool:
    if not isinstance(value, dict) or value.get("type") not in ("direct", "program"):
        return False
    allowed = {"type"} if value["type"] == "direct" else {"type", "caller_id"}
    return set(value) <= allowed and (value["type"] == "direct" or _is_str(value.get("caller_id")))


def _is_summary(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(p, dict)
        and set(p) <= {"type", "text"}
        and p.get("type") == "summary_text"
        and _is_str(p.get("text"))
        for p in value
    )


# The fields OpenAI's schema declares on each input item type that this server does not read
# (an id, a status, a namespace...): (what the value must be, described; its check; whether null
# is allowed). They change nothing here, but a client that sends a wrong one gets a 400 naming
# it, as from OpenAI, and any field the schema does not declare is an unknown parameter.
_Check = tuple[str, Callable[[Any], bool], bool]
_STATUS: _Check = ("one of in_progress, completed, incomplete", _is_status, False)
_UNREAD_FIELDS: dict[str, dict[str, _Check]] = {
    "message": {
        "id": ("a string", _is_str, False),
        "status": _STATUS,
        "phase": ("one of commentary, final_answer", _is_phase, True),
    },
    "function_call": {
        "id": ("a string", _is_str, False),
        "status": _STATUS,
        "namespace": ("a string", _is_str, False),
        "caller": ("a caller object (type direct, or program with a caller_id)", _is_caller, True),
    },
    "function_call_output": {
        "id": ("a string", _is_str, True),
        "status": (_STATUS[0], _is_status, True),
        "name": ("a string", _is_str, True),
        "namespace": ("a string", _is_str, True),
        "caller": ("a caller object (type direct, or program with a caller_id)", _is_caller, True),
    },
    "reasoning": {
        "id": ("a string", _is_str, False),
        "status": _STATUS,
        "summary": ("a list of summary_text parts", _is_summary, False),
        "encrypted_content": ("a string", _is_str, True),
    },
}
# The fields each item type's handling below reads.
_READ_FIELDS = {
    "message": ("type", "role", "content"),
    "function_call": ("type", "call_id", "name", "arguments"),
    "function_call_output": ("type", "call_id", "output"),
    "reasoning": ("type", "content", "summary"),
}


def _check_unread_fields(item: dict[str, Any], kind: str, param: str) -> None:
    """An input item's fields beyond those this server reads, checked against OpenAI's schema
    (a 400 naming the field); `kind` is one of _READ_FIELDS."""
    checks = _UNREAD_FIELDS[kind]
    for key, value in item.items():
        if key in checks:
            what, ok, nullable = checks[key]
            if not (ok(value) or (nullable and value is None)):
                raise _bad(
                    f"Invalid value for '{param}.{key}': {what}{' or null' if nullable else ''}.",
                    f"{param}.{key}",
                    "invalid_type",
                )
        elif key not in _READ_FIELDS[kind]:
            raise _bad(
                f"Unknown parameter: '{param}.{key}'.", f"{param}.{key}", "unknown_parameter"
            )


def _messages(
    request: ResponsesRequest, names: dict[str, str], history: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    own = (
        [{"role": "user", "content": request.input}]
        if isinstance(request.input, str)
        else request.input
    )
    # Stored items were checked when they were stored; an error in one still names where it
    # came from.
    items = [("previous_response_id", item) for item in history]
    items += [(f"input[{i}]", item) for i, item in enumerate(own)]
    reasoning: str | None = None  # a reasoning item's text, for the next assistant turn

    def assistant_turn() -> dict[str, Any]:
        nonlocal reasoning
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        if reasoning is not None:
            message["reasoning_content"], reasoning = reasoning, None
        messages.append(message)
        return message

    for param, item in items:
        if not isinstance(item, dict):
            raise _bad(f"Invalid value for '{param}': an input item object.", param, "invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind in _READ_FIELDS and not param.startswith("previous_response_id"):
            _check_unread_fields(item, kind, param)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(
                    f"Invalid value for '{param}.role': one of {', '.join(_ROLES)}.",
                    f"{param}.role",
                )
            content = item.get("content")
            if role != "assistant" and _has_images(content):
                names[f"messages[{len(messages)}].content"] = f"{param}.content"
                parts = _parts(content, f"{param}.content")
                messages.append({"role": role, "content": parts})
                continue
            text = _text(content, f"{param}.content")
            if role == "assistant":
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
                    last["content"] += text  # one turn given as several output messages
                    if reasoning is not None and "reasoning_content" not in last:
                        last["reasoning_content"], reasoning = reasoning, None
                else:
                    assistant_turn()["content"] = text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {k: item.get(k) for k in ("call_id", "name", "arguments")}
            for key, value in call.items():
                if not isinstance(value, str):
                    raise _bad(
                        f"Invalid value for '{param}.{key}': a function call needs a string "
                        f"'{key}'.",
                        f"{param}.{key}",
                    )
            last = messages[-1] if messages else None
            turn = last if last is not None and last["role"] == "assistant" else assistant_turn()
            turn.setdefault("tool_calls", []).append(
                {
                    "id": call["call_id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            )
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise _bad(f"Invalid value for '{param}.call_id': a string.", f"{param}.call_id")
            raw = item.get("output")
            if _has_images(raw):
                names[f"messages[{len(messages)}].content"] = f"{param}.output"
                output: str | list[dict[str, Any]] = _parts(raw, f"{param}.output")
            else:
                output = _text(raw, f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text(parts, f"{param}.content") or None
        elif kind == "item_reference":
            raise _unsupported(
                "item_reference input items are not supported: send the item itself, or "
                "continue a stored response with previous_response_id.",
                param,
            )
        else:
            raise _unsupported(
                f"input items of type {kind!r} are not supported: this server takes messages, "
                "function_call, function_call_output and reasoning items.",
                f"{param}.type",
            )
    if len(messages) == 0:
        raise _bad("Invalid value for 'input': no messages.", "input")
    return messages


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    param = f"tools[{i}]"
    kind = tool.get("type")
    if kind != "function":
        raise _unsupported(
            f"tools of type {kind!r} are not supported: this server runs no hosted tools; "
            "declare function tools.",
            f"{param}.type",
        )
    if not isinstance(tool.get("name"), str):
        raise _bad(f"Invalid value for '{param}.name': a string.", f"{param}.name")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    if function.get("parameters") is None:
        function.pop("parameters", None)
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> tuple[Any, set[str] | None]:
    """Chat's tool_choice, and the names an `allowed_tools` choice keeps (None: all)."""
    if isinstance(choice, str):
        return choice, None
    kind = choice.get("type")
    if kind == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}, None
    if kind == "allowed_tools":
        tools = choice.get("tools")
        mode = choice.get("mode", "auto")
        if not isinstance(tools, list) or mode not in ("auto", "required"):
            raise _bad(
                "Invalid value for 'tool_choice': allowed_tools needs a 'tools' list and a "
                "'mode' of 'auto' or 'required'.",
                "tool_choice",
            )
        names = {t.get("name") for t in tools if isinstance(t, dict)}
        return mode, names
    raise _unsupported(
        f"tool_choice of type {kind!r} is not supported: use 'auto', 'none', 'required', "
        "a function, or allowed_tools.",
        "tool_choice",
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise _bad(
        "Invalid value for 'text.format.type': one of 'text', 'json_object', 'json_schema'.",
        "text.format.type",
    )


# -- chat answer -> Response ---------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseFormatter:
    """Builds one request's Response object and, streamed, its events from the chat route's
    answer. `count_tokens` counts the tokens of a text (the reasoning-token figure)."""

    def __init__(
        self,
        request: ResponsesRequest,
        model: str,
        count_tokens: Any,
        history: list[dict[str, Any]] | None = None,
    ) -> None:
        self.request = request
        self.history = history or []  # the items previous_response_id brought
        self.model = model
        self.count_tokens = count_tokens
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        # Streaming state.
        self._seq = 0
        self._items: list[dict[str, Any]] = []  # output items so far, final shape
        self._open: dict[str, Any] | None = None  # the item deltas go to
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
        self._finish_reason: str | None = None
        self.final: dict[str, Any] | None = None  # the Response the stream closed with

    # The Response object.

    def response(
        self,
        output: list[dict[str, Any]],
        status: str,
        usage: dict[str, Any] | None,
        finish_reason: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        r = self.request
        text = r.text or {}
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens" if finish_reason == "length" else None}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": r.max_tool_calls,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": r.reasoning or {"effort": None, "summary": None},
            "store": r.store is not False,
            "temperature": r.temperature,
            "text": {"format": text.get("format") or {"type": "text"}},
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": r.tools or [],
            "top_logprobs": r.top_logprobs,
            "top_p": r.top_p,
            "truncation": r.truncation or "disabled",
            "usage": usage,
            "user": r.user,
            "metadata": r.metadata or {},
            "background": False,
        }

    def stored_record(self, response: dict[str, Any]) -> dict[str, Any]:
        """What the store keeps for `response` (see response_store.py): the Response and every
        input item it answered, with ids."""
        return {"response": response, "input": self.history + own_items(self.request)}

    def store_failed(self, events: list[dict[str, Any]], message: str) -> list[dict[str, Any]]:
        """A stream's closing batch when its response could not be stored: the closing
        `response.completed` (or `.incomplete`) becomes an `error` event and `response.failed`."""
        closing = events.pop()
        self._seq -= 1
        error = {"code": "server_error", "message": message}
        failed = {**closing["response"], "status": "failed", "error": error}
        tail = [
            self._event("error", code="server_error", message=message, param=None),
            self._event("response.failed", response=failed),
        ]
        return events + self._numbered(tail)

    def _usage(self, chat_usage: dict[str, int], reasoning: str) -> dict[str, Any]:
        inp, out = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
        reasoning_tokens = min(out, self.count_tokens(reasoning)) if reasoning else 0
        return {
            "input_tokens": inp,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": inp + out,
        }

    @staticmethod
    def _status(finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The Response for a chat.completion answer."""
        choice = chat["choices"][0]
        message = choice["message"]
        finish_reason = choice["finish_reason"]
        item_status = "incomplete" if finish_reason == "length" else "completed"
        output: list[dict[str, Any]] = []
        reasoning = message.get("reasoning_content") or ""
        if reasoning:
            output.append(_reasoning_item(_new_id("rs"), reasoning, item_status))
        calls = message.get("tool_calls") or []
        content = message.get("content") or ""
        if content or not calls:
            logprobs = (choice.get("logprobs") or {}).get("content")
            output.append(_message_item(_new_id("msg"), content, item_status, logprobs or []))
        for call in calls:
            output.append(
                _call_item(
                    _new_id("fc"),
                    call["id"],
                    call["function"]["name"],
                    call["function"]["arguments"],
                    "completed",
                )
            )
        usage = self._usage(chat["usage"], reasoning)
        return self.response(output, self._status(finish_reason), usage, finish_reason)

    # The event stream.

    @staticmethod
    def _event(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, **fields}

    def _numbered(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One batch's events, consecutive deltas of one item merged into one event (a batch of
        tokens is one event, as on chat), then numbered."""
        out: list[dict[str, Any]] = []
        for event in events:
            prev = out[-1] if out else None
            if (
                prev is not None
                and event["type"] in _DELTAS
                and prev["type"] == event["type"]
                and prev["item_id"] == event["item_id"]
            ):
                prev["delta"] += event["delta"]
                if "logprobs" in event:
                    prev["logprobs"] = prev["logprobs"] + event["logprobs"]
                continue
            out.append(event)
        for event in out:
            event["sequence_number"] = self._seq
            self._seq += 1
        return out

    def start(self) -> list[dict[str, Any]]:
        """The events that open the stream, before any token."""
        head = self.response([], "in_progress", None)
        return self._numbered(
            [
                self._event("response.created", response=head),
                self._event("response.in_progress", response=head),
            ]
        )

    def feed(self, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The events of one batch of chat chunks; the usage chunk closes the stream."""
        return self._numbered(self._feed(chunks))

    def _feed(self, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for chunk in chunks:
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    events += self._text_delta("reasoning", delta["reasoning_content"], None)
                if delta.get("content"):
                    logprobs = (choice.get("logprobs") or {}).get("content")
                    events += self._text_delta("message", delta["content"], logprobs)
                for call in delta.get("tool_calls") or ():
                    events += self._call_delta(call)
                if choice.get("finish_reason") is not None:
                    self._finish_reason = choice["finish_reason"]
            if not chunk["choices"] and "usage" in chunk:
                events += self._close(chunk["usage"])
        return events

    def fail(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """An error after the stream began: OpenAI's `error` event, then `response.failed`."""
        info = error.get("error") or {}
        status = getattr(error, "status", 500)
        code = "server_error" if status >= 500 else "invalid_prompt"
        message = str(info.get("message", "the request failed"))
        events = self._close_open("incomplete")
        events.append(
            self._event("error", code=info.get("code"), message=message, param=info.get("param"))
        )
        failed = self.response(
            self._items, "failed", None, error={"code": code, "message": message}
        )
        events.append(self._event("response.failed", response=failed))
        return self._numbered(events)

    def _open_text(self, kind: str) -> list[dict[str, Any]]:
        """Closes the open item and opens a reasoning or message item with its one part."""
        events = self._close_open("completed")
        item_id = _new_id("rs" if kind == "reasoning" else "msg")
        if kind == "reasoning":
            item = _reasoning_item(item_id, "", "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = _message_item(item_id, "", "in_progress", None)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events += self._add(item)
        events.append(self._part_event("response.content_part.added", item, part))
        return events

    def _text_delta(self, kind: str, text: str, logprobs: Any) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._open_text(kind)
        item = self._open
        assert item is not None
        if kind == "reasoning":
            item["content"][0]["text"] += text
            events.append(self._delta_event("response.reasoning_text.delta", item, delta=text))
        else:
            part = item["content"][0]
            part["text"] += text
            part["logprobs"] += logprobs or []
            events.append(
                self._delta_event(
                    "response.output_text.delta", item, delta=text, logprobs=logprobs or []
                )
            )
        return events

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        function = call.get("function") or {}
        item = self._calls.get(call.get("index", 0))
        if item is None:
            events += self._close_open("completed")
            item = _call_item(
                _new_id("fc"),
                call.get("id") or _new_id("call"),
                function.get("name", ""),
                "",
                "in_progress",
            )
            self._calls[call.get("index", 0)] = item
            events += self._add(item)
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self._items.index(item),
                    delta=function["arguments"],
                )
            )
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._items.append(item)
        self._open = item
        return [
            self._event(
                "response.output_item.added", output_index=len(self._items) - 1, item=_copy(item)
            )
        ]

    def _part_event(self, kind: str, item: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
        if kind == "response.content_part.added":
            item["content"].append(part)
        return self._event(
            kind,
            item_id=item["id"],
            output_index=self._items.index(item),
            content_index=0,
            part=_copy(part),
        )

    def _delta_event(self, kind: str, item: dict[str, Any], **fields: Any) -> dict[str, Any]:
        return self._event(
            kind,
            item_id=item["id"],
            output_index=self._items.index(item),
            content_index=0,
            **fields,
        )

    def _close_open(self, status: str) -> list[dict[str, Any]]:
        """The closing events of the item deltas were going to."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self._items.index(item)
        events: list[dict[str, Any]] = []
        if item["type"] == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            part = item["content"][0]
            if item["type"] == "reasoning":
                events.append(
                    self._delta_event("response.reasoning_text.done", item, text=part["text"])
                )
            else:
                events.append(
                    self._delta_event(
                        "response.output_text.done",
                        item,
                        text=part["text"],
                        logprobs=part["logprobs"],
                    )
                )
            events.append(self._part_event("response.content_part.done", item, part))
        item["status"] = status
        events.append(
            self._event("response.output_item.done", output_index=index, item=_copy(item))
        )
        return events

    def _close(self, chat_usage: dict[str, int]) -> list[dict[str, Any]]:
        finish_reason = self._finish_reason
        status = self._status(finish_reason)
        events: list[dict[str, Any]] = []
        if not any(item["type"] != "reasoning" for item in self._items):
            events += self._open_text("message")  # an empty answer is still a message
        events += self._close_open(status)
        reasoning = "".join(
            item["content"][0]["text"] for item in self._items if item["type"] == "reasoning"
        )
        usage = self._usage(chat_usage, reasoning)
        final = self.response(self._items, status, usage, finish_reason)
        self.final = final
        kind = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self._event(kind, response=final))
        return events


def _copy(value: Any) -> Any:
    """A snapshot of an item as it is now (items keep growing after their event is built)."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _message_item(
    item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """`logprobs` None: the item opens without its text part (streamed, the part is added by
    its own event)."""
    content = []
    if logprobs is not None:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


# -- stored responses ----------------------------------------------------------------------

_ITEM_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def own_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as the items a store keeps and lists: a string is a user message,
    string content becomes one text part, and every item has an `id`."""
    if isinstance(request.input, str):
        return [_stored_item({"type": "message", "role": "user", "content": request.input})]
    return [_stored_item(item) for item in request.input]


def _stored_item(item: dict[str, Any]) -> dict[str, Any]:
    item = dict(item)
    kind = item.get("type", "message" if "role" in item else None)
    item["type"] = kind
    content = item.get("content")
    if kind == "message" and isinstance(content, str):
        if item.get("role") == "assistant":
            item["content"] = [{"type": "output_text", "text": content, "annotations": []}]
        else:
            item["content"] = [{"type": "input_text", "text": content}]
    if not isinstance(item.get("id"), str):
        item["id"] = _new_id(_ITEM_PREFIX.get(str(kind), "item"))
    return item


def history_of(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The items a follow-up of a stored response continues: what it answered, then its
    output."""
    return list(record["input"]) + list(record["response"]["output"])


def response_not_found(response_id: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's 404 for a response id that is not stored (the client raises NotFoundError)."""
    if param == "previous_response_id":
        return openai_error(
            f"Previous response with id '{response_id}' not found: it was never stored "
            "(store: false), or it was evicted, expired or deleted.",
            param=param,
            code="previous_response_not_found",
            status=404,
        )
    return openai_error(f"Response with id '{response_id}' not found.", status=404)


def response_deleted(response_id: str) -> dict[str, Any]:
    """DELETE /v1/responses/{id}'s answer, as OpenAI's."""
    return {"id": response_id, "object": "response", "deleted": True}


def input_items_page(record: dict[str, Any], query: dict[str, str]) -> dict[str, Any]:
    """GET /v1/responses/{id}/input_items: a page of the input items the response answered
    (`limit` 1-100, default 20; `order` `desc` (default) or `asc`; `after` an item id)."""
    for name in query:
        if name not in ("limit", "order", "after", "include", "include[]"):
            raise _bad(f"Unknown query parameter '{name}'.", name, "unknown_parameter")
    limit_text = query.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
        raise _bad("Invalid value for 'limit': an integer from 1 to 100.", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise _bad("Invalid value for 'order': 'asc' or 'desc'.", "order")
    items = list(record["input"])
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise _bad(f"Invalid value for 'after': no input item with id '{after}'.", "after")
        items = items[ids.index(after) + 1 :]
    page = items[: int(limit_text)]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > len(page),
    }

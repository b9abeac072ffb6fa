"""Error payloads of the worker's routes, and which errors are the request's own fault.

A native job's error is `{"error": "<message>"}`: the shape worker-vllm used, and the one the
hosted platform recognises (a yielded dict with `error` ends the job as failed). An OpenAI job's
error is OpenAI's error object, built by `api.openai.errors`.

`REQUEST_ERRORS` is the one list of what a request can be refused for, from the engine and from
this layer: each route answers them as a 400 in its own shape (`native_error(str(e))` here,
`api.openai.errors.request_error(e)` on OpenAI routes), never as a server error.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from ..engine import ChatTemplateError, InvalidRequestError

__all__ = [
    "REQUEST_ERRORS",
    "NativeJobError",
    "describe_validation_error",
    "loc_to_path",
    "native_error",
]

# Every request error of the engine (engine/errors.py: sampling parameters, prompts, structured
# output, LoRA adapters) and of this layer (NativeJobError, RequestLimitError, ToolChoiceError)
# is an InvalidRequestError; a chat template that cannot render the messages is the other one.
REQUEST_ERRORS: tuple[type[Exception], ...] = (InvalidRequestError, ChatTemplateError)


class NativeJobError(InvalidRequestError):
    """A native job cannot be served as given; str() is the message the client sees."""


def native_error(message: str) -> dict[str, str]:
    return {"error": message}


def loc_to_path(loc: tuple[Any, ...], prefix: str = "") -> str:
    """('messages', 0, 'role') -> 'messages[0].role'."""
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_validation_error(exc: ValidationError, prefix: str = "") -> tuple[str, str]:
    """The first problem of a pydantic error as (path, one-line message naming it). Union
    members produce one error each; the first is enough to name the field and the value."""
    errors = exc.errors(include_url=False)
    if not errors:
        return prefix, "invalid input"
    err = errors[0]
    loc = tuple(p for p in err.get("loc", ()) if not _is_union_tag(p))
    path = loc_to_path(loc, prefix)
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return path, f"unknown field '{path}'"
    if kind == "missing":
        return path, f"'{path}' is required"
    if kind == "too_short" and err.get("input") in ([], {}, ""):
        return path, f"'{path}' must not be empty"
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    msg = msg[:1].lower() + msg[1:]
    return path, f"'{path}': {msg}, got {_short_repr(err.get('input'))}"


def _is_union_tag(part: Any) -> bool:
    """pydantic names the union member in the loc ('stop', 'str'); that is noise to a user."""
    return isinstance(part, str) and (
        part in {"str", "int", "float", "bool", "list[str]", "list[int]", "none"}
        or part.startswith(("list[", "dict[", "function-"))
    )

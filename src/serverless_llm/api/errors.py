"""Error payloads of the worker's routes, and how validation failures read.

A native job's error is `{"error": "<message>"}`: the shape worker-vllm used, and the one the
hosted platform recognises (a yielded dict with `error` ends the job as failed). An OpenAI job's
error is OpenAI's error object, built by `api.openai.errors` (shared here so errors found before a
job reaches the OpenAI layer look the same as the ones found inside it).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

__all__ = ["NativeJobError", "describe_validation_error", "native_error", "openai_bad_request"]


class NativeJobError(ValueError):
    """A native job cannot be served as given; str() is the message the client sees."""


def native_error(message: str) -> dict[str, str]:
    return {"error": message}


def openai_bad_request(message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's 400 error object, for a job whose OpenAI envelope (route, batch knobs) is bad."""
    try:
        from .openai.errors import openai_error
    except ImportError:  # the OpenAI layer is optional for this module: same shape by hand
        return {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": param,
                "code": None,
            }
        }
    return openai_error(message, param=param)


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

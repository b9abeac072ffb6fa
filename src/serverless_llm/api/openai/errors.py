"""OpenAI's error object, and the HTTP status that goes with each one.

Every failure on an OpenAI route becomes `{"error": {"message", "type", "param", "code"}}`, the
body the official client reads (`openai.APIStatusError.body`, `.code`, `.param`, `.type`). The
status travels two ways: in-process, as the `status` attribute of the dict `openai_error`
returns; after a JSON round trip (RunPod aggregates stream output as JSON), it is recovered from
`code` and `type`, which is why every error built here uses a code or type that maps back to its
status.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from serverless_llm.engine import ChatTemplateError

from ..errors import loc_to_path
from ..limits import RequestLimitError

__all__ = [
    "ErrorDict",
    "OpenAIServingError",
    "http_status",
    "internal_error",
    "is_error",
    "model_not_found",
    "openai_error",
    "request_error",
    "unsupported",
    "validation_error",
]

# Error types, as OpenAI's API names them.
INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"

# code -> status, checked before the type: OpenAI reports a missing model as an
# invalid_request_error with code model_not_found and status 404.
_STATUS_BY_CODE: dict[str, int] = {
    "model_not_found": 404,
    "unknown_url": 404,
}
# type -> status; both OpenAI's snake_case names and vLLM's exception-class names.
_STATUS_BY_TYPE: dict[str, int] = {
    INVALID_REQUEST: 400,
    "BadRequestError": 400,
    "authentication_error": 401,
    "AuthenticationError": 401,
    "permission_error": 403,
    "PermissionDeniedError": 403,
    NOT_FOUND: 404,
    "NotFoundError": 404,
    "conflict_error": 409,
    "unprocessable_entity_error": 422,
    "rate_limit_error": 429,
    "RateLimitError": 429,
    # Anthropic's names (api/anthropic.py), for its errors after a JSON round trip.
    "request_too_large": 413,
    "api_error": 500,
    "overloaded_error": 529,
    SERVER_ERROR: 500,
    "internal_error": 500,
    "InternalServerError": 500,
    "service_unavailable_error": 503,
}
# The type an error gets when the caller names only a status.
_TYPE_BY_STATUS: dict[int, str] = {
    400: INVALID_REQUEST,
    401: "authentication_error",
    403: "permission_error",
    404: NOT_FOUND,
    409: "conflict_error",
    422: "unprocessable_entity_error",
    429: "rate_limit_error",
    500: SERVER_ERROR,
    503: "service_unavailable_error",
}


class ErrorDict(dict):
    """A plain dict (JSON-serialisable as is) that also remembers its HTTP status in-process."""

    status: int = 400


def openai_error(
    message: str,
    type: str = INVALID_REQUEST,
    param: str | None = None,
    code: str | int | None = None,
    status: int = 400,
) -> dict:
    """Builds `{"error": {"message", "type", "param", "code"}}` with `status` attached.

    When only a status is given (type left at its default), the type follows the status, so
    `http_status` finds it again after the dict has been through JSON.
    """
    if type == INVALID_REQUEST and status != 400 and status in _TYPE_BY_STATUS:
        if not (isinstance(code, str) and _STATUS_BY_CODE.get(code) == status):
            type = _TYPE_BY_STATUS[status]
    error = ErrorDict(error={"message": message, "type": type, "param": param, "code": code})
    error.status = status
    return error


def is_error(item: Any) -> bool:
    """True for what `OpenAIServing.handle` yields on failure: a dict with an `error` object."""
    return isinstance(item, dict) and isinstance(item.get("error"), dict)


def http_status(error: dict) -> int:
    """The HTTP status to send with `error`: its own when it came from `openai_error`, otherwise
    derived from an integer code (vLLM puts the status there), the code, then the type."""
    status = getattr(error, "status", None)
    if isinstance(status, int):
        return status
    body = error.get("error") if isinstance(error, dict) else None
    if not isinstance(body, dict):
        return 500
    code = body.get("code")
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
        return code
    if isinstance(code, str) and code in _STATUS_BY_CODE:
        return _STATUS_BY_CODE[code]
    return _STATUS_BY_TYPE.get(body.get("type"), 400)


class OpenAIServingError(Exception):
    """Raised inside the serving layer to stop a request; `handle` yields `.error` instead."""

    def __init__(self, error: dict) -> None:
        super().__init__(error["error"]["message"])
        self.error = error

    @classmethod
    def bad_request(
        cls, message: str, param: str | None = None, code: str | None = None
    ) -> OpenAIServingError:
        return cls(openai_error(message, INVALID_REQUEST, param, code, 400))


def model_not_found(model: str) -> dict:
    """OpenAI's answer for a model it does not serve (404; the client raises NotFoundError)."""
    return openai_error(
        f"The model `{model}` does not exist.", INVALID_REQUEST, "model", "model_not_found", 404
    )


def unsupported(field: str, detail: str = "") -> OpenAIServingError:
    """A request field this server accepts in the schema but cannot honour yet."""
    message = f"'{field}' is not supported yet"
    if detail:
        message += f": {detail}"
    return OpenAIServingError(
        openai_error(message, INVALID_REQUEST, field, "unsupported_parameter", 400)
    )


def request_error(exc: Exception) -> dict:
    """OpenAI's 400 for one of the request's own errors (api.errors.REQUEST_ERRORS, raised by
    the engine or by this layer): its message, the field at fault as `param`, and the code that
    says what is wrong (a limit's own, `invalid_chat_template` for a template that cannot render
    the messages, `invalid_value` for any other error naming a field)."""
    message = str(exc)
    param = getattr(exc, "param", None)
    code = "invalid_value" if param else None
    if isinstance(exc, ChatTemplateError):
        code = "invalid_chat_template"
    elif isinstance(exc, RequestLimitError):
        code = exc.code
        message = f"{message[:1].upper()}{message[1:]}."  # a sentence, as OpenAI words them
    return openai_error(message, INVALID_REQUEST, param, code, 400)


def internal_error(exc: BaseException) -> dict:
    return openai_error(
        f"internal error while serving the request: {type(exc).__name__}: {exc}",
        SERVER_ERROR,
        None,
        None,
        500,
    )


# -- pydantic validation errors -------------------------------------------------------------

_CODE_BY_PYDANTIC_TYPE = {
    "missing": "missing_required_parameter",
    "extra_forbidden": "unknown_parameter",
}


_INSTANCE_OF = re.compile(r" or instance of \w+")


def _describe(err: dict[str, Any]) -> tuple[str, str | None]:
    param = loc_to_path(err.get("loc", ()))
    kind = err.get("type", "")
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param or None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: '{param}'.", param or None
    msg = err.get("msg", "invalid value")
    if kind == "too_short" and (err.get("ctx") or {}).get("min_length") == 1:
        msg = "must not be empty"
    # Custom validators raise ValueError; pydantic prefixes their text with "Value error, ".
    msg = msg.removeprefix("Value error, ")
    # "a valid dictionary or instance of ChatMessage": the class name means nothing to a client.
    msg = _INSTANCE_OF.sub("", msg).replace("a valid dictionary", "an object")
    if not param:
        return msg, None
    return f"Invalid value for '{param}': {msg}.", param


def validation_error(exc: ValidationError) -> dict:
    """Turns pydantic's error list into one OpenAI error naming the first offending field (and
    how many others there are, so a client fixing them one by one knows to look further)."""
    errors = exc.errors(include_url=False, include_input=False)
    if not errors:
        return openai_error("invalid request body", INVALID_REQUEST, None, "invalid_value", 400)
    message, param = _describe(errors[0])
    if len(errors) > 1:
        others = [loc_to_path(e.get("loc", ())) for e in errors[1:4]]
        message += f" ({len(errors) - 1} more: {', '.join(o or 'body' for o in others)}"
        message += ", ...)" if len(errors) > 4 else ")"
    code = _CODE_BY_PYDANTIC_TYPE.get(errors[0].get("type", ""))
    if code is None:
        code = "invalid_type" if errors[0].get("type", "").endswith("_type") else "invalid_value"
    return openai_error(message, INVALID_REQUEST, param, code, 400)

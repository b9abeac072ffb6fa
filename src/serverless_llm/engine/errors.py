"""The errors a request can be refused with: the client's mistake, never the engine's.

Every one is an `InvalidRequestError` and takes `(message, param)`: str() is the message shown
to the client, `param` the request field at fault (None when no one field is). The API layers
turn them into their routes' error shapes in one place (api/errors.py), so a check added here
reaches every route as a 400 without a change there.
"""

from __future__ import annotations

__all__ = [
    "InvalidRequestError",
    "LoRAError",
    "SamplingParamsError",
    "StructuredOutputError",
]


class InvalidRequestError(ValueError):
    """The request cannot be served as given; the message says why (shown to the client) and
    `param` names the parameter at fault, when one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is unknown, ill-typed, out of range or not supported; the message
    names the parameter and what is allowed. `param` defaults to the message's first word (the
    engine's own messages start with the parameter's name)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param if param is not None else message.split(" ", 1)[0])


class StructuredOutputError(InvalidRequestError):
    """A structured-output request the engine cannot honour: `param` names the request field
    (guided_json, guided_regex, guided_choice, guided_grammar, guided_whitespace_pattern,
    guided_decoding_backend, response_format, ...); the message may not repeat it."""


class LoRAError(InvalidRequestError):
    """An adapter that cannot be served (a bad request, not an engine failure)."""

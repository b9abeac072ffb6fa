"""A RunPod job's `input`, parsed into an OpenAI job or a native job.

With `openai_route` set, the job goes to the OpenAI layer with `openai_input` as the request
body (and `openai_method`, optional, as the HTTP method where a route has several: `DELETE`
for `/v1/responses/{id}`); otherwise it is a native job. Both may set the stream batch knobs
(`max_batch_size`, `min_batch_size`, `batch_size_growth_factor`), which override the env
defaults for this job.
A native job with `task` (`embed`, `rerank`, `score`, `classify`, `pooling`) is a pooling job:
the rest of its input is that route's request body (`{"task": "embed", "input": [...]}` is
`/v1/embeddings`' `{"input": [...]}`), answered with the route's response object and failed in
the native shape, `{"error": "..."}`.
A job that cannot be parsed raises JobError, whose `payload` is the error in the shape of the
job's route. Every string of the input (keys included) must be Unicode text that UTF-8 can carry:
JSON's `\\ud800` escapes decode to lone surrogates, which the tokenizer, the templates and the
grammar compiler cannot take, so such a job is refused here, naming the field. An input nested
more than `MAX_JSON_DEPTH` levels deep is refused too: the layers above walk requests with
recursive code (pydantic, templates, `json.dumps`), which would fail on it with RecursionError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..api.batching import BatchSizes
from ..api.errors import NativeJobError, describe_validation_error, loc_to_path, native_error
from ..api.limits import RequestLimitError, RequestLimits
from ..api.native import NativeRequest
from ..api.openai import openai_error

__all__ = ["MAX_JSON_DEPTH", "JobError", "NativeJob", "OpenAIJob", "nesting_over", "parse_job"]

# Levels of arrays and objects a job's input (and a request body) may nest. Far beyond what a
# request needs (a JSON schema nested 40 levels deep fits), far below where Python's recursion
# limit (1,000 frames) breaks the recursive code that reads requests.
MAX_JSON_DEPTH = 128

_OPENAI_KEYS = ("openai_route", "openai_input", "openai_method")
_BATCH_KEYS = ("max_batch_size", "min_batch_size", "batch_size_growth_factor")
# A native pooling job's `task` -> the OpenAI-layer route that serves it.
POOLING_JOB_ROUTES = {
    "embed": "/v1/embeddings",
    "rerank": "/rerank",
    "score": "/score",
    "classify": "/classify",
    "pooling": "/pooling",
}


class JobError(ValueError):
    """A job that cannot be served; `payload` is what the handler yields."""

    def __init__(self, message: str, *, openai: bool, param: str | None = None) -> None:
        super().__init__(message)
        self.payload: dict[str, Any] = (
            openai_error(message, param=param) if openai else native_error(message)
        )


@dataclass(frozen=True)
class OpenAIJob:
    route: str
    body: Any
    batch: BatchSizes
    method: str | None = None  # the HTTP method, where the route has several
    native: bool = False  # a native pooling job: errors in the native shape


@dataclass(frozen=True)
class NativeJob:
    request: NativeRequest
    batch: BatchSizes


class _BatchKnobs(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    max_batch_size: int | None = Field(None, ge=1)
    min_batch_size: int | None = Field(None, ge=1)
    batch_size_growth_factor: float | None = Field(None, gt=0)


def _batch_sizes(data: dict[str, Any], defaults: BatchSizes, *, openai: bool) -> BatchSizes:
    try:
        knobs = _BatchKnobs.model_validate({k: data[k] for k in _BATCH_KEYS if k in data})
    except ValidationError as e:
        path, message = describe_validation_error(e)
        raise JobError(message, openai=openai, param=path) from None
    return BatchSizes(
        max_batch_size=(
            defaults.max_batch_size if knobs.max_batch_size is None else knobs.max_batch_size
        ),
        min_batch_size=(
            defaults.min_batch_size if knobs.min_batch_size is None else knobs.min_batch_size
        ),
        growth_factor=(
            defaults.growth_factor
            if knobs.batch_size_growth_factor is None
            else knobs.batch_size_growth_factor
        ),
    )


def _scan(data: Any, limit: int, strings: bool) -> tuple[bool, bool]:
    """(whether arrays and objects nest more than `limit` levels deep in `data`, whether a
    string holds a lone surrogate: looked for only with `strings`, and only until the first).
    One iterative pass, without paths (a 4 MB input: ~50 ms); it stops at the first branch
    past the limit."""
    bad = False
    stack: list[tuple[int, Any]] = [(0, data)]
    pop, push = stack.pop, stack.append
    while stack:
        depth, value = pop()
        if isinstance(value, dict):
            if strings and not bad:
                bad = any(isinstance(k, str) and not _utf8(k) for k in value)
            items: Any = value.values()
        elif isinstance(value, (list, tuple)):
            items = value
        else:
            continue
        depth += 1
        if depth > limit:
            return True, bad
        for item in items:
            if isinstance(item, str):
                if strings and not bad and not _utf8(item):
                    bad = True
            elif isinstance(item, (dict, list, tuple)):
                push((depth, item))
    return False, bad


def _utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def nesting_over(data: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels deep in `data` (a scalar is 0
    levels, `[]` is 1). Iterative, and stops at the first branch past the limit."""
    if not isinstance(data, (dict, list, tuple)):
        return False
    return _scan(data, limit, strings=False)[0]


def _lone_surrogate(data: Any) -> tuple[str, str] | None:
    """(path, repr of the character) of the first string in `data`, key or value, holding a lone
    surrogate; None when every string is valid text. Iterative: inputs may nest deeply."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as e:
                    # The path itself may hold it (a key's): escaped, so the error is text.
                    return path.encode("utf-8", "backslashreplace").decode(), repr(value[e.start])
        elif isinstance(value, dict):
            items = []
            for key, item in value.items():
                key_path = loc_to_path((key,), path) if isinstance(key, str) else path
                if isinstance(key, str):
                    items.append((key_path, key))
                items.append((key_path, item))
            stack.extend(reversed(items))
        elif isinstance(value, (list, tuple)):
            stack.extend((loc_to_path((i,), path), v) for i, v in reversed(list(enumerate(value))))
    return None


def _check_text(data: Any, *, openai: bool) -> None:
    too_deep, bad_text = _scan(data, MAX_JSON_DEPTH, strings=True)
    if too_deep:
        raise JobError(
            f"the {'openai_input' if openai else 'input'} is nested more than {MAX_JSON_DEPTH} "
            "levels deep",
            openai=openai,
        )
    # The walk with paths, to name the field, only for an input known to hold one.
    found = _lone_surrogate(data) if bad_text else None
    if found is not None:
        path, char = found
        raise JobError(
            f"'{path or 'openai_input'}' is not valid Unicode text: it holds a lone surrogate "
            f"({char}); send UTF-8 text",
            openai=openai,
            param=path or None,
        )


def parse_job(
    job: Any, defaults: BatchSizes, limits: RequestLimits | None = None
) -> OpenAIJob | NativeJob:
    """Parses a RunPod job (`{"id": ..., "input": {...}}`), raising JobError. With `limits`, a
    native job's message count and prompt size are checked on the input as sent, before the
    schema spends anything on it (as the OpenAI routes do): validating 40,000 messages holds
    the interpreter lock for a good part of a second, wherever it runs."""
    if not isinstance(job, dict):
        raise JobError(f"a job must be an object, got {type(job).__name__}", openai=False)
    data = job.get("input")
    if data is None:
        raise JobError("the job has no input", openai=False)
    if not isinstance(data, dict):
        raise JobError(
            f"the job's input must be an object, got {type(data).__name__}", openai=False
        )

    if data.get("openai_route") is not None:
        route = data["openai_route"]
        if not isinstance(route, str):
            raise JobError(
                f"openai_route must be a string such as '/v1/chat/completions', got {route!r}",
                openai=True,
                param="openai_route",
            )
        extra = [k for k in data if k not in _OPENAI_KEYS + _BATCH_KEYS]
        if extra:
            raise JobError(
                f"unknown input field '{extra[0]}' in an OpenAI job (the request goes in "
                "openai_input)",
                openai=True,
                param=extra[0],
            )
        method = data.get("openai_method")
        if method is not None and method not in ("GET", "POST", "DELETE"):
            raise JobError(
                f"openai_method must be 'GET', 'POST' or 'DELETE', got {method!r}",
                openai=True,
                param="openai_method",
            )
        batch = _batch_sizes(data, defaults, openai=True)
        _check_text(data.get("openai_input"), openai=True)  # param: a path in the body
        return OpenAIJob(route=route, body=data.get("openai_input"), batch=batch, method=method)

    batch = _batch_sizes(data, defaults, openai=False)
    _check_text(data, openai=False)
    rest = {k: v for k, v in data.items() if k not in _BATCH_KEYS and k not in _OPENAI_KEYS}
    for key in ("openai_input", "openai_method"):
        if key in data:
            raise JobError(f"{key} needs openai_route", openai=False)
    if "task" in rest:
        task = rest.pop("task")
        if not isinstance(task, str) or task not in POOLING_JOB_ROUTES:
            raise JobError(
                f"task must be one of {', '.join(POOLING_JOB_ROUTES)} (a pooling job), got "
                f"{task!r}",
                openai=False,
            )
        return OpenAIJob(route=POOLING_JOB_ROUTES[task], body=rest, batch=batch, native=True)
    if limits is not None:
        try:
            if isinstance(rest.get("prompt"), str):
                limits.check_prompt_chars(len(rest["prompt"]), "prompt")
            limits.check_messages(rest.get("messages"))
        except RequestLimitError as e:
            raise JobError(str(e), openai=False) from None
    try:
        request = NativeRequest.parse(rest)
    except NativeJobError as e:
        raise JobError(str(e), openai=False) from None
    return NativeJob(request=request, batch=batch)

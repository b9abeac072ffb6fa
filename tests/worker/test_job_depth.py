"""A job's input nested past MAX_JSON_DEPTH is refused by the worker itself (the hosted
platform hands the worker parsed JSON, so the local endpoint's own check is not the only one),
in the job route's shape; an input at the limit is taken. The check is iterative."""

from __future__ import annotations

import pytest

from serverless_llm.api.batching import BatchSizes
from serverless_llm.worker.job_input import (
    MAX_JSON_DEPTH,
    JobError,
    NativeJob,
    OpenAIJob,
    nesting_over,
    parse_job,
)

SIZES = BatchSizes(max_batch_size=50, min_batch_size=1, growth_factor=3.0)


def nested(levels: int, leaf: object = 1) -> object:
    value = leaf
    for i in range(levels):
        value = [value] if i % 2 == 0 else {"a": value}
    return value


def test_nesting_over_counts_levels_of_arrays_and_objects():
    assert not nesting_over(1, 0) and not nesting_over("x", 0)
    assert nesting_over([], 0) and not nesting_over([], 1)
    assert not nesting_over({"a": [1, {"b": 2}]}, 3) and nesting_over({"a": [1, {"b": 2}]}, 2)
    assert not nesting_over(nested(50), 50) and nesting_over(nested(51), 50)
    # Deeper than Python's recursion limit: no RecursionError.
    assert nesting_over(nested(5_000), MAX_JSON_DEPTH)
    # One deep branch among shallow ones is found.
    assert nesting_over([1, [2], {"x": nested(10)}, 3], 10)


def test_a_native_job_nested_too_deep_is_refused_in_the_native_shape():
    job = {"id": "j", "input": {"prompt": "hi", "extra": nested(MAX_JSON_DEPTH)}}
    with pytest.raises(JobError) as info:
        parse_job(job, SIZES)
    assert info.value.payload == {
        "error": f"the input is nested more than {MAX_JSON_DEPTH} levels deep"
    }
    ok = {"id": "j", "input": {"prompt": "hi", "sampling_params": {"max_tokens": 2}}}
    assert isinstance(parse_job(ok, SIZES), NativeJob)


def test_an_openai_job_nested_too_deep_is_refused_in_openai_shape():
    body = {"model": "m", "messages": [], "metadata": nested(MAX_JSON_DEPTH)}
    job = {"id": "j", "input": {"openai_route": "/v1/chat/completions", "openai_input": body}}
    with pytest.raises(JobError) as info:
        parse_job(job, SIZES)
    error = info.value.payload["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"] == f"the openai_input is nested more than {MAX_JSON_DEPTH} levels deep"
    body["metadata"] = nested(MAX_JSON_DEPTH - 1)  # with the body's own object: at the limit
    assert isinstance(parse_job(job, SIZES), OpenAIJob)


def test_native_limits_are_checked_before_the_schema(monkeypatch):
    """With the worker's limits, a native job over MAX_MESSAGES or MAX_PROMPT_CHARS is refused
    before NativeRequest's schema validates it (as the OpenAI routes check the body as sent)."""
    from serverless_llm.api import native as native_module
    from serverless_llm.api.limits import RequestLimits

    limits = RequestLimits(max_messages=3, max_prompt_chars=10)
    validated = []
    parse = native_module.NativeRequest.parse
    monkeypatch.setattr(
        native_module.NativeRequest,
        "parse",
        staticmethod(lambda d: validated.append(d) or parse(d)),
    )
    many = {"id": "j", "input": {"messages": [{"role": "user", "content": "hi"}] * 4}}
    with pytest.raises(JobError) as info:
        parse_job(many, SIZES, limits)
    assert info.value.payload == {
        "error": "'messages' has 4 entries, over this endpoint's limit of 3 (MAX_MESSAGES)"
    }
    long = {"id": "j", "input": {"prompt": "x" * 11}}
    with pytest.raises(JobError, match="MAX_PROMPT_CHARS"):
        parse_job(long, SIZES, limits)
    assert validated == []
    assert isinstance(
        parse_job({"id": "j", "input": {"prompt": "x" * 10}}, SIZES, limits), NativeJob
    )
    assert isinstance(parse_job(many, SIZES), NativeJob)  # no limits given: the schema's only

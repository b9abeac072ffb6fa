"""Deeply nested JSON at the local endpoint (issue 38 item 11): a body nested past
MAX_JSON_DEPTH gets a 400 in its route's shape on every route that reads a body (found from the
app's own routes, so a route added later is covered too), never a 500 plain-text page; the
server keeps serving. Against the real worker, bodies at the limit, and deep JSON inside strings
(a schema, tool-call arguments), get an answer of their route's shape too."""

from __future__ import annotations

import json
import re
import warnings

import httpx
import pytest

from serverless_llm.devserver.body import PARSE_ON_LOOP_BYTES
from serverless_llm.worker.job_input import MAX_JSON_DEPTH
from tests.devserver.conftest import API_KEY, SERVED_MODEL, ServerThread

DEEP = 1_000  # json.loads itself gives up (RecursionError) around here


def nested(levels: int, leaf: object = 1) -> object:
    """`levels` levels of arrays and objects, alternating: [{"a": [{"a": ... leaf}]}]."""
    value = leaf
    for i in range(levels):
        value = [value] if i % 2 == 0 else {"a": value}
    return value


def deep_text(levels: int) -> str:
    return "[" * levels + "]" * levels


def body_routes(server: ServerThread) -> list[str]:
    """Every POST route whose only path parameter, if any, is the endpoint's id."""
    with warnings.catch_warnings():  # the /v2 copies repeat operation ids
        warnings.simplefilter("ignore")
        schema = server.app.openapi()
    paths = set()
    for path, operations in schema["paths"].items():
        path = path.replace("{endpoint_id}", "ep-1")
        if "post" in operations and "{" not in path:
            paths.add(path)
    return sorted(paths)


def error_message(path: str, response: httpx.Response) -> str:
    """The error's message, after checking the body is the route's error shape."""
    body = response.json()
    if path.rstrip("/").endswith(("/v1/messages", "/v1/messages/count_tokens")):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"]
    last = path.rstrip("/").rsplit("/", 1)[-1]
    vllm_routes = ("tokenize", "detokenize", "rerank", "score", "classify", "pooling")
    if "/openai/" in path or last in vllm_routes or "lora_adapter" in last:
        assert body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"]
    assert isinstance(body["error"], str), body
    return body["error"]


def test_the_routes_reading_bodies_are_all_found(fake_server: ServerThread):
    routes = body_routes(fake_server)
    for path in (
        "/run",
        "/runsync",
        "/openai/v1/chat/completions",
        "/openai/v1/completions",
        "/openai/v1/responses",
        "/v1/messages",
        "/tokenize",
        "/v2/ep-1/run",
        "/v2/ep-1/openai/v1/chat/completions",
    ):
        assert path in routes


@pytest.mark.parametrize(
    "case",
    ["recursion", "over-the-limit", "over-the-limit-large"],
)
def test_a_deeply_nested_body_gets_400_on_every_route(fake_server: ServerThread, case: str):
    """1,000 levels (json.loads' RecursionError), one level past the limit (the depth check),
    and one past the limit in a body large enough to be parsed on the parse thread."""
    if case == "recursion":
        deep = deep_text(DEEP)
    else:
        deep = json.dumps(nested(MAX_JSON_DEPTH))  # + the body's own object: one too many
    pad = "x" * (PARSE_ON_LOOP_BYTES + 10) if case.endswith("large") else ""
    raw = f'{{"pad": "{pad}", "input": {deep}}}'.encode()
    with httpx.Client(base_url=fake_server.base_url, timeout=60) as client:
        for path in body_routes(fake_server):
            r = client.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, r.status_code, r.text[:200])
            message = error_message(path, r)
            assert f"nested more than {MAX_JSON_DEPTH} levels deep" in message, (path, message)
        assert client.get("/health").json()["ok"] is True


def test_a_body_at_the_limit_is_taken(fake_server: ServerThread):
    job_input = {"items": 1, "deep": nested(MAX_JSON_DEPTH - 2)}  # + input's and the body's
    with httpx.Client(base_url=fake_server.base_url, timeout=60) as client:
        r = client.post("/runsync", json={"input": job_input})
        assert r.status_code == 200 and r.json()["status"] == "COMPLETED", r.text[:300]
        r = client.post("/runsync", json={"input": {**job_input, "deep": nested(MAX_JSON_DEPTH)}})
        assert r.status_code == 400


def test_bad_json_still_names_the_fault(fake_server: ServerThread):
    with httpx.Client(base_url=fake_server.base_url, timeout=60) as client:
        for raw in (b'{"input": ', b'{"input": {}, "x": "' + b"y" * PARSE_ON_LOOP_BYTES + b"}"):
            r = client.post("/run", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400
            assert r.json()["error"].startswith("the request body is not valid JSON")


# -- the real worker -------------------------------------------------------------------------


def test_deep_json_reaching_the_worker_is_answered_in_shape(endpoint: ServerThread):
    """Bodies at the limit through every part of a chat request, and deep JSON inside strings
    (a guided_json schema, an assistant's tool-call arguments, a response_format schema): each
    gets a 200 or a 400 in OpenAI's shape, never a 500."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    base = {"model": SERVED_MODEL, "max_tokens": 2}
    user = [{"role": "user", "content": "hi"}]
    limit = MAX_JSON_DEPTH - 6  # room for the fields around it
    schema_deep = {"type": "object"}
    for _ in range(limit // 2):
        schema_deep = {"type": "object", "properties": {"a": schema_deep}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema_deep}}
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": deep_text(DEEP)},
    }
    bodies = {
        "metadata": {**base, "messages": user, "metadata": {"k": json.dumps(nested(limit))}},
        "extra field": {**base, "messages": user, "unknown": nested(limit)},
        "content": {**base, "messages": [{"role": "user", "content": nested(limit)}]},
        "guided_json text": {**base, "messages": user, "guided_json": deep_text(DEEP)},
        "guided_json deep": {**base, "messages": user, "guided_json": schema_deep},
        "response_format": {
            **base,
            "messages": user,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": schema_deep},
            },
        },
        "tools": {**base, "messages": user, "tools": [tool]},
        "tool-call arguments": {
            **base,
            "messages": [
                *user,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ],
        },
    }
    with httpx.Client(base_url=endpoint.base_url, timeout=120, headers=headers) as client:
        for name, body in bodies.items():
            r = client.post("/openai/v1/chat/completions", json=body)
            assert r.status_code in (200, 400), (name, r.status_code, r.text[:300])
            if r.status_code == 400:
                assert r.json()["error"]["type"] == "invalid_request_error", (name, r.text)
        native = {"prompt": "hi", "sampling_params": {"max_tokens": 2, "guided_json": "[" * DEEP}}
        r = client.post("/runsync", json={"input": native})
        assert r.status_code == 200 and r.json()["status"] in ("COMPLETED", "FAILED"), r.text
        if r.json()["status"] == "FAILED":
            assert re.search("JSON", json.dumps(r.json()["error"])), r.text
        assert client.get("/health").json()["ok"] is True

"""Anthropic's Messages API in the serving layer (issue 38 item 5): the translation of a Messages
request into the chat body, the Message and stream events built from the chat route's answer,
errors in Anthropic's shape, and the route through `OpenAIServing.handle` on the tiny Llama
(both RAW_OPENAI_OUTPUT forms). The official client's view is tests/devserver/
test_anthropic_client.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from serverless_llm.api.anthropic import (
    MessageFormatter,
    MessagesRequest,
    anthropic_error,
    to_chat_body,
)
from serverless_llm.api.openai.errors import OpenAIServingError, http_status, openai_error
from tests.api.conftest import MODEL, collect

TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}


def body_of(**fields: Any) -> dict[str, Any]:
    fields.setdefault("model", MODEL)
    fields.setdefault("max_tokens", 16)
    fields.setdefault("messages", [{"role": "user", "content": "Hi"}])
    return to_chat_body(MessagesRequest.model_validate(fields))


def test_conversation_translation():
    image = {"type": "base64", "media_type": "image/png", "data": "AAAA"}
    body = body_of(
        system=[{"type": "text", "text": "One."}, {"type": "text", "text": "Two."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Call it.", "signature": "s"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"a": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "no"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "Thanks."},
                    {"type": "image", "source": image},
                ],
            },
        ],
        stop_sequences=["END"],
        temperature=0.5,
        top_k=3,
        seed=1,
    )
    assert body["messages"] == [
        {"role": "system", "content": "One.\nTwo."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Call it.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"a": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Thanks."},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        },
    ]
    assert body["stop"] == ["END"] and body["temperature"] == 0.5 and body["top_k"] == 3
    assert body["seed"] == 1 and "max_tokens" not in body  # fitted to the context later
    assert "continue_final_message" not in body

    prefill = body_of(
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well"}]
    )
    assert prefill["continue_final_message"] is True
    assert prefill["add_generation_prompt"] is False


@pytest.mark.parametrize(
    ("choice", "chat_choice", "parallel"),
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "any"}, "required", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "none"}, "none", None),
        (
            {"type": "tool", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
            None,
        ),
    ],
)
def test_tool_choice(choice, chat_choice, parallel):
    body = body_of(tools=[{**TOOL, "description": "Weather"}], tool_choice=choice)
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": TOOL["input_schema"],
                "description": "Weather",
            },
        }
    ]
    assert body["tool_choice"] == chat_choice
    assert body.get("parallel_tool_calls") is parallel


def test_thinking_and_output_config():
    on = body_of(thinking={"type": "enabled", "budget_tokens": 8})
    assert on["chat_template_kwargs"] == {"enable_thinking": True, "thinking": True}
    assert body_of(thinking={"type": "disabled"})["chat_template_kwargs"] == {
        "enable_thinking": False,
        "thinking": False,
    }
    assert "chat_template_kwargs" not in body_of()  # the model's own default
    own = body_of(thinking={"type": "adaptive"}, chat_template_kwargs={"enable_thinking": False})
    assert own["chat_template_kwargs"] == {"enable_thinking": False}
    schema = {"type": "object"}
    body = body_of(
        output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "max"}
    )
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }
    assert body["reasoning_effort"] == "high"


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "server tools"),
        ({"tools": [{"name": "x"}]}, "input_schema"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"thinking": {"type": "enabled", "budget_tokens": 16}}, "budget_tokens"),
        ({"thinking": {"type": "enabled"}}, "budget_tokens"),
        ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "document"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}],
                    }
                ]
            },
            "source",
        ),
    ],
)
def test_refusals_name_the_field(fields, words):
    with pytest.raises(OpenAIServingError) as raised:
        body_of(**fields)
    assert words in str(raised.value)


def test_errors_keep_their_status_in_anthropics_shape():
    for status, kind in [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (500, "api_error"),
        (503, "overloaded_error"),
    ]:
        err = anthropic_error(openai_error("bad", param="messages", status=status))
        assert err == {"type": "error", "error": {"type": kind, "message": "messages: bad"}}
        assert http_status(err) == status
        if status != 503:  # the platform's JSON round trip keeps it too
            assert http_status(json.loads(json.dumps(err))) == status


def chunk(delta: dict[str, Any], finish: str | None = None, stop: Any = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = stop
    return {"id": "c", "object": "chat.completion.chunk", "choices": [choice]}


def usage(n: int) -> dict[str, Any]:
    return {"id": "c", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}}


def test_stream_events_from_chat_chunks():
    fmt = MessageFormatter(MODEL, ["END"])
    start = fmt.start(5)
    assert [e["type"] for e in start] == ["message_start", "ping"]
    assert start[0]["message"]["usage"]["input_tokens"] == 5
    call = {
        "index": 0,
        "id": "toolu_9",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a"'},
    }
    events = fmt.feed(
        [
            chunk({"role": "assistant", "content": ""}),
            chunk({"reasoning_content": "hm"}),
            chunk({"reasoning_content": "m"}),
            chunk({"content": "Hi"}),
            chunk({"tool_calls": [call]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "tool_calls"),
            usage(7),
        ]
    )
    assert events == [
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "thinking", "thinking": "", "signature": ""},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "thinking_delta", "thinking": "hmm"},
        },
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Hi"}},
        {"type": "content_block_stop", "index": 1},
        {
            "type": "content_block_start",
            "index": 2,
            "content_block": {"type": "tool_use", "id": "toolu_9", "name": "f", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": '{"a": 1}'},
        },
        {"type": "content_block_stop", "index": 2},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {"output_tokens": 7},
        },
        {"type": "message_stop"},
    ]


@pytest.mark.parametrize(
    ("finish", "stop", "clamped", "expected"),
    [
        ("stop", None, False, ("end_turn", None)),
        ("stop", "END", False, ("stop_sequence", "END")),
        ("stop", 2, False, ("end_turn", None)),  # a stop token id
        ("length", None, False, ("max_tokens", None)),
        ("length", None, True, ("model_context_window_exceeded", None)),
    ],
)
def test_stop_reasons(finish, stop, clamped, expected):
    fmt = MessageFormatter(MODEL, ["END"], clamped=clamped)
    chat = {
        "choices": [
            {
                "message": {"role": "assistant", "content": "x", "tool_calls": []},
                "finish_reason": finish,
                "stop_reason": stop,
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
    message = fmt.from_chat(chat)
    assert (message["stop_reason"], message["stop_sequence"]) == expected
    assert message["content"] == [{"type": "text", "text": "x"}]
    fmt.start(3)
    events = fmt.feed([chunk({"content": "x"}, finish, stop), usage(1)])
    assert events[-2]["delta"] == {"stop_reason": expected[0], "stop_sequence": expected[1]}


def test_an_error_after_the_stream_began_is_an_error_event():
    fmt = MessageFormatter(MODEL, None)
    (event,) = fmt.fail(openai_error("the engine stopped", type="server_error", status=500))
    assert event == {
        "type": "error",
        "error": {"type": "api_error", "message": "the engine stopped"},
    }


def test_routes_through_the_serving_layer(serve):
    request = {
        "model": MODEL,
        "max_tokens": 6,
        "messages": [{"role": "user", "content": "Hello"}],
        "temperature": 0.0,
        "ignore_eos": True,
    }

    async def run(s):
        (full,) = await collect(s, "/v1/messages", request)
        streamed = await collect(s, "/v1/messages", {**request, "stream": True})
        (count,) = await collect(
            s, "/v1/messages/count_tokens", {"model": MODEL, "messages": request["messages"]}
        )
        (error,) = await collect(s, "/v1/messages", {**request, "max_tokens": 0})
        return full, streamed, count, error

    full, streamed, count, error = serve(run)
    assert full["type"] == "message" and full["usage"]["output_tokens"] == 6
    assert count == {"input_tokens": full["usage"]["input_tokens"]}
    assert error["type"] == "error" and http_status(error) == 400
    # RAW_OPENAI_OUTPUT on: SSE text with `event:` lines, no [DONE].
    raw = "".join(streamed)
    assert "[DONE]" not in raw and raw.startswith("event: message_start\ndata: ")
    events = [json.loads(f.split("\n")[1][len("data: ") :]) for f in raw.strip().split("\n\n")]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == full["content"][0]["text"]

    # Off: lists of event objects.
    lists = serve(
        lambda s: collect(s, "/v1/messages", {**request, "stream": True}), raw_output=False
    )
    flat = [e for item in lists for e in item]
    assert [e["type"] for e in flat[:2]] == ["message_start", "ping"]
    assert flat[-1] == {"type": "message_stop"}


def test_auto_tool_choice_off_says_what_works_instead(serve):
    request = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [TOOL],
        "tool_choice": {"type": "auto"},
    }
    (error,) = serve(lambda s: collect(s, "/v1/messages", request), enable_auto_tool_choice=False)
    assert error["type"] == "error" and http_status(error) == 400
    assert "ENABLE_AUTO_TOOL_CHOICE" in error["error"]["message"]
    assert "'type': 'any'" in error["error"]["message"]

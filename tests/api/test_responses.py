"""/v1/responses in the serving layer: how a request becomes a chat body, what a job on the
route yields (raw SSE with `event:` lines, or event dicts), reasoning items, and errors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from serverless_llm.api.openai.errors import OpenAIServingError
from serverless_llm.api.openai.responses import ResponseFormatter, ResponsesRequest, to_chat_body
from tests.api.conftest import collect

ROUTE = "/v1/responses"


def chat_body(**fields: Any) -> dict[str, Any]:
    return to_chat_body(ResponsesRequest.model_validate(fields))


def test_input_items_become_one_conversation():
    body = chat_body(
        instructions="Be terse.",
        input=[
            {"role": "user", "content": "Weather?"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Call the tool."}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"a": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "rainy"}],
            },
            {"role": "developer", "content": [{"type": "input_text", "text": "Now answer."}]},
        ],
    )
    assert body["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Call the tool.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"a": 1}'},
                },
                {"id": "c2", "type": "function", "function": {"name": "w", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rainy"},
        {"role": "developer", "content": "Now answer."},
    ]


def test_a_reasoning_item_before_a_continued_turn_is_kept():
    text = {"type": "output_text", "text": "b"}
    body = chat_body(
        input=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "why"}]},
            {"type": "message", "role": "assistant", "content": [text]},
        ]
    )
    assert body["messages"][1:] == [
        {"role": "assistant", "content": "ab", "reasoning_content": "why"}
    ]


def test_local_endpoint_writes_event_lines_for_responses_events():
    from serverless_llm.devserver.app import _sse

    events = [{"type": "response.created", "sequence_number": 0}]
    # The API's framing (api/openai/sse.py): compact JSON, as with RAW_OPENAI_OUTPUT on.
    assert _sse(events) == (
        'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'
    )
    assert _sse([{"object": "chat.completion.chunk"}]).startswith("data: ")


def test_fields_map_to_chat():
    tool = {"type": "function", "name": "w", "parameters": {"type": "object"}, "strict": True}
    body = chat_body(
        input="hi",
        max_output_tokens=9,
        temperature=0.5,
        top_p=0.9,
        tools=[tool],
        tool_choice={"type": "function", "name": "w"},
        reasoning={"effort": "xhigh"},
        top_logprobs=2,
        seed=4,
        top_k=3,
        stream=True,
        store=True,
        metadata={"k": "v"},
    )
    assert body == {
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.9,
        "stream": True,
        "tools": [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}],
        "tool_choice": {"type": "function", "function": {"name": "w"}},
        "reasoning_effort": "high",
        "logprobs": True,
        "top_logprobs": 2,
        "seed": 4,
        "top_k": 3,
    }
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}
    assert chat_body(input="hi", text=fmt)["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": schema, "strict": True},
    }
    assert chat_body(input="hi", text={"format": {"type": "json_object"}})["response_format"] == {
        "type": "json_object"
    }
    assert "response_format" not in chat_body(input="hi", text={"format": {"type": "text"}})
    # A turn forced to call a tool has no message for the format to shape.
    forced = chat_body(input="hi", text=fmt, tools=[tool], tool_choice="required")
    assert "response_format" not in forced
    allowed = chat_body(
        input="hi",
        tools=[tool, {**tool, "name": "v"}],
        tool_choice={"type": "allowed_tools", "mode": "required", "tools": [{"name": "v"}]},
    )
    assert allowed["tool_choice"] == "required"
    assert [t["function"]["name"] for t in allowed["tools"]] == ["v"]
    assert chat_body(input="hi", max_tool_calls=1)["parallel_tool_calls"] is False


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"input": [{"type": "function_call", "name": "w", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "computer_call_output"}]}, "input[0].type"),
        ({"input": [3]}, "input[0]"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": "x", "max_tool_calls": 2}, "max_tool_calls"),
        ({"input": "x", "tool_choice": {"type": "mcp"}}, "tool_choice"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "x", "reasoning": {"effort": "bogus"}}, "reasoning.effort"),
    ],
)
def test_what_cannot_be_honoured_is_a_400(fields, param):
    with pytest.raises(OpenAIServingError) as info:
        chat_body(**fields)
    assert info.value.error["error"]["param"] == param
    assert info.value.error.status == 400


def test_job_route_raw_sse_and_event_dicts(serve):
    body = {
        "model": "tiny",
        "input": "Hello",
        "max_output_tokens": 5,
        "stream": True,
        "temperature": 0,
    }

    async def run(s):
        raw = await collect(s, ROUTE, body)
        s.raw_output = False
        dicts = await collect(s, ROUTE, body)
        whole = await collect(s, "responses", {**body, "stream": False})
        return raw, dicts, whole

    raw, dicts, (whole,) = serve(run, served_model_name="tiny")
    text = "".join(raw)
    assert "[DONE]" not in text and text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        head, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        events.append(event)
    flat = [e for batch in dicts for e in batch]
    assert [e["type"] for e in flat] == [e["type"] for e in events]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.incomplete"
    # One batch of tokens is one delta event.
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) < 5
    final = events[-1]["response"]
    assert "".join(deltas) == final["output"][0]["content"][0]["text"]
    assert whole["output"][0]["content"][0]["text"] == final["output"][0]["content"][0]["text"]
    assert whole["usage"] == final["usage"]
    assert whole["status"] == "incomplete" and whole["error"] is None


def test_reasoning_items_streamed_and_not(serve):
    forced = "<think>two and two</think>four"
    body = {
        "model": "tiny",
        "input": "2+2?",
        "max_output_tokens": 60,
        # vLLM's structured_outputs extra forces the tiny model's (random) text.
        "structured_outputs": {"regex": forced},  # (no regex metacharacters in it)
        "temperature": 0,
    }

    async def run(s):
        s.raw_output = False
        (whole,) = await collect(s, ROUTE, body)
        streamed = await collect(s, ROUTE, {**body, "stream": True})
        return whole, [e for batch in streamed for e in batch]

    # The regex forces the reasoning too: structured output from the first token.
    whole, events = serve(
        run, served_model_name="tiny", reasoning_parser="qwen3", structured_in_reasoning=True
    )
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "two and two"}]
    assert message["content"][0]["text"] == "four"
    usage = whole["usage"]
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] < usage["output_tokens"]
    types = [e["type"] for e in events]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert text == "two and two"
    final = events[-1]["response"]
    assert [{**item, "id": None} for item in final["output"]] == [
        {**reasoning, "id": None},
        {**message, "id": None},
    ]
    assert final["usage"] == usage

    # The reasoning item sent back as input reaches the template as reasoning_content.
    again = chat_body(input=[{"role": "user", "content": "2+2?"}, reasoning, message])
    assert again["messages"][1] == {
        "role": "assistant",
        "content": "four",
        "reasoning_content": "two and two",
    }


def test_an_error_mid_stream_fails_the_response():
    fmt = ResponseFormatter(ResponsesRequest(input="x"), "m", lambda text: len(text))
    start = fmt.start()
    fed = fmt.feed([{"choices": [{"index": 0, "delta": {"content": "ab"}, "finish_reason": None}]}])
    err = {"error": {"message": "engine died", "type": "server_error", "param": None, "code": None}}
    failed = fmt.fail(err)
    events = start + fed + failed
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in failed] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "error",
        "response.failed",
    ]
    assert failed[2]["item"]["status"] == "incomplete"
    assert failed[-1]["response"]["status"] == "failed"
    assert failed[-1]["response"]["error"] == {"code": "server_error", "message": "engine died"}
    assert failed[-1]["response"]["output"][0]["content"][0]["text"] == "ab"

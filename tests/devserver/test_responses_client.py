"""/v1/responses through the official OpenAI client against the local endpoint: the answer is
the chat route's, token for token (text, usage, status), `text.format` shapes it, a function
tool round trip, and `responses.stream`'s event order with its final response."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.devserver.conftest import API_KEY, SERVED_MODEL, ServerThread

COMPACT = {"guided_decoding_backend": "xgrammar:disable-any-whitespace"}
QUESTION = "What is the weather in Paris?"
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": CITY}
VERDICT = {
    "type": "object",
    "properties": {"verdict": {"enum": ["sunny", "rainy"]}},
    "required": ["verdict"],
    "additionalProperties": False,
}


class Verdict(BaseModel):
    verdict: Literal["sunny", "rainy"]


@pytest.fixture(scope="module")
def client(endpoint: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{endpoint.base_url}/openai/v1", api_key=API_KEY, timeout=60)


def _same_as_chat(response, completion) -> None:
    choice = completion.choices[0]
    assert response.output_text == choice.message.content
    assert response.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert response.usage.input_tokens == completion.usage.prompt_tokens
    assert response.usage.output_tokens == completion.usage.completion_tokens
    assert response.usage.total_tokens == completion.usage.total_tokens


def test_text_is_the_chat_answer(client: openai.OpenAI):
    response = client.responses.create(
        model=SERVED_MODEL,
        instructions="Answer briefly.",
        input=QUESTION,
        max_output_tokens=12,
        temperature=0,
    )
    completion = client.chat.completions.create(
        model=SERVED_MODEL,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=12,
        temperature=0,
    )
    _same_as_chat(response, completion)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == SERVED_MODEL
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"


def test_seeded_sampling_and_vllm_extras(client: openai.OpenAI):
    kwargs = dict(model=SERVED_MODEL, max_output_tokens=10, temperature=1.0, top_p=0.9)
    response = client.responses.create(
        input=QUESTION, extra_body={"seed": 7, "top_k": 20}, **kwargs
    )
    completion = client.chat.completions.create(
        model=SERVED_MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=10,
        temperature=1.0,
        top_p=0.9,
        seed=7,
        extra_body={"top_k": 20},
    )
    _same_as_chat(response, completion)


def test_json_schema_format(client: openai.OpenAI):
    response = client.responses.create(
        model=SERVED_MODEL,
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT}},
        max_output_tokens=60,
        extra_body=COMPACT,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), VERDICT)
    assert response.text.format.type == "json_schema"

    parsed = client.responses.parse(
        model=SERVED_MODEL,
        input=QUESTION,
        text_format=Verdict,
        max_output_tokens=60,
        extra_body=COMPACT,
    )
    assert isinstance(parsed.output_parsed, Verdict)


def test_function_tool_round_trip(client: openai.OpenAI):
    first = client.responses.create(
        model=SERVED_MODEL,
        input=QUESTION,
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80,
        extra_body=COMPACT,
    )
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id
    jsonschema.validate(json.loads(call.arguments), CITY)

    # The call and its output go back as input items; the answer is the chat route's for the
    # same conversation.
    second = client.responses.create(
        model=SERVED_MODEL,
        input=[
            {"role": "user", "content": QUESTION},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        ],
        tools=[TOOL],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    completion = client.chat.completions.create(
        model=SERVED_MODEL,
        messages=[
            {"role": "user", "content": QUESTION},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
        ],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}],
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    _same_as_chat(second, completion)
    assert second.usage.input_tokens > first.usage.input_tokens


def test_stream_event_order_and_final_response(client: openai.OpenAI):
    kwargs = dict(
        model=SERVED_MODEL,
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT}},
        max_output_tokens=60,
        extra_body={**COMPACT, "seed": 3},
        temperature=1.0,
    )
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert deltas and "".join(deltas) == final.output_text
    jsonschema.validate(json.loads(final.output_text), VERDICT)
    assert final.status == "completed"
    # The same request, not streamed, gives the same answer and usage.
    whole = client.responses.create(**kwargs)
    assert whole.output_text == final.output_text
    assert whole.usage.output_tokens == final.usage.output_tokens > 0
    assert whole.usage.input_tokens == final.usage.input_tokens > 0
    assert final.usage.total_tokens == final.usage.input_tokens + final.usage.output_tokens


def test_streamed_function_call(client: openai.OpenAI):
    with client.responses.stream(
        model=SERVED_MODEL,
        input=QUESTION,
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        extra_body=COMPACT,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and call.status == "completed"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == call.arguments
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments and done.item_id == call.id
    jsonschema.validate(json.loads(call.arguments), CITY)
    assert not [e for e in events if e.type == "response.output_text.delta"]


def test_a_cut_stream_ends_incomplete(client: openai.OpenAI):
    events = list(
        client.responses.create(
            model=SERVED_MODEL, input=QUESTION, max_output_tokens=3, stream=True, temperature=0
        )
    )
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.usage.output_tokens == 3
    (item_done,) = [e for e in events if e.type == "response.output_item.done"]
    assert item_done.item.status == "incomplete"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"background": True}, "background"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ],
)
def test_refusals_name_the_parameter(client: openai.OpenAI, extra, param):
    body = {"model": SERVED_MODEL, "input": QUESTION, "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**body)
    assert info.value.status_code == 400
    assert info.value.param == param
    # The worker keeps serving.
    assert client.responses.create(model=SERVED_MODEL, input="hi", max_output_tokens=2).usage

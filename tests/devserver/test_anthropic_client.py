"""The official `anthropic` client against the local endpoint's Messages API (issue 38 item 5),
on the real worker and a tiny Llama: what a user who points `base_url` at the endpoint gets.

The tiny model writes random text, so answers are checked against the OpenAI chat route given
the same conversation (the Messages route is a view of it: same prompt, same greedy text), and
token counts against the chat template. Tool calls are forced by the grammar (`tool_choice`
any / tool) and reasoning by a regex, as the OpenAI-route tests do."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.devserver.conftest import ServerThread, serve
from tests.tiny_models import build_tiny_model

MODEL = "tiny-claude"
KEY = "anthropic-key"
MAX_MODEL_LEN = 1024
COMPACT = {"guided_decoding_backend": "xgrammar:disable-any-whitespace"}
GREEDY = {"temperature": 0.0}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": SCHEMA}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """The tiny Llama with a qwen3 reasoning parser whose constraint covers the reasoning too
    (so a regex can force a `<think>` block)."""
    from serverless_llm.devserver.app import create_app
    from serverless_llm.worker.handler import Worker
    from serverless_llm.worker.settings import Settings

    root = tmp_path_factory.mktemp("anthropic")
    model_dir = build_tiny_model(str(root / "llama"), "llama", max_position_embeddings=1024)
    settings = Settings.from_env(
        {
            "MODEL_NAME": model_dir,
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": MODEL,
            "BASE_PATH": str(root / "base"),
            "DEVICE": "cpu",
            "DTYPE": "float32",
            "MAX_MODEL_LEN": str(MAX_MODEL_LEN),
            "BLOCK_SIZE": "16",
            "NUM_KV_BLOCKS": "256",
            "REASONING_PARSER": "qwen3",
            "STRUCTURED_OUTPUTS_ENABLE_IN_REASONING": "true",
        }
    )
    worker = Worker(settings)
    with serve(create_app(worker, api_key=KEY)) as srv:
        srv.worker = worker  # type: ignore[attr-defined]
        srv.model_dir = model_dir  # type: ignore[attr-defined]
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/openai/v1", api_key=KEY, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(server: ServerThread) -> Any:
    return AutoTokenizer.from_pretrained(server.model_dir)  # type: ignore[attr-defined]


def prompt_tokens(tokenizer: Any, messages: list[dict[str, Any]]) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_text(chat: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int, **extra) -> str:
    answer = chat.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, **GREEDY, extra_body=extra
    )
    return answer.choices[0].message.content or ""


def test_text_system_and_usage(client: anthropic.Anthropic, chat: openai.OpenAI, tokenizer):
    message = client.messages.create(
        model=MODEL,
        max_tokens=12,
        system="Be brief.",
        messages=ASK,
        metadata={"user_id": "u-1"},
        extra_body={**GREEDY, "ignore_eos": True},
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    (block,) = message.content
    assert block.type == "text"
    expected = [{"role": "system", "content": "Be brief."}, *ASK]
    assert block.text == chat_text(chat, expected, 12, ignore_eos=True)
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 12
    assert message.usage.input_tokens == prompt_tokens(tokenizer, expected)

    # The system prompt as text blocks is the same prompt.
    blocks = client.messages.create(
        model=MODEL,
        max_tokens=12,
        system=[{"type": "text", "text": "Be brief."}],
        messages=ASK,
        extra_body={**GREEDY, "ignore_eos": True},
    )
    assert blocks.content[0].text == block.text
    assert blocks.usage.input_tokens == message.usage.input_tokens


def test_multi_turn_and_prefill(client: anthropic.Anthropic, chat: openai.OpenAI, tokenizer):
    turns = [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi, how can I help?"}]},
        {"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]},
    ]
    as_chat = [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Tell me a story."},
    ]
    message = client.messages.create(
        model=MODEL, max_tokens=10, messages=turns, extra_body={**GREEDY, "ignore_eos": True}
    )
    assert message.content[0].text == chat_text(chat, as_chat, 10, ignore_eos=True)
    assert message.usage.input_tokens == prompt_tokens(tokenizer, as_chat)

    # A last assistant turn is continued (Anthropic's prefill), as chat's continue_final_message.
    prefill = [*turns, {"role": "assistant", "content": "Once upon"}]
    continued = client.messages.create(
        model=MODEL, max_tokens=8, messages=prefill, extra_body={**GREEDY, "ignore_eos": True}
    )
    expected = chat_text(
        chat,
        [*as_chat, {"role": "assistant", "content": "Once upon"}],
        8,
        ignore_eos=True,
        continue_final_message=True,
        add_generation_prompt=False,
    )
    assert continued.content[0].text == expected


def test_stop_sequences(client: anthropic.Anthropic):
    kwargs = dict(model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY)
    text = client.messages.create(**kwargs).content[0].text
    # A stop string that first occurs a few characters in.
    cut = next(i for i in range(2, len(text) - 2) if text.find(text[i : i + 2]) == i)
    stop = text[cut : cut + 2]
    message = client.messages.create(**kwargs, stop_sequences=["never-written", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[:cut]


def test_sampling_parameters(client: anthropic.Anthropic):
    """temperature, top_p, top_k (sent at the top level, as older clients send them): the same
    seed gives the same text, and top_k=1 is greedy."""
    kwargs = dict(model=MODEL, max_tokens=10, messages=ASK)
    sampled = {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 7, "ignore_eos": True}
    first = client.messages.create(**kwargs, extra_body=sampled).content[0].text
    assert client.messages.create(**kwargs, extra_body=sampled).content[0].text == first
    greedy = client.messages.create(**kwargs, extra_body={**GREEDY, "ignore_eos": True})
    top_k = client.messages.create(
        **kwargs, extra_body={"temperature": 1.0, "top_k": 1, "seed": 3, "ignore_eos": True}
    )
    assert top_k.content[0].text == greedy.content[0].text


def test_stream_helper_and_event_order(client: anthropic.Anthropic, server: ServerThread):
    kwargs = dict(model=MODEL, max_tokens=20, messages=ASK)
    full = client.messages.create(**kwargs, extra_body={**GREEDY, "ignore_eos": True})
    with client.messages.stream(**kwargs, extra_body={**GREEDY, "ignore_eos": True}) as stream:
        kinds = [event.type for event in stream if event.type != "text"]
        final = stream.get_final_message()
    assert final.content[0].text == full.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 20
    assert final.usage.input_tokens == full.usage.input_tokens
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    with client.messages.stream(**kwargs, extra_body=GREEDY) as stream:
        assert (
            "".join(stream.text_stream)
            == client.messages.create(**kwargs, extra_body=GREEDY).content[0].text
        )

    # The wire: each event named as its data's type, ping after message_start, no [DONE].
    body = {**kwargs, **GREEDY, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/messages", json=body, headers={"x-api-key": KEY}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join(response.iter_text())
    events = []
    for frame in raw.strip().split("\n\n"):
        name_line, data_line = frame.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}"
        events.append(data)
    assert "[DONE]" not in raw
    assert [e["type"] for e in events[:3]] == ["message_start", "ping", "content_block_start"]
    start = events[0]["message"]
    assert start["stop_reason"] is None and start["content"] == []
    assert start["usage"]["input_tokens"] == full.usage.input_tokens
    assert events[2]["content_block"] == {"type": "text", "text": ""}
    deltas = [e for e in events if e["type"] == "content_block_delta"]
    assert all(e["index"] == 0 and e["delta"]["type"] == "text_delta" for e in deltas)
    assert "".join(e["delta"]["text"] for e in deltas) == full.content[0].text
    delta = events[-2]
    assert delta["type"] == "message_delta" and delta["delta"]["stop_reason"] == "max_tokens"
    assert delta["usage"]["output_tokens"] == 20


def test_tool_use_and_tool_result_round_trip(
    client: anthropic.Anthropic, chat: openai.OpenAI, tokenizer
):
    kwargs = dict(
        model=MODEL, max_tokens=60, tools=TOOLS, messages=ASK, extra_body={**COMPACT, "seed": 11}
    )
    message = client.messages.create(**kwargs, tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use"
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id
    jsonschema.validate(call.input, SCHEMA)

    # Streamed: the helper rebuilds the same call from input_json_delta events.
    with client.messages.stream(
        **kwargs, tool_choice={"type": "tool", "name": "get_weather"}
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "get_weather", call.input)
    ]
    assert "input_json" in kinds

    # "any" (a call to some tool), one call only.
    anyone = client.messages.create(
        **kwargs, tool_choice={"type": "any", "disable_parallel_tool_use": True}
    )
    assert anyone.stop_reason == "tool_use"
    assert [b.type for b in anyone.content] == ["tool_use"]
    jsonschema.validate(anyone.content[0].input, SCHEMA)

    # The call and its result sent back, as the client does after running the tool.
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": [b.model_dump(exclude_none=True) for b in message.content],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21C"}],
        },
    ]
    answer = client.messages.create(
        model=MODEL,
        max_tokens=10,
        tools=TOOLS,
        tool_choice={"type": "none"},
        messages=history,
        extra_body={**GREEDY, "ignore_eos": True},
    )
    assert answer.stop_reason == "max_tokens" and answer.content[0].type == "text"
    as_chat = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(call.input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"},
    ]
    openai_tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": t["description"],
                "parameters": SCHEMA,
            },
        }
        for t in TOOLS
    ]
    expected = chat.chat.completions.create(
        model=MODEL,
        messages=as_chat,
        tools=openai_tools,
        tool_choice="none",
        max_tokens=10,
        **GREEDY,
        extra_body={"ignore_eos": True},
    )
    assert answer.content[0].text == expected.choices[0].message.content
    assert answer.usage.input_tokens == expected.usage.prompt_tokens
    assert answer.usage.input_tokens == prompt_tokens(tokenizer, as_chat)


def test_auto_tool_choice_uses_the_chat_routes_parser(client: anthropic.Anthropic):
    """tool_choice auto (and none given): the text goes through the chat route's tool parser
    (hermes here: the tiny template ignores tools, so they are described in its format); the
    output is forced by a regex."""
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    forced = "Let me check.<tool_call>\n" + call + "\n</tool_call>"
    regex = forced.replace(".", "\\.").replace("{", "\\{").replace("}", "\\}")
    kwargs = dict(
        model=MODEL,
        max_tokens=300,
        tools=TOOLS,
        messages=ASK,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    for choice in ({"tool_choice": {"type": "auto"}}, {}):
        message = client.messages.create(**kwargs, **choice)
        assert [b.type for b in message.content] == ["text", "tool_use"]
        assert message.content[0].text == "Let me check."
        assert (message.content[1].name, message.content[1].input) == (
            "get_weather",
            {"city": "Paris"},
        )
        assert message.stop_reason == "tool_use"
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Let me check."
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_thinking_blocks(client: anthropic.Anthropic):
    forced = {"structured_outputs": {"regex": "<think>two and two</think>four"}}
    kwargs = dict(
        model=MODEL,
        max_tokens=60,
        thinking={"type": "enabled", "budget_tokens": 30},
        messages=[{"role": "user", "content": "2+2?"}],
        extra_body=forced,
    )
    message = client.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "two and two"
    assert message.content[1].text == "four"
    assert message.stop_reason == "end_turn"

    with client.messages.stream(**kwargs) as stream:
        events = [e for e in stream if e.type in ("content_block_start", "content_block_delta")]
        final = stream.get_final_message()
    assert [
        (b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content
    ] == [
        ("thinking", "two and two"),
        ("text", "four"),
    ]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert deltas == {"thinking_delta", "text_delta"}

    # Thinking blocks sent back join the assistant turn (as reasoning_content); accepted.
    back = client.messages.create(
        model=MODEL,
        max_tokens=4,
        messages=[
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": [b.model_dump() for b in message.content]},
            {"role": "user", "content": "And 3+3?"},
        ],
        extra_body=GREEDY,
    )
    assert back.type == "message"


def test_count_tokens(client: anthropic.Anthropic, tokenizer):
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=ASK)
    expected = [{"role": "system", "content": "Be brief."}, *ASK]
    assert counted.input_tokens == prompt_tokens(tokenizer, expected)
    created = client.messages.create(
        model=MODEL, max_tokens=2, system="Be brief.", messages=ASK, extra_body=GREEDY
    )
    assert created.usage.input_tokens == counted.input_tokens
    # With tools and a forced choice: what messages.create would prompt.
    with_tools = client.messages.count_tokens(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "any"}
    )
    created = client.messages.create(
        model=MODEL, max_tokens=40, messages=ASK, tools=TOOLS, tool_choice={"type": "any"}
    )
    assert with_tools.input_tokens == created.usage.input_tokens


def test_max_tokens_beyond_the_context(client: anthropic.Anthropic):
    """A max_tokens larger than the context leaves is cut to fit; a turn stopped there says
    model_context_window_exceeded."""
    message = client.messages.create(
        model=MODEL, max_tokens=100_000, messages=ASK, extra_body={**GREEDY, "ignore_eos": True}
    )
    assert message.stop_reason == "model_context_window_exceeded"
    assert message.usage.input_tokens + message.usage.output_tokens == MAX_MODEL_LEN


def _error_body(exc: anthropic.APIStatusError) -> dict[str, Any]:
    body = exc.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}
    return body["error"]


def test_errors_in_anthropics_shape(client: anthropic.Anthropic, server: ServerThread):
    with pytest.raises(anthropic.BadRequestError) as missing:
        client.post(
            "/v1/messages",
            cast_to=anthropic.types.Message,
            body={"model": MODEL, "messages": ASK},
        )
    error = _error_body(missing.value)
    assert error["type"] == "invalid_request_error" and "max_tokens" in error["message"]

    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
    assert _error_body(unknown.value)["type"] == "not_found_error"

    bad = [
        dict(extra_body={"temperature": 1.5}),  # Anthropic's range is 0..1
        dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        dict(tool_choice={"type": "tool", "name": "missing"}, tools=TOOLS),
        dict(thinking={"type": "enabled", "budget_tokens": 8}),  # not below max_tokens
        dict(messages=[{"role": "system", "content": "no"}]),
    ]
    for extra in bad:
        kwargs = {"model": MODEL, "max_tokens": 4, "messages": ASK, **extra}
        with pytest.raises(anthropic.BadRequestError) as raised:
            client.messages.create(**kwargs)
        assert _error_body(raised.value)["type"] == "invalid_request_error", extra
    with pytest.raises(anthropic.BadRequestError):  # streamed: refused before the stream
        with client.messages.stream(
            model=MODEL, max_tokens=4, messages=ASK, extra_body={"top_p": 2.0}
        ) as stream:
            list(stream)

    wrong_key = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong_key.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    assert _error_body(denied.value)["type"] == "authentication_error"
    response = httpx.post(
        f"{server.base_url}/v1/messages",
        content=b"{not json",
        headers={"x-api-key": KEY, "content-type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["type"] == "error"


def test_base_urls_and_the_job_form(server: ServerThread, client: anthropic.Anthropic):
    """The platform's prefixes work as base_url too, and the route is an openai_route job."""
    reference = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    for base in (f"{server.base_url}/openai", f"{server.base_url}/v2/endpoint-1"):
        other = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)
        assert other.messages.count_tokens(model=MODEL, messages=ASK).input_tokens == reference
        assert other.messages.create(model=MODEL, max_tokens=2, messages=ASK).type == "message"

    job = {
        "input": {
            "openai_route": "/v1/messages",
            "openai_input": {"model": MODEL, "max_tokens": 3, "messages": ASK, **GREEDY},
        }
    }
    out = httpx.post(
        f"{server.base_url}/runsync", json=job, headers={"authorization": f"Bearer {KEY}"}
    ).json()
    assert out["status"] == "COMPLETED", out
    (message,) = out["output"]
    assert message["type"] == "message" and message["usage"]["output_tokens"] <= 3
    job["input"]["openai_input"] = {"model": MODEL, "messages": ASK}
    out = httpx.post(
        f"{server.base_url}/runsync", json=job, headers={"authorization": f"Bearer {KEY}"}
    ).json()
    # A yielded error fails the job, as on the platform; its error is Anthropic's.
    assert out["status"] == "FAILED", out
    assert out["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in out["error"]["message"]

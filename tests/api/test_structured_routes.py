"""Structured output and tool calls on the OpenAI routes (tiny random model, so every output is
the constraint's doing): response_format json_schema, guided_* fields, named / required
tool_choice with arguments that validate, and streamed tool-call deltas that reassemble to the
non-streamed call. Shapes are checked with the official client's pydantic types."""

from __future__ import annotations

import json
import re

import jsonschema
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from serverless_llm.api.openai import is_error
from tests.api.conftest import MODEL, collect, parse_sse

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": SCHEMA},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["utc", "cet"]}},
                "required": ["zone"],
            },
        },
    },
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
COMPACT = "xgrammar:disable-any-whitespace"


def chat_body(**kw):
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 150, "seed": 3, **kw}


def one(items):
    assert len(items) == 1, items
    assert not is_error(items[0]), items[0]
    return items[0]


def test_response_format_json_schema(serve):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}

    async def run(s):
        return one(
            await collect(
                s,
                CHAT,
                chat_body(response_format=fmt, n=4, guided_decoding_backend=COMPACT),
            )
        )

    resp = ChatCompletion.model_validate(serve(run))
    assert len(resp.choices) == 4
    for c in resp.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        assert not c.message.tool_calls


def test_guided_fields_on_completions_and_chat(serve):
    async def run(s):
        a = one(
            await collect(
                s,
                COMPLETIONS,
                {
                    "model": MODEL,
                    "prompt": "Mood:",
                    "max_tokens": 20,
                    "n": 5,
                    "guided_choice": ["positive", "negative"],
                },
            )
        )
        b = one(await collect(s, CHAT, chat_body(guided_regex=r"\d{3}-\d{4}", n=3)))
        c = one(
            await collect(
                s, COMPLETIONS, {"model": MODEL, "prompt": "x", "response_format": {"type": "text"}}
            )
        )
        return a, b, c

    a, b, c = serve(run)
    assert {ch.text for ch in Completion.model_validate(a).choices} <= {"positive", "negative"}
    for ch in ChatCompletion.model_validate(b).choices:
        assert re.fullmatch(r"\d{3}-\d{4}", ch.message.content)
    Completion.model_validate(c)


def test_named_tool_choice_returns_valid_tool_calls(serve):
    async def run(s):
        return one(await collect(s, CHAT, chat_body(tools=TOOLS, tool_choice=NAMED, n=3)))

    resp = ChatCompletion.model_validate(serve(run))
    for c in resp.choices:
        assert c.finish_reason == "stop"  # OpenAI's for a named choice
        assert c.message.content is None
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_required_tool_choice(serve):
    async def run(s):
        return one(await collect(s, CHAT, chat_body(tools=TOOLS, tool_choice="required", n=3)))

    resp = ChatCompletion.model_validate(serve(run))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for c in resp.choices:
        if c.finish_reason == "length":
            continue
        assert c.finish_reason == "tool_calls"
        assert c.message.tool_calls
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def _reassemble(chunks):
    calls: dict[int, dict] = {}
    content = ""
    finish = None
    for ch in chunks:
        for choice in ch.choices:
            d = choice.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    entry["id"] = tc.id
                if tc.function and tc.function.name:
                    entry["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    entry["arguments"] += tc.function.arguments
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_streamed_tool_call_deltas_reassemble(serve):
    """Complete outputs (a call cut off by max_tokens is content in a full response, as in
    vLLM, while a stream has already sent its start: the two differ there by design)."""
    for choice_kind in (NAMED, "required"):

        async def run(s, choice_kind=choice_kind):
            body = chat_body(tools=TOOLS, tool_choice=choice_kind, max_tokens=210)
            full = one(await collect(s, CHAT, body))
            streamed = await collect(s, CHAT, {**body, "stream": True})
            return full, streamed

        full, streamed = serve(run)
        resp = ChatCompletion.model_validate(full)
        chunks = [ChatCompletionChunk.model_validate(c) for c in parse_sse(streamed)]
        content, calls, finish = _reassemble(chunks)
        msg = resp.choices[0].message
        assert finish == resp.choices[0].finish_reason != "length"
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in msg.tool_calls
        ]
        assert all(c["id"] for c in calls)
        assert (content or None) == msg.content


def test_auto_tool_choice_with_hermes_parser(serve, core):
    # The tiny model writes noise: force a hermes call through a regex so the parser sees one.
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'

    async def run(s):
        body = chat_body(tools=TOOLS, guided_regex=re.escape("Sure. " + call))
        full = one(await collect(s, CHAT, body))
        streamed = await collect(s, CHAT, {**body, "stream": True})
        return full, streamed

    full, streamed = serve(run, enable_auto_tool_choice=True, tool_call_parser="hermes")
    resp = ChatCompletion.model_validate(full)
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content.strip() == "Sure."
    (tc,) = c.message.tool_calls
    assert tc.function.name == "get_time" and json.loads(tc.function.arguments) == {"zone": "utc"}
    chunks = [ChatCompletionChunk.model_validate(x) for x in parse_sse(streamed)]
    content, calls, finish = _reassemble(chunks)
    assert finish == "tool_calls" and content.strip() == "Sure."
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == [
        ("get_time", {"zone": "utc"})
    ]


HERMES_STYLE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}. Call one as <tool_call>{json}</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)


def test_tools_alone_mean_auto_with_the_parser_the_template_calls_for(serve):
    """Issue 15: `tools` without `tool_choice` reach the template and the call comes back
    parsed, with no TOOL_CALL_PARSER set (hermes, read from the template's <tool_call>)."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'

    async def run(s):
        assert s.auto_tool_parser is not None and s.auto_tool_parser.name == "hermes"
        with_tools = one(
            await collect(
                s, CHAT, chat_body(tools=TOOLS, guided_regex=re.escape(call), max_tokens=145)
            )
        )
        without = one(await collect(s, CHAT, chat_body(max_tokens=2)))
        return with_tools, without

    full, without = serve(run, enable_auto_tool_choice=True, chat_template=HERMES_STYLE_TEMPLATE)
    resp = ChatCompletion.model_validate(full)
    # The tools were rendered into the prompt: the system turn naming them is there.
    assert resp.usage.prompt_tokens > without["usage"]["prompt_tokens"] + 5
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls"
    (tc,) = c.message.tool_calls
    assert tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Paris"}


def test_auto_is_refused_with_the_reason_when_the_template_shows_no_format(serve):
    async def run(s):
        assert s.auto_tool_parser is None
        (refused,) = await collect(s, CHAT, chat_body(tools=TOOLS, tool_choice="auto"))
        plain = one(await collect(s, CHAT, chat_body(tools=TOOLS, max_tokens=3)))
        return refused, plain

    # The template shows the tools, but in no call format the worker knows.
    plain_template = (
        "{% for t in tools %}{{ t.function.name }} {% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    refused, plain = serve(run, enable_auto_tool_choice=True, chat_template=plain_template)
    assert refused["error"]["param"] == "tool_choice"
    assert "TOOL_CALL_PARSER" in refused["error"]["message"]
    assert "no tool-call format" in refused["error"]["message"]
    assert plain["choices"][0]["message"].get("tool_calls") in (None, [])


def test_tool_messages_render_through_the_template(serve):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "utc"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]

    async def run(s):
        return one(await collect(s, CHAT, chat_body(messages=history, tools=TOOLS, max_tokens=4)))

    ChatCompletion.model_validate(serve(run))


def test_required_single_call_cut_at_random_lengths_never_loses_or_repeats_a_call(serve):
    """Issue 15: `tool_choice: "required"` with `parallel_tool_calls: false`, max_tokens small
    enough to cut, 50 seeds: one call at most, never its JSON as content, and a call whose JSON
    closed is returned as a call whatever the finish reason."""

    async def run(s):
        out = []
        for seed in range(50):
            body = chat_body(
                tools=TOOLS,
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=10 + (seed * 37) % 190,
                seed=seed,
                temperature=1.0,
            )
            full = one(await collect(s, CHAT, body))
            streamed = await collect(s, CHAT, {**body, "stream": True}) if seed % 5 == 0 else None
            out.append((full, streamed))
        return out

    finishes = set()
    for full, streamed in serve(run):
        c = ChatCompletion.model_validate(full).choices[0]
        finishes.add(c.finish_reason)
        calls = c.message.tool_calls or []
        assert c.message.content is None, c.message.content
        assert len(calls) <= 1
        if c.finish_reason != "length":
            assert len(calls) == 1 and json.loads(calls[0].function.arguments) is not None
        if streamed is not None:
            chunks = [ChatCompletionChunk.model_validate(x) for x in parse_sse(streamed)]
            content, streamed_calls, _ = _reassemble(chunks)
            assert not content, content
            assert [(x["name"], x["arguments"]) for x in streamed_calls][: len(calls)] == [
                (x.function.name, x.function.arguments) for x in calls
            ]
    assert "length" in finishes and finishes - {"length"}  # both cut and whole answers ran


def test_a_template_that_ignores_tools_gets_them_described_in_a_system_message(serve):
    """Issue 15: tools still work on a model whose template has no tool support: our system
    message describes them in the hermes format, which the hermes parser reads (the parse
    itself is tested above; the description alone outgrows this tiny model's 256 tokens)."""
    from serverless_llm.api.openai.chat import render_chat_prompt
    from serverless_llm.api.openai.protocol import ChatCompletionRequest

    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}<|im_start|>assistant\n"
    )

    async def run(s):
        return s.describe_tools, s.auto_tool_parser, s.tokenizer

    describe, parser, tok = serve(run, enable_auto_tool_choice=True, chat_template=template)
    assert describe and parser.name == "hermes"
    request = ChatCompletionRequest.model_validate(chat_body(tools=TOOLS))
    text = tok.decode(render_chat_prompt(request, tok, template, TOOLS, describe_tools=True))
    assert text.index("system") < text.index("get_weather") < text.index(MESSAGES[0]["content"])
    assert "<tool_call>" in text
    plain = tok.decode(render_chat_prompt(request, tok, template, TOOLS))
    assert "get_weather" not in plain  # what the model saw before: no tools at all

    # A template that renders tools itself keeps doing so, with no message of ours.
    async def run_own(s):
        return s.describe_tools

    assert not serve(run_own, enable_auto_tool_choice=True, chat_template=HERMES_STYLE_TEMPLATE)


def test_the_default_tool_prompt_describes_every_tool():
    from serverless_llm.api.openai.tool_parsers.default_prompt import with_tool_prompt

    tools = [t for t in TOOLS]
    system = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": "Hi"}
    merged = with_tool_prompt([system, user], tools)
    assert [m["role"] for m in merged] == ["system", "user"]
    assert merged[0]["content"].startswith("Be brief.\n\n")
    for t in tools:
        assert json.dumps(t["function"]) in merged[0]["content"]
    assert "<tool_call>" in merged[0]["content"]
    added = with_tool_prompt([user], tools)
    assert [m["role"] for m in added] == ["system", "user"] and added[1] == user

"""gpt-oss's harmony format (issue 37 item 7), without model weights: outputs written from the
published format (reasoning, a tool call, a final answer, and every cut of them a max_tokens
stop could leave), tokenized with the harmony encoding and parsed whole, token by token and in
random pieces; prompts rendered for conversations with tools and tool results against what the
library renders from messages built by hand; and the chat, completions and Responses routes on
a scripted engine that has gpt-oss's config and tokenizer and "writes" given token ids."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import random
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from serverless_llm.api.batching import BatchSizes
from serverless_llm.api.openai import OpenAIServing
from serverless_llm.api.openai import harmony as hm
from serverless_llm.api.openai.serving import coalesce_chunks
from serverless_llm.engine import EngineOutput, PreparedPrompt
from tests.api.conftest import collect, parse_sse
from tests.harmony_tokenizer import harmony_tokenizer

ENC = hm.load_encoding()

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Gets the current weather in the provided location.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and state"},
                "format": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}


def special(text: str) -> list[int]:
    return ENC.encode(text, allowed_special="all")


# -- outputs as the format describes them ----------------------------------------------------

ANALYSIS = ("<|channel|>analysis<|message|>", "<|end|>")
FINAL = ("<|start|>assistant<|channel|>final<|message|>", "<|return|>")
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
    "<|call|>",
)
PREAMBLE = ("<|start|>assistant<|channel|>commentary<|message|>", "<|end|>")

# (kind, header, body, end); the first message's `<|start|>assistant` is the prompt's.
OUTPUTS = {
    "reasoning_then_answer": [
        ("reasoning", "<|channel|>analysis<|message|>", "User asks 2+2. Simple: 4.", "<|end|>"),
        ("content", *FINAL[:1], "2 + 2 = 4. Voilà, 𝄞 日本.", FINAL[1]),
    ],
    "reasoning_then_call": [
        ("reasoning", *ANALYSIS[:1], "Need the weather in Tokyo; call the tool.", ANALYSIS[1]),
        ("call", CALL[0], '{"location": "Tokyo, JP", "format": "celsius"}', CALL[1]),
    ],
    "preamble_then_call": [
        ("reasoning", *ANALYSIS[:1], "Check the weather.", ANALYSIS[1]),
        ("content", *PREAMBLE[:1], "Let me look that up.", PREAMBLE[1]),
        ("call", CALL[0], '{"location": "Paris"}', CALL[1]),
    ],
    "answer_only": [("content", "<|channel|>final<|message|>", "Hello there!", "<|return|>")],
}


def tokenize(segments) -> tuple[list[int], list[tuple[str, int, list[int], int]]]:
    """The output's ids, and each message as (kind, header length, body ids, end length)."""
    ids: list[int] = []
    parts = []
    for kind, header, body, end in segments:
        h, b, e = special(header), ENC.encode(body), special(end)
        ids += h + b + e
        parts.append((kind, len(h), b, len(e)))
    return ids, parts


def expected(parts, cut: int) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """What the first `cut` ids hold: a message whose header is cut is absent; one whose body
    is cut holds the whole characters of its first ids."""
    reasoning, content, calls = "", "", []
    pos = 0
    for kind, h, body, e in parts:
        if cut < pos + h:
            break
        n = min(len(body), cut - pos - h)
        text = ENC.decode(body[:n], errors="ignore")
        if kind == "reasoning":
            reasoning += text
        elif kind == "content":
            content += text
        else:
            calls.append(("get_weather", text))
        pos += h + len(body) + e
    return reasoning or None, content if content or not calls else None, calls


def summary(out: hm.HarmonyOutput):
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in out.tool_calls]
    return out.reasoning, out.content, calls


def streamed(ids: list[int], sizes: list[int]):
    """The deltas of `ids` fed in pieces of `sizes`, added up as a client would."""
    parser = hm.HarmonyParser(ENC)
    reasoning, content = "", ""
    calls: dict[int, dict[str, Any]] = {}
    i = 0
    for size in sizes:
        delta = parser.feed(ids[i : i + size]) or {}
        i += size
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            if piece["index"] not in calls:
                assert piece["id"].startswith("call_") and piece["type"] == "function"
                calls[piece["index"]] = {"id": piece["id"], **piece["function"]}
            else:
                assert "id" not in piece and "name" not in piece["function"]
                calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
    whole = parser.result()
    assert [c["id"] for c in whole.tool_calls] == [calls[k]["id"] for k in sorted(calls)]
    got = (
        reasoning or None,
        content if content or not calls else None,
        [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)],
    )
    assert got == summary(whole)  # the stream adds up to the whole
    return got


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_outputs_and_every_cut_parse_whole_and_streamed(name):
    ids, parts = tokenize(OUTPUTS[name])
    for cut in range(len(ids) + 1):
        want = expected(parts, cut)
        assert summary(hm.HarmonyParser(ENC).parse(ids[:cut])) == want, cut
        assert streamed(ids[:cut], [1] * cut) == want, cut
        rng = random.Random(cut)
        sizes = [rng.choice([1, 2, 3, 7, 50]) for _ in range(cut)]
        assert streamed(ids[:cut], sizes) == want, cut


def test_the_full_outputs_read_as_openai_fields():
    ids, _ = tokenize(OUTPUTS["reasoning_then_call"])
    out = hm.HarmonyParser(ENC).parse(ids)
    assert out.reasoning == "Need the weather in Tokyo; call the tool."
    assert out.content is None
    (call,) = out.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {
        "name": "get_weather",
        "arguments": '{"location": "Tokyo, JP", "format": "celsius"}',
    }
    ids, _ = tokenize(OUTPUTS["reasoning_then_answer"])
    out = hm.HarmonyParser(ENC).parse(ids)
    assert (out.reasoning, out.content, out.tool_calls) == (
        "User asks 2+2. Simple: 4.",
        "2 + 2 = 4. Voilà, 𝄞 日本.",
        [],
    )


def test_the_stop_token_may_be_left_out_and_calls_dropped_for_tool_choice_none():
    ids, _ = tokenize(OUTPUTS["preamble_then_call"])
    assert summary(hm.HarmonyParser(ENC).parse(ids[:-1])) == summary(
        hm.HarmonyParser(ENC).parse(ids)
    )
    out = hm.HarmonyParser(ENC, calls=False).parse(ids)
    assert (out.reasoning, out.content, out.tool_calls) == (
        "Check the weather.",
        "Let me look that up.",
        [],
    )


def test_a_named_call_header_in_the_prompt_and_output_that_leaves_the_format():
    header = special("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>")
    parser = hm.HarmonyParser(ENC, header=header)
    first = parser.feed(ENC.encode('{"location"'))
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"location"'}
    parser.feed(ENC.encode(': "Oslo"}') + special("<|call|>"))
    assert summary(parser.result()) == (None, None, [("get_weather", '{"location": "Oslo"}')])
    # Text after <|end|> with no <|start|>: the library refuses it; it becomes content.
    ids = special("<|channel|>final<|message|>Hi<|end|>") + ENC.encode(" and 𝄞 more")
    assert summary(hm.HarmonyParser(ENC).parse(ids)) == (None, "Hi and 𝄞 more", [])
    assert streamed(ids, [1] * len(ids)) == (None, "Hi and 𝄞 more", [])


# -- the vocabulary and the prompt -----------------------------------------------------------


def test_the_vocabulary_comes_from_the_packaged_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = hm.vocab_dir()
    assert folder == tmp_path / "serverless_llm" / "harmony"
    data = (folder / hm.VOCAB_FILE).read_bytes()
    assert hashlib.sha256(data).hexdigest() == hm.VOCAB_SHA256
    assert hm.vocab_dir() == folder  # found again, not rewritten
    assert hm.speaks_harmony(SimpleNamespace(model_type="gpt_oss"))
    assert hm.speaks_harmony(SimpleNamespace(architectures=["GptOssForCausalLM"]))
    assert not hm.speaks_harmony(SimpleNamespace(model_type="llama", architectures=None))


def conversation_messages() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "What is the weather in Tokyo?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Need to use get_weather.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"location": "Tokyo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 20}'},
    ]


def library_prompt(date: str, effort=ReasoningEffort.MEDIUM) -> list[int]:
    """The same conversation as harmony's documentation builds it."""
    system = SystemContent.new().with_reasoning_effort(effort).with_conversation_start_date(date)
    developer = (
        DeveloperContent.new()
        .with_instructions("Answer in one sentence.")
        .with_function_tools(
            [
                ToolDescription.new(
                    "get_weather",
                    "Gets the current weather in the provided location.",
                    WEATHER["function"]["parameters"],
                )
            ]
        )
    )
    convo = Conversation.from_messages(
        [
            Message.from_role_and_content(Role.SYSTEM, system),
            Message.from_role_and_content(Role.DEVELOPER, developer),
            Message.from_role_and_content(Role.USER, "What is the weather in Tokyo?"),
            Message.from_role_and_content(Role.ASSISTANT, "Need to use get_weather.").with_channel(
                "analysis"
            ),
            Message.from_role_and_content(Role.ASSISTANT, '{"location": "Tokyo"}')
            .with_channel("commentary")
            .with_recipient("functions.get_weather")
            .with_content_type("json"),
            Message.from_author_and_content(
                Author.new(Role.TOOL, "functions.get_weather"), '{"temperature": 20}'
            )
            .with_channel("commentary")
            .with_recipient("assistant"),
        ]
    )
    return ENC.render_conversation_for_completion(convo, Role.ASSISTANT)


def test_a_conversation_with_tools_renders_as_the_library_does():
    date = "2025-08-05"
    prompt = hm.render_prompt(conversation_messages(), tools=[WEATHER], today=date)
    assert prompt.token_ids == library_prompt(date) and prompt.header == []
    text = ENC.decode(prompt.token_ids)
    assert "Current date: 2025-08-05" in text and "Reasoning: medium" in text
    assert "namespace functions {" in text and "type get_weather = (_: {" in text
    assert (
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"location": "Tokyo"}<|call|><|start|>functions.get_weather to=assistant'
        '<|channel|>commentary<|message|>{"temperature": 20}<|end|><|start|>assistant'
    ) in text
    high = hm.render_prompt(conversation_messages(), tools=[WEATHER], reasoning_effort="high")
    assert "Reasoning: high" in ENC.decode(high.token_ids)
    for effort in ("minimal", "none"):
        low = hm.render_prompt(conversation_messages()[1:2], reasoning_effort=effort)
        assert "Reasoning: low" in ENC.decode(low.token_ids)
    user = [{"role": "user", "content": "Hi"}]
    cont = hm.render_prompt([*user, {"role": "assistant", "content": "Hello, wor"}])
    assert ENC.decode(cont.token_ids).endswith("<|end|><|start|>assistant")  # a closed turn
    cont = hm.render_prompt(
        [*user, {"role": "assistant", "content": "Hello, wor"}], continue_final_message=True
    )
    assert ENC.decode(cont.token_ids).endswith(
        "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Hello, wor"
    )
    assert summary(hm.HarmonyParser(ENC, header=cont.header).parse(ENC.encode("ld!"))) == (
        None,
        "ld!",
        [],
    )
    closed = hm.render_prompt(user, add_generation_prompt=False)
    assert ENC.decode(closed.token_ids).endswith("<|start|>user<|message|>Hi<|end|>")
    with pytest.raises(hm.HarmonyPromptError) as e:
        hm.render_prompt([{"role": "tool", "tool_call_id": "x", "content": "1"}])
    assert e.value.param == "messages[0].tool_call_id"


def test_the_prompt_is_what_gpt_oss_tokenizer_reads():
    """The engine's tokenizer path: gpt-oss's tokenizer (o200k_base plus harmony's special
    tokens) decodes the rendered ids to the rendered text and encodes that text back to them."""
    tok = harmony_tokenizer()
    ids = hm.render_prompt(conversation_messages(), tools=[WEATHER], today="2025-08-05").token_ids
    text = ENC.decode(ids)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode(text, add_special_tokens=False) == ids
    assert max(ids) < len(tok) == 201088


# -- the routes, on a scripted engine ---------------------------------------------------------


class ScriptedEngine:
    """An EngineClient with gpt-oss's config and tokenizer whose "model" writes `script`,
    stopping at a stop token (kept in the output, as the engine does) or at max_tokens."""

    def __init__(self) -> None:
        self.tokenizer = harmony_tokenizer()
        self.model_config = SimpleNamespace(
            model_type="gpt_oss", architectures=["GptOssForCausalLM"]
        )
        self.model_info = SimpleNamespace(image_input=False, image_placeholder=None)
        self.max_model_len = 8192
        self.vocab_size = len(self.tokenizer)
        self.script: list[int] = []
        self.prompts: list[list[int]] = []
        self.params: list[Any] = []

    def prepare_prompt(self, prompt, params) -> PreparedPrompt:
        ids = list(prompt) if not isinstance(prompt, str) else self.tokenizer.encode(prompt)
        return PreparedPrompt(ids, None, params.max_tokens, None, self.max_model_len)

    async def prepare(self, prompt, params, lora_request=None) -> PreparedPrompt:
        return prompt

    async def generate(
        self, prompt, params, request_id=None, lora_request=None, priority=0
    ) -> AsyncIterator:
        self.prompts.append(prompt.token_ids)
        self.params.append(params)
        out: list[int] = []
        for t in self.script:
            out.append(t)
            stop = t in params.stop_token_ids
            length = params.max_tokens is not None and len(out) >= params.max_tokens
            finished = stop or length or len(out) == len(self.script)
            await asyncio.sleep(0)
            yield EngineOutput(
                request_id=request_id or "r",
                new_token_ids=[t],
                new_text="" if stop else self.tokenizer.decode([t]),
                finished=finished,
                finish_reason=("stop" if stop or not length else "length") if finished else None,
                stop_reason=t if stop else None,
                num_prompt_tokens=len(prompt.token_ids),
                num_output_tokens=len(out),
            )
            if finished:
                return

    async def abort(self, request_id: str) -> None:
        pass

    async def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def engine() -> ScriptedEngine:
    return ScriptedEngine()


def run(engine: ScriptedEngine, route: str, body: dict, script: list[int], **kwargs) -> list:
    engine.script = script
    engine.prompts.clear()
    engine.params.clear()

    kwargs.setdefault("enable_auto_tool_choice", True)  # the worker's default

    async def main():
        serving = OpenAIServing(engine, served_model_name="gpt-oss", **kwargs)
        assert serving.harmony is not None
        return await collect(serving, route, body, BatchSizes())

    return asyncio.run(main())


def chat_body(**extra) -> dict[str, Any]:
    return {"model": "gpt-oss", "messages": conversation_messages(), "tools": [WEATHER], **extra}


def deltas(items: list[str]) -> list[dict[str, Any]]:
    return [c["choices"][0] for c in parse_sse(items) if c.get("choices")]


def test_chat_renders_with_harmony_and_answers_with_reasoning_and_a_call(engine):
    ids, _ = tokenize(OUTPUTS["reasoning_then_call"])
    before = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    (full,) = run(engine, "/v1/chat/completions", chat_body(max_tokens=200), ids)
    after = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    assert engine.prompts[0] in (library_prompt(before), library_prompt(after))
    params = engine.params[0]
    assert {200002, 200012} <= set(params.stop_token_ids)
    choice = full["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["stop_reason"] == 200012
    message = choice["message"]
    assert message["reasoning_content"] == "Need the weather in Tokyo; call the tool."
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert call["function"] == {
        "name": "get_weather",
        "arguments": '{"location": "Tokyo, JP", "format": "celsius"}',
    }
    assert full["usage"]["completion_tokens"] == len(ids)

    items = run(engine, "/v1/chat/completions", chat_body(max_tokens=200, stream=True), ids)
    chunks = deltas(items)
    assert chunks[0]["delta"]["role"] == "assistant"
    reasoning = "".join(c["delta"].get("reasoning_content", "") for c in chunks)
    assert reasoning == message["reasoning_content"]
    assert not "".join(c["delta"].get("content") or "" for c in chunks)
    pieces = [p for c in chunks for p in c["delta"].get("tool_calls", [])]
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"].startswith("call_")
    assert (
        "".join(p["function"].get("arguments", "") for p in pieces)
        == (call["function"]["arguments"])
    )
    assert chunks[-1]["finish_reason"] == "tool_calls"
    # A batch of reasoning tokens is one chunk (coalesced), not one per token.
    assert len([c for c in chunks if "reasoning_content" in c["delta"]]) < 5


def test_chat_answer_cut_by_max_tokens_streamed_and_not(engine):
    ids, parts = tokenize(OUTPUTS["reasoning_then_answer"])
    cut = len(ids) - 4
    want_reasoning, want_content, _ = expected(parts, cut)
    body = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": cut}
    (full,) = run(engine, "/v1/chat/completions", body, ids)
    choice = full["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["reasoning_content"] == want_reasoning
    assert choice["message"]["content"] == want_content and choice["message"]["tool_calls"] == []
    chunks = deltas(run(engine, "/v1/chat/completions", {**body, "stream": True}, ids))
    assert "".join(c["delta"].get("reasoning_content", "") for c in chunks) == want_reasoning
    assert "".join(c["delta"].get("content") or "" for c in chunks) == want_content
    assert chunks[-1]["finish_reason"] == "length"
    text = ENC.decode(engine.prompts[0])
    assert text.endswith("<|start|>user<|message|>2+2?<|end|><|start|>assistant")
    assert "<|start|>developer" not in text  # no instructions, no tools


def test_chat_tool_choices_with_harmony(engine):
    # Named: the prompt opens the call; the model writes the arguments, under the grammar.
    args = ENC.encode('{"location": "Oslo"}') + special("<|call|>")
    body = chat_body(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (full,) = run(engine, "/v1/chat/completions", body, args)
    assert ENC.decode(engine.prompts[0]).endswith(
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        "<|message|>"
    )
    params = engine.params[0]
    assert params.structured is not None and params.structured_after == ()
    message = full["choices"][0]["message"]
    assert full["choices"][0]["finish_reason"] == "stop"
    assert message["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"location": "Oslo"}',
    }
    # Required with several tools: the model names one; the arguments are constrained.
    other = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    script = ENC.encode("get_time") + special(" <|constrain|>json<|message|>{}<|call|>")
    body = chat_body(tools=[WEATHER, other], tool_choice="required")
    (full,) = run(engine, "/v1/chat/completions", body, script)
    assert ENC.decode(engine.prompts[0]).endswith("<|channel|>commentary to=functions.")
    assert engine.params[0].structured_after == (hm.message_start_id(ENC),)
    assert full["choices"][0]["finish_reason"] == "tool_calls"
    assert full["choices"][0]["message"]["tool_calls"][0]["function"] == {
        "name": "get_time",
        "arguments": "{}",
    }
    # None: the tools are not described, and a call is not one.
    ids, _ = tokenize(OUTPUTS["preamble_then_call"])
    (full,) = run(engine, "/v1/chat/completions", chat_body(tool_choice="none"), ids)
    assert "namespace functions" not in ENC.decode(engine.prompts[0])
    message = full["choices"][0]["message"]
    assert message["tool_calls"] == [] and message["content"] == "Let me look that up."
    # response_format constrains the final answer only.
    body = {
        "messages": [{"role": "user", "content": "JSON please"}],
        "response_format": {"type": "json_object"},
        "reasoning_effort": "low",
    }
    run(engine, "/v1/chat/completions", body, special("<|channel|>final<|message|>{}<|return|>"))
    assert engine.params[0].structured_after == hm.final_header_ids(ENC)
    assert "Reasoning: low" in ENC.decode(engine.prompts[0])


def test_completions_parse_a_harmony_prompt_and_leave_plain_text_alone(engine):
    prompt = ENC.decode(hm.render_prompt([{"role": "user", "content": "2+2?"}]).token_ids)
    ids, _ = tokenize(OUTPUTS["reasoning_then_answer"])
    body = {"model": "gpt-oss", "prompt": prompt, "max_tokens": 100}
    (full,) = run(engine, "/v1/completions", body, ids)
    choice = full["choices"][0]
    assert choice["text"] == "2 + 2 = 4. Voilà, 𝄞 日本."
    assert choice["reasoning_content"] == "User asks 2+2. Simple: 4."
    chunks = deltas(run(engine, "/v1/completions", {**body, "stream": True}, ids))
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert "".join(c.get("reasoning_content", "") for c in chunks) == choice["reasoning_content"]
    # A plain prompt: the output is text, as on any model.
    plain = ENC.encode("Once upon a time")
    (full,) = run(engine, "/v1/completions", {**body, "prompt": "Hello"}, plain)
    assert full["choices"][0]["text"] == "Once upon a time"
    assert "reasoning_content" not in full["choices"][0]


def test_responses_give_reasoning_and_function_call_items(engine):
    ids, _ = tokenize(OUTPUTS["reasoning_then_call"])
    body = {
        "model": "gpt-oss",
        "instructions": "Answer in one sentence.",
        "input": [
            {"role": "user", "content": "What is the weather in Tokyo?"},
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Look it up."}]},
            {
                "type": "function_call",
                "call_id": "call_9",
                "name": "get_weather",
                "arguments": '{"location": "Tokyo"}',
            },
            {"type": "function_call_output", "call_id": "call_9", "output": "20C"},
        ],
        "tools": [{"type": "function", **WEATHER["function"]}],
        "reasoning": {"effort": "high"},
    }
    (full,) = run(engine, "/v1/responses", body, ids)
    text = ENC.decode(engine.prompts[0])
    assert "Reasoning: high" in text and "# Instructions\n\nAnswer in one sentence." in text
    assert "<|channel|>analysis<|message|>Look it up.<|end|>" in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>20C" in text
    kinds = [item["type"] for item in full["output"]]
    assert kinds == ["reasoning", "function_call"]
    assert full["output"][0]["content"][0]["text"] == "Need the weather in Tokyo; call the tool."
    assert full["output"][1]["name"] == "get_weather"
    assert json.loads(full["output"][1]["arguments"]) == {
        "location": "Tokyo, JP",
        "format": "celsius",
    }
    raw = "".join(run(engine, "/v1/responses", {**body, "stream": True}, ids))
    events = [json.loads(b.split("\n")[1].removeprefix("data: ")) for b in raw.split("\n\n")[:-1]]
    types = [e["type"] for e in events]
    assert "response.reasoning_text.delta" in types
    assert "response.function_call_arguments.delta" in types
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == kinds
    assert final["output"][1]["arguments"] == full["output"][1]["arguments"]


def test_reasoning_deltas_coalesce_but_never_into_content():
    def chunk(delta):
        return {
            "id": "x",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
        }

    merged = coalesce_chunks(
        [
            chunk({"reasoning_content": "a"}),
            chunk({"reasoning_content": "b"}),
            chunk({"content": "c"}),
            chunk({"content": "d"}),
        ]
    )
    assert [c["choices"][0]["delta"] for c in merged] == [
        {"reasoning_content": "ab"},
        {"content": "cd"},
    ]

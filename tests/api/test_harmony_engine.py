"""gpt-oss end to end through the chat route (issue 37 item 7): a tiny random GptOssForCausalLM
with gpt-oss's tokenizer (tests/harmony_tokenizer.py) served by the engine; the route turns
harmony on by itself, renders the prompt with the library (the engine takes those ids), and
parses what the model writes, streamed and not, to the same fields. A named tool choice makes
even a random model write a call: the prompt opens the call's header and the grammar the
arguments, which `<|call|>` ends."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch
import transformers

from serverless_llm.api.openai import OpenAIServing
from serverless_llm.api.openai import harmony as hm
from serverless_llm.engine.async_engine import AsyncEngine
from serverless_llm.engine.config import EngineConfig
from tests.api.conftest import collect, parse_sse
from tests.harmony_tokenizer import harmony_tokenizer
from tests.tiny_models import tiny_dims

UNIT = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "description": "Sets the temperature unit.",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Use celsius."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "set_unit", "arguments": '{"unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
]


@pytest.fixture(scope="module")
def gpt_oss_path(tmp_path_factory) -> str:
    tok = harmony_tokenizer()
    config = transformers.GptOssConfig(
        **tiny_dims(
            tok,
            hidden_size=32,
            num_hidden_layers=2,
            head_dim=16,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
        )
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    path = str(tmp_path_factory.mktemp("gpt_oss"))
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def serve(path: str, fn) -> Any:
    async def main() -> Any:
        engine = AsyncEngine.from_config(
            EngineConfig(model=path, num_kv_blocks=64, max_model_len=512, show_progress=False)
        )
        try:
            serving = OpenAIServing(
                engine, served_model_name="gpt-oss", enable_auto_tool_choice=True
            )
            assert serving.harmony is not None  # from the config, no setting
            return await fn(serving, engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_tiny_gpt_oss_through_the_chat_route(gpt_oss_path):
    body = {
        "model": "gpt-oss",
        "messages": MESSAGES,
        "tools": [UNIT],
        "temperature": 0,
        "max_tokens": 24,
    }
    named = {**body, "tool_choice": {"type": "function", "function": {"name": "set_unit"}}}

    async def run(serving, engine):
        (full,) = await collect(serving, "/v1/chat/completions", body)
        streamed = await collect(serving, "/v1/chat/completions", {**body, "stream": True})
        (call,) = await collect(serving, "/v1/chat/completions", {**named, "max_tokens": 40})
        calls = await collect(
            serving, "/v1/chat/completions", {**named, "max_tokens": 40, "stream": True}
        )
        return full, streamed, call, calls

    full, streamed, call, calls = serve(gpt_oss_path, run)
    assert "error" not in full, full
    prompt = hm.render_prompt(MESSAGES, tools=[UNIT]).token_ids
    assert full["usage"]["prompt_tokens"] == len(prompt)
    # Whatever the random model wrote, the stream adds up to the whole answer.
    message = full["choices"][0]["message"]
    chunks = [c["choices"][0] for c in parse_sse(streamed) if c.get("choices")]
    reasoning = "".join(c["delta"].get("reasoning_content", "") for c in chunks)
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    assert reasoning == (message.get("reasoning_content") or "")
    assert content == (message["content"] or "")
    assert chunks[-1]["finish_reason"] == full["choices"][0]["finish_reason"]
    # The named call: valid arguments, ended by <|call|>.
    choice = call["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    (tool_call,) = choice["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "set_unit"
    assert json.loads(tool_call["function"]["arguments"])["unit"] in ("celsius", "fahrenheit")
    pieces = [
        p
        for c in parse_sse(calls)
        if c.get("choices")
        for p in c["choices"][0]["delta"].get("tool_calls", [])
    ]
    assert pieces[0]["function"]["name"] == "set_unit"
    assert (
        "".join(p["function"].get("arguments", "") for p in pieces)
        == (tool_call["function"]["arguments"])
    )

"""gpt-oss's harmony format on the native job route (issue 37): `messages` (and
`apply_chat_template`) rendered by harmony as the library renders the conversation, the turn
stopped at `<|return|>` / `<|call|>`, and the text the final answer only (analysis and tool
calls dropped), streamed pieces adding up to the non-streamed text; a plain prompt stays raw.
On test_harmony.py's scripted engine (gpt-oss's config and tokenizer, no weights)."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
)

from serverless_llm.api.batching import BatchSizes
from serverless_llm.api.native import NativeRequest, NativeServing
from tests.api.test_harmony import (
    ENC,
    OUTPUTS,
    ScriptedEngine,
    conversation_messages,
    expected,
    tokenize,
)


def native(engine: ScriptedEngine, body: dict[str, Any], script: list[int], **batch) -> list:
    engine.script = script
    engine.prompts.clear()
    engine.params.clear()

    async def main():
        serving = NativeServing(engine)
        assert serving.harmony is not None
        request = NativeRequest.parse(body)
        return [item async for item in serving.handle(request, BatchSizes(**batch), "job")]

    return asyncio.run(main())


def library_prompt(date: str) -> list[int]:
    """conversation_messages() as the library builds it (no tools described: a native job
    has no `tools`)."""
    system = (
        SystemContent.new()
        .with_reasoning_effort(ReasoningEffort.MEDIUM)
        .with_conversation_start_date(date)
    )
    convo = Conversation.from_messages(
        [
            Message.from_role_and_content(Role.SYSTEM, system),
            Message.from_role_and_content(
                Role.DEVELOPER, DeveloperContent.new().with_instructions("Answer in one sentence.")
            ),
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


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def test_native_messages_render_with_harmony_and_answer_the_final_text():
    engine = ScriptedEngine()
    ids, _ = tokenize(OUTPUTS["reasoning_then_answer"])
    body = {"messages": conversation_messages(), "sampling_params": {"max_tokens": 200}}
    before = today()
    (item,) = native(engine, body, ids)
    after = today()
    assert engine.prompts[0] in (library_prompt(before), library_prompt(after))
    assert {200002, 200012} <= set(engine.params[0].stop_token_ids)
    assert item["choices"] == [{"tokens": ["2 + 2 = 4. Voilà, 𝄞 日本."]}]
    assert item["usage"]["output"] == len(ids)

    # Streamed (batches of 1, 3, ... tokens): one piece per engine output, "" for the
    # analysis and headers, adding up to the same text; usage counts every token.
    items = native(engine, {**body, "stream": True}, ids, min_batch_size=1, max_batch_size=8)
    assert len(items) > 1
    pieces = [p for it in items for p in it["choices"][0]["tokens"]]
    assert len(pieces) == len(ids) and "".join(pieces) == "2 + 2 = 4. Voilà, 𝄞 日本."
    assert items[-1]["usage"]["output"] == len(ids)

    # apply_chat_template: the prompt as one user message, rendered the same way.
    (item,) = native(engine, {"prompt": "2+2?", "apply_chat_template": True}, ids)
    text = ENC.decode(engine.prompts[0])
    assert text.startswith("<|start|>system<|message|>")
    assert text.endswith("<|start|>user<|message|>2+2?<|end|><|start|>assistant")
    assert item["choices"][0]["tokens"] == ["2 + 2 = 4. Voilà, 𝄞 日本."]


def test_native_calls_and_cuts_drop_all_but_the_final_answer():
    engine = ScriptedEngine()
    ids, _ = tokenize(OUTPUTS["reasoning_then_call"])
    body = {"messages": [{"role": "user", "content": "Weather in Tokyo?"}]}
    (item,) = native(engine, body, ids)
    assert item["choices"][0]["tokens"] == [""]  # reasoning and the call are dropped
    ids, parts = tokenize(OUTPUTS["reasoning_then_answer"])
    cut = len(ids) - 4
    _, want, _ = expected(parts, cut)
    params = {"max_tokens": cut, "n": 2}
    (whole,) = native(engine, {**body, "sampling_params": params}, ids)
    assert [c["tokens"] for c in whole["choices"]] == [[want], [want]]
    items = native(engine, {**body, "sampling_params": params, "stream": True}, ids)
    for j in range(2):
        assert "".join(p for it in items for p in it["choices"][j]["tokens"]) == want


def test_native_plain_prompt_stays_raw_and_bad_history_is_an_error():
    engine = ScriptedEngine()
    ids, _ = tokenize(OUTPUTS["answer_only"])
    (item,) = native(engine, {"prompt": "Hello"}, ids)
    assert engine.prompts[0] == engine.tokenizer.encode("Hello")
    assert 200002 not in engine.params[0].stop_token_ids
    assert item["choices"][0]["tokens"] == [engine.tokenizer.decode(ids)]
    bad = {"messages": [{"role": "tool", "tool_call_id": "x", "content": "1"}]}
    (item,) = native(engine, bad, ids)
    assert "messages[0].tool_call_id" in item["error"]


def system_text(engine: ScriptedEngine) -> str:
    """The system message of the last prompt the engine was given."""
    text = ENC.decode(engine.prompts[0])
    return text[: text.index("<|end|>")]


def test_native_reasoning_effort_sets_the_system_message():
    """`reasoning_effort` at the top level, or in chat_template_kwargs as vLLM takes it (with
    `model_identity`), becomes harmony's `Reasoning: ...` line; the top-level field wins;
    without either, medium."""
    engine = ScriptedEngine()
    ids, _ = tokenize(OUTPUTS["answer_only"])
    user = [{"role": "user", "content": "2+2?"}]
    native(engine, {"messages": user}, ids)
    assert "Reasoning: medium" in system_text(engine)
    for effort in ("low", "medium", "high"):
        (item,) = native(engine, {"messages": user, "reasoning_effort": effort}, ids)
        assert f"Reasoning: {effort}" in system_text(engine) and "error" not in item
    body = {
        "messages": user,
        "chat_template_kwargs": {"reasoning_effort": "high", "model_identity": "You are Ada."},
    }
    native(engine, body, ids)
    assert "Reasoning: high" in system_text(engine)
    assert system_text(engine).startswith("<|start|>system<|message|>You are Ada.")
    native(engine, {**body, "reasoning_effort": "low"}, ids)
    assert "Reasoning: low" in system_text(engine)
    # apply_chat_template's one user message takes it too
    native(engine, {"prompt": "2+2?", "apply_chat_template": True, "reasoning_effort": "high"}, ids)
    assert "Reasoning: high" in system_text(engine)


def test_native_reasoning_effort_is_checked():
    """Anything but low / medium / high, or a job that is not a chat, is refused by name in
    the native route's {"error": ...} shape (worker/job_input.py), before the engine sees it."""
    from serverless_llm.worker.job_input import JobError, parse_job

    defaults = BatchSizes()
    user = [{"role": "user", "content": "2+2?"}]
    for body, words in (
        ({"messages": user, "reasoning_effort": "max"}, ("reasoning_effort", "'high'", "'max'")),
        ({"messages": user, "reasoning_effort": 2}, ("reasoning_effort",)),
        ({"prompt": "2+2?", "reasoning_effort": "low"}, ("reasoning_effort", "chat jobs")),
        ({"prompt": "2+2?", "chat_template_kwargs": {}}, ("chat_template_kwargs", "chat jobs")),
        ({"messages": user, "chat_template_kwargs": []}, ("chat_template_kwargs",)),
    ):
        try:
            parse_job({"input": body}, defaults)
        except JobError as e:
            assert set(e.payload) == {"error"}, e.payload
            assert all(w in e.payload["error"] for w in words), e.payload
        else:
            raise AssertionError(f"{body} was accepted")
    # In chat_template_kwargs the value is harmony's to read: checked when the job renders.
    engine = ScriptedEngine()
    ids, _ = tokenize(OUTPUTS["answer_only"])
    for bad in ("minimal", "max", 3):
        body = {"messages": user, "chat_template_kwargs": {"reasoning_effort": bad}}
        (item,) = native(engine, body, ids)
        assert "chat_template_kwargs.reasoning_effort" in item["error"]
        assert repr(bad) in item["error"]
    assert not engine.prompts  # nothing reached the engine

"""Per-request limits (issue 14 item 3): each setting refuses a request over it, on both routes,
in the route's own error shape, before tokenizing; at the limit a request is served; 0 turns a
limit off; the worker serves on."""

from __future__ import annotations

from typing import Any

import pytest

from serverless_llm.api.limits import RequestLimits, string_chars
from serverless_llm.worker.settings import Settings
from serverless_llm.worker.settings.validation import SettingsError
from tests.worker.conftest import blocks_all_free, run, run_job

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LIMITS = {
    "MAX_PROMPT_CHARS": "200",
    "MAX_MESSAGES": "3",
    "MAX_STOP_STRINGS": "2",
    "MAX_LOGIT_BIAS": "2",
    "MAX_TOOLS": "1",
    "MAX_N": "2",
    "MAX_PROMPTS": "2",
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def user(text: str = "hi") -> dict[str, str]:
    return {"role": "user", "content": text}


def openai(route: str, **body: Any) -> dict[str, Any]:
    return {"openai_route": route, "openai_input": {"max_tokens": 2, **body}}


def native(**job: Any) -> dict[str, Any]:
    job.setdefault("sampling_params", {})
    job["sampling_params"].setdefault("max_tokens", 2)
    return job


# (job over a limit, the field named, the setting named); each has a twin at the limit below.
OVER = [
    (openai(CHAT, messages=[user("x" * 201)]), "messages", "MAX_PROMPT_CHARS"),
    (
        openai(
            CHAT,
            messages=[
                user(),
                {"role": "assistant", "content": [{"type": "text", "text": "y" * 200}]},
            ],
        ),
        "messages",
        "MAX_PROMPT_CHARS",
    ),  # fmt: skip
    (openai(COMPLETIONS, prompt="x" * 201), "prompt", "MAX_PROMPT_CHARS"),
    (openai(COMPLETIONS, prompt=["x" * 150, "y" * 60]), "prompt", "MAX_PROMPT_CHARS"),
    (openai(CHAT, messages=[user()] * 4), "messages", "MAX_MESSAGES"),
    (openai(CHAT, messages=[user()], stop=["a", "b", "c"]), "stop", "MAX_STOP_STRINGS"),
    (
        openai(COMPLETIONS, prompt="hi", logit_bias={"1": 1, "2": 1, "3": 1}),
        "logit_bias",
        "MAX_LOGIT_BIAS",
    ),  # fmt: skip
    (openai(CHAT, messages=[user()], tools=[TOOL, TOOL]), "tools", "MAX_TOOLS"),
    (openai(CHAT, messages=[user()], n=3), "n", "MAX_N"),
    (openai(COMPLETIONS, prompt="hi", best_of=3), "best_of", "MAX_N"),
    (openai(COMPLETIONS, prompt=[[5], [6], [7]]), "prompt", "MAX_PROMPTS"),
    (openai(COMPLETIONS, prompt=["a", "b", "c"]), "prompt", "MAX_PROMPTS"),
    (native(prompt="x" * 201), "prompt", "MAX_PROMPT_CHARS"),
    (native(messages=[user("x" * 195), user()]), "messages", "MAX_PROMPT_CHARS"),
    (native(messages=[user()] * 4), "messages", "MAX_MESSAGES"),
    (native(prompt="hi", sampling_params={"stop": ["a", "b", "c"]}), "stop", "MAX_STOP_STRINGS"),
    (
        native(prompt="hi", sampling_params={"logit_bias": {"1": 1, "2": 1, "3": 1}}),
        "logit_bias",
        "MAX_LOGIT_BIAS",
    ),  # fmt: skip
    (native(prompt="hi", sampling_params={"n": 3}), "n", "MAX_N"),
]

AT_LIMIT = [
    openai(CHAT, messages=[user("x" * 196)]),  # and "user"
    openai(COMPLETIONS, prompt=["x" * 150, "y" * 50]),
    openai(CHAT, messages=[user()] * 3, stop=["a", "b"], tools=[TOOL], n=2),
    openai(COMPLETIONS, prompt="hi", logit_bias={"1": 1, "2": 1}, best_of=2),
    openai(COMPLETIONS, prompt=[[5], [6]]),
    openai(COMPLETIONS, prompt=[5, 6, 7, 8]),  # one prompt of token ids
    native(prompt="x" * 200, sampling_params={"stop": ["a", "b"], "n": 2}),
    native(messages=[user()] * 3, sampling_params={"logit_bias": {"1": 1, "2": 1}}),
]


def error_of(items: list[Any]) -> tuple[str, str | None]:
    """(message, param) of a job's error: OpenAI's object or the native string."""
    assert len(items) == 1, items
    error = items[0]["error"]
    if isinstance(error, dict):
        assert error["type"] == "invalid_request_error" and error["code"], error
        return error["message"], error["param"]
    return error, None


def test_each_limit_refuses_a_request_over_it_and_serves_one_at_it(make_worker):
    async def scenario(w):
        over = [await run_job(w, job) for job, _, _ in OVER]
        at = [await run_job(w, job) for job in AT_LIMIT]
        return over, at, blocks_all_free(w)

    over, at, free = run(make_worker(**LIMITS), scenario)
    for items, (job, param, setting) in zip(over, OVER):
        message, got_param = error_of(items)
        assert setting in message, (job, message)
        if "openai_route" in job:
            assert got_param == param, (job, got_param)
        else:
            assert param in message, (job, message)
    for items, job in zip(at, AT_LIMIT):
        assert items and all("error" not in item for item in items), (job, items)
    assert free


def test_a_huge_prompt_is_refused_without_tokenizing(make_worker, monkeypatch):
    calls = []

    async def scenario(w):
        tokenizer = w.engine.tokenizer
        real = tokenizer.encode

        def counting(*args, **kwargs):
            calls.append(len(args[0]) if args else 0)
            return real(*args, **kwargs)

        monkeypatch.setattr(tokenizer, "encode", counting)
        big = "word " * 300_000  # 1.5 M characters, over the default 1 M
        return [
            await run_job(w, openai(CHAT, messages=[user(big)])),
            await run_job(w, openai(COMPLETIONS, prompt=big)),
            await run_job(w, native(prompt=big)),
        ]

    results = run(make_worker(), scenario)
    for items in results:
        message, _ = error_of(items)
        assert "15000" in message and "limit of 1000000 (MAX_PROMPT_CHARS)" in message
    assert not [n for n in calls if n > 1000], calls


def test_zero_turns_a_limit_off(make_worker):
    async def scenario(w):
        return await run_job(w, openai(CHAT, messages=[user()] * 5, n=3))

    items = run(make_worker(MAX_MESSAGES="0", MAX_N="0"), scenario)
    assert "error" not in items[0] and len(items[0]["choices"]) == 3


def test_top_logprobs_over_20_and_a_prompt_longer_than_the_model_are_refused(make_worker):
    async def scenario(w):
        return [
            await run_job(w, openai(CHAT, messages=[user()], logprobs=True, top_logprobs=21)),
            await run_job(w, native(prompt="hi", sampling_params={"logprobs": 21})),
            await run_job(w, openai(COMPLETIONS, prompt=[5] * 600)),
            await run_job(w, native(prompt="hi " * 600)),
        ]

    results = run(make_worker(), scenario)
    assert error_of(results[0])[1] == "top_logprobs"
    assert "20" in error_of(results[1])[0]
    assert "maximum context length" in error_of(results[2])[0]
    assert "512" in error_of(results[3])[0]


def test_settings_defaults_are_the_routes_defaults():
    assert Settings.from_env({}).request_limits == RequestLimits()
    limits = Settings.from_env(LIMITS).request_limits
    assert (limits.max_prompt_chars, limits.max_messages, limits.max_n) == (200, 3, 2)
    assert limits.max_prompts == 2
    with pytest.raises(SettingsError, match="MAX_TOOLS='-1' is not valid"):
        Settings.from_env({"MAX_TOOLS": "-1"})


def test_string_chars_counts_every_string_without_recursion():
    assert string_chars({"a": ["xy", {"bcd": "z"}, 3, None]}) == 3
    deep: Any = "x"
    for _ in range(100_000):
        deep = [deep]
    assert string_chars(deep) == 1


def test_memory_left_by_a_huge_prompt_goes_back_to_the_system(make_worker, monkeypatch):
    """Tokenizing a prompt near MAX_PROMPT_CHARS leaves ~120 MB in the heap (the allocator is
    tuned to keep freed memory for the next step); the preparation thread gives it back."""
    from serverless_llm.api import offload
    from serverless_llm.engine import resident_bytes

    big = "Hello world, this is a test. " * 34_000  # 986,000 characters

    async def growth(w) -> float:
        before = resident_bytes()
        items = await run_job(w, native(prompt=big))
        assert "maximum context length" in items[0]["error"] or "512" in items[0]["error"]
        return (resident_bytes() - before) / 2**20

    async def scenario(w):
        await run_job(w, native(prompt="warm up"))
        kept = await growth(w)
        monkeypatch.setattr(offload, "RELEASE_ABOVE", 1 << 40)
        unreleased = await growth(w)
        return kept, unreleased

    kept, unreleased = run(make_worker(), scenario)
    print(f"\nresident growth: {kept:.0f} MiB released, {unreleased:.0f} MiB without release")
    assert kept < 40 and unreleased > kept + 40, (kept, unreleased)

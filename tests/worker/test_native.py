"""The native route: prompt and messages, geometric stream batches, n choices, usage counts,
sampling parameter validation, malformed jobs, and cancellation freeing every KV block."""

from __future__ import annotations

import asyncio

import pytest

from serverless_llm.api.native_sampling import build_sampling_params, parse_sampling_params
from serverless_llm.engine import SamplingParamsError
from serverless_llm.engine.tokenizer import apply_chat_template
from tests.worker.conftest import (
    GREEDY_LONG,
    blocks_all_free,
    joined,
    run,
    run_job,
    token_counts,
    wait_blocks_free,
)

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello world! How are you today?"},
]


def test_stream_batches_grow_geometrically(make_worker):
    async def scenario(w):
        items = await run_job(
            w, {"prompt": "Hello world", "sampling_params": GREEDY_LONG, "stream": True}
        )
        whole = await run_job(w, {"prompt": "Hello world", "sampling_params": GREEDY_LONG})
        return items, whole

    items, whole = run(make_worker(), scenario)
    assert token_counts(items) == [1, 3, 9, 27, 50, 50, 50, 10]
    assert [item["usage"]["output"] for item in items] == [1, 4, 13, 40, 90, 140, 190, 200]
    assert len(whole) == 1 and len(whole[0]["choices"][0]["tokens"]) == 1
    assert whole[0]["choices"][0]["tokens"][0] == joined(items)
    assert whole[0]["usage"]["output"] == 200
    assert all(item["usage"]["input"] == whole[0]["usage"]["input"] for item in items)


def test_per_job_knobs_change_the_sequence(make_worker):
    def job(**knobs):
        return {"prompt": "Hello", "sampling_params": GREEDY_LONG, "stream": True, **knobs}

    async def scenario(w):
        return (
            await run_job(w, job(max_batch_size=10, min_batch_size=2, batch_size_growth_factor=2)),
            await run_job(w, job(max_batch_size=64, batch_size_growth_factor=1)),
            await run_job(w, job(min_batch_size=5, batch_size_growth_factor=1.5)),
        )

    grow2, flat, slow = run(make_worker(), scenario)
    assert token_counts(grow2) == [2, 4, 8] + [10] * 18 + [6]
    assert token_counts(flat) == [64, 64, 64, 8]  # not dynamic: every batch holds the max
    assert token_counts(slow)[:5] == [5, 7, 11, 16, 25]
    assert sum(token_counts(slow)) == 200


def test_env_defaults_change_the_sequence(make_worker):
    worker = make_worker(
        DEFAULT_BATCH_SIZE="20", DEFAULT_MIN_BATCH_SIZE="5", DEFAULT_BATCH_SIZE_GROWTH_FACTOR="2"
    )

    async def scenario(w):
        return await run_job(w, {"prompt": "Hi", "sampling_params": GREEDY_LONG, "stream": True})

    assert token_counts(run(worker, scenario)) == [5, 10] + [20] * 9 + [5]


def test_prompt_usage_and_default_max_tokens(make_worker):
    worker = make_worker()

    async def scenario(w):
        items = await run_job(w, {"prompt": "Hello world", "sampling_params": {"ignore_eos": True}})
        return items, w.engine.tokenizer.encode("Hello world")

    items, ids = run(worker, scenario)
    assert items[0]["usage"] == {"input": len(ids), "output": 100}  # native default: 100


def test_default_max_tokens_shrinks_to_fit(make_worker):
    worker = make_worker(MAX_MODEL_LEN="40")

    async def scenario(w):
        prompt = "The quick brown fox jumps over the lazy dog."
        n = len(w.engine.tokenizer.encode(prompt))
        items = await run_job(w, {"prompt": prompt, "sampling_params": {"ignore_eos": True}})
        explicit = await run_job(
            w, {"prompt": prompt, "sampling_params": {"ignore_eos": True, "max_tokens": 100}}
        )
        return n, items, explicit

    n, items, explicit = run(worker, scenario)
    assert items[0]["usage"] == {"input": n, "output": 40 - n}
    assert "max_model_len=40" in explicit[0]["error"]  # asked for explicitly: an error


def test_messages_use_the_chat_template(make_worker):
    async def scenario(w):
        rendered = apply_chat_template(w.engine.tokenizer, MESSAGES)
        expected = len(w.engine.tokenizer.encode(rendered, add_special_tokens=False))
        chat = await run_job(w, {"messages": MESSAGES, "sampling_params": GREEDY_LONG})
        as_prompt = await run_job(
            w, {"prompt": rendered, "sampling_params": GREEDY_LONG}, job_id="p"
        )
        return expected, chat, as_prompt

    expected, chat, as_prompt = run(make_worker(), scenario)
    assert chat[0]["usage"]["input"] == expected
    # The tiny tokenizer adds no BOS, so the rendered prompt gives the same tokens and text.
    assert chat[0]["choices"] == as_prompt[0]["choices"]


def test_apply_chat_template_wraps_the_prompt(make_worker):
    params = {"max_tokens": 30, "temperature": 0.0, "ignore_eos": True}

    async def scenario(w):
        wrapped = await run_job(
            w, {"prompt": "Hello there", "apply_chat_template": True, "sampling_params": params}
        )
        chat = await run_job(
            w, {"messages": [{"role": "user", "content": "Hello there"}], "sampling_params": params}
        )
        raw = await run_job(w, {"prompt": "Hello there", "sampling_params": params})
        return wrapped, chat, raw

    wrapped, chat, raw = run(make_worker(), scenario)
    assert wrapped == chat
    assert wrapped[0]["usage"]["input"] > raw[0]["usage"]["input"]


def test_custom_chat_template(make_worker):
    worker = make_worker(
        CUSTOM_CHAT_TEMPLATE="{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )

    async def scenario(w):
        chat = await run_job(w, {"messages": [{"role": "user", "content": "Hello world"}]})
        return chat, len(w.engine.tokenizer.encode("Hello world", add_special_tokens=False))

    chat, n = run(worker, scenario)
    assert chat[0]["usage"]["input"] == n


def test_template_variables_reach_the_chat_template(make_worker):
    """`chat_template_kwargs` and `reasoning_effort` are the template's variables (a model that
    does not speak harmony; gpt-oss's are tested in tests/api/test_harmony_native.py)."""
    worker = make_worker(
        CUSTOM_CHAT_TEMPLATE=(
            "{{ reasoning_effort | default('none') }}/{{ tone | default('plain') }}:"
            "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        )
    )
    user = [{"role": "user", "content": "Hello world"}]
    jobs = {
        "none/plain:Hello world": {"messages": user},
        "high/plain:Hello world": {"messages": user, "reasoning_effort": "high"},
        "none/warm:Hello world": {"messages": user, "chat_template_kwargs": {"tone": "warm"}},
        "low/warm:Hello world": {
            "messages": user,
            "chat_template_kwargs": {"tone": "warm", "reasoning_effort": "low"},
        },
        "medium/plain:Hello world": {
            "prompt": "Hello world",
            "apply_chat_template": True,
            "reasoning_effort": "medium",
        },
    }

    async def scenario(w):
        # Each job answers as the prompt its template should render does (greedy).
        pairs = []
        for i, (text, job) in enumerate(jobs.items()):
            chat = await run_job(w, {**job, "sampling_params": GREEDY_LONG}, job_id=f"c{i}")
            raw = await run_job(w, {"prompt": text, "sampling_params": GREEDY_LONG}, job_id=f"r{i}")
            pairs.append((chat, raw))
        return pairs

    for chat, raw in run(worker, scenario):
        assert chat == raw


def test_n_choices(make_worker):
    params = {"n": 2, "max_tokens": 30, "ignore_eos": True, "seed": 5, "temperature": 1.0}

    async def scenario(w):
        whole = await run_job(w, {"prompt": "Once upon a time", "sampling_params": params})
        streamed = await run_job(
            w, {"prompt": "Once upon a time", "sampling_params": params, "stream": True}
        )
        greedy = await run_job(
            w,
            {
                "prompt": "Once upon a time",
                "sampling_params": {"n": 3, "max_tokens": 20, "ignore_eos": True, "temperature": 0},
            },
        )
        return whole, streamed, greedy

    whole, streamed, greedy = run(make_worker(), scenario)
    assert len(whole) == 1 and len(whole[0]["choices"]) == 2
    assert whole[0]["usage"]["output"] == 60
    # Seeded choices differ (choice i gets seed + i) and are reproducible in a stream.
    texts = [c["tokens"][0] for c in whole[0]["choices"]]
    assert texts[0] != texts[1]
    assert [joined(streamed, 0), joined(streamed, 1)] == texts
    assert streamed[-1]["usage"]["output"] == 60
    # Batch sizes count the tokens of all choices together.
    per_item = [len(i["choices"][0]["tokens"]) + len(i["choices"][1]["tokens"]) for i in streamed]
    assert sum(per_item) == 60 and per_item[0] >= 1
    assert [c["tokens"][0] for c in greedy[0]["choices"]] == [
        greedy[0]["choices"][0]["tokens"][0]
    ] * 3


# -- sampling parameters ---------------------------------------------------------------------


def test_sampling_params_supported_and_defaults():
    p = build_sampling_params(
        {"temperature": 0, "top_p": 0.5, "top_k": 5, "seed": 3, "stop_token_ids": [1, 2]},
        default_max_tokens=100,
    )
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop_token_ids) == (0, 0.5, 5, 3, [1, 2])
    assert p.max_tokens == 100
    parsed = parse_sampling_params({"n": 3, "max_tokens": None}, default_max_tokens=100)
    assert parsed.n == 3 and parsed.params.max_tokens is None and parsed.max_tokens_given
    # Every vLLM and Aphrodite sampling name reaches the engine's parameters.
    everything = {
        "n": 2,
        "best_of": 4,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "min_p": 0.05,
        "top_a": 0.2,
        "tfs": 0.9,
        "eta_cutoff": 3.0,
        "epsilon_cutoff": 2.0,
        "typical_p": 0.9,
        "smoothing_factor": 0.3,
        "smoothing_curve": 1.5,
        "stop": "\n\n",
        "include_stop_str_in_output": True,
        "min_tokens": 2,
        "logprobs": 3,
        "prompt_logprobs": 1,
        "logit_bias": {"5": 2.5},
        "allowed_token_ids": [5, 6, 7],
        "truncate_prompt_tokens": 8,
    }
    p = parse_sampling_params(everything, default_max_tokens=7).params
    for name, value in everything.items():
        if name == "stop":
            assert p.stop == ["\n\n"]
        elif name == "logit_bias":
            assert p.logit_bias == {5: 2.5}
        else:
            assert getattr(p, name) == value, name
    # Beam search's names, and names not honoured yet, are fine at their defaults.
    defaults = {
        "use_beam_search": False,
        "length_penalty": 1.0,
        "early_stopping": False,
        "guided_json": None,
        "bad_words": [],
        "detokenize": True,
    }
    assert parse_sampling_params(defaults, default_max_tokens=7).params.max_tokens == 7


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"foo": 1}, "unknown sampling parameter 'foo'"),
        ({"mirostat_mode": 2}, "unknown sampling parameter 'mirostat_mode'"),
        ({"use_beam_search": True, "temperature": 0.5}, "temperature must be 0 when using beam"),
        ({"use_beam_search": True, "top_k": 5}, "top_k must be -1 when using beam search"),
        ({"use_beam_search": True, "presence_penalty": 1.0}, "presence_penalty must be 0.0 when"),
        ({"length_penalty": 0.5}, "length_penalty is not effective and must be the default"),
        ({"early_stopping": "never"}, "early_stopping is not effective and must be false"),
        ({"use_beam_search": True, "early_stopping": "no"}, "early_stopping must be true, false"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "only one structured output"),
        ({"guided_choice": []}, "the list of choices is empty"),
        ({"guided_regex": "a", "guided_decoding_backend": "nope"}, "unknown guided decoding"),
        ({"bad_words": ["x"]}, "'bad_words' is not supported yet"),
        ({"best_of": 1, "n": 2}, "best_of must be an integer >= n (2)"),
        ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a number in (0, inf)"),
        ({"min_p": 1.5}, "min_p must be a number in [0, 1]"),
        ({"top_a": -1.0}, "top_a must be a number in [0, inf)"),
        ({"tfs": 0.0}, "tfs must be a number in (0, 1]"),
        ({"typical_p": 2.0}, "typical_p must be a number in (0, 1]"),
        ({"epsilon_cutoff": 5000.0}, "epsilon_cutoff must be a number in [0, 1000]"),
        ({"smoothing_curve": 0.0}, "smoothing_curve must be a number in [1, inf)"),
        ({"stop": [""]}, "stop must not contain an empty string"),
        ({"stop": 5}, "sampling_params.stop"),
        ({"logit_bias": {"5": 200.0}}, "logit_bias values must be numbers in [-100, 100]"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias keys must be token ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
        ({"logprobs": 50}, "logprobs must be an integer in [0, 20]"),
        ({"min_tokens": 200, "max_tokens": 10}, "min_tokens must be <= max_tokens (10)"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be an integer >= 1"),
        ({"temperature": "hot"}, "sampling_params.temperature"),
        ({"temperature": "0.5"}, "sampling_params.temperature"),
        ({"ignore_eos": 1}, "sampling_params.ignore_eos"),
        ({"max_tokens": 1.5}, "sampling_params.max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.5}, "temperature must be a number in [0, inf)"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "sampling_params.n"),
        ({"stop_token_ids": ["a"]}, "sampling_params.stop_token_ids[0]"),
        ({"seed": 2**70}, "sampling_params.seed"),
    ],
)
def test_sampling_param_errors_name_the_parameter(params, message):
    with pytest.raises(SamplingParamsError) as info:
        parse_sampling_params(params, default_max_tokens=100)
    assert message in str(info.value)
    assert info.value.param in str(info.value)


# -- malformed jobs --------------------------------------------------------------------------

MALFORMED = [
    {"prompt": 42},
    {"prompt": ["not", "a", "string"]},
    {"prompt": ""},
    {"messages": []},
    {"messages": "hello"},
    {"messages": [{"content": "no role"}]},
    {"messages": [{"role": 7, "content": "x"}]},
    {"messages": [{"role": "", "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"prompt": "x", "sampling_params": {"foo": 1}},
    {"prompt": "x", "sampling_params": {"max_tokens": -5}},
    {"prompt": "x", "sampling_params": {"max_tokens": 0}},
    {"prompt": "x", "sampling_params": {"temperature": -1}},
    {"prompt": "x", "sampling_params": {"temperature": "warm"}},
    {"prompt": "x", "sampling_params": {"n": 0}},
    {"prompt": "x", "sampling_params": {"top_k": -7}},
    {"prompt": "x", "sampling_params": {"presence_penalty": 3.0}},
    {"prompt": "x", "sampling_params": {"use_beam_search": True, "top_p": 0.5}},
    {"prompt": "x", "sampling_params": {"logit_bias": {"100000": 1.0}}},
    {"prompt": "x", "sampling_params": {"best_of": 3}, "stream": True},
    {"prompt": "x", "sampling_params": ["max_tokens", 5]},
    {"prompt": "x", "sampling_params": {"max_tokens": 10_000}},
    {"prompt": "word " * 600},
    {"prompt": "word " * 600, "stream": True},
    {"prompt": "x", "stream": "yes"},
    {"prompt": "x", "apply_chat_template": "true"},
    {"prompt": "x", "max_tokens": 5},
    {"prompt": "x", "max_batch_size": 0},
    {"prompt": "x", "min_batch_size": "3"},
    {"prompt": "x", "batch_size_growth_factor": -2},
    {"prompt": "x", "openai_input": {"model": "m"}},
    {},
    {"sampling_params": {"max_tokens": 5}},
    {"prompt": "x", "sampling_params": {"n": 2, "max_tokens": 10_000}, "stream": True},
]
NOT_A_DICT = ["just a string", ["a", "list"], 7, None]


def test_malformed_jobs_get_an_error_and_the_worker_recovers(make_worker):
    async def scenario(w):
        results = [await run_job(w, job) for job in MALFORMED]
        results += [await run_job(w, job) for job in NOT_A_DICT]
        results.append([item async for item in w.handle("not even a job")])
        free = await wait_blocks_free(w)  # once the engine loop has applied any abort
        after = await run_job(
            w, {"prompt": "Hello", "sampling_params": GREEDY_LONG, "stream": True}
        )
        return results, free, after, await wait_blocks_free(w)

    results, free_between, after, free_after = run(make_worker(), scenario)
    assert len(results) >= 30
    for job, items in zip(MALFORMED + NOT_A_DICT + ["not even a job"], results):
        assert len(items) == 1, job
        assert set(items[0]) == {"error"}, job
        assert isinstance(items[0]["error"], str) and items[0]["error"], job
        assert "\n" not in items[0]["error"], job
    assert free_between and free_after
    assert sum(token_counts(after)) == 200


def test_error_messages_are_specific(make_worker):
    async def scenario(w):
        return {
            "unknown": await run_job(w, {"prompt": "x", "sampling_params": {"foo": 1}}),
            "role": await run_job(w, {"messages": [{"role": 7, "content": "x"}]}),
            "empty": await run_job(w, {"messages": []}),
            "long": await run_job(w, {"prompt": "word " * 600}),
            "missing": await run_job(w, {"stream": True}),
            "top": await run_job(w, {"prompt": "x", "max_tokens": 5}),
        }

    r = run(make_worker(), scenario)
    assert r["unknown"][0]["error"] == "unknown sampling parameter 'foo'"
    assert "messages[0].role" in r["role"][0]["error"]
    assert r["empty"][0]["error"] == "'messages' must not be empty"
    assert "max_model_len=512" in r["long"][0]["error"]
    assert r["missing"][0]["error"] == "the job needs 'prompt' or 'messages'"
    assert "sampling_params" in r["top"][0]["error"] and "'max_tokens'" in r["top"][0]["error"]


# -- cancellation ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3])
def test_closing_a_stream_aborts_its_requests(make_worker, n):
    params = {"n": n, "max_tokens": 400, "ignore_eos": True}

    async def scenario(w):
        gen = w.handle(
            {"id": "c", "input": {"prompt": "Hi", "sampling_params": params, "stream": True}}
        )
        first = await gen.__anext__()
        await gen.aclose()  # the client went away
        for _ in range(100):
            if blocks_all_free(w) and not w.engine.stats().num_requests:
                break
            await asyncio.sleep(0.01)
        return first, blocks_all_free(w), w.engine.stats().num_requests

    first, free, left = run(make_worker(), scenario)
    assert "choices" in first and free and left == 0


@pytest.mark.parametrize("n", [1, 2])
def test_cancelling_a_job_task_propagates_and_frees_blocks(make_worker, n):
    params = {"n": n, "max_tokens": 400, "ignore_eos": True}

    async def scenario(w):
        started = asyncio.Event()

        async def consume():
            async for _ in w.handle(
                {"id": "k", "input": {"prompt": "Hi", "sampling_params": params, "stream": True}}
            ):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()  # cancelled at its first item, before it can finish
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if blocks_all_free(w) and not w.engine.stats().num_requests:
                break
            await asyncio.sleep(0.01)
        return blocks_all_free(w), w.active_jobs

    free, active = run(make_worker(), scenario)
    assert free and active == 0


def test_prompts_are_prepared_off_the_event_loop(make_worker, monkeypatch):
    """Template and tokenizer work never runs on the event loop (a huge prompt would stall
    every stream): the native and the OpenAI routes prepare on api.offload's thread."""
    import threading

    from serverless_llm.api import native, offload
    from serverless_llm.api.openai import serving

    seen: list[str] = []

    def spy(fn):
        def wrapped(*args, **kwargs):
            seen.append(threading.current_thread().name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(native.NativeServing, "_prompt", spy(native.NativeServing._prompt))
    monkeypatch.setattr(serving, "render_chat_prompt", spy(serving.render_chat_prompt))
    monkeypatch.setattr(serving, "tokenize_prompts", spy(serving.tokenize_prompts))

    async def scenario(w):
        await run_job(w, {"messages": MESSAGES, "sampling_params": {"max_tokens": 2}})
        for route, body in (
            ("/v1/chat/completions", {"messages": MESSAGES}),
            ("/v1/completions", {"prompt": "Hello"}),
        ):
            body = {"model": w.settings.served_model_name, "max_tokens": 2, **body}
            await run_job(w, {"openai_route": route, "openai_input": body})
        return threading.current_thread().name

    loop_thread = run(make_worker(), scenario)
    assert len(seen) == 3
    assert all(name.startswith(offload.THREAD_NAME) for name in seen), seen
    assert loop_thread not in seen

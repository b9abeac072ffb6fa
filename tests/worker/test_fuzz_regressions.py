"""Inputs the job fuzzing (test_fuzz_jobs.py, issue 14 item 7) found breaking the worker, each
pinned as a plain test: what was sent, and the documented answer it now gets."""

from __future__ import annotations

import tracemalloc

from serverless_llm.api.openai import http_status
from tests.worker.conftest import run, run_job, wait_blocks_free

CHAT = "/v1/chat/completions"


def _openai(route: str, body: dict) -> dict:
    return {"openai_route": route, "openai_input": body}


def _chat(content: str, **body) -> dict:
    return _openai(CHAT, {"messages": [{"role": "user", "content": content}], **body})


def test_lone_surrogates_are_refused_in_the_routes_shape(make_worker):
    """JSON's "\\ud800" escape decodes to a lone surrogate, which the tokenizer cannot take: it
    was a TypeError out of the tokenizer, an internal error (a 500 on the OpenAI routes)."""
    jobs = [
        {"prompt": "a\ud800b", "sampling_params": {"max_tokens": 2}},
        {"messages": [{"role": "user", "content": "\udfff"}]},
        {"prompt": "hi", "sampling_params": {"stop": ["ok", "\ud800"], "max_tokens": 2}},
        _openai("/v1/completions", {"prompt": "\ud800", "max_tokens": 2}),
        _chat("hi", max_tokens=2, metadata={"k\udc00": "v"}),
        _chat("x\ud83d", max_tokens=2),
    ]

    async def scenario(w):
        results = [await run_job(w, job) for job in jobs]
        fine = await run_job(w, {"prompt": "Hello", "sampling_params": {"max_tokens": 2}})
        return results, fine, await wait_blocks_free(w)

    results, fine, free = run(make_worker(), scenario)
    native = [items[0]["error"] for items in results[:3]]
    assert all("lone surrogate" in e and "not valid Unicode" in e for e in native), native
    assert "'prompt'" in native[0] and "'messages[0].content'" in native[1]
    assert "'sampling_params.stop[1]'" in native[2]
    params = []
    for items in results[3:]:
        assert len(items) == 1 and http_status(items[0]) == 400, items
        error = items[0]["error"]
        assert error["type"] == "invalid_request_error" and "lone surrogate" in error["message"]
        error["message"].encode("utf-8")  # the answer itself is valid text
        params.append(error["param"])
    assert params == ["prompt", "metadata.k\\udc00", "messages[0].content"]
    assert fine[-1]["usage"]["output"] == 2 and free


def test_huge_length_penalty_runs_the_beam_search(make_worker):
    """use_beam_search with length_penalty 1e300: `length ** length_penalty` raised
    OverflowError in the output processing, so the job failed with "generation failed" (a 500
    on the OpenAI routes)."""
    beam = {"use_beam_search": True, "n": 2, "max_tokens": 3, "length_penalty": 1e300}

    async def scenario(w):
        native = await run_job(w, {"prompt": "Hello", "sampling_params": beam})
        never = await run_job(
            w, {"prompt": "Hello", "sampling_params": {**beam, "early_stopping": "never"}}
        )
        chat = await run_job(w, _chat("Hello", **beam))
        return native, never, chat, await wait_blocks_free(w)

    native, never, chat, free = run(make_worker(), scenario)
    for items in (native, never):
        assert "error" not in items[-1], items
        assert len(items[-1]["choices"]) == 2
    assert chat[0]["object"] == "chat.completion" and len(chat[0]["choices"]) == 2, chat
    assert free


def test_a_long_stop_string_costs_no_more_than_its_length():
    """A stop string of L characters built a set of its L - 1 prefixes: L**2 / 2 characters
    (a 100 kB stop string took 20 s and 5 GB before the first token; a 1 MB one, 500 GB)."""
    from serverless_llm.engine.tokenizer import StopStringMatcher

    stop = "ab" * 15_000
    tracemalloc.start()
    try:
        matcher = StopStringMatcher([stop, "zz"])
        released = [matcher.feed(piece) for piece in ("xx", "ab" * 50, "ab", "c")]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000, peak  # the prefix set was 450 MB
    assert released[0] == ("xx", None)
    assert released[1] == ("", None) and released[2] == ("", None)  # may still start the stop
    assert released[3] == ("ab" * 51 + "c", None)  # it did not: released whole
    matcher = StopStringMatcher([stop])
    assert matcher.feed("x" + stop[:-1]) == ("x", None)
    assert matcher.feed("b") == ("", stop)


def test_a_megabyte_stop_string_runs(make_worker):
    async def scenario(w):
        native = await run_job(
            w,
            {
                "prompt": "Hello",
                "sampling_params": {"max_tokens": 3, "ignore_eos": True, "stop": ["a" * 1_000_000]},
            },
        )
        completion = await run_job(
            w,
            _openai(
                "/v1/completions",
                {"prompt": "Hi", "max_tokens": 3, "stop": "é" * 1_000_000, "stream": True},
            ),
        )
        return native, completion, await wait_blocks_free(w)

    native, completion, free = run(make_worker(), scenario)
    assert native[-1]["usage"]["output"] == 3, native
    assert completion[-1].endswith("data: [DONE]\n\n"), completion
    assert free


def test_batch_knobs_past_a_float_stream(make_worker):
    """max_batch_size 10**400 (any integer >= 1 is a valid knob): the growth was computed as
    float(max_batch_size), an OverflowError once the second batch was due, so a streamed job
    failed with "generation failed" (a 500 on the OpenAI routes)."""
    greedy = {"max_tokens": 6, "ignore_eos": True, "temperature": 0.0}
    huge = {"max_batch_size": 10**400}
    both = {"max_batch_size": 10**400, "min_batch_size": 10**399, "batch_size_growth_factor": 1e300}

    async def scenario(w):
        native = await run_job(
            w, {"prompt": "Hello", "sampling_params": greedy, "stream": True, **huge}
        )
        whole = await run_job(
            w, {"prompt": "Hello", "sampling_params": greedy, "stream": True, **both}
        )
        completion = await run_job(
            w, {**_openai("/v1/completions", {"prompt": "Hi", **greedy, "stream": True}), **huge}
        )
        return native, whole, completion, await wait_blocks_free(w)

    native, whole, completion, free = run(make_worker(), scenario)
    assert [len(item["choices"][0]["tokens"]) for item in native] == [1, 3, 2], native
    assert [len(item["choices"][0]["tokens"]) for item in whole] == [6], whole
    assert completion[-1].endswith("data: [DONE]\n\n") and free

"""Sampling parameters on the native route: each reaches the engine with its meaning, logprobs
and prompt_logprobs in the items, best_of, and stop strings that never show in a stream."""

from __future__ import annotations

import pytest

from serverless_llm.engine.sampling.params import SamplingParams
from tests.worker.conftest import joined, run, run_job

PROMPT = "Once upon a time"
BASE = {"max_tokens": 16, "temperature": 1.0, "seed": 5, "ignore_eos": True}

PARAMS = {
    "top_p": {"top_p": 0.5},
    "top_k": {"top_k": 2},
    "min_p": {"min_p": 0.3},
    "top_a": {"top_a": 0.4},
    "tfs": {"tfs": 0.8},
    "eta_cutoff": {"eta_cutoff": 40.0},
    "epsilon_cutoff": {"epsilon_cutoff": 20.0},
    "typical_p": {"typical_p": 0.4},
    "smoothing": {"smoothing_factor": 0.6, "smoothing_curve": 1.5},
    "penalties": {"presence_penalty": 1.0, "frequency_penalty": 1.0, "repetition_penalty": 1.5},
    "logit_bias": {"logit_bias": {"12": 100.0}},
    "allowed_token_ids": {"allowed_token_ids": [20, 21, 22]},
    "min_tokens": {"min_tokens": 5, "stop_token_ids": [20]},
    "stop": {"stop": ["a"]},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 2},
}


async def engine_text(worker, params: SamplingParams) -> str:
    ids = worker.engine.tokenize_prompt(PROMPT).token_ids
    return "".join([o.new_text async for o in worker.engine.generate(ids, params)])


def test_every_parameter_reaches_the_engine(make_worker):
    async def scenario(w):
        out = {}
        for name, extra in PARAMS.items():
            item = await run_job(w, {"prompt": PROMPT, "sampling_params": {**BASE, **extra}})
            want = await engine_text(w, SamplingParams(**BASE, **extra))
            out[name] = (item[0]["choices"][0]["tokens"][0], want)
        plain = await run_job(w, {"prompt": PROMPT, "sampling_params": BASE})
        return out, plain[0]["choices"][0]["tokens"][0]

    out, plain = run(make_worker(), scenario)
    for name, (got, want) in out.items():
        assert got == want, name
        assert got != plain or name == "min_tokens", name
    assert out["logit_bias"][0] == out["logit_bias"][0][:1] * len(out["logit_bias"][0])


def test_logprobs_and_prompt_logprobs_in_the_items(make_worker):
    params = {**BASE, "temperature": 0, "logprobs": 2, "prompt_logprobs": 1}

    async def scenario(w):
        whole = await run_job(w, {"prompt": PROMPT, "sampling_params": params})
        streamed = await run_job(w, {"prompt": PROMPT, "sampling_params": params, "stream": True})
        return whole, streamed, w.engine.tokenize_prompt(PROMPT).token_ids

    whole, streamed, prompt_ids = run(make_worker(), scenario)
    choice = whole[0]["choices"][0]
    assert len(choice["logprobs"]) == 16
    for entry in choice["logprobs"]:
        assert set(entry) == {"token_id", "token", "logprob", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token_id"] == entry["token_id"]  # greedy
    assert choice["cumulative_logprob"] == pytest.approx(
        sum(e["logprob"] for e in choice["logprobs"])
    )
    prompt_lp = whole[0]["prompt_logprobs"]
    assert len(prompt_lp) == len(prompt_ids) and prompt_lp[0] is None
    assert [e["token_id"] for e in prompt_lp[1:]] == prompt_ids[1:]
    assert all(e["rank"] >= 1 and len(e["top_logprobs"]) == 1 for e in prompt_lp[1:])
    # Streamed: each item's logprobs line up with its tokens.
    for item in streamed:
        c = item["choices"][0]
        assert len(c["logprobs"]) == len(c["tokens"])
    assert [e for item in streamed for e in item["choices"][0]["logprobs"]] == choice["logprobs"]
    assert streamed[0]["prompt_logprobs"] == prompt_lp
    assert all("prompt_logprobs" not in item for item in streamed[1:])
    assert joined(streamed) == choice["tokens"][0]


def test_best_of_keeps_the_most_likely(make_worker):
    params = {**BASE, "n": 2, "best_of": 4}

    async def scenario(w):
        best = await run_job(w, {"prompt": PROMPT, "sampling_params": params})
        singles = [
            await run_job(
                w, {"prompt": PROMPT, "sampling_params": {**BASE, "seed": 5 + i, "logprobs": 0}}
            )
            for i in range(4)
        ]
        return best, singles

    best, singles = run(make_worker(), scenario)
    scores = [s[0]["choices"][0]["cumulative_logprob"] for s in singles]
    texts = [s[0]["choices"][0]["tokens"][0] for s in singles]
    order = sorted(range(4), key=lambda i: -scores[i])[:2]
    assert [c["tokens"][0] for c in best[0]["choices"]] == [texts[i] for i in order]
    assert "logprobs" not in best[0]["choices"][0]  # not asked for
    assert best[0]["usage"]["output"] == 32


def test_stop_strings_never_show_in_a_stream(make_worker):
    greedy = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}

    async def scenario(w):
        free = await run_job(w, {"prompt": PROMPT, "sampling_params": greedy})
        text = free[0]["choices"][0]["tokens"][0]
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        params = {**greedy, "stop": [stop]}
        streamed = await run_job(w, {"prompt": PROMPT, "sampling_params": params, "stream": True})
        whole = await run_job(w, {"prompt": PROMPT, "sampling_params": params})
        return text, stop, streamed, whole

    text, stop, streamed, whole = run(make_worker(), scenario)
    cut = text[: text.index(stop)]
    assert whole[0]["choices"][0]["tokens"][0] == cut
    shown = ""
    for item in streamed:
        shown += "".join(item["choices"][0]["tokens"])
        assert stop not in shown
    assert shown == cut


def test_guided_decoding_on_the_native_route(make_worker):
    import json
    import re

    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["id"],
    }

    async def scenario(w):
        base = {"max_tokens": 60, "seed": 1}
        as_json = await run_job(
            w,
            {
                "prompt": PROMPT,
                "sampling_params": {
                    **base,
                    "n": 3,
                    "guided_json": schema,
                    "guided_decoding_backend": "xgrammar:disable-any-whitespace",
                },
            },
        )
        choice = await run_job(
            w, {"prompt": PROMPT, "sampling_params": {**base, "guided_choice": ["yes", "no"]}}
        )
        regex = await run_job(
            w,
            {
                "prompt": PROMPT,
                "stream": True,
                "sampling_params": {**base, "guided_regex": r"\d{4}"},
            },
        )
        bad = await run_job(w, {"prompt": PROMPT, "sampling_params": {"guided_regex": "(a"}})
        return as_json, choice, regex, bad

    as_json, choice, regex, bad = run(make_worker(), scenario)
    for k in range(3):
        assert json.loads(joined(as_json, k))["id"] in range(1, 100)
    assert joined(choice) in ("yes", "no")
    assert re.fullmatch(r"\d{4}", joined(regex))
    assert len(bad) == 1 and "error" in bad[0] and "guided_regex" in json.dumps(bad[0])

"""Beam search on both routes: the OpenAI fields (`use_beam_search`, `length_penalty`,
`early_stopping`, where the official client's `extra_body` puts them) and the native
`sampling_params`; the same sequences as the engine's, streamed as one chunk per choice."""

from __future__ import annotations

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from serverless_llm.api.batching import BatchSizes
from serverless_llm.api.native import NativeRequest, NativeServing
from serverless_llm.engine.sampling.params import SamplingParams
from tests.api.conftest import MODEL, collect, parse_sse
from tests.api.test_openai_serving import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    chat_prompt_ids,
    one,
    validate_completion_chunk,
)

BEAM = {"use_beam_search": True, "n": 2, "best_of": 3, "length_penalty": 0.5}
ENGINE_BEAM = dict(use_beam_search=True, temperature=0.0, n=2, best_of=3, length_penalty=0.5)


async def engine_beams(s, ids: list[int], **kw) -> list:
    """The engine's n best sequences for `ids` (one final output holds them all)."""
    outs = [o async for o in s.engine.generate(ids, SamplingParams(**{**ENGINE_BEAM, **kw}))]
    assert len(outs) == 1 and outs[0].finished
    return outs[0].sequences


def test_chat_beam_search(serve, core):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, **BEAM}

    async def run(s):
        resp = one(await collect(s, CHAT, body))
        streamed = parse_sse(
            await collect(
                s, CHAT, {**body, "stream": True, "stream_options": {"include_usage": True}}
            )
        )
        want = await engine_beams(s, chat_prompt_ids(core.tokenizer), max_tokens=10)
        return resp, streamed, want

    resp, streamed, want = serve(run)
    ChatCompletion.model_validate(resp)
    assert [c["message"]["content"] for c in resp["choices"]] == [w.new_text for w in want]
    assert [c["finish_reason"] for c in resp["choices"]] == [w.finish_reason for w in want]
    assert resp["usage"]["completion_tokens"] == sum(w.num_output_tokens for w in want)
    # Streamed: each choice opens with its role, then comes whole with its finish reason.
    for chunk in streamed:
        ChatCompletionChunk.model_validate(chunk)
    content = [c for c in streamed if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert [c["choices"][0]["index"] for c in content] == [0, 1]
    for chunk, w in zip(content, want):
        assert chunk["choices"][0]["delta"]["content"] == w.new_text
        assert chunk["choices"][0]["finish_reason"] == w.finish_reason
    assert streamed[-1]["usage"] == resp["usage"]


def test_completion_beam_search_prompts_logprobs_and_early_stopping(serve, core):
    """Two prompts, n=2 each (choice p * n + i), logprobs in OpenAI's legacy shape, and
    early_stopping given as the string "never"."""
    prompts = ["The quick brown fox", "Hello world"]
    body = {
        "model": MODEL,
        "prompt": prompts,
        "max_tokens": 8,
        "logprobs": 2,
        "early_stopping": "never",
        **BEAM,
    }

    async def run(s):
        resp = one(await collect(s, COMPLETIONS, body))
        want = [
            await engine_beams(
                s, core.tokenizer.encode(p), max_tokens=8, logprobs=2, early_stopping="never"
            )
            for p in prompts
        ]
        return resp, want

    resp, want = serve(run)
    Completion.model_validate(resp)
    flat = [w for group in want for w in group]
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in resp["choices"]] == [w.new_text for w in flat]
    for choice, w in zip(resp["choices"], flat):
        lp = choice["logprobs"]
        # (The model's numbers vary by ~1e-6 with what shares the batch.)
        assert lp["token_logprobs"] == pytest.approx([e.logprob for e in w.logprobs], abs=1e-4)
        assert all(len(top) <= 3 for top in lp["top_logprobs"])


def test_completion_beam_search_streamed_with_echo(serve, core):
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "echo": True,
        "stream": True,
        **BEAM,
    }

    async def run(s):
        chunks = parse_sse(await collect(s, COMPLETIONS, body))
        want = await engine_beams(s, core.tokenizer.encode("Once upon a time"), max_tokens=6)
        return chunks, want

    chunks, want = serve(run)
    for chunk in chunks:
        validate_completion_chunk(chunk)
    texts = ["", ""]
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == ["Once upon a time" + w.new_text for w in want]


def test_native_beam_search(serve, core):
    prompt = "Once upon a time"
    params = {**BEAM, "max_tokens": 8, "logprobs": 1}

    async def run(s):
        native = NativeServing(s.engine)

        async def job(stream: bool):
            request = NativeRequest.parse(
                {"prompt": prompt, "sampling_params": params, "stream": stream}
            )
            return [item async for item in native.handle(request, BatchSizes(), "job")]

        whole, streamed = await job(False), await job(True)
        want = await engine_beams(s, core.tokenizer.encode(prompt), max_tokens=8, logprobs=1)
        return whole, streamed, want

    whole, streamed, want = serve(run)
    assert len(whole) == 1 and len(streamed) == 1  # streamed: all choices in one item, at the end
    for item in (whole[0], streamed[0]):
        assert [c["tokens"] for c in item["choices"]] == [[w.new_text] for w in want]
        assert [c["cumulative_logprob"] for c in item["choices"]] == [
            w.cumulative_logprob for w in want
        ]
        assert [len(c["logprobs"]) for c in item["choices"]] == [w.num_output_tokens for w in want]
        assert item["usage"]["output"] == sum(w.num_output_tokens for w in want)


def test_native_beam_search_errors(serve):
    async def run(s):
        native = NativeServing(s.engine)
        out = []
        for params in (
            {"use_beam_search": True, "temperature": 0.8},
            {"use_beam_search": True, "top_k": 3},
            {"length_penalty": 2.0},
            {"early_stopping": True},
        ):
            request = NativeRequest.parse({"prompt": "x", "sampling_params": params})
            out.append([item async for item in native.handle(request, BatchSizes(), "job")])
        return out

    for items, name in zip(
        serve(run), ("temperature", "top_k", "length_penalty", "early_stopping")
    ):
        assert len(items) == 1 and name in items[0]["error"], items

"""Sampling parameters on the OpenAI routes: each one is accepted (top level, where the official
client's `extra_body` puts it), reaches the engine with the same meaning, and shows in the
output; logprobs in OpenAI's shapes; best_of; stop strings in streams."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from serverless_llm.engine.sampling.params import SamplingParams
from tests.api.conftest import MODEL, collect, parse_sse
from tests.api.test_openai_serving import chat_prompt_ids, one

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Hello world! How are you today?"}]

# Each parameter alone (with sampling on and a seed, so the output is reproducible).
PARAMS = {
    "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.6},
    "top_k": {"top_k": 3},
    "min_p": {"min_p": 0.3},
    "top_a": {"top_a": 0.5},
    "tfs": {"tfs": 0.8},
    "eta_cutoff": {"eta_cutoff": 50.0},
    "epsilon_cutoff": {"epsilon_cutoff": 30.0},
    "typical_p": {"typical_p": 0.5},
    "smoothing": {"smoothing_factor": 0.5, "smoothing_curve": 2.0},
    "presence_penalty": {"presence_penalty": 1.5},
    "frequency_penalty": {"frequency_penalty": 1.5},
    "repetition_penalty": {"repetition_penalty": 1.8},
    "logit_bias": {"logit_bias": {"10": 5.0, "11": -100}},
    "allowed_token_ids": {"allowed_token_ids": [10, 11, 12, 13, 40, 41]},
    "min_tokens": {"min_tokens": 8, "stop_token_ids": [10]},
    "stop": {"stop": ["e", "zz"], "include_stop_str_in_output": True},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 3},
}


def engine_params(extra: dict, max_tokens: int) -> SamplingParams:
    kw = {"temperature": 1.0, "seed": 7, "ignore_eos": True, **extra}
    return SamplingParams(max_tokens=max_tokens, **kw)


async def engine_text(s, ids: list[int], params: SamplingParams) -> tuple[str, list[int]]:
    text, tokens = "", []
    async for out in s.engine.generate(ids, params):
        text += out.new_text
        tokens += out.new_token_ids
    return text, tokens


@pytest.mark.parametrize("name", PARAMS)
def test_each_parameter_reaches_the_engine(serve, core, name):
    extra = PARAMS[name]
    base = {"model": MODEL, "max_tokens": 12, "temperature": 1.0, "seed": 7, "ignore_eos": True}

    async def run(s):
        chat = await collect(s, CHAT, {**base, "messages": MESSAGES, **extra})
        comp = await collect(s, COMPLETIONS, {**base, "prompt": PROMPT, **extra})
        plain = await collect(s, COMPLETIONS, {**base, "prompt": PROMPT})
        chat_ids = chat_prompt_ids(core.tokenizer, MESSAGES)
        comp_ids = core.tokenizer.encode(PROMPT)
        params = engine_params(extra, 12)
        return (
            chat,
            comp,
            plain,
            await engine_text(s, chat_ids, params),
            await engine_text(s, comp_ids, params),
        )

    chat, comp, plain, (chat_want, _), (comp_want, comp_tokens) = serve(run)
    ChatCompletion.model_validate(one(chat))
    Completion.model_validate(one(comp))
    assert one(chat)["choices"][0]["message"]["content"] == chat_want
    assert one(comp)["choices"][0]["text"] == comp_want
    changed = one(comp)["choices"][0]["text"] != one(plain)["choices"][0]["text"]
    assert changed or name == "min_tokens", "the parameter changed nothing"
    if name == "allowed_token_ids":
        assert set(comp_tokens) <= set(extra["allowed_token_ids"])
    if name == "logit_bias":
        assert 11 not in comp_tokens
    if name == "min_tokens":
        assert 10 not in comp_tokens[:8]
    if name == "stop":
        choice = one(comp)["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] in ("e", "zz")
        assert choice["text"].endswith(choice["stop_reason"])


def test_chat_logprobs_shape_and_values(serve, core):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 3,
    }

    async def run(s):
        whole = await collect(s, CHAT, body)
        stream = await collect(s, CHAT, {**body, "stream": True})
        bare = await collect(s, CHAT, {**body, "top_logprobs": 0})
        ids = chat_prompt_ids(core.tokenizer, MESSAGES)
        lps = []
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
        async for out in s.engine.generate(ids, params):
            lps += out.logprobs
        return whole, stream, bare, lps

    whole, stream, bare, lps = serve(run)
    resp = ChatCompletion.model_validate(one(whole))
    content = resp.choices[0].logprobs.content
    assert len(content) == 8
    for item, want in zip(content, lps):
        assert item.token == core.tokenizer.decode([want.token_id])
        assert item.logprob == pytest.approx(want.logprob)
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(want.top_logprobs)
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)  # greedy
        assert bytes(item.bytes).decode("utf-8", errors="replace") or item.token == ""
    joined = b"".join(bytes(item.bytes) for item in content)
    assert joined.decode("utf-8", errors="replace") == resp.choices[0].message.content
    chunks = [ChatCompletionChunk.model_validate(c) for c in parse_sse(stream)]
    streamed = [lp for c in chunks for ch in c.choices if ch.logprobs for lp in ch.logprobs.content]
    assert [x.model_dump() for x in streamed] == [x.model_dump() for x in content]
    bare_content = one(bare)["choices"][0]["logprobs"]["content"]
    assert all(item["top_logprobs"] == [] for item in bare_content) and len(bare_content) == 8


def test_completion_logprobs_echo_and_prompt_logprobs(serve, core):
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
    }
    prompt_ids = core.tokenizer.encode(PROMPT)

    async def run(s):
        return (
            await collect(s, COMPLETIONS, body),
            await collect(s, COMPLETIONS, {**body, "echo": True}),
            await collect(s, COMPLETIONS, {**body, "echo": True, "stream": True}),
            await collect(s, COMPLETIONS, {**body, "prompt_logprobs": 1}),
        )

    plain, echoed, echo_stream, with_prompt = serve(run)
    lp = Completion.model_validate(one(plain)).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == pytest.approx(value)  # the sampled token is always listed
        assert 2 <= len(top) <= 3
    text = one(plain)["choices"][0]["text"]
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens) == text
    # Echo: the prompt's tokens first, the first without a logprob (null, as OpenAI sends it,
    # though the client's types say float: they are not validated on responses).
    elp = SimpleNamespace(**one(echoed)["choices"][0]["logprobs"])
    assert len(elp.tokens) == len(prompt_ids) + 6
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in elp.token_logprobs[1:])
    assert elp.token_logprobs[len(prompt_ids) :] == pytest.approx(lp.token_logprobs)
    assert elp.text_offset[len(prompt_ids)] == len(PROMPT)
    chunks = parse_sse(echo_stream)
    merged = {"tokens": [], "token_logprobs": []}
    for c in chunks:
        lpc = c["choices"][0]["logprobs"]
        if lpc:
            merged["tokens"] += lpc["tokens"]
            merged["token_logprobs"] += lpc["token_logprobs"]
    assert merged["tokens"] == elp.tokens
    assert merged["token_logprobs"][0] is None
    assert merged["token_logprobs"][1:] == pytest.approx(elp.token_logprobs[1:])
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    # vLLM's prompt_logprobs: per prompt token, None first, then {token id: {logprob, rank, ...}}.
    pl = one(with_prompt)["choices"][0]["prompt_logprobs"]
    assert len(pl) == len(prompt_ids) and pl[0] is None
    for i in range(1, len(prompt_ids)):
        entry = pl[i][str(prompt_ids[i])]
        assert entry["logprob"] == pytest.approx(elp.token_logprobs[i])
        assert entry["rank"] >= 1 and isinstance(entry["decoded_token"], str)


def test_chat_prompt_logprobs_at_the_top(serve, core):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "prompt_logprobs": 2}

    async def run(s):
        return await collect(s, CHAT, body)

    resp = one(serve(run))
    ids = chat_prompt_ids(core.tokenizer, MESSAGES)
    assert len(resp["prompt_logprobs"]) == len(ids) and resp["prompt_logprobs"][0] is None
    assert all(len(e) in (2, 3) for e in resp["prompt_logprobs"][1:])
    assert resp["choices"][0]["logprobs"] is None


def test_best_of_returns_the_most_likely(serve):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "seed": 3, "ignore_eos": True}

    async def run(s):
        best = await collect(s, COMPLETIONS, {**body, "n": 2, "best_of": 5, "logprobs": 0})
        again = await collect(s, COMPLETIONS, {**body, "n": 2, "best_of": 5})
        singles = []
        for i in range(5):
            singles.append(await collect(s, COMPLETIONS, {**body, "seed": 3 + i, "logprobs": 0}))
        return best, again, singles

    best, again, singles = serve(run)
    resp = Completion.model_validate(one(best))
    assert [c.index for c in resp.choices] == [0, 1]
    scores = [sum(one(x)["choices"][0]["logprobs"]["token_logprobs"]) for x in singles]
    texts = [one(x)["choices"][0]["text"] for x in singles]
    ranked = sorted(range(5), key=lambda i: -scores[i])[:2]
    assert [c.text for c in resp.choices] == [texts[i] for i in ranked]
    assert [c["text"] for c in one(again)["choices"]] == [texts[i] for i in ranked]
    assert one(again)["choices"][0]["logprobs"] is None  # not asked for
    assert resp.usage.completion_tokens == 16
    assert math.isfinite(sum(resp.choices[0].logprobs.token_logprobs))


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_streamed_text_never_shows_the_stop_string(serve, route):
    base = {"model": MODEL, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    base.update({"messages": MESSAGES} if route == CHAT else {"prompt": PROMPT})

    def text_of(resp):
        c = resp["choices"][0]
        return c["message"]["content"] if route == CHAT else c["text"]

    async def run(s):
        free = text_of(one(await collect(s, route, base)))
        # A stop string of two characters from the middle of the free-running text.
        stop = free[len(free) // 2 : len(free) // 2 + 2]
        whole = await collect(s, route, {**base, "stop": [stop]})
        stream = await collect(s, route, {**base, "stop": [stop], "stream": True})
        return free, stop, whole, stream

    free, stop, whole, stream = serve(run)
    cut = free[: free.index(stop)]
    assert text_of(one(whole)) == cut
    assert one(whole)["choices"][0]["stop_reason"] == stop
    shown = ""
    for chunk in parse_sse(stream):
        for c in chunk["choices"]:
            shown += (c.get("delta") or {}).get("content") or "" if route == CHAT else c["text"]
            assert stop not in shown
    assert shown == cut


def test_streamed_echo_with_logprobs_for_every_choice(serve, core):
    body = {
        "model": MODEL,
        "prompt": [PROMPT, "Once upon a time"],
        "n": 2,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "echo": True,
    }

    async def run(s):
        return await collect(s, COMPLETIONS, body), await collect(
            s, COMPLETIONS, {**body, "stream": True}
        )

    whole, stream = serve(run)
    chunks = parse_sse(stream)
    for k, choice in enumerate(one(whole)["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == k]
        assert "".join(c["text"] for c in mine) == choice["text"]
        tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]]
        values = [v for c in mine if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
        assert tokens == choice["logprobs"]["tokens"]
        assert values[0] is None and values[1:] == pytest.approx(
            choice["logprobs"]["token_logprobs"][1:]
        )
        prompt_len = len(core.tokenizer.encode(body["prompt"][k // 2]))
        assert len(tokens) == prompt_len + 4

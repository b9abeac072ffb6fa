"""OpenAIServing on a real engine: chat and completions, streamed and not, shapes checked with the
official client's own pydantic types."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from serverless_llm.api.batching import BatchSizes
from serverless_llm.api.openai import http_status, is_error
from serverless_llm.engine.sampling.params import SamplingParams
from serverless_llm.engine.tokenizer import apply_chat_template
from tests.api.conftest import MAX_MODEL_LEN, MODEL, collect, parse_sse, pool_full, wait_idle

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [
    {"role": "system", "content": "You are a tiny model."},
    {"role": "user", "content": "Hello world! How are you today?"},
]
GREEDY = {"temperature": 0, "ignore_eos": True}


def chat_body(**kw):
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, **GREEDY, **kw}


def completion_body(**kw):
    return {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, **GREEDY, **kw}


def one(items):
    assert len(items) == 1, items
    assert not is_error(items[0]), items[0]
    return items[0]


def validate_completion_chunk(chunk):
    """Completion's type makes finish_reason required, while OpenAI streams null until the end
    (the client never validates); check the rest of the shape with a stand-in."""
    patched = dict(chunk)
    patched["choices"] = [
        {**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]
    ]
    Completion.model_validate(patched)


def chat_prompt_ids(tokenizer, messages=MESSAGES, **kw):
    text = apply_chat_template(tokenizer, messages, **kw)
    return tokenizer.encode(text, add_special_tokens=False)


# -- chat --------------------------------------------------------------------------------------


def test_chat_non_stream_shape_and_usage(serve, core):
    resp = one(serve(lambda s: collect(s, CHAT, chat_body())))
    parsed = ChatCompletion.model_validate(resp)
    assert parsed.id.startswith("chatcmpl-") and parsed.object == "chat.completion"
    assert parsed.model == MODEL and abs(parsed.created - time.time()) < 60
    (choice,) = parsed.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and isinstance(choice.message.content, str)
    prompt_tokens = len(chat_prompt_ids(core.tokenizer))
    assert parsed.usage.prompt_tokens == prompt_tokens
    assert parsed.usage.completion_tokens == 12
    assert parsed.usage.total_tokens == prompt_tokens + 12


def test_chat_stream_raw_sse_equals_non_stream(serve):
    async def run(s):
        full = await collect(s, CHAT, chat_body(max_tokens=40))
        streamed = await collect(s, CHAT, chat_body(max_tokens=40, stream=True))
        return full, streamed

    full, streamed = serve(run)
    text = one(full)["choices"][0]["message"]["content"]
    chunks = [ChatCompletionChunk.model_validate(c) for c in parse_sse(streamed)]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)


def test_chat_stream_list_mode(serve):
    async def run(s):
        full = await collect(s, CHAT, chat_body(max_tokens=30))
        streamed = await collect(s, CHAT, chat_body(max_tokens=30, stream=True))
        return full, streamed

    full, streamed = serve(run, raw_output=False)
    assert all(isinstance(item, list) and item for item in streamed)
    chunks = [ChatCompletionChunk.model_validate(c) for item in streamed for c in item]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == one(full)["choices"][0]["message"]["content"]


def test_chat_include_usage_final_chunk(serve, core):
    async def run(s):
        opts = {"include_usage": True}
        return await collect(s, CHAT, chat_body(stream=True, stream_options=opts))

    chunks = [ChatCompletionChunk.model_validate(c) for c in parse_sse(serve(run))]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == len(chat_prompt_ids(core.tokenizer))
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_continuous_usage_stats(serve):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    items = serve(lambda s: collect(s, CHAT, chat_body(stream=True, stream_options=opts)))
    chunks = parse_sse(items)
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    # The role chunk, then one chunk per yield (batches of 1, 3, then the last 8 tokens), each
    # with the usage so far.
    assert counts == [0, 1, 4, 12]


def test_chat_n_and_seed(serve):
    body = chat_body(temperature=1.0, seed=1234, max_tokens=16)

    async def run(s):
        pair = await collect(s, CHAT, {**body, "n": 2})
        again = await collect(s, CHAT, {**body, "n": 2})
        first = await collect(s, CHAT, body)
        second = await collect(s, CHAT, {**body, "seed": 1235})
        stream = await collect(s, CHAT, {**body, "n": 2, "stream": True})
        return pair, again, first, second, stream

    pair, again, first, second, stream = serve(run)
    resp = ChatCompletion.model_validate(one(pair))
    assert [c.index for c in resp.choices] == [0, 1]
    texts = [c.message.content for c in resp.choices]
    assert texts == [c["message"]["content"] for c in one(again)["choices"]]
    # Choice i samples with seed + i.
    assert texts[0] == one(first)["choices"][0]["message"]["content"]
    assert texts[1] == one(second)["choices"][0]["message"]["content"]
    assert resp.usage.completion_tokens == 32
    assert resp.usage.prompt_tokens == one(first)["usage"]["prompt_tokens"]
    chunks = [ChatCompletionChunk.model_validate(c) for c in parse_sse(stream)]
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == texts[i]
        assert mine[-1].finish_reason == "length"


def test_chat_max_completion_tokens_and_default_limit(serve, core):
    async def run(s):
        limited = await collect(s, CHAT, chat_body(max_tokens=None, max_completion_tokens=5))
        unlimited = await collect(s, CHAT, chat_body(max_tokens=None))
        return limited, unlimited

    limited, unlimited = serve(run)
    assert one(limited)["usage"]["completion_tokens"] == 5
    # No max_tokens: up to max_model_len minus the prompt.
    usage = one(unlimited)["usage"]
    assert usage["total_tokens"] == MAX_MODEL_LEN
    assert usage["prompt_tokens"] == len(chat_prompt_ids(core.tokenizer))
    assert one(unlimited)["choices"][0]["finish_reason"] == "length"


def test_stop_token_ids(serve):
    prompt = [5, 6, 7]

    async def run(s):
        ids = []
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        async for out in s.engine.generate(prompt, params):
            ids.extend(out.new_token_ids)
        body = completion_body(prompt=prompt, stop_token_ids=[ids[2]])
        return ids, await collect(s, COMPLETIONS, body)

    ids, items = serve(run)
    resp = one(items)
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == ids[2]
    assert resp["usage"]["completion_tokens"] == ids.index(ids[2]) + 1
    Completion.model_validate(resp)


def test_chat_template_options(serve, core):
    tok = core.tokenizer
    custom = "{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}|{{ flavour }}]{% endfor %}"

    async def run(s):
        results = {}
        results["no_gen_prompt"] = await collect(s, CHAT, chat_body(add_generation_prompt=False))
        results["custom"] = await collect(
            s,
            CHAT,
            chat_body(chat_template=custom, chat_template_kwargs={"flavour": "mint"}),
        )
        parts = [
            {"role": "system", "content": [{"type": "text", "text": "You are a tiny model."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Hello world!"},
                    {"type": "text", "text": "How are you today?"},
                ],
            },
        ]
        results["parts"] = await collect(s, CHAT, chat_body(messages=parts))
        results["documents"] = await collect(
            s, CHAT, chat_body(documents=[{"title": "t", "text": "x"}])
        )
        return results

    r = serve(run)
    assert one(r["no_gen_prompt"])["usage"]["prompt_tokens"] == len(
        chat_prompt_ids(tok, add_generation_prompt=False)
    )
    assert one(r["custom"])["usage"]["prompt_tokens"] == len(
        chat_prompt_ids(tok, chat_template=custom, chat_template_kwargs={"flavour": "mint"})
    )
    flat = [MESSAGES[0], {"role": "user", "content": "Hello world!\nHow are you today?"}]
    assert one(r["parts"])["usage"]["prompt_tokens"] == len(chat_prompt_ids(tok, flat))
    one(r["documents"])


def test_chat_continue_final_message_with_echo(serve, core):
    messages = [*MESSAGES, {"role": "assistant", "content": "I am"}]
    body = chat_body(
        messages=messages, add_generation_prompt=False, continue_final_message=True, echo=True
    )

    async def run(s):
        return await collect(s, CHAT, body), await collect(s, CHAT, {**body, "stream": True})

    full, streamed = serve(run)
    content = one(full)["choices"][0]["message"]["content"]
    assert content.startswith("I am")
    chunks = parse_sse(streamed)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "I am"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == content
    expected = chat_prompt_ids(
        core.tokenizer, messages, add_generation_prompt=False, continue_final_message=True
    )
    assert one(full)["usage"]["prompt_tokens"] == len(expected)


def test_response_role_and_model_alias(serve):
    async def run(s):
        return await collect(s, CHAT, chat_body(model="org/original-name"))

    resp = one(serve(run, response_role="bot", model_aliases=["org/original-name"]))
    assert resp["choices"][0]["message"]["role"] == "bot"
    assert resp["model"] == "org/original-name"


def test_model_without_chat_template(serve, core):
    tok = core.tokenizer
    saved = tok.chat_template
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tok.chat_template = None
    try:

        async def run(s):
            return (
                await collect(s, CHAT, chat_body()),
                await collect(s, COMPLETIONS, completion_body()),
                await collect(s, CHAT, chat_body(chat_template=template)),
            )

        chat, completion, per_request = serve(run)

        async def run_custom(s):
            return await collect(s, CHAT, chat_body())

        server_template = serve(run_custom, chat_template=template)
    finally:
        tok.chat_template = saved
    (err,) = chat
    assert is_error(err) and "no chat template" in err["error"]["message"]
    assert http_status(err) == 400
    Completion.model_validate(one(completion))
    ChatCompletion.model_validate(one(per_request))
    ChatCompletion.model_validate(one(server_template))


# -- completions -------------------------------------------------------------------------------


def test_completion_non_stream_and_stream(serve, core):
    async def run(s):
        full = await collect(s, COMPLETIONS, completion_body(max_tokens=40))
        raw = await collect(s, COMPLETIONS, completion_body(max_tokens=40, stream=True))
        return full, raw

    full, raw = serve(run)
    resp = Completion.model_validate(one(full))
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert resp.usage.prompt_tokens == len(core.tokenizer.encode("The quick brown fox"))
    assert resp.usage.completion_tokens == 40
    chunks = parse_sse(raw)
    for c in chunks:
        validate_completion_chunk(c)
    assert "".join(c["choices"][0]["text"] for c in chunks) == resp.choices[0].text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_completion_list_of_prompts_and_n(serve, core):
    prompts = ["The quick brown fox", "Once upon a time"]

    async def run(s):
        both = await collect(s, COMPLETIONS, completion_body(prompt=prompts, n=2))
        singles = [await collect(s, COMPLETIONS, completion_body(prompt=p)) for p in prompts]
        stream = await collect(s, COMPLETIONS, completion_body(prompt=prompts, n=2, stream=True))
        return both, singles, stream

    both, singles, stream = serve(run)
    resp = Completion.model_validate(one(both))
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    single_texts = [one(x)["choices"][0]["text"] for x in singles]
    # Greedy: both choices of a prompt equal that prompt alone; index = prompt * n + i.
    assert [c.text for c in resp.choices] == [single_texts[0]] * 2 + [single_texts[1]] * 2
    tok = core.tokenizer
    assert resp.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert resp.usage.completion_tokens == 4 * 12
    chunks = parse_sse(stream)
    for k in range(4):
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == k)
        assert text == resp.choices[k].text


def test_completion_token_id_prompts(serve, core):
    ids_a = core.tokenizer.encode("The quick brown fox")
    ids_b = [5, 6, 7, 8]

    async def run(s):
        return (
            await collect(s, COMPLETIONS, completion_body(prompt=ids_a)),
            await collect(s, COMPLETIONS, completion_body(prompt="The quick brown fox")),
            await collect(s, COMPLETIONS, completion_body(prompt=[ids_a, ids_b])),
        )

    single, text, nested = serve(run)
    assert one(single)["choices"][0]["text"] == one(text)["choices"][0]["text"]
    resp = Completion.model_validate(one(nested))
    assert resp.choices[0].text == one(single)["choices"][0]["text"]
    assert resp.usage.prompt_tokens == len(ids_a) + len(ids_b)


def test_completion_echo(serve, core):
    ids = [5, 6, 7, 8]

    async def run(s):
        return (
            await collect(s, COMPLETIONS, completion_body(echo=True)),
            await collect(s, COMPLETIONS, completion_body()),
            await collect(s, COMPLETIONS, completion_body(echo=True, stream=True)),
            await collect(s, COMPLETIONS, completion_body(prompt=ids, echo=True)),
        )

    echoed, plain, stream, token_echo = serve(run)
    plain_text = one(plain)["choices"][0]["text"]
    assert one(echoed)["choices"][0]["text"] == "The quick brown fox" + plain_text
    assert one(echoed)["usage"] == one(plain)["usage"]
    chunks = parse_sse(stream)
    assert chunks[0]["choices"][0]["text"] == "The quick brown fox"
    assert "".join(c["choices"][0]["text"] for c in chunks) == "The quick brown fox" + plain_text
    prompt_text = core.tokenizer.decode(ids, skip_special_tokens=False)
    assert one(token_echo)["choices"][0]["text"].startswith(prompt_text)


def test_completion_truncate_prompt_tokens(serve, core):
    ids = core.tokenizer.encode("The quick brown fox jumps over the lazy dog.")

    async def run(s):
        return (
            await collect(s, COMPLETIONS, completion_body(prompt=ids, truncate_prompt_tokens=3)),
            await collect(s, COMPLETIONS, completion_body(prompt=ids[-3:])),
        )

    truncated, tail = serve(run)
    assert one(truncated)["usage"]["prompt_tokens"] == 3
    assert one(truncated)["choices"][0]["text"] == one(tail)["choices"][0]["text"]


# -- stream grouping ---------------------------------------------------------------------------


def _events(item):
    """The chunks of one raw yield (SSE text) or one list-mode yield."""
    if isinstance(item, list):
        return item
    data = [e.removeprefix("data: ") for e in item.split("\n\n") if e]
    return [json.loads(d) for d in data if d != "[DONE]"]


def _tokens_per_yield(items):
    """Tokens in each yield, read from continuous usage stats (every token gets a chunk)."""
    seen, sizes = 0, []
    for item in items:
        counts = [c["usage"]["completion_tokens"] for c in _events(item) if c["choices"]]
        top = max(counts, default=seen)
        sizes.append(top - seen)
        seen = top
    return sizes


@pytest.mark.parametrize("raw_output", [True, False])
@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        (BatchSizes(), [1, 3, 9, 27, 50, 50, 50, 10]),
        (
            BatchSizes(max_batch_size=10, min_batch_size=2, growth_factor=2),
            [2, 4, 8] + [10] * 18 + [6],
        ),
        (BatchSizes(max_batch_size=7, min_batch_size=7, growth_factor=3), [7] * 28 + [4]),
    ],
)
def test_stream_batches_grow_geometrically(serve, batch, expected, raw_output):
    body = completion_body(
        prompt=[5, 6, 7],
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )

    async def run(s):
        return await collect(s, COMPLETIONS, body, batch)

    items = serve(run, raw_output=raw_output)
    assert _tokens_per_yield(items) == expected
    last = _events(items[-1])[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 200


def test_stream_chat_first_yield_has_role_and_one_token(serve):
    body = chat_body(max_tokens=20, stream=True, stream_options={"include_usage": True})
    items = serve(lambda s: collect(s, CHAT, body, BatchSizes()), raw_output=False)
    first = items[0]
    assert first[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len(first) <= 2  # the role chunk and at most one token chunk
    assert items[-1][-1]["usage"]["completion_tokens"] == 20


# -- models ------------------------------------------------------------------------------------


def test_models_list_and_retrieve(serve):
    async def run(s):
        return (
            await collect(s, "/v1/models", None),
            await collect(s, "models", {}),
            await collect(s, "/v1/models/" + MODEL, None),
            await collect(s, "/v1/models/other", None),
        )

    listed, bare, card, missing = serve(run, model_aliases=["alias"])
    data = one(listed)
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == [MODEL, "alias"]
    for m in data["data"]:
        Model.model_validate(m)
        assert m["max_model_len"] == MAX_MODEL_LEN
    assert one(bare) == data
    assert Model.model_validate(one(card)).id == MODEL
    (err,) = missing
    assert err["error"]["code"] == "model_not_found"


def test_route_prefixes(serve):
    async def run(s):
        out = []
        for route in ("chat/completions", "/chat/completions", "/openai/v1/chat/completions/"):
            out.append(await collect(s, route, chat_body(max_tokens=2)))
        return out

    for items in serve(run):
        ChatCompletion.model_validate(one(items))


# -- cancellation ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3])
def test_closing_the_stream_aborts_engine_requests(serve, core, n):
    body = completion_body(max_tokens=200, stream=True, n=n)

    async def run(s):
        gen = s.handle(COMPLETIONS, body, BatchSizes())
        first = await gen.__anext__()
        assert isinstance(first, str)
        assert core.requests  # still generating
        await gen.aclose()
        await wait_idle(core)
        return pool_full(core)

    assert serve(run)


@pytest.mark.parametrize("n", [1, 2])
def test_cancelling_the_task_aborts_and_propagates(serve, core, n):
    async def run(s):
        started = asyncio.Event()

        async def consume():
            async for _ in s.handle(COMPLETIONS, completion_body(max_tokens=200, stream=True, n=n)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(core)
        return pool_full(core)

    assert serve(run)


def test_concurrent_requests(serve):
    async def run(s):
        bodies = [chat_body(max_tokens=8, stream=bool(i % 2)) for i in range(12)]
        return await asyncio.gather(*(collect(s, CHAT, b) for b in bodies))

    results = serve(run)
    texts = set()
    for i, items in enumerate(results):
        if i % 2:
            chunks = parse_sse(items)
            texts.add("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks))
        else:
            texts.add(one(items)["choices"][0]["message"]["content"])
    assert len(texts) == 1  # greedy: every request, streamed or not, says the same


def test_add_special_tokens_defaults(serve, core, monkeypatch):
    """Completions add the tokenizer's special tokens (BOS) by default, chat does not (the
    template writes them); both can be switched per request."""
    from tokenizers.processors import TemplateProcessing

    tok = core.tokenizer
    bos = tok.bos_token_id
    monkeypatch.setattr(
        tok._tokenizer,
        "post_processor",
        TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)]),
    )
    plain = len(tok.encode("The quick brown fox", add_special_tokens=False))
    chat_len = len(chat_prompt_ids(tok))

    async def run(s):
        return [
            one(await collect(s, COMPLETIONS, completion_body()))["usage"]["prompt_tokens"],
            one(await collect(s, COMPLETIONS, completion_body(add_special_tokens=False)))["usage"][
                "prompt_tokens"
            ],
            one(await collect(s, CHAT, chat_body()))["usage"]["prompt_tokens"],
            one(await collect(s, CHAT, chat_body(add_special_tokens=True)))["usage"][
                "prompt_tokens"
            ],
        ]

    try:
        counts = serve(run)
    finally:
        monkeypatch.undo()
    assert counts == [plain + 1, plain, chat_len, chat_len + 1]


# -- coalescing a yield's chunks ----------------------------------------------------------------


def _chat_chunk(index, delta, logprobs=None, finish=None, usage=None):
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = None
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    chunk["choices"] = [choice]
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def test_coalesce_chunks_merges_each_choices_text_in_order():
    import copy

    from serverless_llm.api.openai.serving import coalesce_chunks

    def lp(tok):
        return {"content": [{"token": tok, "logprob": -1.0, "bytes": [1], "top_logprobs": []}]}

    chunks = [
        _chat_chunk(0, {"role": "assistant", "content": ""}),
        _chat_chunk(1, {"role": "assistant", "content": ""}),
        _chat_chunk(0, {"content": "a"}, lp("a"), usage={"completion_tokens": 1}),
        _chat_chunk(1, {"content": "x"}, lp("x"), usage={"completion_tokens": 1}),
        _chat_chunk(0, {"content": "b"}, lp("b"), usage={"completion_tokens": 2}),
        _chat_chunk(1, {"tool_calls": [{"index": 0}]}),  # a tool-call delta never merges
        _chat_chunk(1, {"content": "y"}, lp("y")),
        _chat_chunk(0, {}, lp("c"), finish="stop", usage={"completion_tokens": 3}),
        _chat_chunk(0, {"content": "after"}, lp("d")),  # nothing merges past a finish reason
        {"id": "c", "choices": [], "usage": {"completion_tokens": 6}},
    ]
    before = copy.deepcopy(chunks)
    out = coalesce_chunks(chunks)
    assert chunks == before  # the input is not changed
    texts = [
        (c["choices"][0]["index"], c["choices"][0]["delta"].get("content"))
        for c in out
        if c["choices"]
    ]
    assert texts == [(0, ""), (1, ""), (0, "ab"), (1, "x"), (1, None), (1, "y"), (0, "after")]
    merged = out[2]["choices"][0]
    assert [e["token"] for e in merged["logprobs"]["content"]] == ["a", "b", "c"]
    assert merged["finish_reason"] == "stop" and "stop_reason" in merged
    assert out[2]["usage"] == {"completion_tokens": 3}
    assert out[-1] == before[-1]


def test_coalesce_chunks_completions_logprobs():
    from serverless_llm.api.openai.serving import coalesce_chunks

    def chunk(text, offset, finish=None):
        logprobs = {
            "tokens": [text],
            "token_logprobs": [-0.5],
            "top_logprobs": [{text: -0.5}],
            "text_offset": [offset],
        }
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {"id": "c", "object": "text_completion", "choices": [choice]}

    (out,) = coalesce_chunks([chunk("He", 0), chunk("llo", 2), chunk("!", 5, "length")])
    choice = out["choices"][0]
    assert choice["text"] == "Hello!" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["He", "llo", "!"]
    assert choice["logprobs"]["text_offset"] == [0, 2, 5]


def test_streamed_chunks_hold_a_batch_each(serve):
    """Streamed, each yield holds at most one text chunk per choice, and the chunks add up to
    the non-streamed answer."""
    body = chat_body(n=2, max_tokens=30, temperature=0.0)

    async def run(s):
        return (
            await collect(s, CHAT, body),
            await collect(s, CHAT, {**body, "stream": True}, BatchSizes()),
        )

    full, items = serve(run, raw_output=False)
    (response,) = full
    texts = ["", ""]
    for item in items:
        content = [
            c["choices"][0]["index"]
            for c in item
            if c["choices"] and "role" not in c["choices"][0]["delta"]
        ]
        assert len(content) == len(set(content)), item
        for c in item:
            if c["choices"]:
                ch = c["choices"][0]
                texts[ch["index"]] += ch["delta"].get("content") or ""
    assert texts == [c["message"]["content"] for c in response["choices"]]
    # A batch counts the tokens of both choices: yields after 2, 4, 10, 28 and the last 16.
    assert len(items) == 5

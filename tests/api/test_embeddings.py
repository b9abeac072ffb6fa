"""/v1/embeddings (issue 41's first slice): a tiny random Llama served with TASK=embed, read
through the official OpenAI client; vectors checked against transformers' final hidden states
(AutoModel: after the final norm), pooled and normalised the same way."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx2
import numpy as np
import openai
import pytest
import torch
import transformers

from serverless_llm.api.openai import OpenAIServing, http_status, is_error
from serverless_llm.api.openai.embeddings import MAX_EMBEDDING_INPUTS
from serverless_llm.engine.async_engine import AsyncEngine
from serverless_llm.engine.config import EngineConfig
from serverless_llm.llm import LLM
from tests.api.conftest import MODEL, collect, pool_full, wait_idle

MAX_MODEL_LEN = 64
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello",
    "Paged attention stores keys and values in fixed-size blocks. " * 2,
    "Café, naïve, résumé",
]


@pytest.fixture(scope="module")
def embed_core(tiny_llama):
    engine = AsyncEngine.from_config(
        EngineConfig(
            model=tiny_llama,
            task="embed",
            dtype="float32",
            num_kv_blocks=32,
            max_model_len=MAX_MODEL_LEN,
            show_progress=False,
        )
    )
    return engine.core


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    return transformers.AutoModel.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def reference(hf_model, ids: list[int], mean: bool = False, dims: int | None = None):
    with torch.no_grad():
        hidden = hf_model(torch.tensor([ids])).last_hidden_state[0]
    vec = hidden.mean(0) if mean else hidden[-1]
    if dims is not None:
        vec = vec[:dims]
    return torch.nn.functional.normalize(vec, dim=-1).numpy()


class _Transport(httpx2.AsyncBaseTransport):
    """Hands the client's requests to OpenAIServing.handle, as the devserver does."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def handle_async_request(self, request):
        body = json.loads(request.content or b"{}")
        (item,) = await collect(self.serving, request.url.path, body)
        status = http_status(item) if is_error(item) else 200
        return httpx2.Response(status, json=item, request=request)


def run_client(core, fn):
    """`await fn(client, serving)` with the official AsyncOpenAI client on a fresh engine;
    afterwards every KV block is free again."""

    async def main():
        engine = AsyncEngine(core)
        serving = OpenAIServing(engine, served_model_name=MODEL)
        client = openai.AsyncOpenAI(
            api_key="test",
            base_url="http://test/v1",
            http_client=httpx2.AsyncClient(transport=_Transport(serving)),
            max_retries=0,
        )
        try:
            return await fn(client, serving)
        finally:
            await wait_idle(core)
            await engine.shutdown()

    result = asyncio.run(main())
    assert pool_full(core), "KV blocks leaked"
    return result


def test_batch_of_ragged_inputs_equals_transformers(embed_core, hf_model):
    tok = embed_core.tokenizer

    async def fn(client, _):
        return await client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")

    resp = run_client(embed_core, fn)
    assert [d.index for d in resp.data] == list(range(len(TEXTS)))
    lengths = [len(tok.encode(t)) for t in TEXTS]
    assert len(set(lengths)) == len(TEXTS)  # ragged
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(lengths)
    assert resp.model == MODEL
    for text, d in zip(TEXTS, resp.data):
        ref = reference(hf_model, list(tok.encode(text)))
        got = np.asarray(d.embedding, dtype=np.float32)
        assert got.shape == (embed_core.hf_config.hidden_size,)
        np.testing.assert_allclose(got, ref, atol=1e-5)
        assert abs(np.linalg.norm(got) - 1.0) < 1e-5


def test_base64_equals_float_and_client_default(embed_core):
    async def fn(client, _):
        f = await client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float")
        b = await client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="base64")
        default = await client.embeddings.create(model=MODEL, input=TEXTS[:2])
        return f, b, default

    f, b, default = run_client(embed_core, fn)
    for fd, bd, dd in zip(f.data, b.data, default.data):
        assert isinstance(bd.embedding, str)
        decoded = np.frombuffer(base64.b64decode(bd.embedding), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(fd.embedding, dtype=np.float32))
        # the client asks for base64 itself when no format is given, and decodes it
        np.testing.assert_array_equal(np.asarray(dd.embedding, dtype=np.float32), decoded)


def test_dimensions_truncate_then_renormalise(embed_core, hf_model):
    tok = embed_core.tokenizer

    async def fn(client, _):
        return await client.embeddings.create(
            model=MODEL, input=TEXTS[0], dimensions=8, encoding_format="float"
        )

    resp = run_client(embed_core, fn)
    got = np.asarray(resp.data[0].embedding, dtype=np.float32)
    assert got.shape == (8,)
    np.testing.assert_allclose(
        got, reference(hf_model, list(tok.encode(TEXTS[0])), dims=8), atol=1e-5
    )


def test_token_id_inputs(embed_core, hf_model):
    ids_a, ids_b = [5, 17, 42, 99, 7], [300, 12]

    async def fn(client, _):
        one = await client.embeddings.create(model=MODEL, input=ids_a, encoding_format="float")
        many = await client.embeddings.create(
            model=MODEL, input=[ids_a, ids_b], encoding_format="float"
        )
        return one, many

    one, many = run_client(embed_core, fn)
    assert len(one.data) == 1 and one.usage.prompt_tokens == 5
    assert len(many.data) == 2 and many.usage.prompt_tokens == 7
    np.testing.assert_allclose(one.data[0].embedding, reference(hf_model, ids_a), atol=1e-5)
    np.testing.assert_allclose(many.data[0].embedding, reference(hf_model, ids_a), atol=1e-5)
    np.testing.assert_allclose(many.data[1].embedding, reference(hf_model, ids_b), atol=1e-5)


def test_truncate_prompt_tokens_keeps_the_last_tokens(embed_core, hf_model):
    ids = list(range(10, 10 + MAX_MODEL_LEN + 20))

    async def fn(client, _):
        return await client.embeddings.create(
            model=MODEL,
            input=ids,
            encoding_format="float",
            extra_body={"truncate_prompt_tokens": 16},
        )

    resp = run_client(embed_core, fn)
    assert resp.usage.prompt_tokens == 16
    np.testing.assert_allclose(resp.data[0].embedding, reference(hf_model, ids[-16:]), atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, param, words",
    [
        ({"input": []}, "input", "empty"),
        ({"input": ""}, "input", "empty"),
        ({"input": ["ok", ""]}, "input", "input[1]"),
        ({"input": ["a"] * 10_000}, "input", str(MAX_EMBEDDING_INPUTS)),
        ({"input": list(range(3, 3 + MAX_MODEL_LEN))}, "input", str(MAX_MODEL_LEN - 1)),
        ({"input": "hi", "dimensions": 100_000}, "dimensions", "larger than"),
        ({"input": "hi", "dimensions": 0}, "dimensions", None),
        ({"input": [10**9]}, "input", None),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", None),
    ],
)
def test_bad_inputs_are_400s_and_the_engine_serves_on(embed_core, kwargs, param, words):
    async def fn(client, _):
        with pytest.raises(openai.BadRequestError) as info:
            await client.embeddings.create(model=MODEL, **kwargs)
        after = await client.embeddings.create(model=MODEL, input="still serving")
        return info.value, after

    exc, after = run_client(embed_core, fn)
    assert exc.param == param, exc.message
    if words is not None:
        assert words in exc.message
    assert len(after.data) == 1


def test_unknown_model_is_404(embed_core):
    async def fn(client, _):
        with pytest.raises(openai.NotFoundError):
            await client.embeddings.create(model="nope", input="x")

    run_client(embed_core, fn)


def test_generation_routes_refuse_on_an_embedding_model(embed_core):
    async def fn(client, serving):
        with pytest.raises(openai.BadRequestError) as chat:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}]
            )
        with pytest.raises(openai.BadRequestError) as comp:
            await client.completions.create(model=MODEL, prompt="hi")
        return chat.value, comp.value

    chat, comp = run_client(embed_core, fn)
    for exc in (chat, comp):
        assert "TASK=embed" in exc.message and "/v1/embeddings" in exc.message


def test_mixed_embeddings_and_chat_on_one_generating_model(core, hf_model):
    """One decoder served with TASK=generate answers /v1/embeddings and /v1/chat/completions
    at once (the official client, all requests in flight together): each chat completion
    equals the same request alone, each embedding equals the same request alone and
    transformers' last hidden state (normalised)."""
    tok = core.tokenizer
    chats = [[{"role": "user", "content": t}] for t in TEXTS[:3]]

    async def chat(client, messages):
        r = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0.0, seed=0
        )
        return r.choices[0].message.content, r.usage.completion_tokens

    async def embed(client, inputs):
        r = await client.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
        return [d.embedding for d in r.data]

    async def fn(client, _):
        alone_chats = [await chat(client, m) for m in chats]
        alone_embs = [await embed(client, [t]) for t in TEXTS]
        mixed = await asyncio.gather(
            *(chat(client, m) for m in chats),
            embed(client, TEXTS[:2]),
            embed(client, TEXTS[2:]),
            embed(client, TEXTS[1]),
        )
        return alone_chats, alone_embs, mixed

    alone_chats, alone_embs, mixed = run_client(core, fn)
    mixed_chats, first, second, single = mixed[:3], mixed[3], mixed[4], mixed[5]
    assert mixed_chats == alone_chats
    assert all(n == 10 for _, n in alone_chats)
    for got, want in zip(first + second + single, alone_embs + [alone_embs[1]]):
        np.testing.assert_allclose(got, want[0], atol=1e-5)
    for text, want in zip(TEXTS, alone_embs):
        np.testing.assert_allclose(want[0], reference(hf_model, tok.encode(text)), atol=1e-5)


def test_embeddings_refused_on_a_classifier(tmp_path):
    """TASK=classify (and score) do not embed: /v1/embeddings is a 400 naming TASK=embed."""
    from tests.tiny_scorers import build_classifier

    path = build_classifier(str(tmp_path / "cls"), "qwen3", 2)
    engine = AsyncEngine.from_config(
        EngineConfig(
            model=path, dtype="float32", num_kv_blocks=16, max_model_len=64, show_progress=False
        )
    )

    async def fn(client, _):
        with pytest.raises(openai.BadRequestError) as info:
            await client.embeddings.create(model=MODEL, input="hi")
        return info.value

    exc = run_client(engine.core, fn)
    assert "TASK=embed" in exc.message and "TASK=classify" in exc.message


def test_llm_embed_mean_pooling_and_frees_blocks(tiny_llama, hf_model):
    llm = LLM(
        tiny_llama,
        task="embed",
        pooling_type="mean",
        dtype="float32",
        num_kv_blocks=32,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=16,
    )
    tok = llm.get_tokenizer()
    outs = llm.embed(TEXTS)  # the long input is prefilled in chunks of 16 tokens
    for text, out in zip(TEXTS, outs):
        ids = list(tok.encode(text))
        assert out.prompt_token_ids == ids
        np.testing.assert_allclose(
            out.outputs.embedding, reference(hf_model, ids, mean=True), atol=1e-5
        )
    pool = llm.engine.block_pool
    assert pool.num_free == pool.num_blocks and not llm.engine.requests
    with pytest.raises(ValueError, match="TASK=embed"):
        llm.generate("hi")

"""vLLM's pooling routes (issue 41): /rerank (Cohere's and Jina's shapes, through httpx),
/score, /classify and /pooling on tiny random decoder classifiers and a Qwen3-Reranker-shaped
causal LM, checked against transformers; every bad input a 400 in OpenAI's error shape with
the engine serving on and no KV block left; embeddings and generation mixed on one model."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx2
import numpy as np
import pytest
import torch
import transformers

from serverless_llm.api.openai import OpenAIServing, http_status, is_error
from serverless_llm.api.openai.pooling_routes import MAX_POOLING_INPUTS
from serverless_llm.engine.async_engine import AsyncEngine
from serverless_llm.engine.config import EngineConfig
from serverless_llm.engine.sampling.params import SamplingParams
from tests.api.conftest import MODEL, collect, pool_full, wait_idle
from tests.engine.test_scoring import _recipe_score
from tests.tiny_scorers import build_classifier, build_reranker

MAX_MODEL_LEN = 512
QUERY = "What is paged attention?"
DOCS = [
    "Paged attention stores keys and values in fixed-size blocks.",
    "The quick brown fox jumps over the lazy dog.",
    "Hello",
    "Café, naïve, résumé",
]


def _core(path: str, task: str = "auto", max_model_len: int = MAX_MODEL_LEN):
    return AsyncEngine.from_config(
        EngineConfig(
            model=path,
            task=task,
            dtype="float32",
            num_kv_blocks=96,
            max_model_len=max_model_len,
            show_progress=False,
        )
    ).core


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooling-routes")
    return {
        "classifier": build_classifier(str(root / "cls"), "qwen3", 3),
        "cross": build_classifier(str(root / "cross"), "llama", 1),
        "reranker": build_reranker(str(root / "rr")),
    }


@pytest.fixture(scope="module")
def reranker_core(paths):
    return _core(paths["reranker"], "score")


@pytest.fixture(scope="module")
def classifier_core(paths):
    return _core(paths["classifier"])


class _Transport(httpx2.AsyncBaseTransport):
    """Hands each HTTP request to OpenAIServing.handle, as the devserver relays it."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def handle_async_request(self, request):
        body = json.loads(request.content or b"{}")
        (item,) = await collect(self.serving, request.url.path, body)
        status = http_status(item) if is_error(item) else 200
        return httpx2.Response(status, json=item, request=request)


def run_http(core, fn):
    """`await fn(client)` with an httpx client on a fresh engine over `core`; afterwards every
    KV block is free again."""

    async def main():
        engine = AsyncEngine(core)
        serving = OpenAIServing(engine, served_model_name=MODEL)
        client = httpx2.AsyncClient(transport=_Transport(serving), base_url="http://test")
        try:
            return await fn(client)
        finally:
            await wait_idle(core)
            await engine.shutdown()

    result = asyncio.run(main())
    assert pool_full(core), "KV blocks leaked"
    return result


@pytest.fixture(scope="module")
def recipe(paths):
    """P(yes) of each of DOCS for QUERY, by the model card's recipe on transformers."""
    path = paths["reranker"]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    from serverless_llm.engine.pooling import RERANKER_INSTRUCTION

    return [_recipe_score(model, tok, QUERY, d, RERANKER_INSTRUCTION)[1] for d in DOCS]


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_jina_shape(reranker_core, recipe, route):
    """Jina's request: documents as strings, top_n, return_documents; results best first."""

    async def fn(client):
        r = await client.post(
            route,
            json={"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 3},
        )
        return r.status_code, r.json()

    status, body = run_http(reranker_core, fn)
    assert status == 200, body
    want = sorted(range(len(DOCS)), key=lambda i: -recipe[i])[:3]
    assert [r["index"] for r in body["results"]] == want
    for r in body["results"]:
        assert abs(r["relevance_score"] - recipe[r["index"]]) < 1e-5
        assert r["document"] == {"text": DOCS[r["index"]]}
    assert body["model"] == MODEL and body["id"].startswith("rerank-")
    assert body["usage"]["total_tokens"] > 0


def test_rerank_cohere_shape(reranker_core, recipe):
    """Cohere's request: documents as {"text": ...}, return_documents false: no document."""

    async def fn(client):
        r = await client.post(
            "/v2/rerank",
            json={
                "model": MODEL,
                "query": QUERY,
                "documents": [{"text": d} for d in DOCS],
                "return_documents": False,
            },
        )
        return r.status_code, r.json()

    status, body = run_http(reranker_core, fn)
    assert status == 200, body
    assert len(body["results"]) == len(DOCS)  # no top_n: every document
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)
    for r in body["results"]:
        assert "document" not in r
        assert abs(r["relevance_score"] - recipe[r["index"]]) < 1e-5


def test_score_one_to_many_and_one_to_one(reranker_core, recipe):
    async def fn(client):
        many = await client.post("/score", json={"text_1": QUERY, "text_2": DOCS})
        pairs = await client.post("/v1/score", json={"text_1": [QUERY, QUERY], "text_2": DOCS[:2]})
        return many.json(), pairs.json()

    many, pairs = run_http(reranker_core, fn)
    assert [d["index"] for d in many["data"]] == list(range(len(DOCS)))
    for d, want in zip(many["data"], recipe):
        assert d["object"] == "score" and abs(d["score"] - want) < 1e-5
    np.testing.assert_allclose([d["score"] for d in pairs["data"]], recipe[:2], atol=1e-5)
    assert many["object"] == "list" and many["usage"]["prompt_tokens"] > 0


def test_classify_equals_transformers(classifier_core, paths):
    async def fn(client):
        r = await client.post("/classify", json={"model": MODEL, "input": DOCS})
        one = await client.post("/classify", json={"input": DOCS[0]})
        return r.json(), one.json()

    body, one = run_http(classifier_core, fn)
    tok = transformers.AutoTokenizer.from_pretrained(paths["classifier"])
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        paths["classifier"], dtype=torch.float32
    ).eval()
    for text, item in zip(DOCS, body["data"]):
        with torch.no_grad():
            logits = hf(torch.tensor([tok.encode(text)])).logits[0]
        probs = torch.softmax(logits, -1)
        np.testing.assert_allclose(item["probs"], probs.numpy(), atol=1e-5)
        assert item["num_classes"] == 3
        assert item["label"] == f"class_{int(probs.argmax())}"
    assert one["data"][0]["probs"] == body["data"][0]["probs"]


def test_pooling_route_on_a_classifier(classifier_core):
    async def fn(client):
        cls = await client.post("/classify", json={"input": DOCS[:2]})
        pool = await client.post("/pooling", json={"input": DOCS[:2]})
        b64 = await client.post("/pooling", json={"input": DOCS[:2], "encoding_format": "base64"})
        return cls.json(), pool.json(), b64.json()

    cls, pool, b64 = run_http(classifier_core, fn)
    for c, p, b in zip(cls["data"], pool["data"], b64["data"]):
        assert p["object"] == "pooling"
        np.testing.assert_allclose(p["data"], c["probs"], atol=1e-7)
        decoded = np.frombuffer(base64.b64decode(b["data"]), dtype="<f4")
        np.testing.assert_allclose(decoded, c["probs"], atol=1e-6)


def test_one_label_cross_encoder_reranks(paths):
    """A one-label ...ForSequenceClassification (TASK auto: classify) serves /rerank: sigmoid
    of its logit over the tokenizer's pair encoding."""
    core = _core(paths["cross"])
    assert core.task == "classify"

    async def fn(client):
        r = await client.post("/rerank", json={"query": QUERY, "documents": DOCS})
        return r.json()

    body = run_http(core, fn)
    tok = transformers.AutoTokenizer.from_pretrained(paths["cross"])
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        paths["cross"], dtype=torch.float32
    ).eval()
    for r in body["results"]:
        ids = tok(QUERY, DOCS[r["index"]])["input_ids"]
        with torch.no_grad():
            want = torch.sigmoid(hf(torch.tensor([ids])).logits[0, 0]).item()
        assert abs(r["relevance_score"] - want) < 1e-5


def test_score_on_an_embedding_model_is_cosine(tiny_llama):
    core = _core(tiny_llama, "embed", 64)

    async def fn(client):
        s = await client.post("/score", json={"text_1": "Hello", "text_2": ["Hello", DOCS[1]]})
        e = await client.post("/v1/embeddings", json={"input": ["Hello", DOCS[1]]})
        return s.json(), e.json()

    score, emb = run_http(core, fn)
    a, b = (np.asarray(d["embedding"]) for d in emb["data"])
    assert abs(score["data"][0]["score"] - 1.0) < 1e-5
    assert abs(score["data"][1]["score"] - float(a @ b)) < 1e-5  # normalised: dot = cosine


LONG = "Paged attention stores keys and values in fixed-size blocks. " * 60


@pytest.mark.parametrize(
    "route, body, param, words",
    [
        ("/classify", {"input": []}, "input", "empty"),
        ("/classify", {"input": ""}, "input", "empty"),
        ("/classify", {"input": ["ok", ""]}, "input", "input[1]"),
        ("/classify", {"input": ["a"] * 10_000}, "input", str(MAX_POOLING_INPUTS)),
        ("/classify", {"input": LONG}, "input", str(MAX_MODEL_LEN - 1)),
        ("/classify", {"input": "hi", "truncate_prompt_tokens": 10**6}, None, "truncate"),
        ("/pooling", {"input": "hi", "dimensions": 10**6}, "dimensions", "embeddings only"),
        ("/rerank", {"query": "q", "documents": []}, "documents", "at least one document"),
        ("/rerank", {"query": "", "documents": ["d"]}, "query", "empty"),
        ("/rerank", {"query": "q", "documents": ["d", ""]}, "documents", "documents[1]"),
        ("/rerank", {"query": "q", "documents": ["d"] * 10_000}, "documents", "2048"),
        ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n", None),
        ("/rerank", {"query": "q", "documents": [{"txt": "d"}]}, None, None),
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", "2 texts"),
        ("/score", {"text_1": [], "text_2": ["c"]}, "text_1", "empty"),
        ("/score", {"text_1": "a"}, "text_2", None),
        ("/score", {"text_1": "q", "text_2": LONG}, "text_2", str(MAX_MODEL_LEN - 1)),
    ],
)
def test_bad_inputs_are_400s_and_the_engine_serves_on(
    reranker_core, classifier_core, route, body, param, words
):
    core = classifier_core if route in ("/classify", "/pooling") else reranker_core

    async def fn(client):
        bad = await client.post(route, json=body)
        if route in ("/classify", "/pooling"):
            ok = await client.post("/classify", json={"input": "still serving"})
        else:
            ok = await client.post("/rerank", json={"query": "q", "documents": ["still"]})
        return bad, ok

    bad, ok = run_http(core, fn)
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    if param is not None:
        assert err["param"] == param, err
    if words is not None:
        assert words in err["message"], err
    assert ok.status_code == 200


def test_routes_refused_by_task(core, reranker_core, tiny_llama):
    """A generating model: the pooling routes say what to set; a scorer without a classifier
    of labels: /classify gives P(yes) (one label); an embedding model has no classifier head."""

    async def gen(client):
        return [await client.post(r, json=b) for r, b in ROUTE_BODIES]

    for resp in run_http(core, gen):
        assert resp.status_code == 400
        assert "TASK=generate" in resp.json()["error"]["message"]
    embed_core = _core(tiny_llama, "embed", 64)

    async def emb(client):
        c = await client.post("/classify", json={"input": "hi"})
        chat = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        return c, chat

    c, chat = run_http(embed_core, emb)
    assert c.status_code == 400 and "no classifier head" in c.json()["error"]["message"]
    assert chat.status_code == 400 and "TASK=embed" in chat.json()["error"]["message"]

    async def score_chat(client):
        return await client.post("/v1/completions", json={"prompt": "hi"})

    r = run_http(reranker_core, score_chat)
    assert r.status_code == 400 and "TASK=score" in r.json()["error"]["message"]


ROUTE_BODIES = [
    ("/rerank", {"query": "q", "documents": ["d"]}),
    ("/score", {"text_1": "a", "text_2": "b"}),
    ("/classify", {"input": "a"}),
    ("/pooling", {"input": "a"}),
]


def test_mixed_embedding_and_generation_on_one_model(core, tiny_llama):
    """One generating decoder, embeddings and greedy generations concurrently through the
    async engine: each embedding equals transformers' last hidden state (normalised), each
    generation equals the same generation run alone."""
    hf = transformers.AutoModel.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = core.tokenizer
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def alone(engine, prompt):
        text = ""
        async for out in engine.generate(prompt, params):
            text += out.new_text
        return text

    async def main():
        engine = AsyncEngine(core)
        try:
            solo = [await alone(engine, p) for p in DOCS[:3]]
            gens = [asyncio.ensure_future(alone(engine, p)) for p in DOCS[:3]]
            embs = [asyncio.ensure_future(engine.embed(d)) for d in DOCS]
            return solo, await asyncio.gather(*gens), await asyncio.gather(*embs)
        finally:
            await wait_idle(core)
            await engine.shutdown()

    solo, mixed, embs = asyncio.run(main())
    assert mixed == solo
    for doc, out in zip(DOCS, embs):
        with torch.no_grad():
            last = hf(torch.tensor([tok.encode(doc)])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(last, dim=-1).numpy()
        np.testing.assert_allclose(out.embedding, want, atol=1e-5)
    assert pool_full(core)


def test_embedding_instruction_and_prompt_name(tiny_llama, tmp_path):
    """/v1/embeddings with `prompt_name` (config_sentence_transformers.json) or `instruction`
    (Qwen3-Embedding's form) embeds the prefixed text; an unknown prompt name is a 400."""
    import shutil

    path = shutil.copytree(tiny_llama, tmp_path / "m")
    with open(path / "config_sentence_transformers.json", "w") as f:
        json.dump({"prompts": {"query": "query: ", "passage": "passage: "}}, f)
    core = _core(str(path), "embed", 64)

    async def fn(client):
        named = await client.post("/v1/embeddings", json={"input": "Hello", "prompt_name": "query"})
        plain = await client.post("/v1/embeddings", json={"input": "query: Hello"})
        instr = await client.post(
            "/v1/embeddings", json={"input": "Hello", "instruction": "Find greetings"}
        )
        by_hand = await client.post(
            "/v1/embeddings", json={"input": "Instruct: Find greetings\nQuery:Hello"}
        )
        bad = await client.post("/v1/embeddings", json={"input": "Hello", "prompt_name": "nope"})
        ids = await client.post("/v1/embeddings", json={"input": [5, 6], "instruction": "x"})
        return named.json(), plain.json(), instr.json(), by_hand.json(), bad, ids

    named, plain, instr, by_hand, bad, ids = run_http(core, fn)
    assert named["data"][0]["embedding"] == plain["data"][0]["embedding"]
    assert instr["data"][0]["embedding"] == by_hand["data"][0]["embedding"]
    assert named["data"][0]["embedding"] != instr["data"][0]["embedding"]
    assert bad.status_code == 400 and "passage, query" in bad.json()["error"]["message"]
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "instruction"


def test_pooling_route_on_an_embedder(tiny_llama):
    """/pooling with TASK=embed: the embedding (as /v1/embeddings'), `dimensions` truncating;
    dimensions over the hidden size a 400 naming it."""
    core = _core(tiny_llama, "embed", 64)

    async def fn(client):
        pool = await client.post("/pooling", json={"input": ["Hello", "Paged attention"]})
        emb = await client.post("/v1/embeddings", json={"input": ["Hello", "Paged attention"]})
        dims = await client.post("/pooling", json={"input": "Hello", "dimensions": 8})
        emb_dims = await client.post("/v1/embeddings", json={"input": "Hello", "dimensions": 8})
        big = await client.post("/pooling", json={"input": "Hello", "dimensions": 10**6})
        return pool.json(), emb.json(), dims.json(), emb_dims.json(), big

    pool, emb, dims, emb_dims, big = run_http(core, fn)
    for p, e in zip(pool["data"], emb["data"]):
        np.testing.assert_allclose(p["data"], e["embedding"], atol=1e-7)
    assert len(dims["data"][0]["data"]) == 8
    np.testing.assert_allclose(dims["data"][0]["data"], emb_dims["data"][0]["embedding"])
    assert big.status_code == 400
    assert big.json()["error"]["param"] == "dimensions"
    assert "larger than the model's" in big.json()["error"]["message"]


def test_classify_token_id_inputs(classifier_core, paths):
    tok = transformers.AutoTokenizer.from_pretrained(paths["classifier"])
    ids = [tok.encode(d) for d in DOCS[:2]]

    async def fn(client):
        by_ids = await client.post("/classify", json={"input": ids})
        by_text = await client.post("/classify", json={"input": DOCS[:2]})
        bad = await client.post("/classify", json={"input": [[10**9]]})
        return by_ids.json(), by_text.json(), bad

    by_ids, by_text, bad = run_http(classifier_core, fn)
    for a, b in zip(by_ids["data"], by_text["data"]):
        assert a["probs"] == b["probs"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


def test_embeddings_on_a_classifier_names_its_task(classifier_core):
    async def fn(client):
        return await client.post("/v1/embeddings", json={"input": "hi"})

    r = run_http(classifier_core, fn)
    assert r.status_code == 400
    assert "served for classify (TASK=classify)" in r.json()["error"]["message"]

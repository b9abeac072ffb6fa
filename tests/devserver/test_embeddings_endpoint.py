"""/openai/v1/embeddings on the local endpoint with the real worker started with TASK=embed
(settings -> engine), read by the official OpenAI client, and the same route as an
`openai_route` job; generation routes answer a clear 400 on such a worker."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers

from serverless_llm.devserver.app import create_app
from tests.devserver.conftest import API_KEY, SERVED_MODEL, ServerThread, serve


@pytest.fixture(scope="module")
def embed_endpoint(tiny_llama: str, tmp_path_factory) -> Iterator[ServerThread]:
    from serverless_llm.worker.handler import Worker
    from serverless_llm.worker.settings import Settings

    settings = Settings.from_env(
        {
            "MODEL_NAME": tiny_llama,
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": SERVED_MODEL,
            "BASE_PATH": str(tmp_path_factory.mktemp("base")),
            "DEVICE": "cpu",
            "DTYPE": "float32",
            "MAX_MODEL_LEN": "128",
            "NUM_KV_BLOCKS": "64",
            "TASK": "embed",
            "POOLING_TYPE": "mean",
        }
    )
    worker = Worker(settings)
    app = create_app(worker, api_key=API_KEY, max_concurrency=settings.max_concurrency)
    with serve(app) as server:
        server.worker = worker  # type: ignore[attr-defined]
        yield server


def test_client_embeddings_and_job(embed_endpoint: ServerThread, tiny_llama: str):
    client = openai.OpenAI(
        base_url=f"{embed_endpoint.base_url}/openai/v1", api_key=API_KEY, timeout=60
    )
    texts = ["The quick brown fox", "Hello world! How are you today? I am fine."]
    resp = client.embeddings.create(model=SERVED_MODEL, input=texts, encoding_format="float")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    model = transformers.AutoModel.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    total = 0
    for text, d in zip(texts, resp.data):
        ids = tok(text)["input_ids"]
        total += len(ids)
        with torch.no_grad():
            mean = model(torch.tensor([ids])).last_hidden_state[0].mean(0)
        ref = torch.nn.functional.normalize(mean, dim=-1).numpy()
        np.testing.assert_allclose(np.asarray(d.embedding, dtype=np.float32), ref, atol=1e-5)
    assert resp.usage.prompt_tokens == total

    job = {"input": {"openai_route": "/v1/embeddings", "openai_input": {"input": texts[0]}}}
    out = httpx.post(
        f"{embed_endpoint.base_url}/runsync",
        json=job,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ).json()
    assert out["status"] == "COMPLETED"
    (body,) = out["output"]
    assert body["object"] == "list"
    np.testing.assert_allclose(body["data"][0]["embedding"], resp.data[0].embedding, atol=1e-6)

    with pytest.raises(openai.BadRequestError, match="TASK=embed"):
        client.chat.completions.create(
            model=SERVED_MODEL, messages=[{"role": "user", "content": "hi"}]
        )
    pool = embed_endpoint.worker.engine.core.block_pool  # type: ignore[attr-defined]
    assert pool.num_free == pool.num_blocks

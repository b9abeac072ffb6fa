"""vLLM's pooling routes on the local endpoint with the real worker started with TASK=score on
a tiny Qwen3-Reranker-shaped model (settings -> engine): /rerank at the root, under /openai/v1
and as /v2/rerank, a 400 in OpenAI's shape for a bad request, and the native pooling job
`{"task": "rerank", ...}` whose errors are native `{"error": "..."}`."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from serverless_llm.devserver.app import create_app
from tests.devserver.conftest import API_KEY, SERVED_MODEL, ServerThread, serve
from tests.tiny_scorers import build_reranker

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
DOCS = ["Paged attention stores keys and values in blocks.", "Hello", "The quick brown fox"]


@pytest.fixture(scope="module")
def score_endpoint(tmp_path_factory) -> Iterator[ServerThread]:
    from serverless_llm.worker.handler import Worker
    from serverless_llm.worker.settings import Settings

    path = build_reranker(str(tmp_path_factory.mktemp("reranker")))
    settings = Settings.from_env(
        {
            "MODEL_NAME": path,
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": SERVED_MODEL,
            "BASE_PATH": str(tmp_path_factory.mktemp("base")),
            "DEVICE": "cpu",
            "DTYPE": "float32",
            "MAX_MODEL_LEN": "512",
            "NUM_KV_BLOCKS": "64",
            "TASK": "score",
        }
    )
    worker = Worker(settings)
    app = create_app(worker, api_key=API_KEY, max_concurrency=settings.max_concurrency)
    with serve(app) as server:
        server.worker = worker  # type: ignore[attr-defined]
        yield server


def test_rerank_paths_job_and_native_job(score_endpoint: ServerThread):
    base = score_endpoint.base_url
    body = {"model": SERVED_MODEL, "query": "What is paged attention?", "documents": DOCS}
    answers = []
    for path in ("/rerank", "/v1/rerank", "/v2/rerank", "/openai/v1/rerank"):
        r = httpx.post(base + path, json=body, headers=HEADERS, timeout=60)
        assert r.status_code == 200, (path, r.text)
        answers.append([(x["index"], round(x["relevance_score"], 6)) for x in r.json()["results"]])
    assert all(a == answers[0] for a in answers) and len(answers[0]) == len(DOCS)
    scores = [s for _, s in answers[0]]
    assert scores == sorted(scores, reverse=True)

    bad = httpx.post(base + "/rerank", json={"query": "q", "documents": []}, headers=HEADERS)
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "documents"

    score = httpx.post(
        base + "/score", json={"text_1": body["query"], "text_2": DOCS[:2]}, headers=HEADERS
    ).json()
    by_index = dict(answers[0])
    assert [round(d["score"], 6) for d in score["data"]] == [by_index[0], by_index[1]]

    job = {"input": {"task": "rerank", "query": body["query"], "documents": DOCS, "top_n": 1}}
    out = httpx.post(base + "/runsync", json=job, headers=HEADERS, timeout=60).json()
    assert out["status"] == "COMPLETED", out
    (result,) = out["output"]
    assert [(x["index"], round(x["relevance_score"], 6)) for x in result["results"]] == answers[0][
        :1
    ]

    for bad_input, words in (
        ({"task": "rerank", "query": "q", "documents": []}, "at least one document"),
        ({"task": "score", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "2 texts"),
        ({"task": "classify", "input": ""}, "empty"),
        ({"task": "translate", "input": "x"}, "task must be one of"),
    ):
        out = httpx.post(
            base + "/runsync", json={"input": bad_input}, headers=HEADERS, timeout=60
        ).json()
        error = out["output"][0]["error"] if "output" in out else out["error"]
        assert isinstance(error, str) and words in error, out

    chat = httpx.post(
        base + "/openai/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers=HEADERS,
    )
    assert chat.status_code == 400 and "TASK=score" in chat.json()["error"]["message"]
    pool = score_endpoint.worker.engine.core.block_pool  # type: ignore[attr-defined]
    assert pool.num_free == pool.num_blocks

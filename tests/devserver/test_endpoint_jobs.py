"""The local endpoint's job API and its load behaviour, on the real worker and tiny Llama:
concurrency, incremental /stream, cancellation and disconnects freeing KV blocks, the API key,
malformed bodies."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.devserver.conftest import (
    API_KEY,
    SERVED_MODEL,
    ServerThread,
    StepGate,
    kv_pool,
    wait_until,
)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "Once upon a time, in a land far away"


@pytest.fixture()
def client(endpoint: ServerThread):
    with httpx.Client(base_url=endpoint.base_url, headers=AUTH, timeout=60) as c:
        yield c


def native(max_tokens: int, stream: bool) -> dict:
    params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    return {"prompt": PROMPT, "sampling_params": params, "stream": stream}


def tokens_of(items: list[dict]) -> list[str]:
    return [t for item in items for t in item["choices"][0]["tokens"]]


def wait_idle(endpoint: ServerThread, client: httpx.Client, timeout: float = 10.0) -> dict:
    """Waits until no job runs and every KV block is back in the pool; returns /health."""
    pool = kv_pool(endpoint)
    deadline = time.monotonic() + timeout
    while True:
        health = client.get("/health").json()
        idle = health["jobs"]["inProgress"] == 0 and health["engine"]["requests"] == 0
        if idle and pool.num_free == pool.num_blocks:
            assert health["engine"]["kvBlocksFree"] == health["engine"]["kvBlocksTotal"]
            return health
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle: {health}, {pool.num_free}/{pool.num_blocks} free")
        time.sleep(0.02)


def test_32_concurrent_streamed_chats(endpoint: ServerThread, client: httpx.Client):
    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await aclient.chat.completions.create(
            model=SERVED_MODEL,
            messages=[{"role": "user", "content": f"Question number {i}: how are you?"}],
            max_tokens=16,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, finish = "", None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        return text, finish

    async def main() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(
            base_url=f"{endpoint.base_url}/openai/v1", api_key=API_KEY, timeout=60
        ) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    before = client.get("/health").json()["jobs"]["completed"]
    results = asyncio.run(main())
    assert len(results) == 32
    assert all(text and finish == "length" for text, finish in results)
    health = wait_idle(endpoint, client)
    assert health["jobs"]["completed"] - before == 32


def test_run_and_stream_polling_match_runsync(endpoint: ServerThread, client: httpx.Client):
    job = client.post("/run", json={"input": native(60, stream=True)}).json()
    assert job["status"] in ("IN_QUEUE", "IN_PROGRESS")
    polls, status = [], "IN_QUEUE"
    while status in ("IN_QUEUE", "IN_PROGRESS"):
        body = client.get(f"/stream/{job['id']}").json()
        status = body["status"]
        polls.append([entry["output"] for entry in body["stream"]])
    assert status == "COMPLETED"
    streamed = [item for poll in polls for item in poll]
    assert len(streamed) > 1  # geometric batches: 1, 3, 9, 27, ...
    assert [len(item["choices"][0]["tokens"]) for item in streamed][:3] == [1, 3, 9]
    assert streamed[-1]["usage"]["output"] == 60

    status_view = client.get(f"/status/{job['id']}").json()
    assert status_view["output"] == streamed

    sync_stream = client.post("/runsync", json={"input": native(60, stream=True)}).json()
    assert sync_stream["status"] == "COMPLETED"
    assert sync_stream["output"] == streamed  # the same items, aggregated

    sync_whole = client.post("/runsync", json={"input": native(60, stream=False)}).json()
    assert len(sync_whole["output"]) == 1
    assert "".join(tokens_of(sync_whole["output"])) == "".join(tokens_of(streamed))
    wait_idle(endpoint, client)


def test_cancel_aborts_the_engine_request(
    endpoint: ServerThread, client: httpx.Client, step_gate: StepGate
):
    pool = kv_pool(endpoint)
    engine = endpoint.worker.engine  # type: ignore[attr-defined]
    job = client.post("/run", json={"input": native(220, stream=True)}).json()
    body = {"stream": []}
    while not body["stream"]:
        body = client.get(f"/stream/{job['id']}").json()
        assert body["status"] in ("IN_QUEUE", "IN_PROGRESS")
    step_gate.wait_held()  # its second step waits: it cannot finish whatever the machine's speed
    assert pool.num_free < pool.num_blocks  # it holds blocks now
    (request_id,) = step_gate.seen
    assert client.post(f"/cancel/{job['id']}").json()["status"] == "CANCELLED"
    wait_until(lambda: engine.num_unfinished == 0, "the cancelled job let go of its request")
    step_gate.release()
    wait_idle(endpoint, client)
    assert step_gate.aborted == [request_id] and step_gate.finished == []
    final = client.get(f"/status/{job['id']}").json()
    assert final["status"] == "CANCELLED"
    produced = body["stream"] + client.get(f"/stream/{job['id']}").json()["stream"]
    assert produced[-1]["output"]["usage"]["output"] < 220


def test_client_disconnect_aborts_the_engine_request(
    endpoint: ServerThread, client: httpx.Client, step_gate: StepGate
):
    pool = kv_pool(endpoint)
    engine = endpoint.worker.engine  # type: ignore[attr-defined]
    oai = openai.OpenAI(base_url=f"{endpoint.base_url}/openai/v1", api_key=API_KEY, timeout=60)
    before = client.get("/health").json()["jobs"]["cancelled"]
    stream = oai.completions.create(
        model=SERVED_MODEL,
        prompt=PROMPT,
        max_tokens=220,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    step_gate.wait_held()  # the engine waits before its second step: the stream cannot end
    assert pool.num_free < pool.num_blocks
    (streamed,) = step_gate.seen
    stream.close()  # drops the connection mid-stream
    wait_until(lambda: engine.num_unfinished == 0, "the server saw the client go")
    step_gate.release()
    health = wait_idle(endpoint, client)
    assert health["jobs"]["cancelled"] == before + 1  # the handler was closed, not finished
    assert step_gate.aborted == [streamed] and step_gate.finished == []

    # A non-streamed request whose client gives up before the answer is aborted too. The client
    # gives up once the request is in the engine (held after its first token, so the answer
    # cannot be ready), not after some time.
    step_gate.rearm()
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 220, "ignore_eos": True}

    async def give_up_waiting() -> None:
        async with httpx.AsyncClient(base_url=endpoint.base_url, headers=AUTH, timeout=60) as ac:
            post = asyncio.ensure_future(ac.post("/openai/v1/completions", json=body))
            await asyncio.to_thread(step_gate.wait_held)
            assert not post.done()
            post.cancel()  # the client stops waiting; leaving the block closes its connection
            with pytest.raises(asyncio.CancelledError):
                await post

    asyncio.run(give_up_waiting())
    (whole,) = step_gate.seen
    wait_until(lambda: engine.num_unfinished == 0, "the server saw the client go")
    assert pool.num_free < pool.num_blocks  # still in the engine until the held step returns
    step_gate.release()
    health = wait_idle(endpoint, client)
    assert health["jobs"]["cancelled"] == before + 2
    assert step_gate.aborted == [whole] and step_gate.finished == []


def test_api_key_is_enforced(endpoint: ServerThread):
    base = endpoint.base_url
    job = {"input": native(4, stream=False)}
    assert httpx.post(f"{base}/runsync", json=job).status_code == 401
    wrong = httpx.post(f"{base}/runsync", json=job, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "error" in wrong.json()
    assert httpx.get(f"{base}/openai/v1/models").status_code == 401
    ok = httpx.post(f"{base}/runsync", json=job, headers=AUTH, timeout=30)
    assert ok.json()["status"] == "COMPLETED"


def test_malformed_bodies_get_400_and_the_server_keeps_serving(
    endpoint: ServerThread, client: httpx.Client
):
    for path in ("/openai/v1/chat/completions", "/openai/v1/completions"):
        for raw in (b"{", b"not json", b"[]", b"\xff"):
            resp = client.post(path, content=raw, headers={"content-type": "application/json"})
            assert resp.status_code == 400, (path, raw)
            assert resp.json()["error"]["type"] == "invalid_request_error"
    for raw in (b"{", b'{"input": "text"}'):
        resp = client.post("/run", content=raw)
        assert resp.status_code == 400 and isinstance(resp.json()["error"], str)
    # A well-formed job the worker rejects ends FAILED with the worker's error.
    bad = client.post("/runsync", json={"input": {"prompt": PROMPT, "sampling_params": 3}})
    assert bad.json()["status"] == "FAILED" and bad.json()["error"]

    ok = client.post("/runsync", json={"input": native(5, stream=False)}).json()
    assert ok["status"] == "COMPLETED" and ok["output"][0]["usage"]["output"] == 5
    wait_idle(endpoint, client)

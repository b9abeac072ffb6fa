"""The local endpoint's own logic, against a fake worker (no model): job states, incremental
/stream, cancellation, concurrency slots, SSE framing, disconnects, API key, error shapes."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest

from serverless_llm.devserver import job_store
from serverless_llm.devserver.app import create_app
from serverless_llm.devserver.job_store import JobManager
from tests.devserver.conftest import ServerThread, serve
from tests.devserver.fake_worker import MODEL, FakeWorker


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def poll_stream(client: httpx.Client, job_id: str) -> tuple[list[list], str]:
    """Polls /stream until the job ends; returns the batches each poll got, and the status."""
    batches, status = [], "IN_QUEUE"
    while status in ("IN_QUEUE", "IN_PROGRESS"):
        body = client.get(f"/stream/{job_id}").json()
        status = body["status"]
        batches.append([entry["output"] for entry in body["stream"]])
    return batches, status


def test_run_stream_status_runsync(fake_server: ServerThread, fake_worker: FakeWorker):
    with httpx.Client(base_url=fake_server.base_url, timeout=10) as client:
        job_input = {"items": 5, "delay": 0.05}
        submitted = client.post("/run", json={"input": job_input}).json()
        assert submitted["status"] in ("IN_QUEUE", "IN_PROGRESS")
        batches, status = poll_stream(client, submitted["id"])
        assert status == "COMPLETED"
        streamed = [item for batch in batches for item in batch]
        assert [i["choices"][0]["tokens"] for i in streamed] == [[f"t{i}"] for i in range(5)]
        assert sum(1 for batch in batches if batch) > 1  # it came in pieces, not all at the end
        # Nothing is handed out twice.
        assert client.get(f"/stream/{submitted['id']}").json()["stream"] == []

        final = client.get(f"/status/{submitted['id']}").json()
        assert final["status"] == "COMPLETED" and final["output"] == streamed
        assert final["executionTime"] >= 200 and "delayTime" in final

        sync = client.post("/runsync", json={"input": job_input}).json()
        assert sync["status"] == "COMPLETED" and sync["output"] == streamed
    assert not fake_worker.open


def test_failed_jobs(fake_server: ServerThread, fake_worker: FakeWorker):
    with httpx.Client(base_url=fake_server.base_url, timeout=10) as client:
        failed = client.post("/runsync", json={"input": {"items": 5, "fail_at": 2}}).json()
        assert failed["status"] == "FAILED" and failed["error"] == "failed at item 2"
        assert "output" not in failed

        raised = client.post("/runsync", json={"input": {"items": 5, "raise_at": 1}}).json()
        assert raised["status"] == "FAILED" and "RuntimeError: raised at item 1" in raised["error"]

        # The /stream of a failed job carries what came before the error, then the error.
        job = client.post("/run", json={"input": {"items": 5, "fail_at": 3}}).json()
        batches, status = poll_stream(client, job["id"])
        assert status == "FAILED" and sum(len(b) for b in batches) == 3
        assert client.get(f"/stream/{job['id']}").json()["error"] == "failed at item 3"

        ok = client.post("/runsync", json={"input": {"items": 2}}).json()
        assert ok["status"] == "COMPLETED"
        health = client.get("/health").json()
        assert health["ok"] and health["jobs"]["failed"] == 3 and health["jobs"]["completed"] == 1
    assert not fake_worker.open


def test_cancel_closes_the_handler(fake_server: ServerThread, fake_worker: FakeWorker):
    with httpx.Client(base_url=fake_server.base_url, timeout=10) as client:
        job = client.post("/run", json={"input": {"items": 1000, "delay": 0.02}}).json()
        assert wait_until(lambda: job["id"] in fake_worker.open)
        first = client.get(f"/stream/{job['id']}").json()
        assert first["status"] == "IN_PROGRESS"
        cancelled = client.post(f"/cancel/{job['id']}").json()
        assert cancelled == {"id": job["id"], "status": "CANCELLED"}
        assert job["id"] in fake_worker.closed and not fake_worker.open
        assert client.get(f"/status/{job['id']}").json()["status"] == "CANCELLED"
        assert client.get(f"/stream/{job['id']}").json()["status"] == "CANCELLED"

        done = client.post("/runsync", json={"input": {"items": 1}}).json()
        assert client.post(f"/cancel/{done['id']}").json()["status"] == "COMPLETED"
        missing = client.post("/cancel/nope")
        assert missing.status_code == 404 and "error" in missing.json()


def test_concurrency_slots_queue_jobs(fake_server: ServerThread, fake_worker: FakeWorker):
    """max_concurrency=4: the fifth and sixth jobs wait IN_QUEUE; a queued job can be
    cancelled without ever reaching the handler."""
    with httpx.Client(base_url=fake_server.base_url, timeout=10) as client:
        ids = [
            client.post("/run", json={"input": {"items": 1000, "delay": 0.01}}).json()["id"]
            for _ in range(6)
        ]
        assert wait_until(lambda: len(fake_worker.open) == 4)
        health = client.get("/health").json()
        assert health["jobs"]["inProgress"] == 4 and health["jobs"]["inQueue"] == 2
        assert health["workers"]["running"] == 1 and health["workers"]["concurrency"] == 4
        queued = [i for i in ids if i not in fake_worker.open]
        assert client.get(f"/status/{queued[0]}").json()["status"] == "IN_QUEUE"
        assert client.post(f"/cancel/{queued[0]}").json()["status"] == "CANCELLED"
        assert queued[0] not in fake_worker.closed  # it never started
        for job_id in ids:
            client.post(f"/cancel/{job_id}")
        assert not fake_worker.open
        health = client.get("/health").json()
        assert health["jobs"]["inProgress"] == 0 and health["jobs"]["inQueue"] == 0
        assert health["jobs"]["cancelled"] == 6


def test_runsync_wait_returns_early(fake_server: ServerThread):
    with httpx.Client(base_url=fake_server.base_url, timeout=10) as client:
        early = client.post("/runsync?wait=100", json={"input": {"items": 10, "delay": 0.05}})
        body = early.json()
        assert body["status"] == "IN_PROGRESS" and "output" not in body
        assert wait_until(
            lambda: client.get(f"/status/{body['id']}").json()["status"] == "COMPLETED"
        )


def test_openai_routes(fake_server: ServerThread):
    with httpx.Client(base_url=f"{fake_server.base_url}/openai/v1", timeout=10) as client:
        models = client.get("/models").json()
        assert models["data"][0]["id"] == MODEL
        assert client.get(f"/models/{MODEL}").json()["id"] == MODEL
        missing_model = client.get("/models/other")
        assert missing_model.status_code == 404
        assert missing_model.json()["error"]["code"] == "model_not_found"

        plain = client.post("/completions", json={"model": MODEL, "prompt": "x"})
        assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == "w0 w1 w2 "

        with client.stream(
            "POST", "/completions", json={"model": MODEL, "prompt": "x", "stream": True}
        ) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            text = resp.read().decode()
        assert text.count("data: [DONE]\n\n") == 1 and text.endswith("data: [DONE]\n\n")
        events = [e for e in text.split("\n\n") if e and e != "data: [DONE]"]
        assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events) == "w0 w1 w2 "

        unknown = client.post("/chat/completions", json={"model": "nope", "messages": []})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
        streamed_unknown = client.post("/completions", json={"model": "nope", "stream": True})
        assert streamed_unknown.status_code == 404  # errors before the first event get a status

        for bad in (b"{not json", b"\xff\xfe", b"[1, 2]", b""):
            resp = client.post(
                "/chat/completions", content=bad, headers={"content-type": "application/json"}
            )
            assert resp.status_code == 400, bad
            err = resp.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"]

        # The platform's path style works too.
        v2 = httpx.get(f"{fake_server.base_url}/v2/abc123/openai/v1/models")
        assert v2.json()["data"][0]["id"] == MODEL


def test_chunk_lists_are_framed_as_sse():
    """RAW_OPENAI_OUTPUT off: the handler yields lists of chunk dicts; the server frames them
    and adds the final [DONE] itself."""
    worker = FakeWorker(raw_openai_output=False)
    with serve(create_app(worker)) as server:
        body = {"model": MODEL, "prompt": "x", "stream": True, "fake_items": 4}
        with httpx.stream("POST", f"{server.base_url}/openai/v1/completions", json=body) as r:
            text = r.read().decode()
    events = text.split("\n\n")[:-1]
    assert events[-1] == "data: [DONE]" and len(events) == 5
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == [
        f"w{i} " for i in range(4)
    ]


def test_sse_is_framed_by_the_api():
    """The devserver frames chunk objects (RAW_OPENAI_OUTPUT off) with the API's own functions,
    so a stream reads the same byte for byte whichever side framed it."""
    from serverless_llm.api.openai import sse
    from serverless_llm.devserver import app

    chunks = [
        {"id": "c", "choices": [{"text": "é"}]},
        {"type": "response.done", "sequence_number": 3},
    ]
    assert app._sse(chunks) == sse.sse_events(chunks)
    assert app._sse({"error": {"message": "x"}}) == sse.sse_event({"error": {"message": "x"}})
    assert app._sse("data: raw\n\n") == "data: raw\n\n"
    assert app.SSE_DONE is sse.SSE_DONE


def test_client_disconnect_closes_the_handler(fake_server: ServerThread, fake_worker: FakeWorker):
    url = f"{fake_server.base_url}/openai/v1/completions"
    body = {"model": MODEL, "prompt": "x", "stream": True, "fake_items": 1000, "fake_delay": 0.02}
    with httpx.stream("POST", url, json=body, timeout=10) as resp:
        for _ in resp.iter_raw():
            assert len(fake_worker.open) == 1
            break  # httpx drops the connection here
    # The connection is closed; the server notices and closes the handler's generator.
    assert wait_until(lambda: not fake_worker.open)

    # Gone before the first event (the handler is still waiting): closed too.
    body["fake_delay"] = 30.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=body, timeout=0.5)
    assert wait_until(lambda: not fake_worker.open)
    health = httpx.get(f"{fake_server.base_url}/health").json()
    assert health["jobs"]["inProgress"] == 0 and health["jobs"]["cancelled"] == 2


def test_health_counts_each_request_as_it_ended():
    """/health's terminal counts: a listing, a plain and a streamed completion and a native job
    completed; an OpenAI error and a failed native job failed; a stream the client dropped was
    cancelled (a plain response used to count as cancelled: its handler was closed, not run to
    its end)."""
    worker = FakeWorker()
    with serve(create_app(worker)) as server:
        oai = f"{server.base_url}/openai/v1"
        with httpx.Client(timeout=10) as client:
            assert client.get(f"{oai}/models").status_code == 200
            assert client.get(f"{oai}/models/{MODEL}").status_code == 200
            plain = client.post(f"{oai}/completions", json={"model": MODEL, "prompt": "x"})
            assert plain.status_code == 200
            body = {"model": MODEL, "prompt": "x", "stream": True}
            with client.stream("POST", f"{oai}/completions", json=body) as resp:
                assert resp.read().decode().endswith("data: [DONE]\n\n")
            ok = client.post(f"{server.base_url}/runsync", json={"input": {"items": 2}})
            assert ok.json()["status"] == "COMPLETED"
            wrong = client.post(f"{oai}/completions", json={"model": "nope", "prompt": "x"})
            assert wrong.status_code == 404
            bad = client.post(f"{server.base_url}/runsync", json={"input": {"fail_at": 0}})
            assert bad.json()["status"] == "FAILED"
        body = {"model": MODEL, "prompt": "x", "stream": True, "fake_items": 1000}
        body["fake_delay"] = 0.02
        with httpx.stream("POST", f"{oai}/completions", json=body, timeout=10) as resp:
            for _ in resp.iter_raw():
                break  # dropped
        assert wait_until(lambda: not worker.open)

        def jobs():
            return httpx.get(f"{server.base_url}/health").json()["jobs"]

        assert wait_until(lambda: jobs()["inProgress"] == 0)
        health = jobs()
        assert (health["completed"], health["failed"], health["cancelled"]) == (5, 2, 1), health
        assert health["inQueue"] == 0


def test_request_bodies_over_the_limit_get_413_in_the_route_shape():
    worker = FakeWorker()
    with serve(create_app(worker, max_body_bytes=1000)) as server:
        base = server.base_url
        big = {"model": MODEL, "prompt": "x" * 2000}
        oai = httpx.post(f"{base}/openai/v1/completions", json=big)
        assert oai.status_code == 413
        assert oai.json()["error"]["code"] == "request_too_large"
        job = httpx.post(f"{base}/runsync", json={"input": {"prompt": "x" * 2000}})
        assert job.status_code == 413 and "larger than 1000 bytes" in job.json()["error"]

        def chunks():  # no Content-Length: the limit is enforced while reading
            for _ in range(20):
                yield b" " * 100

        unsized = httpx.post(f"{base}/run", content=chunks())
        assert unsized.status_code == 413
        small = httpx.post(f"{base}/openai/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert small.status_code == 200
        assert not worker.open and httpx.get(f"{base}/health").json()["jobs"]["inQueue"] == 0


def test_api_key_on_every_route(fake_worker: FakeWorker):
    with serve(create_app(fake_worker, api_key="sekret")) as server:
        base = server.base_url
        for method, path in [
            ("POST", "/run"),
            ("POST", "/runsync"),
            ("GET", "/stream/x"),
            ("GET", "/status/x"),
            ("POST", "/cancel/x"),
            ("GET", "/health"),
            ("POST", "/v2/ep/run"),
        ]:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                resp = httpx.request(method, base + path, json={"input": {}}, headers=headers)
                assert resp.status_code == 401, (path, headers)
                assert isinstance(resp.json()["error"], str)
        for path in ("/openai/v1/models", "/v2/ep/openai/v1/models"):
            resp = httpx.get(base + path, headers={"Authorization": "Bearer wrong"})
            assert resp.status_code == 401
            assert resp.json()["error"]["code"] == "invalid_api_key"
        resp = httpx.post(
            base + "/openai/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=5
        )
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
        assert not fake_worker.closed  # nothing reached the handler

        for auth in ("Bearer sekret", "sekret"):  # the platform also takes a bare key
            ok = httpx.post(
                base + "/runsync", json={"input": {"items": 1}}, headers={"Authorization": auth}
            )
            assert ok.json()["status"] == "COMPLETED"
        models = httpx.get(base + "/openai/v1/models", headers={"Authorization": "Bearer sekret"})
        assert models.status_code == 200


def test_job_api_errors_keep_the_server_serving(fake_server: ServerThread):
    with httpx.Client(base_url=fake_server.base_url, timeout=10) as client:
        for body in (b"{nope", b"[]", b'{"no_input": 1}', b'{"input": 3}', b""):
            resp = client.post("/run", content=body)
            assert resp.status_code == 400 and isinstance(resp.json()["error"], str), body
        assert client.get("/status/unknown").status_code == 404
        assert client.get("/no/such/route").status_code == 404
        assert client.get("/runsync").status_code == 405
        assert client.post("/runsync?wait=soon", json={"input": {}}).status_code == 400
        assert client.post("/v2/ep/runsync", json={"input": {"items": 2}}).json()["status"] == (
            "COMPLETED"
        )


def test_finished_jobs_are_bounded(monkeypatch: pytest.MonkeyPatch):
    # The job store's clock is the test's: a finished job ages by 0.35 s only when the test
    # says so, not while a slow machine runs the jobs (a 0.3 s TTL on the real clock could
    # purge them before the count limit is checked).
    now = [1000.0]
    monkeypatch.setattr(job_store, "time", SimpleNamespace(monotonic=lambda: now[0]))

    async def main() -> None:
        async def handle(job):
            yield {"n": 1}

        jobs = JobManager(handle, max_concurrency=2, max_finished=3, finished_ttl_s=0.3)
        first = [jobs.submit({}) for _ in range(5)]
        for job in first:
            await jobs.wait_done(job, 1.0)
        assert all(job.done for job in first)
        jobs.submit({})  # purges down to the newest 3 finished
        assert [jobs.get(j.id) is not None for j in first] == [False, False, True, True, True]
        now[0] += 0.35
        assert all(jobs.get(j.id) is None for j in first)  # and by age
        await jobs.shutdown()

    asyncio.run(main())

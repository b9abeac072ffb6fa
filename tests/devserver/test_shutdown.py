"""Graceful shutdown of the local endpoint (issue 14): on SIGTERM it refuses new requests with
503, lets running ones finish for SHUTDOWN_GRACE_SECONDS, ends the rest with an error event
and [DONE], and exits 0; a second signal exits at once. Run in a subprocess (signals reach
the main thread) serving the fake worker, whose streams are slow on purpose."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.devserver.fake_server_process import start_fake_server as start


def stream_events(base: str, body: dict, results: list, first: threading.Event) -> None:
    events = []
    try:
        with httpx.stream("POST", f"{base}/openai/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
    except httpx.HTTPError as exc:
        events.append(f"transport error: {exc}")
    results.append(events)


def sigterm_and_wait_draining(proc, base: str) -> None:
    """Sends SIGTERM and returns once the server has taken it (/health says not ok), rather
    than after a guessed time (the deadline only guards against a hang)."""
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while httpx.get(f"{base}/health").json()["ok"]:
        assert time.monotonic() < deadline, "the server did not start draining"
        time.sleep(0.01)


def test_sigterm_drains_then_ends_the_rest_and_exits_0():
    proc, base = start(grace=1.5)
    try:
        results: list[list[str]] = []
        threads, firsts = [], []
        for i in range(8):
            # Two short streams finish inside the grace period; six would take 20 s.
            n, delay = (5, 0.05) if i < 2 else (1000, 0.02)
            body = {"model": "fake-model", "prompt": "x", "stream": True}
            body.update(fake_items=n, fake_delay=delay)
            first = threading.Event()
            t = threading.Thread(target=stream_events, args=(base, body, results, first))
            t.start()
            threads.append(t)
            firsts.append(first)
        assert all(f.wait(10) for f in firsts)
        t0 = time.monotonic()
        sigterm_and_wait_draining(proc, base)
        # While draining: new work is refused in each route's shape; status still answers.
        oai = httpx.post(
            f"{base}/openai/v1/completions", json={"model": "fake-model", "prompt": "x"}
        )
        assert oai.status_code == 503 and oai.json()["error"]["message"]
        job = httpx.post(f"{base}/run", json={"input": {"items": 1}})
        assert job.status_code == 503 and "shutting down" in job.json()["error"]
        assert httpx.get(f"{base}/health").json()["ok"] is False
        for t in threads:
            t.join(20)
        proc.wait(timeout=1.5 + 5)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    assert proc.returncode == 0, out
    assert "EXITED CLEANLY" in out and "Traceback" not in out, out
    assert elapsed < 1.5 + 5
    completed = cut = 0
    for events in results:
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        if "error" in last:
            assert "shut down" in last["error"]["message"]
            cut += 1
        else:
            completed += 1
    assert (completed, cut) == (2, 6)


def test_a_second_signal_exits_at_once():
    proc, base = start(grace=30)
    try:
        first = threading.Event()
        body = {"model": "fake-model", "prompt": "x", "stream": True}
        body.update(fake_items=1000, fake_delay=0.02)
        t = threading.Thread(target=stream_events, args=(base, body, [], first), daemon=True)
        t.start()
        assert first.wait(10)
        sigterm_and_wait_draining(proc, base)  # a second signal sent too soon could merge
        assert proc.poll() is None  # draining: up to 30 s
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=5)
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM

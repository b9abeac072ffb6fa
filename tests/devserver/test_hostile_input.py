"""Hostile input at the local endpoint (issue 14), timed against a server in its own process."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import httpx

from tests.devserver.fake_server_process import start_fake_server

SEND = """
import sys, time, httpx
huge = b"".join([b'{"model": "fake-model", "messages": [{"role": "user", "content": "',
                 b"a" * (50 * 1024 * 1024), b'"}]}'])
t0 = time.monotonic()
try:
    r = httpx.post(sys.argv[1], content=huge, headers={"content-type": "application/json"},
                   timeout=10)
    status, code = r.status_code, r.json()["error"]["code"]
except httpx.WriteError:  # refused before the whole body went out: the connection was closed
    status, code = 413, "request_too_large"
print(status, code, time.monotonic() - t0)
"""


def declare_50_mb(url: str) -> tuple[int, str, float]:
    """A request whose headers declare a 50 MB body, none of which is ever sent: only a server
    that refuses it without reading the body can answer (whatever the machine's speed)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        t0 = time.monotonic()
        conn.putrequest("POST", parts.path)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(50 * 1024 * 1024))
        conn.endheaders()
        response = conn.getresponse()
        code = json.loads(response.read())["error"]["code"]
        return response.status, code, time.monotonic() - t0
    finally:
        conn.close()


def test_a_50_mb_request_is_refused_fast_while_a_stream_flows():
    """A 50 MB chat request gets its error (413), and a concurrent stream's gaps between events
    stay under 2x its idle value: the body is never read whole. A request that only declares
    its 50 MB gets the 413 too, in under 2 s, without one byte of its body sent."""
    proc, base = start_fake_server()
    try:
        # An event every 0.2 s (a slow model's pace): 2x its gap tolerates the scheduling noise of
        # a busy 2-core machine, never a blocked event loop.
        body = {"model": "fake-model", "prompt": "x", "stream": True, "fake_items": 20}
        body["fake_delay"] = 0.2
        stamps: list[float] = []

        def consume():
            with httpx.stream("POST", f"{base}/openai/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        stamps.append(time.monotonic())

        t = threading.Thread(target=consume)
        t.start()
        deadline = time.monotonic() + 10
        while len(stamps) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        # Sent from a process of its own, so this one's interpreter lock (the consumer's)
        # never waits on 50 MB being built or written.
        sent = subprocess.run(
            [sys.executable, "-c", SEND, f"{base}/openai/v1/chat/completions"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        status, code, _ = sent.stdout.split()
        declared = declare_50_mb(f"{base}/openai/v1/chat/completions")
        t.join(10)
        assert httpx.get(f"{base}/health").json()["ok"]
    finally:
        proc.terminate()
        proc.wait(10)
    assert status == "413" and code == "request_too_large", sent.stdout + sent.stderr
    assert declared[:2] == (413, "request_too_large") and declared[2] < 2.0, declared
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    idle = sorted(gaps)[len(gaps) // 2]
    assert len(gaps) >= 15 and max(gaps) < 2 * idle, (max(gaps), idle)

"""Soak: N minutes of concurrent, mixed, streamed traffic through the local endpoint, looking for
what only time shows: worker deaths, 5xx, leaked KV blocks, growing memory, slowing first tokens.

The endpoint runs in a subprocess (`python -m serverless_llm.devserver`, as in
`bench/endpoint.py`). `--concurrency` client workers each loop until the time is up, picking at
random: streamed chat, streamed completion, non-streamed chat, n=2, logprobs, guided decoding
(guided_choice, guided_json, response_format), stop strings, a client that disconnects after a
token or two, a `/run` job cancelled with `/cancel/{id}`, `/runsync` and `/run` + `/stream/{id}`
jobs, and bad requests (invalid parameters, unknown model, malformed JSON, a prompt over
MAX_MODEL_LEN, an unknown job id). Bad requests must get a 4xx (or, on the job routes, a FAILED
job): those are counted apart from unexpected errors (5xx, connection failures, timeouts, streams
without [DONE], error events in a stream, a 2xx for a bad request, wrong output).

Reported: requests served by kind, errors by kind (the first few of each with the request that
caused it), worker deaths, the server's resident memory (VmRSS) at start, after the first sixth
of the run, at the middle and at the end, KV blocks free vs total once the load has stopped
(from /health), and p50/p99 time to first token in each sixth of the run.

The bar (issue 14, for 30 minutes on the 2-core machine): zero worker deaths, zero 5xx, zero
leaked blocks, resident memory at the end within 5% of its value after the first sixth (5 of 30
minutes), p99 time to first token in the last sixth within 1.5x the first. Each is printed with
PASS/FAIL, then a final SUMMARY line; the exit status is 0 unless the benchmark itself fails.

    .venv/bin/python bench/soak.py [--minutes 30] [--concurrency 32] [--seed 0] [--model DIR]
                                   [--json out.json]
    .venv/bin/python bench/soak.py --tiny --model DIR --json out.json   # CI: 6 s, 4 clients
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench.common import (  # noqa: E402
    QUESTIONS,
    CpuCompetition,
    default_model_dir,
    format_table,
    machine_info,
    stop_process,
)
from bench.endpoint import free_port, log, start_server  # noqa: E402
from bench.throughput import BATCH_TOKENS, PAGE_SIZE  # noqa: E402

WINDOWS = 6  # the run is judged in sixths: 5-minute windows of a 30-minute run
BAR_RSS_GROWTH = 0.05
BAR_TTFT_RATIO = 1.5
REQUEST_TIMEOUT_S = 300.0
EXAMPLES_PER_KIND = 3

# Kinds of traffic and how often each is picked.
MIX = {
    "chat_stream": 6,
    "completion_stream": 4,
    "chat": 3,
    "n2": 2,
    "logprobs": 2,
    "guided": 2,
    "stop": 2,
    "disconnect": 2,
    "cancel": 1,
    "runsync": 1,
    "run_stream": 1,
    "bad": 3,
}

JSON_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 12}, "score": {"type": "integer"}},
    "required": ["answer", "score"],
}


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (None for no samples)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


class ServerOutput:
    """Drains the server's stdout on a thread (a full pipe would stall the server), keeping the
    tail and counting error lines."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.tail: collections.deque[str] = collections.deque(maxlen=200)
        self.error_lines = 0
        self.tracebacks = 0
        self._thread = threading.Thread(target=self._drain, args=(proc,), daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _drain(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.tail.append(line.rstrip("\n"))
            if line.startswith(("ERROR", "CRITICAL")):
                self.error_lines += 1
            if line.startswith("Traceback"):
                self.tracebacks += 1


@dataclass
class Stats:
    t0: float
    duration: float
    served: collections.Counter = field(default_factory=collections.Counter)
    expected_4xx: collections.Counter = field(default_factory=collections.Counter)
    errors: collections.Counter = field(default_factory=collections.Counter)
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    latency: dict[str, list[float]] = field(default_factory=dict)  # kind -> seconds, served
    ttft: list[list[float]] = field(default_factory=lambda: [[] for _ in range(WINDOWS)])
    done_per_window: list[int] = field(default_factory=lambda: [0] * WINDOWS)
    errors_per_window: list[int] = field(default_factory=lambda: [0] * WINDOWS)
    statuses: collections.Counter = field(default_factory=collections.Counter)

    def window(self, t: float) -> int:
        return min(WINDOWS - 1, max(0, int((t - self.t0) / self.duration * WINDOWS)))

    def ok(self, kind: str, seconds: float) -> None:
        self.served[kind] += 1
        self.latency.setdefault(kind, []).append(seconds)
        self.done_per_window[self.window(time.monotonic())] += 1

    def error(self, err: str, kind: str, request: Any, detail: str) -> None:
        self.errors[err] += 1
        self.errors_per_window[self.window(time.monotonic())] += 1
        shown = self.examples.setdefault(err, [])
        if len(shown) < EXAMPLES_PER_KIND:
            shown.append(
                {
                    "kind": kind,
                    "at_s": round(time.monotonic() - self.t0, 1),
                    "request": _short(request),
                    "detail": detail[:500],
                }
            )


def _short(request: Any) -> Any:
    if isinstance(request, bytes):
        request = request.decode(errors="replace")
    text = request if isinstance(request, str) else json.dumps(request)
    return text if len(text) <= 600 else text[:600] + f"... ({len(text)} chars)"


class Failure(Exception):
    """One request's unexpected outcome: `kind` names it in the error counts."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class Client:
    """One client worker's requests; each method raises Failure on an unexpected outcome."""

    def __init__(self, http: httpx.AsyncClient, model: str, stats: Stats, rng: random.Random):
        self.http = http
        self.model = model
        self.stats = stats
        self.rng = rng
        self.max_tokens = 64
        self.last: dict[str, Any] = {}  # the last request sent, for the error examples

    # -- prompts and parameters -----------------------------------------------------------

    def question(self) -> str:
        q = self.rng.choice(QUESTIONS)
        # Half repeat a question verbatim (prefix-cache hits), half are new.
        return q if self.rng.random() < 0.5 else f"Request {self.rng.randrange(10**6)}. {q}"

    def tokens(self) -> int:
        return self.rng.randint(4, self.max_tokens)

    def sampling(self) -> dict[str, Any]:
        if self.rng.random() < 0.5:
            return {"temperature": 0.0}
        return {"temperature": 0.8, "top_p": 0.95, "seed": self.rng.randrange(1000)}

    def chat_body(self, **extra: Any) -> dict[str, Any]:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": self.question()}],
            "max_tokens": self.tokens(),
            **self.sampling(),
        }
        body.update(extra)
        return body

    def completion_body(self, **extra: Any) -> dict[str, Any]:
        body = {
            "model": self.model,
            "prompt": self.question(),
            "max_tokens": self.tokens(),
            **self.sampling(),
        }
        body.update(extra)
        return body

    # -- transports -------------------------------------------------------------------------

    async def post_json(self, path: str, body: Any) -> dict[str, Any]:
        self.last = {"path": path, "body": body}
        r = await self.http.post(path, json=body)
        self.stats.statuses[r.status_code] += 1
        if r.status_code >= 500:
            raise Failure("http_5xx", f"{r.status_code}: {r.text[:300]}")
        if r.status_code != 200:
            raise Failure("unexpected_4xx", f"{r.status_code}: {r.text[:300]}")
        try:
            return r.json()
        except ValueError:
            raise Failure("bad_body", r.text[:300]) from None

    async def sse(
        self, path: str, body: dict[str, Any], stop_after: int | None = None
    ) -> tuple[list[dict[str, Any]], float | None]:
        """Streams an OpenAI request; returns its chunks and the time to the first text. With
        `stop_after`, closes the stream once that many chunks with text have come (a client
        that goes away mid-stream)."""
        t_start = time.monotonic()
        ttft = None
        chunks: list[dict[str, Any]] = []
        texts = 0
        self.last = {"path": path, "body": body}
        async with self.http.stream("POST", path, json=body) as r:
            self.stats.statuses[r.status_code] += 1
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:300]
                kind = "http_5xx" if r.status_code >= 500 else "unexpected_4xx"
                raise Failure(kind, f"{r.status_code}: {text}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return chunks, ttft
                chunk = json.loads(data)
                if "error" in chunk:
                    raise Failure("stream_error", data[:300])
                chunks.append(chunk)
                if any(_choice_text(c) for c in chunk.get("choices") or ()):
                    if ttft is None:
                        ttft = time.monotonic() - t_start
                        self.stats.ttft[self.stats.window(t_start)].append(ttft)
                    texts += 1
                    if stop_after is not None and texts >= stop_after:
                        return chunks, ttft  # leaving the block closes the connection
        raise Failure("stream_without_done", f"{len(chunks)} chunks, then the stream ended")

    # -- the kinds of traffic -------------------------------------------------------------

    async def chat_stream(self) -> None:
        body = self.chat_body(stream=True, stream_options={"include_usage": True})
        chunks, _ = await self.sse("/openai/v1/chat/completions", body)
        if not chunks or chunks[-1].get("usage") is None:
            raise Failure("wrong_output", "no usage chunk at the end of the stream")

    async def completion_stream(self) -> None:
        body = self.completion_body(stream=True)
        if self.rng.random() < 0.3:
            body["prompt"] = [self.question(), self.question()]
        await self.sse("/openai/v1/completions", body)

    async def chat(self) -> None:
        out = await self.post_json("/openai/v1/chat/completions", self.chat_body())
        if len(out.get("choices") or ()) != 1:
            raise Failure("wrong_output", json.dumps(out)[:300])

    async def n2(self) -> None:
        if self.rng.random() < 0.5:
            body = self.chat_body(n=2, stream=True)
            chunks, _ = await self.sse("/openai/v1/chat/completions", body)
            indexes = {c["index"] for ch in chunks for c in ch.get("choices") or ()}
            if chunks and not indexes <= {0, 1}:
                raise Failure("wrong_output", f"choice indexes {sorted(indexes)} for n=2")
            return
        out = await self.post_json("/openai/v1/completions", self.completion_body(n=2))
        if len(out.get("choices") or ()) != 2:
            raise Failure("wrong_output", f"{len(out.get('choices') or ())} choices for n=2")

    async def logprobs(self) -> None:
        if self.rng.random() < 0.5:
            body = self.chat_body(logprobs=True, top_logprobs=self.rng.randint(0, 5), stream=True)
            await self.sse("/openai/v1/chat/completions", body)
            return
        out = await self.post_json(
            "/openai/v1/completions", self.completion_body(logprobs=self.rng.randint(0, 5))
        )
        choice = (out.get("choices") or [{}])[0]
        if choice.get("text") and not (choice.get("logprobs") or {}).get("tokens"):
            raise Failure("wrong_output", "logprobs asked for, none returned")

    async def guided(self) -> None:
        pick = self.rng.randrange(3)
        if pick == 0:
            options = ["yes", "no", "maybe"]
            out = await self.post_json(
                "/openai/v1/chat/completions",
                self.chat_body(guided_choice=options, max_tokens=16),
            )
            content = out["choices"][0]["message"]["content"]
            if out["choices"][0]["finish_reason"] == "stop" and content not in options:
                raise Failure("wrong_output", f"guided_choice answered {content!r}")
            return
        if pick == 1:
            body = self.chat_body(guided_json=JSON_SCHEMA, max_tokens=48)
        else:
            body = self.chat_body(response_format={"type": "json_object"}, max_tokens=48)
        out = await self.post_json("/openai/v1/chat/completions", body)
        choice = out["choices"][0]
        if choice["finish_reason"] == "stop":
            try:
                json.loads(choice["message"]["content"])
            except ValueError:
                raise Failure(
                    "wrong_output", f"guided JSON is not JSON: {choice['message']['content']!r}"
                ) from None

    async def stop(self) -> None:
        stops = self.rng.choice([["\n"], [".", "!"], ["the", " a "], ".\n"])
        body = self.completion_body(stop=stops, stream=True, max_tokens=self.max_tokens)
        chunks, _ = await self.sse("/openai/v1/completions", body)
        text = "".join(_choice_text(c) for ch in chunks for c in ch.get("choices") or ())
        for s in [stops] if isinstance(stops, str) else stops:
            if s in text:
                raise Failure("wrong_output", f"stop string {s!r} in the output {text!r}")

    async def disconnect(self) -> None:
        body = self.chat_body(stream=True, max_tokens=4 * self.max_tokens)
        await self.sse("/openai/v1/chat/completions", body, stop_after=self.rng.randint(1, 2))

    def native_job(self, max_tokens: int, stream: bool) -> dict[str, Any]:
        return {
            "input": {
                "prompt": self.question(),
                "sampling_params": {"max_tokens": max_tokens, **self.sampling()},
                "stream": stream,
            }
        }

    async def wait_terminal(self, job_id: str, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = await self.post_json(f"/status/{job_id}", None)
            if out["status"] in ("COMPLETED", "FAILED", "CANCELLED"):
                return out
            await asyncio.sleep(0.2)
        raise Failure("job_stuck", f"job {job_id} not finished {timeout:.0f} s later")

    async def cancel(self) -> None:
        job = await self.post_json("/run", self.native_job(4 * self.max_tokens, True))
        await asyncio.sleep(self.rng.uniform(0.0, 1.0))
        await self.post_json(f"/cancel/{job['id']}", None)
        out = await self.wait_terminal(job["id"])
        if out["status"] == "FAILED":
            raise Failure("job_failed", json.dumps(out)[:300])

    async def runsync(self) -> None:
        body = self.native_job(self.tokens(), False)
        out = await self.post_json("/runsync?wait=120000", body)
        if out["status"] != "COMPLETED":
            out = await self.wait_terminal(out["id"], REQUEST_TIMEOUT_S)
        if out["status"] != "COMPLETED":
            raise Failure("job_failed", json.dumps(out)[:300])

    async def run_stream(self) -> None:
        job = await self.post_json("/run", self.native_job(self.tokens(), True))
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while time.monotonic() < deadline:
            out = await self.post_json(f"/stream/{job['id']}", None)
            if "error" in out or out["status"] == "FAILED":
                raise Failure("job_failed", json.dumps(out)[:300])
            if out["status"] == "COMPLETED":
                return
        raise Failure("job_stuck", f"job {job['id']} not finished in {REQUEST_TIMEOUT_S:.0f} s")

    async def bad(self) -> str:
        """A request that must be refused (4xx, or a FAILED job); returns which one it was."""
        chat = "/openai/v1/chat/completions"
        cases: list[tuple[str, str, Any]] = [
            ("temperature=-1", chat, self.chat_body(temperature=-1)),
            ("n=0", chat, self.chat_body(n=0)),
            ("max_tokens=-5", chat, self.chat_body(max_tokens=-5)),
            ("top_logprobs=50", chat, self.chat_body(logprobs=True, top_logprobs=50)),
            ("unknown model", chat, self.chat_body(model="no-such-model")),
            ("messages not a list", chat, {"model": self.model, "messages": "hi"}),
            ("stop not strings", chat, self.chat_body(stop=[1, 2])),
            ("invalid guided_regex", chat, self.chat_body(guided_regex="(unclosed")),
            ("malformed JSON", chat, b'{"model": "x", "messages": ['),
            (
                "prompt over MAX_MODEL_LEN",
                "/openai/v1/completions",
                self.completion_body(prompt="word " * 20000, stream=True),
            ),
            ("job: malformed JSON", "/run", b'{"input": {'),
            ("job: input not an object", "/run", {"input": "hello"}),
            ("job: unknown id", "/status/no-such-job", None),
            (
                "job: bad sampling param",
                "/runsync",
                {"input": {"prompt": "hi", "sampling_params": {"top_k": "x"}}},
            ),
        ]
        name, path, body = self.rng.choice(cases)
        self.last = {"case": name, "path": path, "body": _short(body) if body else body}
        if isinstance(body, bytes):
            r = await self.http.post(
                path, content=body, headers={"content-type": "application/json"}
            )
        else:
            r = await self.http.post(path, json=body)
        self.stats.statuses[r.status_code] += 1
        if r.status_code >= 500:
            raise Failure("http_5xx", f"{name}: {r.status_code}: {r.text[:300]}")
        if 400 <= r.status_code < 500:
            self.stats.expected_4xx[r.status_code] += 1
            return name
        if r.status_code == 200 and path.startswith("/runsync"):
            out = r.json()
            if out.get("status") == "FAILED":  # the job routes refuse a bad job this way
                self.stats.expected_4xx["job FAILED"] += 1
                return name
        raise Failure("bad_accepted", f"{name}: {r.status_code}: {r.text[:300]}")


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""


async def run_one(client: Client, kind: str) -> None:
    """One request of `kind`, its outcome counted in the client's stats."""
    client.last = {}
    t = time.monotonic()
    try:
        await getattr(client, kind)()
        client.stats.ok(kind, time.monotonic() - t)
    except Failure as f:
        client.stats.error(f.kind, kind, client.last, str(f))
    except httpx.TimeoutException as e:
        client.stats.error("timeout", kind, client.last, repr(e))
    except httpx.TransportError as e:
        client.stats.error("connection", kind, client.last, repr(e))
    except (ValueError, KeyError, TypeError, IndexError) as e:
        client.stats.error("bad_body", kind, client.last, repr(e))


async def client_loop(
    client: Client, mix: dict[str, int], deadline: float, stop: asyncio.Event
) -> None:
    kinds, weights = list(mix), list(mix.values())
    while time.monotonic() < deadline and not stop.is_set():
        await run_one(client, client.rng.choices(kinds, weights)[0])


async def warm_up(clients: list[Client], kinds: list[str]) -> None:
    """Every client sends every kind once, in its own order: the first request down each path
    grows the server's memory once (allocator pools for new shapes, compiled grammars, ...),
    which belongs before the baseline, not in the run."""

    async def one(client: Client) -> None:
        order = list(kinds)
        client.rng.shuffle(order)
        for kind in order:
            await run_one(client, kind)

    await asyncio.gather(*(one(c) for c in clients))


@dataclass
class Monitor:
    """Samples the server's RSS and /health while the load runs, and per window the cores this
    benchmark and the server used and those other processes kept busy (on a shared machine a
    slow window may be someone else's doing); notices a dead server."""

    proc: subprocess.Popen
    port: int
    t0: float
    duration: float
    rss: list[tuple[float, float]] = field(default_factory=list)  # (seconds in, MiB)
    min_free_blocks: int | None = None
    max_in_flight: list[int] = field(default_factory=lambda: [0] * WINDOWS)
    cpu: list[tuple[float | None, float | None]] = field(default_factory=list)  # (own, others)
    health_failures: int = 0
    max_health_s: float = 0.0
    died_at: float | None = None

    def sample_rss(self) -> None:
        value = rss_mib(self.proc.pid)
        if value is not None:
            self.rss.append((time.monotonic() - self.t0, value))

    def _window(self) -> int:
        return min(WINDOWS - 1, int((time.monotonic() - self.t0) / self.duration * WINDOWS))

    async def run(self, deadline: float, stop: asyncio.Event, every: float) -> None:
        window = 0
        cpu = CpuCompetition(pids=[self.proc.pid]).__enter__()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}") as http:
            while time.monotonic() < deadline and not stop.is_set():
                if self.proc.poll() is not None:
                    self.died_at = time.monotonic() - self.t0
                    stop.set()
                    break
                if self._window() != window:
                    cpu.__exit__(None, None, None)
                    self.cpu.append((cpu.own_cores, cpu.other_cores))
                    window = self._window()
                    cpu = CpuCompetition(pids=[self.proc.pid]).__enter__()
                self.sample_rss()
                t = time.monotonic()
                try:
                    health = (await http.get("/health", timeout=30)).json()
                    engine = health.get("engine") or {}
                    free = engine.get("kvBlocksFree")
                    if free is not None:
                        if self.min_free_blocks is None or free < self.min_free_blocks:
                            self.min_free_blocks = free
                    in_flight = engine.get("requests") or 0
                    self.max_in_flight[window] = max(self.max_in_flight[window], in_flight)
                except (httpx.HTTPError, ValueError):
                    self.health_failures += 1
                self.max_health_s = max(self.max_health_s, time.monotonic() - t)
                await asyncio.sleep(max(0.0, min(every - (time.monotonic() - t), deadline - t)))
        cpu.__exit__(None, None, None)
        self.cpu.append((cpu.own_cores, cpu.other_cores))
        self.sample_rss()

    def rss_at(self, seconds: float) -> float | None:
        """The last sample taken at or before `seconds` into the run."""
        before = [v for t, v in self.rss if t <= seconds]
        return before[-1] if before else (self.rss[0][1] if self.rss else None)


async def fill_kv_pool(
    http: httpx.AsyncClient, model: str, num_blocks: int, max_model_len: int, vocab_size: int
) -> None:
    """Has every KV block written once, with prompts of random token ids (nothing cached to
    share) that together need the whole pool: untouched cache pages cost no memory until first
    written, so without this the server's RSS grows for as long as the LRU free list takes to
    reach every block, which would read as a leak."""
    rng = random.Random(12345)
    # Short prompts keep attention cheap; together they need every block, and as the free list
    # hands out never-used blocks before freed ones, every block gets written.
    length = max(1, min(512, max_model_len - PAGE_SIZE))
    count = math.ceil(num_blocks * PAGE_SIZE / length) + 1
    high = max(2, min(vocab_size, 30_000))

    async def one() -> None:
        prompt = [rng.randrange(1, high) for _ in range(length)]
        body = {"model": model, "prompt": prompt, "max_tokens": 1}
        # No timeout: on a busy machine the prefill of the whole pool can take minutes.
        r = await http.post("/openai/v1/completions", json=body, timeout=None)
        if r.status_code != 200:
            raise RuntimeError(f"filling the KV pool: {r.status_code} {r.text[:300]}")

    await asyncio.gather(*(one() for _ in range(count)))


def vocab_size_of(model_dir: str) -> int:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return 256
    return int(config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size", 256))


async def settle(port: int, timeout: float = 60.0) -> dict[str, Any] | None:
    """/health once nothing is left running (or `timeout` seconds on)."""
    deadline = time.monotonic() + timeout
    health = None
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        while time.monotonic() < deadline:
            try:
                health = (await http.get("/health", timeout=10)).json()
            except (httpx.HTTPError, ValueError):
                health = None
            if health is not None:
                idle = health["jobs"]["inProgress"] == 0 and health["jobs"]["inQueue"] == 0
                if idle and (health.get("engine") or {}).get("requests", 0) == 0:
                    return health
            await asyncio.sleep(0.5)
    return health


async def soak(args: argparse.Namespace, proc: subprocess.Popen, port: int, model: str) -> dict:
    duration = args.minutes * 60
    base = f"http://127.0.0.1:{port}"
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=64)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    loaded_rss = rss_mib(proc.pid)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as http:
        log(f"warm-up: every one of the {args.kv_blocks} KV blocks written once")
        t = time.monotonic()
        await fill_kv_pool(http, model, args.kv_blocks, args.max_model_len, args.vocab_size)
        log(f"  {time.monotonic() - t:.0f} s")
        warm_stats = Stats(time.monotonic(), 1.0)
        warm = []
        for i in range(min(8, args.concurrency)):
            c = Client(http, model, warm_stats, random.Random(-1 - i))
            c.max_tokens = args.max_tokens
            warm.append(c)
        log(f"warm-up: {len(warm)} clients send each kind of request once")
        t = time.monotonic()
        await warm_up(warm, list(args.mix))
        slowest = sorted(((max(v), k) for k, v in warm_stats.latency.items()), reverse=True)
        log(
            f"  {time.monotonic() - t:.0f} s; slowest: "
            + ", ".join(f"{k} {sec:.1f} s" for sec, k in slowest[:4])
        )
        start_rss = rss_mib(proc.pid)

        t0 = time.monotonic()
        deadline = t0 + duration
        stats = Stats(t0, duration)
        monitor = Monitor(proc, port, t0, duration)
        stop = asyncio.Event()
        clients = []
        for i in range(args.concurrency):
            c = Client(http, model, stats, random.Random(args.seed * 100_003 + i))
            c.max_tokens = args.max_tokens
            clients.append(c)
        log(f"{args.concurrency} clients for {duration:.0f} s")
        every = min(2.0, max(0.25, duration / 120))
        monitor_task = asyncio.create_task(monitor.run(deadline, stop, every))
        await asyncio.gather(*(client_loop(c, args.mix, deadline, stop) for c in clients))
        load_s = time.monotonic() - t0
        stop.set()
        await monitor_task
        monitor.sample_rss()
    log(f"load stopped after {load_s:.0f} s; waiting for the engine to go idle")
    health = await settle(port) if proc.poll() is None else None
    end_rss = rss_mib(proc.pid)
    return {
        "stats": stats,
        "warm_stats": warm_stats,
        "monitor": monitor,
        "loaded_rss": loaded_rss,
        "start_rss": start_rss,
        "after_drain_rss": end_rss,
        "health": health,
        "load_s": load_s,
    }


def _fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def build_report(args: argparse.Namespace, res: dict, proc: subprocess.Popen) -> dict[str, Any]:
    stats: Stats = res["stats"]
    monitor: Monitor = res["monitor"]
    duration = stats.duration
    died = monitor.died_at is not None or proc.poll() is not None
    health = res["health"] or {}
    engine = health.get("engine") or {}
    free, total = engine.get("kvBlocksFree"), engine.get("kvBlocksTotal")
    leaked = None if free is None or total is None else total - free
    rss = {
        "loaded": res["loaded_rss"],
        "start": res["start_rss"],
        "first_sixth": monitor.rss_at(duration / WINDOWS),
        "middle": monitor.rss_at(duration / 2),
        "end": monitor.rss_at(res["load_s"]),
        "after_drain": res["after_drain_rss"],
    }
    windows = []
    for w in range(WINDOWS):
        samples = stats.ttft[w]
        windows.append(
            {
                "index": w + 1,
                "start_s": duration * w / WINDOWS,
                "end_s": duration * (w + 1) / WINDOWS,
                "requests": stats.done_per_window[w],
                "errors": stats.errors_per_window[w],
                "ttft_samples": len(samples),
                "ttft_p50_s": percentile(samples, 50),
                "ttft_p99_s": percentile(samples, 99),
                "rss_mib": monitor.rss_at(duration * (w + 1) / WINDOWS),
                "max_engine_requests": monitor.max_in_flight[w],
                "own_cores": monitor.cpu[w][0] if w < len(monitor.cpu) else None,
                "other_cores": monitor.cpu[w][1] if w < len(monitor.cpu) else None,
            }
        )
    warm: Stats = res["warm_stats"]
    http_5xx = stats.errors.get("http_5xx", 0) + warm.errors.get("http_5xx", 0)
    unexpected = sum(stats.errors.values()) + sum(warm.errors.values())
    rss_growth = (
        None
        if rss["end"] is None or not rss["first_sixth"]
        else rss["end"] / rss["first_sixth"] - 1
    )
    first_p99, last_p99 = windows[0]["ttft_p99_s"], windows[-1]["ttft_p99_s"]
    ttft_ratio = None if not first_p99 or last_p99 is None else last_p99 / first_p99
    checks = {
        "no_worker_deaths": not died,
        "no_5xx": http_5xx == 0,
        "no_leaked_blocks": leaked == 0,
        "rss_growth_within_5pct": rss_growth is not None and rss_growth <= BAR_RSS_GROWTH,
        "ttft_p99_last_within_1.5x_first": ttft_ratio is not None and ttft_ratio <= BAR_TTFT_RATIO,
    }
    return {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "kv_blocks_setting": args.kv_blocks,
        "kinds": list(args.mix),
        "load_s": res["load_s"],
        "served": dict(stats.served),
        "served_total": sum(stats.served.values()),
        "latency_s": {
            k: {"p50": percentile(v, 50), "p99": percentile(v, 99), "max": max(v)}
            for k, v in stats.latency.items()
        },
        "expected_4xx": {str(k): v for k, v in stats.expected_4xx.items()},
        "errors": dict(stats.errors),
        "warmup_served": sum(warm.served.values()),
        "warmup_errors": dict(warm.errors),
        "warmup_error_examples": warm.examples,
        "unexpected_errors": unexpected,
        "http_5xx": http_5xx,
        "error_examples": stats.examples,
        "http_statuses": {str(k): v for k, v in sorted(stats.statuses.items())},
        "worker_deaths": int(died),
        "server_exit_code": proc.poll(),
        "server_error_log_lines": None,  # filled in by main
        "rss_mib": rss,
        "rss_growth": rss_growth,
        "kv_blocks": {
            "free": free,
            "total": total,
            "leaked": leaked,
            "min_free_during_run": monitor.min_free_blocks,
            "engine_requests_at_end": engine.get("requests"),
            "jobs_at_end": health.get("jobs"),
        },
        "health": {"failures": monitor.health_failures, "slowest_s": monitor.max_health_s},
        "windows": windows,
        "ttft_p99_ratio": ttft_ratio,
        "checks": checks,
        "passed": all(checks.values()),
    }


def print_report(report: dict[str, Any]) -> None:
    info = machine_info()
    print(
        f"{info.get('cpu')}, {info.get('cores')} cores; {report['concurrency']} clients for "
        f"{report['load_s']:.0f} s (--minutes {report['minutes']}), seed {report['seed']}, "
        f"max_tokens <= {report['max_tokens']}, {report['kv_blocks_setting']} KV blocks"
    )
    print()
    rows = []
    for k in MIX:
        lat = report["latency_s"].get(k) or {}
        rows.append([k, report["served"].get(k, 0), _fmt(lat.get("p50")), _fmt(lat.get("max"))])
    rows.append(["total", report["served_total"], "", ""])
    print(format_table(["served", "requests", "seconds p50", "seconds max"], rows))
    print()
    print(
        "bad requests refused as expected: "
        + (", ".join(f"{k}: {v}" for k, v in sorted(report["expected_4xx"].items())) or "none")
    )
    errs = report["errors"]
    print(
        "unexpected errors: "
        + (", ".join(f"{k}: {v}" for k, v in sorted(errs.items())) if errs else "none")
    )
    for kind, shown in report["error_examples"].items():
        for ex in shown:
            print(f"  {kind} at {ex['at_s']} s ({ex['kind']}): {ex['request']}: {ex['detail']}")
    werrs = report["warmup_errors"]
    print(
        f"warm-up before the run: {report['warmup_served']} served, unexpected errors: "
        + (", ".join(f"{k}: {v}" for k, v in sorted(werrs.items())) if werrs else "none")
    )
    for kind, shown in report["warmup_error_examples"].items():
        for ex in shown:
            print(f"  {kind} ({ex['kind']}): {ex['request']}: {ex['detail']}")
    print(
        f"server: {report['worker_deaths']} deaths (exit code {report['server_exit_code']}), "
        f"{report['server_error_log_lines']} ERROR/Traceback log lines; /health "
        f"{report['health']['failures']} failures, slowest {report['health']['slowest_s']:.2f} s"
    )
    print()
    rows = []
    for w in report["windows"]:
        rows.append(
            [
                w["index"],
                f"{w['start_s']:.0f}-{w['end_s']:.0f} s",
                w["requests"],
                w["errors"],
                w["ttft_samples"],
                _fmt(w["ttft_p50_s"], " s"),
                _fmt(w["ttft_p99_s"], " s"),
                _fmt(w["rss_mib"], " MiB"),
                w["max_engine_requests"],
                _fmt(w["own_cores"]),
                _fmt(w["other_cores"]),
            ]
        )
    print(
        format_table(
            [
                "window",
                "time",
                "served",
                "errors",
                "TTFTs",
                "TTFT p50",
                "TTFT p99",
                "RSS at end",
                "engine reqs (max)",
                "bench+server cores",
                "others' cores",
            ],
            rows,
        )
    )
    rss = report["rss_mib"]
    print(
        "others' cores: CPU other processes kept busy in that window (near 0: a clean run); "
        "bench+server cores: what the clients and the server used"
    )
    print(
        f"RSS: loaded {_fmt(rss['loaded'])} MiB, start (KV pool written, warmed up) "
        f"{_fmt(rss['start'])}, after first sixth {_fmt(rss['first_sixth'])}, "
        f"middle {_fmt(rss['middle'])}, end {_fmt(rss['end'])}, "
        f"after drain {_fmt(rss['after_drain'])}"
    )
    kv = report["kv_blocks"]
    print(
        f"KV blocks at the end: {kv['free']} free of {kv['total']} (leaked {kv['leaked']}); "
        f"fewest free during the run {kv['min_free_during_run']}"
    )
    print()
    growth, ratio = report["rss_growth"], report["ttft_p99_ratio"]
    lines = {
        "no_worker_deaths": f"worker deaths {report['worker_deaths']} (bar 0)",
        "no_5xx": f"5xx responses {report['http_5xx']} (bar 0)",
        "no_leaked_blocks": f"leaked KV blocks {kv['leaked']} (bar 0)",
        "rss_growth_within_5pct": "RSS end vs after first sixth "
        + ("-" if growth is None else f"{growth:+.1%}")
        + f" (bar <= +{BAR_RSS_GROWTH:.0%})",
        "ttft_p99_last_within_1.5x_first": "TTFT p99 last sixth / first "
        + _fmt(ratio, "x")
        + f" (bar <= {BAR_TTFT_RATIO}x)",
    }
    for key, text in lines.items():
        print(f"{'PASS' if report['checks'][key] else 'FAIL'}  {text}")
    print(
        f"SUMMARY served={report['served_total']} unexpected_errors={report['unexpected_errors']} "
        f"http_5xx={report['http_5xx']} deaths={report['worker_deaths']} "
        f"leaked_blocks={kv['leaked']} rss_growth="
        + ("-" if growth is None else f"{growth:+.3f}")
        + " ttft_p99_ratio="
        + ("-" if ratio is None else f"{ratio:.2f}")
        + f" passed={int(report['passed'])}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    ap.add_argument("--concurrency", type=int, default=32, help="client workers")
    ap.add_argument("--max-tokens", type=int, default=64, help="most tokens a request asks for")
    ap.add_argument(
        "--kv-blocks",
        type=int,
        default=384,
        help="the server's KV pool (NUM_GPU_BLOCKS_OVERRIDE, blocks of 16 tokens), about 3x "
        "what 32 clients hold at once; every block is written once before the run starts",
    )
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="model directory (default: embedded SmolLM2)")
    ap.add_argument(
        "--tiny", action="store_true", help="CI smoke size: 6 s, 4 clients, max_tokens <= 16"
    )
    ap.add_argument(
        "--only",
        default=None,
        help="comma-separated kinds to send, from: " + ", ".join(MIX) + " (default: all)",
    )
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    args.mix = dict(MIX)
    if args.only:
        kinds = [k.strip() for k in args.only.split(",") if k.strip()]
        unknown = [k for k in kinds if k not in MIX]
        if unknown or not kinds:
            ap.error(f"--only: unknown kinds {unknown}; choose from {', '.join(MIX)}")
        args.mix = {k: MIX[k] for k in kinds}
    if args.tiny:
        args.minutes, args.concurrency, args.max_tokens = 0.1, 4, 16
        args.kv_blocks, args.max_model_len = 256, 512
    model_dir = args.model or default_model_dir()
    args.vocab_size = vocab_size_of(model_dir)

    port = free_port()
    settings = {
        "DTYPE": "float32",
        "MAX_MODEL_LEN": str(args.max_model_len),
        "BLOCK_SIZE": str(PAGE_SIZE),
        "NUM_GPU_BLOCKS_OVERRIDE": str(args.kv_blocks),
        "MAX_NUM_BATCHED_TOKENS": str(BATCH_TOKENS),
        "MAX_CONCURRENCY": str(max(64, 2 * args.concurrency)),
        "DISABLE_LOG_REQUESTS": "1",
        "DISABLE_LOG_STATS": "1",
    }
    log(f"endpoint on port {port}: load")
    server = start_server(model_dir, port, settings)
    output = ServerOutput(server)
    try:
        model = httpx.get(f"http://127.0.0.1:{port}/openai/v1/models").json()["data"][0]["id"]
        res = asyncio.run(soak(args, server, port, model))
        report = build_report(args, res, server)
    finally:
        stop_process(server)
    output.join(10)
    report["server_error_log_lines"] = output.error_lines + output.tracebacks
    if report["worker_deaths"] or report["server_error_log_lines"]:
        report["server_log_tail"] = list(output.tail)[-60:]
        print("server log tail:\n  " + "\n  ".join(report["server_log_tail"]), file=sys.stderr)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

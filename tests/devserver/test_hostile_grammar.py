"""Adversarial grammars at the local endpoint (issue 14 item 3): a regex and a JSON schema that
would take xgrammar seconds each get a 400 within the compile limit, while a concurrent stream
keeps its pace: compiling runs in low-priority processes that are killed at the limit. The
server runs in its own process, so the timings never share this one's interpreter lock."""

from __future__ import annotations

import re
import signal
import threading
import time

import httpx

from tests.devserver.test_main import run_devserver

LIMIT_S = 1.0
# Each takes several seconds to compile (the work grows with the square of the alternatives). The
# schema is over the default GRAMMAR_MAX_CHARS, which would refuse it at once: the size limit is
# off here so that the time limit is what stops it.
SLOW_REGEX = "(a|b|c|d|e|f|g)" * 3000
SLOW_SCHEMA = {
    "type": "object",
    "properties": {"code": {"enum": [f"value-{i}" for i in range(60_000)]}},
    "required": ["code"],
}


def start(tiny_llama: str, tmp_path) -> tuple:
    proc = run_devserver(
        {
            "MODEL_NAME": tiny_llama,
            "BASE_PATH": str(tmp_path),
            "DEVICE": "cpu",
            "MAX_MODEL_LEN": "512",
            "NUM_KV_BLOCKS": "128",
            "GRAMMAR_COMPILE_TIMEOUT": str(LIMIT_S),
            "GRAMMAR_MAX_CHARS": "0",
            "DEFAULT_BATCH_SIZE": "1",  # one event per token: the stream's pace is visible
            "DEFAULT_MIN_BATCH_SIZE": "1",
        },
        "--port",
        "0",
        "--log-level",
        "warning",
    )
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        match = re.search(r"ready at (http://127\.0\.0\.1:\d+)", line)
        if match:
            return proc, match.group(1) + "/openai/v1"
    proc.kill()
    raise AssertionError("".join(lines))


def chat(base: str, extra: dict, timeout: float = 60) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    return httpx.post(f"{base}/chat/completions", json=body, timeout=timeout)


def test_adversarial_grammars_fail_within_the_limit_while_a_stream_flows(tiny_llama, tmp_path):
    proc, base = start(tiny_llama, tmp_path)
    try:
        # Two grammars at once, so both compile processes are up before the clock starts.
        warm = [
            threading.Thread(target=chat, args=(base, {"guided_regex": "(a|b|c)" * 200})),
            threading.Thread(target=chat, args=(base, {"guided_regex": "(d|e|f)" * 200})),
        ]
        for t in warm:
            t.start()
        for t in warm:
            t.join()

        streams: list[list[float]] = []
        stop = threading.Event()

        def consume():
            body = {
                "prompt": "x",
                "max_tokens": 400,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            while not stop.is_set():
                stamps: list[float] = []
                streams.append(stamps)
                with httpx.stream("POST", f"{base}/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            stamps.append(time.monotonic())

        consumer = threading.Thread(target=consume)
        consumer.start()
        # The idle pace: enough gaps to average, however slow the machine is today.
        deadline = time.monotonic() + 60
        while sum(max(len(x) - 2, 0) for x in streams) < 60 and time.monotonic() < deadline:
            time.sleep(0.05)
        sent_at = time.monotonic()
        answers: dict[str, tuple[httpx.Response, float]] = {}

        def send(name: str, extra: dict) -> None:
            t0 = time.monotonic()
            answers[name] = (chat(base, extra), time.monotonic() - t0)

        hostile = [
            threading.Thread(target=send, args=("regex", {"guided_regex": SLOW_REGEX})),
            threading.Thread(target=send, args=("json", {"guided_json": SLOW_SCHEMA})),
        ]
        for t in hostile:
            t.start()
        for t in hostile:
            t.join(30)
        done_at = time.monotonic()
        stop.set()
        consumer.join(60)
        assert chat(base, {"guided_choice": ["yes", "no"]}).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)

    for name, param in (("regex", "guided_regex"), ("json", "guided_json")):
        response, took = answers[name]
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param, error
        assert f"took more than {LIMIT_S:g} s to compile" in error["message"], error
        assert took < LIMIT_S + 1.5, (name, took)
    # Gaps between a stream's tokens (not the first: that one holds the prefill), before the
    # hostile requests and while they were compiling.
    idle, busy = [], []
    for stamps in streams:
        for a, b in zip(stamps[1:], stamps[2:]):
            if b <= sent_at:
                idle.append(b - a)
            elif a >= sent_at and b <= done_at:
                busy.append(b - a)
    assert len(idle) >= 50 and len(busy) >= 5, (len(idle), len(busy))
    idle_mean, busy_mean = sum(idle) / len(idle), sum(busy) / len(busy)
    print(f"\ninter-token: idle {idle_mean * 1e3:.2f} ms, compiling {busy_mean * 1e3:.2f} ms")
    assert busy_mean < 2 * idle_mean, (busy_mean, idle_mean)

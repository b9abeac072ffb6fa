"""Graceful shutdown of the deployed worker (issue 14 item 2), through the RunPod SDK's real job
loop against a fake job API: on SIGTERM the worker takes no new jobs, lets running ones finish
for SHUTDOWN_GRACE_SECONDS, ends the rest with the shutdown error as their posted result, and
exits 0; a second signal exits at once. The worker runs in a subprocess (signals reach only a
main thread) around the fake worker, whose streams are slow on purpose."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.worker.fake_platform import FakePlatform

REPO = Path(__file__).resolve().parents[2]

WORKER = """
import sys
from serverless_llm.worker.shutdown import GracefulShutdown, serve
from tests.devserver.fake_worker import FakeWorker

config = {"return_aggregate_stream": True, "concurrency_modifier": lambda current: 16}
serve(GracefulShutdown(FakeWorker(), float(sys.argv[1])), config)
print("EXITED CLEANLY", flush=True)
"""


@pytest.fixture
def platform():
    p = FakePlatform().start()
    yield p
    p.stop()


def start_worker(
    platform: FakePlatform, grace: float, log, argv: list[str] | None = None, **env_vars: str
) -> subprocess.Popen:
    """The fake worker under `serve` (or `argv`), pointed at `platform`, logging to `log`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOD_")}
    env.update(platform.env(), **env_vars)
    return subprocess.Popen(
        argv or [sys.executable, "-c", WORKER, str(grace)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )


def sigterm_and_wait(proc: subprocess.Popen, within: float) -> float:
    """Sends SIGTERM and waits for the exit; the seconds it took, asserted under `within`."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=within)
    elapsed = time.monotonic() - t0
    assert elapsed < within
    return elapsed


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def output_of(log) -> str:
    log.seek(0)
    return log.read()


def logged_so_far(log) -> str:
    """What the running worker has written to `log` (read at an offset: the file's position is
    shared with the worker's writes and must not move)."""
    fd = log.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def sigterm_and_wait_draining(proc: subprocess.Popen, log) -> None:
    """Sends SIGTERM and returns once the worker has taken it (its handler logs the line after
    setting `draining`), rather than after a guessed time."""
    proc.send_signal(signal.SIGTERM)
    line = f"signal {int(signal.SIGTERM)}: finishing"
    wait_until(lambda: line in logged_so_far(log) or proc.poll() is not None, 60, line)


def test_sigterm_finishes_short_jobs_ends_the_rest_and_exits_0(platform):
    grace = 1.5
    ids = [f"job-{i}" for i in range(8)]
    for i, job_id in enumerate(ids):
        # Two short jobs end inside the grace period; six would take 20 s.
        platform.add(
            job_id, {"items": 5, "delay": 0.1} if i < 2 else {"items": 1000, "delay": 0.02}
        )
    with tempfile.TemporaryFile("w+") as log:
        proc = start_worker(platform, grace, log)
        try:
            wait_until(lambda: len(platform.snapshot()[1]) == len(ids), 60, "every job to stream")
            t0 = time.monotonic()
            sigterm_and_wait_draining(proc, log)
            platform.add("late", {"items": 1})  # after the signal: refused if taken at all
            proc.wait(timeout=grace + 12)  # margin for a busy machine; the six take 20 s
            elapsed = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
        out = output_of(log)
    assert proc.returncode == 0, out
    assert "EXITED CLEANLY" in out and "Traceback" not in out, out
    assert elapsed < grace + 12
    taken, streamed, results = platform.snapshot()
    assert set(ids) <= set(results), (sorted(results), out)
    completed, cut = [], []
    for job_id in ids:
        result = results[job_id]
        if "error" in result:
            assert "shut down before this request finished" in result["error"], result
            cut.append(job_id)
        else:
            assert len(result["output"]) == 5, result
            completed.append(job_id)
    assert completed == ids[:2] and cut == ids[2:]
    if "late" in taken:
        assert "shutting down" in results["late"]["error"], results["late"]


def test_an_idle_worker_exits_0_at_once(platform):
    with tempfile.TemporaryFile("w+") as log:
        proc = start_worker(platform, 30, log)
        try:
            platform.add("warm", {"items": 1})
            wait_until(lambda: "warm" in platform.snapshot()[2], 60, "a first job's result")
            sigterm_and_wait(proc, 20)  # not the SDK's 90 s long poll, nor the 30 s grace
        finally:
            if proc.poll() is None:
                proc.kill()
        out = output_of(log)
    assert proc.returncode == 0, out
    assert "EXITED CLEANLY" in out, out


def test_a_second_signal_exits_at_once(platform):
    platform.add("long", {"items": 1000, "delay": 0.02})
    with tempfile.TemporaryFile("w+") as log:
        proc = start_worker(platform, 30, log)
        try:
            wait_until(lambda: "long" in platform.snapshot()[1], 60, "the job to stream")
            sigterm_and_wait_draining(proc, log)  # a second signal sent too soon could merge
            assert proc.poll() is None  # draining: up to 30 s
            sigterm_and_wait(proc, 20)  # well under the 30 s grace
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM


def test_the_deployed_worker_on_a_real_model_ends_its_jobs_and_exits_0(platform, tiny_llama):
    """`python -m serverless_llm.worker` itself: the engine's threads and the grammar compile
    processes must not hold the exit. Grace 0: whatever runs at the signal is cut."""
    ids = [f"gen-{i}" for i in range(4)]
    for job_id in ids:
        sampling = {"max_tokens": 480, "ignore_eos": True, "temperature": 0}
        platform.add(job_id, {"prompt": "hello", "sampling_params": sampling, "stream": True})
    with tempfile.TemporaryFile("w+") as log:
        proc = start_worker(
            platform,
            0,
            log,
            [sys.executable, "-m", "serverless_llm.worker"],
            MODEL_NAME=tiny_llama,
            SHUTDOWN_GRACE_SECONDS="0",
            MAX_CONCURRENCY="8",
        )
        try:
            wait_until(lambda: len(platform.snapshot()[1]) == len(ids), 120, "every job to stream")
            sigterm_and_wait(proc, 20)  # a margin for a busy machine
        finally:
            if proc.poll() is None:
                proc.kill()
        out = output_of(log)
    assert proc.returncode == 0, out
    assert "worker stopped" in out and "Traceback" not in out, out
    _, _, results = platform.snapshot()
    for job_id in ids:
        result = results[job_id]
        assert "output" in result or "shut down before" in result["error"], result


FATAL_WORKER = """
import sys
from serverless_llm.worker.shutdown import GracefulShutdown, serve
from tests.devserver.fake_worker import FakeWorker

config = {"return_aggregate_stream": True, "concurrency_modifier": lambda current: 16}
shutdown = GracefulShutdown(FakeWorker(), 30.0)
worker_handle = shutdown.handle

async def handle(job):
    async for item in worker_handle(job):
        yield item
    if job["input"].get("die"):  # what the worker's engine does when a rank dies
        shutdown.fail(RuntimeError("tensor-parallel rank 1 died (exit code -9)"))

shutdown.handle = handle
serve(shutdown, config)
sys.exit(shutdown.exit_code)
"""


def test_an_engine_that_can_never_serve_again_makes_the_worker_exit_1(platform):
    """A fatal engine error (a tensor-parallel rank died) stops the job intake, lets the
    results be posted, and exits non-zero, so the platform replaces the worker."""
    with tempfile.TemporaryFile("w+") as log:
        proc = start_worker(platform, 30, log, argv=[sys.executable, "-c", FATAL_WORKER])
        try:
            platform.add("last", {"items": 1, "die": True})
            proc.wait(timeout=30)  # not the 30 s grace: nothing is left running
        finally:
            if proc.poll() is None:
                proc.kill()
        out = output_of(log)
    assert proc.returncode == 1, out
    assert "last" in platform.snapshot()[2], out  # its result was posted before the exit
    assert "the engine stopped" in out, out

"""Graceful shutdown of the deployed worker (the RunPod SDK's job loop).

The platform sends SIGTERM before it stops a worker. The SDK's own handling stops taking jobs and
then waits, with no limit, for the running ones; the platform's kill then cuts them without a
result, and an idle worker sits in the SDK's long polls for up to 90 s. Here, instead:

- the first SIGTERM or SIGINT stops the job intake; a job that still arrives gets the shutdown
  error at once (OpenAI jobs: a 503 error object; native jobs: `{"error": ...}`);
- running jobs get `SHUTDOWN_GRACE_SECONDS` to finish; each one still running after that ends
  with the shutdown error as its last item, which the SDK posts as the job's result, and its
  engine request is aborted;
- once every result is posted the engine stops, the SDK's polls are cancelled and the process
  exits 0; a second signal exits at once.

The SDK builds `rp_scale.JobScaler` by attribute lookup when it starts, so `serve` installs a
subclass there whose signal handler calls `GracefulShutdown.on_signal`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..api.errors import native_error
from ..api.openai import openai_error

logger = logging.getLogger(__name__)

REFUSED_MESSAGE = "the worker is shutting down; send the request again"
SHUTDOWN_MESSAGE = "the worker shut down before this request finished"
POST_RESULTS_TIMEOUT_S = 10.0  # for the SDK to post the last results once the jobs have ended
_END = object()


class HandlesJobs(Protocol):
    def handle(self, job: dict[str, Any]) -> AsyncIterator[Any]: ...

    async def shutdown(self) -> None: ...


def shutdown_error(job: Any, message: str) -> dict[str, Any]:
    """The error item in the shape of the job's route."""
    inp = job.get("input") if isinstance(job, dict) else None
    if isinstance(inp, dict) and "openai_route" in inp:
        return openai_error(message, type="server_error", code="shutting_down", status=503)
    return native_error(message)


@dataclass(eq=False)
class _Running:
    task: asyncio.Task | None
    waiting: bool = False  # awaiting the worker's next item (not suspended at a yield)
    cancelled_here: bool = False


@dataclass
class GracefulShutdown:
    """Wraps the worker's handler for the SDK and runs the shutdown described above."""

    worker: HandlesJobs
    grace_s: float
    exit_now: Callable[[int], Any] = os._exit
    signal_self: Callable[[], Any] = lambda: os.kill(os.getpid(), signal.SIGTERM)
    exit_code: int = 0  # what the process exits with once drained (1 after a fatal error)
    draining: bool = False
    aborting: bool = False
    finished: bool = False
    _running: set[_Running] = field(default_factory=set)
    _loop: asyncio.AbstractEventLoop | None = None
    _drain_task: asyncio.Task | None = None

    # -- the handler ---------------------------------------------------------------------------

    async def handle(self, job: dict[str, Any]) -> AsyncIterator[Any]:
        if self.draining:
            yield shutdown_error(job, REFUSED_MESSAGE)
            return
        run = _Running(asyncio.current_task())
        self._running.add(run)
        try:
            async with aclosing(self.worker.handle(job)) as items:
                while not self.aborting:
                    run.waiting = True
                    try:
                        item = await anext(items, _END)
                    finally:
                        run.waiting = False
                    if item is _END:
                        return
                    yield item
        except asyncio.CancelledError:
            if not run.cancelled_here:
                raise  # the platform stopped this job, or the loop is going away
            uncancel = getattr(run.task, "uncancel", None)  # Python 3.11+
            if uncancel is not None:
                uncancel()
        finally:
            self._running.discard(run)
        # Only an abort gets here: the worker's generator is closed (its request aborted).
        yield shutdown_error(job, SHUTDOWN_MESSAGE)

    @property
    def running(self) -> int:
        return len(self._running)

    # -- the signal ----------------------------------------------------------------------------

    def fail(self, exc: BaseException) -> None:
        """The engine can never serve again (a tensor-parallel rank died): the jobs in flight
        already got the error; stop as on SIGTERM, and exit 1 so the platform replaces the
        worker instead of sending it more jobs."""
        if self.exit_code:
            return
        self.exit_code = 1
        logger.error("the engine stopped (%s): the worker exits", exc)
        self.signal_self()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def on_signal(
        self, signum: int, stop_intake: Callable[[], None], in_flight: Callable[[], int]
    ) -> None:
        """The signal handler's body (runs in the main thread, between two bytecodes).
        `in_flight` counts the jobs the SDK holds (taken, queued, or with a result to post)."""
        if self.draining:
            logger.warning("signal %d again: exiting now", signum)
            self.exit_now(128 + signum)
            return
        if self._loop is None:  # the job loop has not started: nothing to finish
            self.exit_now(0)
            return
        self.draining = True
        logger.info(
            "signal %d: finishing %d running jobs (up to %gs)", signum, self.running, self.grace_s
        )
        stop_intake()
        self._loop.call_soon_threadsafe(self._start_drain, in_flight)

    def _start_drain(self, in_flight: Callable[[], int]) -> None:
        self._drain_task = asyncio.ensure_future(self.drain(in_flight))

    async def drain(self, in_flight: Callable[[], int] = lambda: 0) -> None:
        """Waits out the grace period, ends what still runs, and stops the worker."""
        self.draining = True
        deadline = time.monotonic() + self.grace_s
        while self._running and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(0.05, left))
        if self._running:
            logger.warning("shutdown grace period over: ending %d unfinished jobs", self.running)
            self.aborting = True
            for run in list(self._running):
                # A job suspended at a yield sees `aborting` when the SDK asks for its next
                # item; one awaiting the worker is interrupted there, never inside the SDK.
                if run.waiting and run.task is not None:
                    run.cancelled_here = True
                    run.task.cancel()
        deadline = time.monotonic() + POST_RESULTS_TIMEOUT_S
        while (self._running or in_flight()) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        try:
            await self.worker.shutdown()
        except Exception:
            logger.exception("stopping the engine failed")
        self.finished = True


def serve(shutdown: GracefulShutdown, config: dict[str, Any]) -> None:
    """`runpod.serverless.start(config)` with the graceful shutdown in place of the SDK's."""
    import runpod
    from runpod.serverless.modules import rp_scale

    class Scaler(rp_scale.JobScaler):
        def handle_shutdown(self, signum, frame) -> None:
            shutdown.on_signal(signum, self.kill_worker, self.current_occupancy)

        async def run(self) -> None:
            shutdown.bind(asyncio.get_running_loop())
            await super().run()

        async def get_jobs(self, session) -> None:
            await self._until_drained(super().get_jobs(session))

        async def monitor_stop_signals(self, session) -> None:
            await self._until_drained(super().monitor_stop_signals(session))

        async def run_jobs(self, session) -> None:
            await super().run_jobs(session)
            if shutdown._drain_task is not None:
                await shutdown._drain_task

        async def _until_drained(self, poll) -> None:
            # The SDK's long polls would hold the exit for up to 90 s after the last job.
            task = asyncio.ensure_future(poll)
            while not task.done():
                await asyncio.wait({task}, timeout=0.1)
                if shutdown.finished:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    return
            await task

    original = rp_scale.JobScaler
    rp_scale.JobScaler = Scaler
    try:
        runpod.serverless.start({**config, "handler": shutdown.handle})
    finally:
        rp_scale.JobScaler = original

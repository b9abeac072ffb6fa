"""Jobs of the local endpoint: what `/run`, `/runsync`, `/stream`, `/status` and `/cancel` read
and write, with the hosted platform's statuses.

A job is one asyncio task iterating the worker's handler; every yielded item is appended to the
job's output (the aggregate that `return_aggregate_stream` gives on the platform) and `/stream`
hands out what is new since the last poll. A shared semaphore of MAX_CONCURRENCY slots is what
makes IN_QUEUE real: the platform never gives a worker more jobs at once, and OpenAI requests,
which are jobs there too, take a slot as well. Finished jobs are kept for a while, bounded in
count and age, so a dev server left running does not grow without limit.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

IN_QUEUE = "IN_QUEUE"
IN_PROGRESS = "IN_PROGRESS"
COMPLETED = "COMPLETED"
FAILED = "FAILED"
CANCELLED = "CANCELLED"
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED})

Handle = Callable[[dict[str, Any]], AsyncIterator[Any]]

SHUTDOWN_MESSAGE = "the worker shut down before this request finished"
_END = object()  # the handler has no more items
_ABORTED = object()  # the shutdown grace period ran out first


def error_of(item: Any) -> Any:
    """The error an item carries, or None. Like the runpod SDK, a yielded dict with a truthy
    `error` ends the job as FAILED."""
    if isinstance(item, dict) and item.get("error"):
        return item["error"]
    return None


@dataclass(eq=False)
class Job:
    id: str
    input: Any
    status: str = IN_QUEUE
    output: list[Any] = field(default_factory=list)
    error: Any = None
    created_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    finished_at: float | None = None
    stream_cursor: int = 0  # items before it were already handed out by /stream
    task: asyncio.Task | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    def notify(self) -> None:
        """Wakes every waiter once; a fresh event per change avoids clear/set races."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_change(self, timeout: float) -> None:
        waiter = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait({waiter}, timeout=max(0.0, timeout))
        finally:
            waiter.cancel()

    def timings(self) -> dict[str, int]:
        """The platform's delayTime (queued) and executionTime (running), in milliseconds."""
        out: dict[str, int] = {}
        if self.started_at is not None:
            out["delayTime"] = round((self.started_at - self.created_at) * 1000)
            end = self.finished_at if self.finished_at is not None else time.monotonic()
            out["executionTime"] = round((end - self.started_at) * 1000)
        elif self.finished_at is not None:
            out["delayTime"] = round((self.finished_at - self.created_at) * 1000)
        return out


async def unless(aw: Awaitable[T], stop: Awaitable[Any]) -> tuple[bool, T | None]:
    """Awaits `aw` unless `stop` completes first, in which case `aw` is cancelled (and awaited,
    so it is idle on return). (True, None) when stopped, else (False, the result)."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(stop)
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        return True, None
    return False, task.result()


class JobManager:
    """Runs jobs on the worker's handler, `max_concurrency` at a time, and keeps their state."""

    def __init__(
        self,
        handle: Handle,
        *,
        max_concurrency: int,
        max_finished: int = 1000,
        finished_ttl_s: float = 600.0,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency}: must be >= 1")
        self._handle = handle
        self.max_concurrency = max_concurrency
        self.max_finished = max_finished
        self.finished_ttl_s = finished_ttl_s
        self._slots = asyncio.Semaphore(max_concurrency)
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._finished: deque[str] = deque()  # ids in the order they finished
        # Live counts cover /run jobs and OpenAI requests; terminal counts are since start-up.
        self.counts: dict[str, int] = dict.fromkeys(
            (IN_QUEUE, IN_PROGRESS, COMPLETED, FAILED, CANCELLED), 0
        )
        self.draining = False  # shutting down: new work is refused (see `drain`)
        self._abort: asyncio.Event | None = None  # set when the grace period has run out

    # -- jobs of /run and /runsync ----------------------------------------------------------

    def submit(self, job_input: Any) -> Job:
        self._purge()
        job = Job(id=f"{uuid.uuid4()}-local", input=job_input)
        self._jobs[job.id] = job
        self.counts[IN_QUEUE] += 1
        job.task = asyncio.get_running_loop().create_task(self._run(job), name=f"job-{job.id}")
        return job

    def get(self, job_id: str) -> Job | None:
        self._purge()
        return self._jobs.get(job_id)

    async def wait_done(self, job: Job, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not job.done and (left := deadline - time.monotonic()) > 0:
            await job.wait_change(left)

    async def next_stream_items(self, job: Job, wait_s: float) -> list[Any]:
        """What the job produced since the last call; waits up to `wait_s` while there is nothing
        new yet and the job is still running (a long poll, so clients need not spin)."""
        deadline = time.monotonic() + wait_s
        while (
            len(job.output) <= job.stream_cursor
            and not job.done
            and (left := deadline - time.monotonic()) > 0
        ):
            await job.wait_change(left)
        items = job.output[job.stream_cursor :]
        job.stream_cursor += len(items)
        return items

    async def cancel(self, job: Job) -> None:
        """Cancels the job's task, which closes the handler's generator (aborting its engine
        request), and returns once that has happened."""
        if job.done:
            return
        if job.task is not None:
            job.task.cancel()
            await asyncio.wait({job.task}, timeout=10.0)
        # A task cancelled before it first ran never reaches its own bookkeeping.
        self._finish(job, CANCELLED)

    @property
    def busy(self) -> int:
        """Jobs and OpenAI requests queued or running."""
        return self.counts[IN_QUEUE] + self.counts[IN_PROGRESS]

    async def drain(self, grace_s: float) -> None:
        """Graceful shutdown: from now on `draining` is set (the routes refuse new work), what
        is queued or running gets up to `grace_s` seconds to finish, then the rest ends with
        SHUTDOWN_MESSAGE: jobs as FAILED, OpenAI requests with the error item they were given as
        their last item. Returns when nothing is left running."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.busy and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(0.05, left))
        if not self.busy:
            return
        logger.warning("shutdown grace period over: ending %d unfinished requests", self.busy)
        self._abort_event().set()
        for job in list(self._jobs.values()):
            if not job.done and job.task is not None:
                job.error = SHUTDOWN_MESSAGE
                job.task.cancel()
        deadline = time.monotonic() + 10.0
        while self.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    def _abort_event(self) -> asyncio.Event:
        if self._abort is None:
            self._abort = asyncio.Event()
        return self._abort

    async def shutdown(self) -> None:
        tasks = [job.task for job in self._jobs.values() if job.task and not job.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10.0)

    async def _run(self, job: Job) -> None:
        try:
            async with self._slots:
                self._move(IN_QUEUE, IN_PROGRESS)
                job.status, job.started_at = IN_PROGRESS, time.monotonic()
                job.notify()
                async with aclosing(self._handle({"id": job.id, "input": job.input})) as items:
                    async for item in items:
                        if (error := error_of(item)) is not None:
                            job.error = error
                            self._finish(job, FAILED)
                            return  # leaving the block closes the handler, as the platform does
                        job.output.append(item)
                        job.notify()
            self._finish(job, COMPLETED)
        except asyncio.CancelledError:
            # Cancelled by /cancel, or ended by a shutdown (which sets the error first).
            self._finish(job, FAILED if job.error else CANCELLED)
            raise
        except Exception as exc:  # the handler broke: the job fails, the server keeps serving
            logger.exception("job %s failed", job.id)
            job.error = f"{type(exc).__name__}: {exc}"
            self._finish(job, FAILED)

    def _finish(self, job: Job, status: str) -> None:
        if job.done:
            return
        self._move(IN_PROGRESS if job.started_at is not None else IN_QUEUE, status)
        job.status, job.finished_at = status, time.monotonic()
        self._finished.append(job.id)
        job.notify()

    def _purge(self) -> None:
        now = time.monotonic()
        while self._finished:
            oldest = self._jobs.get(self._finished[0])
            if (
                oldest is not None
                and len(self._finished) <= self.max_finished
                and now - (oldest.finished_at or now) < self.finished_ttl_s
            ):
                break
            self._finished.popleft()
            if oldest is not None:
                del self._jobs[oldest.id]

    # -- OpenAI requests: a slot and the counts, but no stored output ---------------------------

    async def run_direct(self, job: dict[str, Any], on_shutdown: Any = None) -> AsyncIterator[Any]:
        """Yields what the handler yields for `job` while holding a concurrency slot. Closing
        this generator closes the handler's, which aborts its engine request. When a shutdown's
        grace period runs out first, the handler is closed and `on_shutdown` is the last item."""
        self.counts[IN_QUEUE] += 1
        state = IN_QUEUE
        try:
            async with self._slots:
                self._move(IN_QUEUE, IN_PROGRESS)
                state = IN_PROGRESS
                async with aclosing(self._handle(job)) as items:
                    while (item := await self._next_or_abort(items)) is not _END:
                        aborted = item is _ABORTED
                        if aborted:
                            item = on_shutdown
                        if error_of(item) is not None and state == IN_PROGRESS:
                            self._move(state, FAILED)
                            state = FAILED
                        yield item
                        if aborted:
                            break
            if state == IN_PROGRESS:
                self._move(state, COMPLETED)
                state = COMPLETED
        finally:
            if state in (IN_QUEUE, IN_PROGRESS):
                self._move(state, CANCELLED)

    async def _next_or_abort(self, items: AsyncIterator[Any]) -> Any:
        """The handler's next item, _END, or _ABORTED if a shutdown ends it first."""
        abort = self._abort_event()
        if abort.is_set():
            return _ABORTED
        stopped, item = await unless(anext(items, _END), abort.wait())
        return _ABORTED if stopped else item

    def _move(self, src: str, dst: str) -> None:
        self.counts[src] -= 1
        self.counts[dst] += 1

    def health_counts(self) -> dict[str, int]:
        c = self.counts
        return {
            "inQueue": c[IN_QUEUE],
            "inProgress": c[IN_PROGRESS],
            "completed": c[COMPLETED],
            "failed": c[FAILED],
            "cancelled": c[CANCELLED],
            "retained": len(self._jobs),
        }

"""A stand-in for the RunPod job API that the SDK's job loop talks to: job-take (single and
batch), the stop channel, and the stream and result posts. A test queues jobs, points a worker
process at it through the RUNPOD_WEBHOOK_* variables, and reads what the worker posted."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from aiohttp import web


class FakePlatform:
    def __init__(self) -> None:
        self.queue: list[dict[str, Any]] = []
        self.taken: list[str] = []
        self.streamed: dict[str, list[Any]] = {}
        self.results: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.port = 0

    # -- what a test uses --------------------------------------------------------------------

    def start(self) -> FakePlatform:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def env(self) -> dict[str, str]:
        base = f"http://127.0.0.1:{self.port}"
        return {
            "RUNPOD_WEBHOOK_GET_JOB": f"{base}/job-take/$ID?gpu=none",
            "RUNPOD_WEBHOOK_POST_OUTPUT": f"{base}/done/$ID?gpu=none",
            "RUNPOD_WEBHOOK_POST_STREAM": f"{base}/stream/$ID?gpu=none",
            "RUNPOD_POD_ID": "fake-worker",
            # The SDK's start-up fitness checks judge the host (10% of `/` free, a TCP
            # connection to 8.8.8.8, 4 GB of free memory) and exit the worker when one fails;
            # a CI machine's disk or network says nothing about the worker under test.
            "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true",
        }

    def add(self, job_id: str, job_input: dict[str, Any]) -> None:
        with self._lock:
            self.queue.append({"id": job_id, "input": job_input})

    def snapshot(self) -> tuple[list[str], dict[str, list[Any]], dict[str, dict[str, Any]]]:
        with self._lock:
            return (
                list(self.taken),
                {k: list(v) for k, v in self.streamed.items()},
                dict(self.results),
            )

    # -- the server --------------------------------------------------------------------------

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/job-take/{worker}", self._take)
        app.router.add_get("/job-take-batch/{worker}", self._take)
        app.router.add_get("/job-stop/{worker}", self._stop_channel)
        app.router.add_post("/stream/{job}", self._stream)
        app.router.add_post("/done/{job}", self._done)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _take(self, request: web.Request) -> web.Response:
        batch = "batch" in request.path
        size = int(request.query.get("batch_size", "1")) if batch else 1
        for _ in range(10):  # a short long-poll
            with self._lock:
                jobs, self.queue = self.queue[:size], self.queue[size:]
                self.taken.extend(job["id"] for job in jobs)
            if jobs:
                return web.json_response(jobs if batch else jobs[0])
            await asyncio.sleep(0.05)
        return web.Response(status=204)

    async def _stop_channel(self, request: web.Request) -> web.Response:
        await asyncio.sleep(0.5)
        return web.Response(status=204)

    async def _stream(self, request: web.Request) -> web.Response:
        body = json.loads(await request.text())
        with self._lock:
            self.streamed.setdefault(request.match_info["job"], []).append(body)
        return web.Response(text="ok")

    async def _done(self, request: web.Request) -> web.Response:
        body = json.loads(await request.text())
        with self._lock:
            self.results[request.match_info["job"]] = body
        return web.Response(text="ok")

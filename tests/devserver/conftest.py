"""The local endpoint, served in-process on a free port by uvicorn in a background thread, so
tests talk real HTTP to it and can still look inside the worker (its KV block pool)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from serverless_llm.devserver.app import create_app
from tests.devserver.fake_worker import FakeWorker


class ServerThread:
    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the local endpoint did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def serve(app: FastAPI) -> ServerThread:
    return ServerThread(app)


@pytest.fixture()
def fake_worker() -> FakeWorker:
    return FakeWorker()


@pytest.fixture()
def fake_server(fake_worker: FakeWorker) -> Iterator[ServerThread]:
    with serve(create_app(fake_worker, max_concurrency=4, stream_poll_wait_s=0.5)) as server:
        yield server


API_KEY = "test-key"
SERVED_MODEL = "tiny-llama"


@pytest.fixture(scope="session")
def endpoint(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """The real worker on the tiny Llama behind the local endpoint, for the whole session (the
    model loads once). `endpoint.worker` is the in-process Worker, to inspect its KV pool."""
    from serverless_llm.worker.handler import Worker
    from serverless_llm.worker.settings import Settings

    settings = Settings.from_env(
        {
            "MODEL_NAME": tiny_llama,
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": SERVED_MODEL,
            "BASE_PATH": str(tmp_path_factory.mktemp("base")),
            "DEVICE": "cpu",
            "DTYPE": "float32",
            "MAX_MODEL_LEN": "256",
            "BLOCK_SIZE": "8",
            "NUM_KV_BLOCKS": "512",
            "MAX_NUM_SEQS": "64",
        }
    )
    worker = Worker(settings)
    app = create_app(worker, api_key=API_KEY, max_concurrency=settings.max_concurrency)
    with serve(app) as server:
        server.worker = worker  # type: ignore[attr-defined]
        yield server


def kv_pool(server: ServerThread) -> Any:
    return server.worker.engine.core.block_pool  # type: ignore[attr-defined]


class StepGate:
    """Holds the engine between two steps, so that how far a generation gets is up to the test,
    not to the machine's speed. Installed on the session worker's `LLMEngine` (its `step` and
    `abort_request`, both looked up on the instance at each call): steps run freely until one
    produces output; the step after it waits on the step thread, with the request(s) still in
    the engine and holding KV blocks, until `release()`. The event loop stays free meanwhile
    (the step runs in an executor), so disconnects and cancellations are seen and queue their
    aborts, which the engine applies right after the held step. `seen` lists the requests that
    produced output, `finished` those that ended on their own, `aborted` those the engine
    aborted while they were still in it."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self._step = core.step
        self._abort = core.abort_request
        self._cond = threading.Condition()
        self.rearm()

    def rearm(self) -> None:
        """Closes the gate again: the next generation is held after its first output."""
        with self._cond:
            self._produced = self._released = self._holding = False
            self.seen: list[str] = []
            self.finished: list[str] = []
            self.aborted: list[str] = []

    def step(self) -> list[Any]:
        with self._cond:
            if self._produced and not self._released:
                self._holding = True
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._released)
                self._holding = False
        outputs = self._step()
        with self._cond:
            for out in outputs:
                if out.request_id not in self.seen:
                    self.seen.append(out.request_id)
                if out.finished:
                    self.finished.append(out.request_id)
            self._produced = self._produced or bool(outputs)
        return outputs

    def abort_request(self, request_id: str) -> Any:
        out = self._abort(request_id)
        if out is not None:
            with self._cond:
                self.aborted.append(request_id)
        return out

    def wait_held(self, timeout: float = 60.0) -> None:
        """Until a step waits at the gate (`timeout` only guards against a hang)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._holding, timeout):
                raise AssertionError(f"no engine step reached the gate; outputs from {self.seen}")

    def release(self) -> None:
        with self._cond:
            self._released = True
            self._cond.notify_all()

    def install(self) -> None:
        self._core.step = self.step
        self._core.abort_request = self.abort_request

    def uninstall(self) -> None:
        self.release()  # never leave the session's engine stuck on a failed test
        del self._core.step, self._core.abort_request


@pytest.fixture()
def step_gate(endpoint: ServerThread) -> Iterator[StepGate]:
    gate = StepGate(endpoint.worker.engine.core)  # type: ignore[attr-defined]
    gate.install()
    try:
        yield gate
    finally:
        gate.uninstall()


def wait_until(predicate: Any, what: str, timeout: float = 60.0) -> None:
    """Polls `predicate` until it holds (`timeout` only guards against a hang)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.01)

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
from tests.step_gate import StepGate


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


@pytest.fixture()
def step_gate(endpoint: ServerThread) -> Iterator[StepGate]:
    """Holds the session engine's step after a generation's first output (tests/step_gate.py)."""
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

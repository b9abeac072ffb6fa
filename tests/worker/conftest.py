"""Worker test helpers: a Worker on the tiny random Llama, and a way to run a job to the end."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from serverless_llm.worker.handler import Worker
from serverless_llm.worker.settings import Settings

GREEDY_LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture()
def worker_env(tiny_llama, tmp_path) -> dict[str, str]:
    """Env of a small, fast worker: the tiny Llama, a 512-token context, 128 KV blocks."""
    return {
        "MODEL_NAME": tiny_llama,
        "MAX_MODEL_LEN": "512",
        "NUM_GPU_BLOCKS_OVERRIDE": "128",
        "BASE_PATH": str(tmp_path / "base"),
        "DEVICE": "cpu",
    }


@pytest.fixture()
def make_worker(worker_env) -> Callable[..., Worker]:
    """Worker(env overrides...) -> a Worker whose engine loads on first use."""

    def make(**overrides: str) -> Worker:
        env = {**worker_env, **overrides}
        return Worker(Settings.from_env({k: v for k, v in env.items() if v is not None}))

    return make


def run(worker: Worker, scenario: Callable[[Worker], Awaitable[Any]]) -> Any:
    """Runs `scenario(worker)` on a fresh event loop and shuts the worker down after."""

    async def main():
        await worker.start()
        try:
            return await scenario(worker)
        finally:
            await worker.shutdown()

    return asyncio.run(main())


async def run_job(worker: Worker, job_input: Any, job_id: str = "test-job") -> list[Any]:
    return [item async for item in worker.handle({"id": job_id, "input": job_input})]


def token_counts(items: list[dict], choice: int = 0) -> list[int]:
    return [len(item["choices"][choice]["tokens"]) for item in items]


def joined(items: list[dict], choice: int = 0) -> str:
    return "".join(piece for item in items for piece in item["choices"][choice]["tokens"])


def blocks_all_free(worker: Worker) -> bool:
    stats = worker.engine.stats()
    return stats.num_free_kv_blocks == stats.num_kv_blocks


async def wait_blocks_free(worker: Worker, timeout: float = 30.0) -> bool:
    """Whether every KV block is free once the engine loop has applied what is pending (an
    abort lands at the next step boundary): polls instead of sleeping a guessed time
    (`timeout` only guards against a hang)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not blocks_all_free(worker):
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True

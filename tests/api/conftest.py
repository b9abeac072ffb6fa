"""Fixtures for the OpenAI serving layer: one engine core per session (the tiny random Llama),
and a fresh AsyncEngine + OpenAIServing per test, run in its own event loop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from serverless_llm.api.batching import BatchSizes
from serverless_llm.api.openai import OpenAIServing
from serverless_llm.engine.async_engine import AsyncEngine
from serverless_llm.engine.config import EngineConfig
from serverless_llm.engine.llm_engine import LLMEngine

MODEL = "tiny-llama"
NUM_BLOCKS = 64
MAX_MODEL_LEN = 256


@pytest.fixture(scope="session")
def core(tiny_llama) -> LLMEngine:
    engine = AsyncEngine.from_config(
        EngineConfig(
            model=tiny_llama,
            num_kv_blocks=NUM_BLOCKS,
            max_model_len=MAX_MODEL_LEN,
            show_progress=False,
        )
    )
    return engine.core


async def wait_idle(core: LLMEngine, timeout: float = 5.0) -> None:
    """Aborts land at the engine's next step boundary; wait for them."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if core.block_pool.num_free == core.block_pool.num_blocks and not core.requests:
            return
        await asyncio.sleep(0.01)


def pool_full(core: LLMEngine) -> bool:
    return core.block_pool.num_free == core.block_pool.num_blocks and not core.requests


@pytest.fixture()
def serve(core) -> Callable[..., Any]:
    """`serve(fn, **serving_kwargs)` runs `await fn(serving)` with a fresh AsyncEngine on the
    shared core, then waits for the engine to go idle and checks every KV block is free."""

    def run(fn: Callable[[OpenAIServing], Awaitable[Any]], **kwargs: Any) -> Any:
        async def main() -> Any:
            engine = AsyncEngine(core)
            kwargs.setdefault("served_model_name", MODEL)
            serving = OpenAIServing(engine, **kwargs)
            try:
                return await fn(serving)
            finally:
                await wait_idle(core)
                await engine.shutdown()

        result = asyncio.run(main())
        assert pool_full(core), "KV blocks leaked"
        return result

    return run


async def collect(
    serving: OpenAIServing, route: str, body: Any, batch: BatchSizes | None = None
) -> list[Any]:
    return [item async for item in serving.handle(route, body, batch or BatchSizes())]


def parse_sse(items: list[str]) -> list[Any]:
    """Parses raw SSE yields back with the openai client's own decoder; checks the framing."""
    from openai._streaming import SSEDecoder

    assert all(isinstance(s, str) for s in items)
    raw = "".join(items)
    assert raw.endswith("data: [DONE]\n\n") and raw.count("[DONE]") == 1
    for event in raw.split("\n\n")[:-1]:
        assert event.startswith("data: ") and "\n" not in event
    events = list(SSEDecoder().iter_bytes(iter([raw.encode()])))
    assert events[-1].data == "[DONE]"
    return [json.loads(e.data) for e in events[:-1]]

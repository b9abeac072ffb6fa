"""A stand-in for `Worker` with the same interface and no model: it lets the server's own logic
(job states, stream polling, cancellation, SSE framing, disconnects) be tested fast and
deterministically, and records which handler generators were closed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from serverless_llm.api.openai import openai_error

MODEL = "fake-model"


class FakeWorker:
    """Native jobs: input `{"items": N, "delay": s, "fail_at": i, "raise_at": i}` yields N items
    `{"choices": [{"tokens": ["t<i>"]}], "usage": ...}`. OpenAI jobs: the three routes, with
    `fake_items` / `fake_delay` in the body to shape a stream."""

    def __init__(self, raw_openai_output: bool = True) -> None:
        self.raw_openai_output = raw_openai_output
        self.started = False
        self.stopped = False
        self.open: set[str] = set()  # jobs whose handler generator is still alive
        self.closed: list[str] = []

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.stopped = True

    def engine_stats(self) -> None:
        return None  # no engine behind this worker

    async def handle(self, job: dict[str, Any]) -> AsyncIterator[Any]:
        self.open.add(job["id"])
        try:
            inp = job["input"]
            if "openai_route" in inp:
                async for item in self._openai(inp["openai_route"], inp.get("openai_input")):
                    yield item
                return
            for i in range(inp.get("items", 3)):
                await asyncio.sleep(inp.get("delay", 0.0))
                if inp.get("fail_at") == i:
                    yield {"error": f"failed at item {i}"}
                    return
                if inp.get("raise_at") == i:
                    raise RuntimeError(f"raised at item {i}")
                yield {"choices": [{"tokens": [f"t{i}"]}], "usage": {"input": 1, "output": i + 1}}
        finally:
            self.open.discard(job["id"])
            self.closed.append(job["id"])

    async def _openai(self, route: str, body: Any) -> AsyncIterator[Any]:
        if route == "/v1/models":
            yield {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "me"}]}
            return
        if body.get("model") != MODEL:
            yield openai_error(
                f"The model `{body.get('model')}` does not exist.",
                param="model",
                code="model_not_found",
                status=404,
            )
            return
        n, delay = body.get("fake_items", 3), body.get("fake_delay", 0.0)
        if not body.get("stream"):
            text = "".join(f"w{i} " for i in range(n))
            yield {"object": "text_completion", "model": MODEL, "choices": [{"text": text}]}
            return
        for i in range(n):
            await asyncio.sleep(delay)
            chunk = {"object": "text_completion", "model": MODEL, "choices": [{"text": f"w{i} "}]}
            if self.raw_openai_output:
                yield f"data: {json.dumps(chunk)}\n\n"
            else:
                yield [chunk]
        if self.raw_openai_output:
            yield "data: [DONE]\n\n"

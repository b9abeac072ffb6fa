"""Merging a job's engine streams (one per choice or sequence) into one stream.

Both routes run a job as several engine requests (n, best_of, several prompts) and consume
their outputs as one stream, in arrival order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from serverless_llm.engine import EngineOutput

__all__ = ["merge_streams"]


async def merge_streams(
    streams: Sequence[AsyncIterator[EngineOutput]],
) -> AsyncIterator[tuple[int, EngineOutput]]:
    """Interleaves engine streams as their outputs arrive, tagged with the stream's index.

    One stream is iterated directly (the common case pays for no task). Several get one task
    each, feeding one queue. Whatever way this generator ends (done, error, cancel, close), the
    tasks are cancelled and awaited, and each engine stream is closed, which aborts its request
    and frees its KV blocks, so no request outlives the job. The first error of any stream is
    raised here.
    """
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return

    queue: asyncio.Queue[tuple[int, EngineOutput | Exception | None]] = asyncio.Queue()

    async def pump(k: int, stream: AsyncIterator[EngineOutput]) -> None:
        try:
            async with aclosing(stream) as s:
                async for out in s:
                    queue.put_nowait((k, out))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((k, exc))
            return
        queue.put_nowait((k, None))  # this stream is done

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            k, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield k, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

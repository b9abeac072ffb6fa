"""Request preparation off the event loop.

Parsing a request, rendering its chat template and tokenizing its prompt are CPU work that grows
with the prompt: on the event loop, one huge prompt stalls every other stream and even /health
(a 50 MB chat once froze the endpoint for 47 s). The routes hand that work to `prepare`, which
runs it on one thread of its own: off the loop, and never on the engine's step thread (which
must stay the only thread doing torch work, see AsyncEngine). One thread, so requests are
prepared in arrival order and the tokenizer is never used by two preparations at once.

A preparation that leaves much more resident memory behind than it found (a prompt near
MAX_PROMPT_CHARS: its tokenizing leaves ~120 MB per million characters in the heap) gives the
free memory back to the system at once (`release_free_memory`, tens of ms), so one huge request
does not raise the worker's footprint for good.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..engine import release_free_memory, resident_bytes

T = TypeVar("T")

# Resident memory a preparation may leave behind before it is given back.
RELEASE_ABOVE = 32 << 20

_executor: ThreadPoolExecutor | None = None
_lock = threading.Lock()

THREAD_NAME = "request-prepare"


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME)
        return _executor


def _run(fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    before = resident_bytes()
    try:
        return fn(*args)
    finally:
        if resident_bytes() - before > RELEASE_ABOVE:
            release_free_memory()


async def prepare(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the preparation thread; its exception, if any, raised here."""
    return await asyncio.get_running_loop().run_in_executor(_pool(), _run, fn, args)

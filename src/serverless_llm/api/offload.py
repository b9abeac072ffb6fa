"""Request preparation off the event loop.

Parsing a request, rendering its chat template and tokenizing its prompt are CPU work that grows
with the prompt: on the event loop, one huge prompt stalls every other stream and even /health
(a 50 MB chat once froze the endpoint for 47 s). The routes hand that work to `prepare`, which
runs it on one thread of its own: off the loop, and never on the engine's step thread (which
must stay the only thread doing torch work, see AsyncEngine). One thread, so requests are
prepared in arrival order and the tokenizer is never used by two preparations at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

_executor: ThreadPoolExecutor | None = None
_lock = threading.Lock()

THREAD_NAME = "request-prepare"


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME)
        return _executor


async def prepare(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the preparation thread; its exception, if any, raised here."""
    return await asyncio.get_running_loop().run_in_executor(_pool(), fn, *args)

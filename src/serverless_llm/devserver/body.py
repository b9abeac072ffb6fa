"""Request bodies as JSON: bounded in nesting, and parsed off the event loop when large.

- Nesting: a body nested deeper than `MAX_JSON_DEPTH` levels (the worker's own bound, see
  `worker.job_input`) is refused with a `BodyError`, as is one so deep that `json.loads` itself
  gives up (RecursionError, near 1,000 levels): the routes answer 400 in their own shape, never
  a 500. Nothing legitimate nests that deep (a JSON schema 40 levels deep fits).
- The loop: a body over `PARSE_ON_LOOP_BYTES` is parsed, and its depth checked, on a thread of
  its own (`PARSE_THREADS` of them, so a flood of large bodies queues there, not on the loop).
  `json.loads` holds the interpreter lock while it runs, so the loop still waits for one parse
  at a time: parsing 4 MB of small JSON values takes ~45 ms on a 2-core machine. The depth walk
  is Python, which lets the loop in every few milliseconds. The worker then checks and
  validates the job on its preparation thread (`Worker.handle`), and the entry points keep
  start-up's objects out of the collector's walks (`worker.heap`): the ~150,000 containers of
  such a body otherwise set off a full collection of ~0.5 s that holds the lock.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..worker.job_input import MAX_JSON_DEPTH, nesting_over

__all__ = ["PARSE_ON_LOOP_BYTES", "BodyError", "parse_json", "parse_json_off_loop"]

# Bodies up to this size are parsed on the loop: well under a millisecond, less than the hop.
PARSE_ON_LOOP_BYTES = 64 << 10
PARSE_THREADS = 2

_executor: ThreadPoolExecutor | None = None
_lock = threading.Lock()


class BodyError(ValueError):
    """A body that is not JSON the routes take; str() is the message for the client."""


def _too_deep() -> BodyError:
    return BodyError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")


def parse_json(raw: bytes) -> Any:
    """The body's JSON value, or BodyError (not JSON, or nested too deep)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BodyError(f"the request body is not valid JSON: {exc}") from None
    # Fewer opening brackets than the limit cannot nest past it: no walk for most bodies.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and nesting_over(value, MAX_JSON_DEPTH):
        raise _too_deep()
    return value


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="body-parse")
        return _executor


async def parse_json_off_loop(raw: bytes) -> Any:
    """`parse_json`, on a parse thread when the body is over PARSE_ON_LOOP_BYTES."""
    if len(raw) <= PARSE_ON_LOOP_BYTES:
        return parse_json(raw)
    return await asyncio.get_running_loop().run_in_executor(_pool(), parse_json, raw)

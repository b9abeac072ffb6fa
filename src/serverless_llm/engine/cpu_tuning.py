"""Process-level settings that make CPU inference fast.

glibc serves allocations above its mmap threshold with fresh mmap'd pages, and every one of
those pages faults and is zeroed on first touch. A prefill allocates gigabytes of activations
in such chunks, so without this the first steps spend most of their time in page faults (seen:
a 1,344-token prefill of SmolLM2 took 2.6 s cold and 1.2 s warm). Raising the thresholds keeps
freed activation memory in the heap for the next step, as tcmalloc would.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit
_TRIM_THRESHOLD = 1 << 30

_done = False


def tune_allocator() -> bool:
    """Once per process, on Linux with glibc; False where it does not apply."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and ok
    except (OSError, AttributeError):
        return False
    _done = ok
    if not ok:
        logger.debug("mallopt refused the allocator settings")
    return ok

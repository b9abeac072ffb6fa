"""Process-level settings that make CPU inference fast, and giving memory back.

glibc serves allocations above its mmap threshold with fresh mmap'd pages, and every one of
those pages faults and is zeroed on first touch. A prefill allocates gigabytes of activations
in such chunks, so without this the first steps spend most of their time in page faults (seen:
a 1,344-token prefill of SmolLM2 took 2.6 s cold and 1.2 s warm). Raising the thresholds keeps
freed activation memory in the heap for the next step, as tcmalloc would.

The price: memory freed after a one-off large allocation stays in the process too (tokenizing a
1M-character prompt leaves ~120 MB behind). `resident_bytes` and `release_free_memory` let a
caller that just did such work give it back (`malloc_trim`, tens of ms).

oneDNN (the packed linears) builds a kernel for every new (batch rows, weight shape) and keeps it
in two caches, its own and ideep's, of 1,024 entries each by default; an entry costs ~570 KB
(measured, both caches, any weight shape). A server sees hundreds of distinct batch sizes, so the
process grew by ~40 MB a minute under a mixed load until ~570 MB had gone to kernels.
`cap_kernel_caches` bounds them before oneDNN first reads its settings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit
_TRIM_THRESHOLD = 1 << 30

# A step uses one entry per distinct weight shape (4-6 in a dense decoder) at its batch size, so
# 128 keep the kernels of 20+ recent batch sizes: a miss costs ~0.5 ms per shape, once a step.
KERNEL_CACHE_ENTRIES = 128
_KERNEL_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_done = False
_libc: ctypes.CDLL | None = None


def _load_libc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            return None
    return _libc


def tune_allocator() -> bool:
    """Once per process, on Linux with glibc; False where it does not apply."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    libc = _load_libc()
    if libc is None:
        return False
    try:
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and ok
    except AttributeError:
        return False
    _done = ok
    if not ok:
        logger.debug("mallopt refused the allocator settings")
    return ok


def cap_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> dict[str, str]:
    """Bounds oneDNN's kernel caches unless the environment already sets them. oneDNN and ideep
    read these variables once, at their first kernel in the process, so this must run before the
    first packed linear (a later call changes nothing). Returns the values in force."""
    for name in _KERNEL_CACHE_VARS:
        os.environ.setdefault(name, str(entries))
    return {name: os.environ[name] for name in _KERNEL_CACHE_VARS}


def resident_bytes() -> int:
    """This process's resident memory (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return 0


def release_free_memory() -> bool:
    """Returns the heap's free memory, in every arena, to the system (glibc's malloc_trim).
    False where it does not apply."""
    libc = _load_libc()
    if libc is None:
        return False
    try:
        libc.malloc_trim(0)
    except AttributeError:  # not glibc
        return False
    return True

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

torch runs each op on an OpenMP team of one thread per core, whose threads spin, then wait, at
every op's end for the slowest one. When other processes take cores, a team thread is often
descheduled and the whole step waits for it: on 2 cores with two busy processes, one request's
decode fell from 20.7 to 5.1 tokens/s with 2 threads, against 7.6 with 1 (SmolLM2, AVX2).
`ThreadGovernor` sizes the team to the cores the other processes leave free, measured from
/proc/stat every half second.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import time
from collections.abc import Callable

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


# -- thread count under contention -----------------------------------------------------------

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_times() -> tuple[float, float] | None:
    """(CPU seconds processes that compete with this one have run, CPU seconds this process has
    run) since boot, from /proc (None where it is not there). Steal time counts: the hypervisor
    gave that core to someone else."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    try:
        # cpu: user nice system idle iowait irq softirq steal ...
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
        # /proc/self/stat after the name: state is field 3, utime 14 and stime 15.
        utime, stime = int(own[11]), int(own[12])
    except (ValueError, IndexError):
        return None
    # Niced processes (grammar compiles run at nice 19) yield their core to this one within a
    # scheduler tick, so they take nothing from it, unless this process is niced too.
    busy = user + system + irq + softirq + steal + (nice if _own_niceness() > 0 else 0)
    return busy / _TICKS_PER_S, (utime + stime) / _TICKS_PER_S


def _own_niceness() -> int:
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):
        return 0


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ThreadGovernor:
    """Keeps torch's intra-op thread count at the cores other processes leave free: at most
    the count it started with, at least 1. `update()` is cheap and is called before each CPU
    step, on the thread that runs the step (OpenMP's thread count belongs to the calling
    thread); it samples the CPU times every `interval_s` and resizes when the free cores, to
    the nearest whole core, change. Off when OMP_NUM_THREADS is set: the operator chose."""

    def __init__(
        self,
        max_threads: int,
        *,
        cores: int | None = None,
        interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        read_times: Callable[[], tuple[float, float] | None] = cpu_times,
        set_threads: Callable[[int], None] | None = None,
    ) -> None:
        self.max_threads = max(1, max_threads)
        self.cores = cores or available_cores()
        self.threads = self.max_threads
        self.interval_s = interval_s
        self._clock = clock
        self._read = read_times
        self._set = set_threads or _torch_set_threads
        self._last: tuple[float, float, float] | None = None
        self.enabled = self.max_threads > 1 and "OMP_NUM_THREADS" not in os.environ

    def update(self) -> int:
        if not self.enabled:
            return self.threads
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.interval_s:
            return self.threads
        times = self._read()
        if times is None:
            self.enabled = False
            return self.threads
        last, self._last = self._last, (now, *times)
        if last is None:
            return self.threads
        wall = now - last[0]
        others = max(0.0, (times[0] - last[1]) - (times[1] - last[2])) / wall
        want = min(self.max_threads, max(1, int(self.cores - others + 0.5)))
        if want != self.threads:
            logger.debug(
                "threads: %d -> %d (other processes use %.1f of %d cores)",
                self.threads,
                want,
                others,
                self.cores,
            )
            self._set(want)
            self.threads = want
        return self.threads


def _torch_set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)

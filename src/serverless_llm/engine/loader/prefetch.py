"""Reading a checkpoint's weight files ahead of the loader, while the config is read and the
model is built (issue 42: a cold start's floor is the imports, the weights read at the disk's
bandwidth and one forward, so the disk should be busy while the CPU does the rest).

A background thread reads each weight file once, start to end, into one reused buffer: the
pages land in the page cache and the loader's own reads (safetensors' memory map, torch.load)
find them there. The thread only reads (a read releases the GIL) and never touches the model.
It is skipped where it could cost more than it saves: files larger than half the memory the
kernel reports available (the cache could not keep them until the loader reads them), and
anything it cannot stat or read (it stops quietly: the loader reads the files itself and says
what is wrong). `stop()` ends it early once the loader is done.
"""

from __future__ import annotations

import logging
import os
import threading

from .base import ResolvedModel
from .weights import local_weight_files

logger = logging.getLogger(__name__)

CHUNK = 1 << 20  # bytes a read asks for (the buffer counts in the resident size)
MEMORY_SHARE = 0.5  # of MemAvailable the files may take


def weight_paths(resolved: ResolvedModel) -> list[str]:
    """The files the loader will read for this checkpoint (indexes left out)."""
    if resolved.load_format == "gguf":
        return [resolved.gguf_path] if resolved.gguf_path else []
    if resolved.load_format == "dummy":
        return []
    try:
        found = local_weight_files(resolved.model_dir, resolved.load_format)
    except Exception:  # noqa: BLE001 - a bad index: the loader reports it
        return []
    if found is None:
        return []
    names = [n for n in found[1] if not n.endswith(".json")]
    return [os.path.join(resolved.model_dir, n) for n in names]


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class WeightPrefetch:
    """The background read of `paths`; `bytes_read` says how far it got."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.bytes_read = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        buf = bytearray(CHUNK)
        try:
            for path in self.paths:
                with open(path, "rb", buffering=0) as f:
                    while not self._stop.is_set():
                        n = f.readinto(buf)
                        if not n:
                            break
                        self.bytes_read += n
                if self._stop.is_set():
                    return
        except OSError as e:
            logger.debug("weight prefetch stopped: %s", e)

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


def prefetch_weights(resolved: ResolvedModel) -> WeightPrefetch | None:
    """Starts reading the checkpoint's weight files in the background; None when there is
    nothing to read or they would not fit in half the available memory."""
    paths = weight_paths(resolved)
    try:
        total = sum(os.path.getsize(p) for p in paths)
    except OSError:
        return None
    available = available_memory()
    if not paths or available is None or total > MEMORY_SHARE * available:
        return None
    return WeightPrefetch(paths)

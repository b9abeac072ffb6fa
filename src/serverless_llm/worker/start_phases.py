"""The worker's cold-start line: where the time from process start to ready, and then to the
first token, went (imports and settings, weights, KV allocation, kernel warm-up or cache load,
graph capture, the rest of the engine's set-up)."""

from __future__ import annotations

import os
import time


def seconds_since_process_start() -> float | None:
    """Seconds since this process started, from /proc (Linux); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class StartPhases:
    """Marks taken by the worker: when loading began and ended (since process start), the
    engine's own phases, and the first token."""

    def __init__(self) -> None:
        self._clock0 = time.perf_counter()
        since = seconds_since_process_start()
        self.origin = self._clock0 - (since if since is not None else 0.0)
        self.load_start: float | None = None
        self.ready: float | None = None
        self.engine: dict[str, float] = {}
        self.first_token: float | None = None

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def line(self) -> str:
        assert self.load_start is not None and self.ready is not None
        parts = [f"imports and settings {self.load_start:.1f}s"]
        parts += [f"{name} {seconds:.1f}s" for name, seconds in self.engine.items()]
        other = self.ready - self.load_start - sum(self.engine.values())
        parts.append(f"other set-up {max(0.0, other):.1f}s")
        return f"start-up: ready {self.ready:.1f}s after process start ({', '.join(parts)})"

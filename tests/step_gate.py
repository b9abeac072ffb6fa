"""A gate between an engine's steps, so that how far a generation gets before the test acts
(disconnects, cancels, aborts) is up to the test, not to the machine's speed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class StepGate:
    """Installed on an `LLMEngine` (its `step` and `abort_request`, both looked up on the
    instance at each call). Steps run freely until `hold_when(gate)` holds before one (by
    default: once a step has produced output); that step then waits, on the step thread, with
    the requests still in the engine and holding KV blocks, until `release()`. Under an
    AsyncEngine the event loop stays free meanwhile (steps run in an executor), so disconnects
    and cancellations are seen and queue their aborts, which the engine applies right after the
    held step. `steps` counts the steps run, `seen` lists the requests that produced output,
    `finished` those that ended on their own, `aborted` those the engine aborted while they were
    still in it."""

    def __init__(self, core: Any, hold_when: Callable[[StepGate], bool] | None = None) -> None:
        self._core = core
        self._step = core.step
        self._abort = core.abort_request
        self._hold_when = hold_when or (lambda gate: bool(gate.seen))
        self._cond = threading.Condition()
        self.rearm()

    def rearm(self) -> None:
        """Closes the gate again, for the next generation (call it while the engine is idle)."""
        with self._cond:
            self._released = self._holding = False
            self.steps = 0
            self.seen: list[str] = []
            self.finished: list[str] = []
            self.aborted: list[str] = []

    def step(self) -> list[Any]:
        with self._cond:
            if not self._released and self._hold_when(self):
                self._holding = True
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._released)
                self._holding = False
        outputs = self._step()
        with self._cond:
            self.steps += 1
            for out in outputs:
                if out.request_id not in self.seen:
                    self.seen.append(out.request_id)
                if out.finished:
                    self.finished.append(out.request_id)
        return outputs

    def abort_request(self, request_id: str) -> Any:
        out = self._abort(request_id)
        if out is not None:
            with self._cond:
                self.aborted.append(request_id)
        return out

    def wait_held(self, timeout: float = 60.0) -> None:
        """Until a step waits at the gate (`timeout` only guards against a hang)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._holding, timeout):
                raise AssertionError(
                    f"no engine step reached the gate after {self.steps} steps; "
                    f"outputs from {self.seen}"
                )

    def release(self) -> None:
        with self._cond:
            self._released = True
            self._cond.notify_all()

    def install(self) -> None:
        self._core.step = self.step
        self._core.abort_request = self.abort_request

    def uninstall(self) -> None:
        self.release()  # never leave the engine stuck on a failed test
        self._core.__dict__.pop("step", None)
        self._core.__dict__.pop("abort_request", None)

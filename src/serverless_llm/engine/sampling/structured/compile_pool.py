"""The compile processes: where grammars are compiled, with a time limit, and given up.

A `CompilePool` keeps up to `size` compile processes. They are forked, in milliseconds, by one
*zygote* process (`compile_worker.py` run by path), which imports xgrammar once: about 3 s and
260 MB, since xgrammar imports torch. A compilation takes an idle child, sends it the spec and
waits for the serialized result. When the time limit passes, or when every request waiting for
the grammar has gone (`abandoned`), the child is killed, which stops the work at once, and a
replacement is forked in the background. So one adversarial grammar holds one child for at most
the limit, and the other child keeps compiling everyone else's.

The processes run at the lowest priority (nice 19): on a busy machine the engine's steps come
first. At nice 10, two adversarial compiles on a 2-core machine slowed a stream's tokens by
1.8-2.1x (the engine's two OpenMP threads wait on each other when one loses its core); at 15,
1.5-2.1x; at 19, 1.1-1.6x. The price: under a saturated CPU, grammars compile slower (a 2-minute
soak: guided requests' p50 1.8 s against 1.25 s at nice 10). One pool serves the whole process (`shared_pool`); a child keeps the
tokenizers it was sent, and asks for one it does not know (`need_info`).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .compile_worker import SpecError, encode_frame

__all__ = [
    "CompileAbandoned",
    "CompilePool",
    "CompileProcessError",
    "CompileStartError",
    "CompileTimeout",
    "shared_pool",
]

logger = logging.getLogger(__name__)

WORKER_PATH = Path(__file__).with_name("compile_worker.py")
# Starting a child imports xgrammar (and torch, which xgrammar imports): seconds on a cold disk.
START_TIMEOUT = 120.0
# Forking a compile process from the zygote takes milliseconds.
FORK_TIMEOUT = 10.0
# How often a waiting compilation looks at whether it was abandoned.
POLL_INTERVAL = 0.02


class CompileTimeout(Exception):
    """The compilation ran past its time limit; its child was killed."""


class CompileAbandoned(Exception):
    """Every request waiting for the compilation went away; its child was killed."""


class CompileProcessError(Exception):
    """A child died or broke the protocol while compiling (a crash inside xgrammar)."""


class CompileStartError(CompileProcessError):
    """No child could be started: the caller may compile in its own process instead."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise CompileProcessError("the compile process died")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _wait_readable(sock: socket.socket, deadline: float, abandoned: threading.Event | None) -> None:
    """Returns when `sock` has data (or EOF); raises CompileTimeout or CompileAbandoned."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CompileTimeout()
        ready, _, _ = select.select([sock], [], [], min(POLL_INTERVAL, remaining))
        if ready:
            return
        if abandoned is not None and abandoned.is_set():
            raise CompileAbandoned()


class _Zygote:
    """The process that forks compile processes (see compile_worker.zygote)."""

    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER_PATH), str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                env=env,
                pass_fds=(theirs.fileno(),),
            )
        except OSError as exc:
            ours.close()
            raise CompileStartError(f"cannot start the grammar compiler: {exc}") from exc
        finally:
            theirs.close()
        self.control = ours
        self.lock = threading.Lock()
        try:
            _wait_readable(ours, time.monotonic() + START_TIMEOUT, None)
            ready = ours.recv(1)
        except (CompileTimeout, OSError):
            ready = b""
        if ready != b"R":
            self.close()
            status = self.proc.returncode
            raise CompileStartError(f"the grammar compiler did not start (status {status})")

    def fork(self) -> tuple[int, socket.socket]:
        """A new compile process: its pid and our end of its socket."""
        ours, theirs = socket.socketpair()
        try:
            with self.lock:
                socket.send_fds(self.control, [b"F"], [theirs.fileno()])
                _wait_readable(self.control, time.monotonic() + FORK_TIMEOUT, None)
                pid = int.from_bytes(_recv_exact(self.control, 8), "big")
        except (OSError, CompileTimeout, CompileProcessError) as exc:
            ours.close()
            raise CompileStartError(f"the grammar compiler could not fork: {exc}") from exc
        finally:
            theirs.close()
        return pid, ours

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.control.close()
        self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a kill that did not land
            logger.warning("grammar compiler %d did not exit after SIGKILL", self.proc.pid)


class _Child:
    """One compile process (forked by the zygote) and its socket."""

    def __init__(self, zygote: _Zygote) -> None:
        self.pid, self.sock = zygote.fork()
        try:
            reply = self._read(time.monotonic() + START_TIMEOUT, None)
        except (CompileProcessError, CompileTimeout) as exc:
            self.kill()
            raise CompileStartError(f"the compile process did not start: {exc}") from exc
        if not reply.get("ready"):
            self.kill()
            raise CompileStartError(f"the compile process said {reply!r} at start")

    def request(
        self, message: dict[str, Any], deadline: float, abandoned: threading.Event | None
    ) -> dict[str, Any]:
        try:
            self.sock.sendall(encode_frame(message))
        except OSError as exc:
            raise CompileProcessError(f"the compile process died: {exc}") from exc
        return self._read(deadline, abandoned)

    def _read(self, deadline: float, abandoned: threading.Event | None) -> dict[str, Any]:
        _wait_readable(self.sock, deadline, abandoned)
        try:
            size = int.from_bytes(_recv_exact(self.sock, 8), "big")
            return json.loads(_recv_exact(self.sock, size))
        except OSError as exc:
            raise CompileProcessError(f"the compile process died: {exc}") from exc

    def alive(self) -> bool:
        """False once the process is gone (the zygote reaps its children at once)."""
        try:
            os.kill(self.pid, 0)
        except OSError:
            return False
        return True

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:  # gone already (the zygote reaps its children)
            pass
        self.sock.close()


class CompilePool:
    """Up to `size` compile processes; see the module docstring."""

    def __init__(self, size: int = 2) -> None:
        self.size = max(1, size)
        self._idle: list[_Child] = []
        self._count = 0  # children alive or starting
        self._cond = threading.Condition()
        self._zygote: _Zygote | None = None
        self._zygote_lock = threading.Lock()
        self.killed = 0  # children killed on a time limit or an abandonment (for tests, stats)

    def compile(
        self,
        key: str,
        tokenizer_info: Callable[[], str],
        spec: dict[str, Any],
        *,
        max_bytes: int,
        timeout: float | None,
        abandoned: threading.Event | None = None,
    ) -> str:
        """The serialized xgrammar CompiledGrammar of `spec` for tokenizer `key` (whose
        serialized TokenizerInfo `tokenizer_info()` gives, sent to a child that lacks it).
        Raises SpecError, CompileTimeout, CompileAbandoned, CompileProcessError or
        CompileStartError. `timeout` counts compile time only, not the wait for a child."""
        child = self._acquire(abandoned)
        message = {"op": "compile", "key": key, "spec": spec, "max_bytes": max_bytes}
        try:
            reply = child.request(message, self._deadline(timeout), abandoned)
            if reply.get("need_info"):
                info = {"op": "info", "key": key, "info": tokenizer_info()}
                child.request(info, time.monotonic() + START_TIMEOUT, abandoned)
                reply = child.request(message, self._deadline(timeout), abandoned)
        except (CompileTimeout, CompileAbandoned):
            self._discard(child, replace=True)
            raise
        except BaseException:
            self._discard(child, replace=False)
            raise
        self._release(child)
        if "error" in reply:
            raise SpecError(reply["error"], reply.get("param"))
        return reply["ok"]

    @staticmethod
    def _deadline(timeout: float | None) -> float:
        return time.monotonic() + timeout if timeout else float("inf")

    def _acquire(self, abandoned: threading.Event | None) -> _Child:
        with self._cond:
            while True:
                while self._idle:
                    child = self._idle.pop()
                    if child.alive():
                        return child
                    child.kill()  # died while idle (say the OOM killer): not this grammar's fault
                    self._count -= 1
                if self._count < self.size:
                    break
                if abandoned is not None and abandoned.is_set():
                    raise CompileAbandoned()
                self._cond.wait(POLL_INTERVAL)
            self._count += 1
        try:
            return self._spawn()
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def _spawn(self) -> _Child:
        """A new compile process, from the zygote (started, or restarted, as needed)."""
        with self._zygote_lock:
            if self._zygote is None or not self._zygote.alive():
                self._zygote = _Zygote()
            zygote = self._zygote
        return _Child(zygote)

    def _release(self, child: _Child) -> None:
        with self._cond:
            self._idle.append(child)
            self._cond.notify()

    def _discard(self, child: _Child, *, replace: bool) -> None:
        child.kill()
        with self._cond:
            self._count -= 1
            self.killed += 1
            self._cond.notify()
        if replace:  # the next grammar should not wait for a child to start
            threading.Thread(target=self.prestart, name="grammar-prestart", daemon=True).start()

    def prestart(self, idle: int = 1) -> None:
        """Starts children now until `idle` are idle or the pool is full (say at engine start,
        so the first structured request does not wait for one)."""
        while True:
            with self._cond:
                if len(self._idle) >= idle or self._count >= self.size:
                    return
                self._count += 1
            try:
                child = self._spawn()
            except CompileStartError as exc:
                logger.warning("%s", exc)
                with self._cond:
                    self._count -= 1
                    self._cond.notify()
                return
            self._release(child)

    def pids(self) -> list[int]:
        """The idle children's pids (for tests)."""
        with self._cond:
            return [c.pid for c in self._idle]

    def close(self) -> None:
        """Kills the idle children (a busy one is killed by its compilation's end)."""
        with self._cond:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for child in idle:
            child.kill()
        with self._zygote_lock:
            zygote, self._zygote = self._zygote, None
        if zygote is not None:
            zygote.close()


_shared: CompilePool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> CompilePool:
    """The process's pool (two children at most)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = CompilePool(2)
        return _shared

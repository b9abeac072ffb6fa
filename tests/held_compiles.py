"""Grammar compiles whose answer the test releases, so that a time limit or an abandonment is
tested whatever the machine's speed (a "slow" grammar that a fast machine compiles inside the
limit would otherwise turn the test around).

This file is also a program: the compile pool runs it by path in place of `compile_worker.py`
(`HeldCompiles.install` points `compile_pool.WORKER_PATH` here, or `SERVER_BOOTSTRAP` does in a
server process). Run so, it loads the real `compile_worker.py` and becomes its zygote, with one
change in the forked compile processes: a spec of at least `min_chars` characters (its JSON) is
*held*. The process writes `<pid>-<n>.held` in the folder, compiles it for real (the same work,
at nice 19 as ever), and then waits, however long the compile took, for `<pid>-<n>.release`
before it answers. A held compile therefore ends only when the test releases it or when the
pool kills its process (the time limit, an abandonment, a test's own kill). Smaller specs are
compiled and answered as usual. Run as a program it imports nothing but the standard library
and the real worker (which imports xgrammar), as the real one does.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

WORKER_PATH = Path(__file__).resolve()
ENV_REAL = "HELD_COMPILE_REAL_WORKER"
ENV_DIR = "HELD_COMPILE_DIR"
ENV_MIN_CHARS = "HELD_COMPILE_MIN_CHARS"

# Starts the local endpoint (`python -c SERVER_BOOTSTRAP <this file> <devserver args>`) with its
# compile pool running this file; the environment must hold `HeldCompiles.env()`.
SERVER_BOOTSTRAP = """
import sys
from pathlib import Path
from serverless_llm.engine.sampling.structured import compile_pool
compile_pool.WORKER_PATH = Path(sys.argv[1])
from serverless_llm.devserver.__main__ import main
sys.exit(main(sys.argv[2:]))
"""


class HeldCompiles:
    """The test's side: where the compile processes report held compiles, and the releases."""

    def __init__(self, folder: Path, min_chars: int = 5_000) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.min_chars = min_chars

    def env(self) -> dict[str, str]:
        """What a compile pool's zygote needs in its environment (it inherits its parent's)."""
        from serverless_llm.engine.sampling.structured import compile_pool

        real = compile_pool.WORKER_PATH
        if Path(real).resolve() == WORKER_PATH:  # installed already: keep the real one
            real = Path(os.environ[ENV_REAL])
        return {ENV_REAL: str(real), ENV_DIR: str(self.folder), ENV_MIN_CHARS: str(self.min_chars)}

    def install(self, monkeypatch) -> None:
        """This process's compile pools (the zygotes started from now on) hold compiles."""
        from serverless_llm.engine.sampling.structured import compile_pool

        for key, value in self.env().items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(compile_pool, "WORKER_PATH", WORKER_PATH)

    def held(self) -> list[str]:
        """Every compile held so far (released or not), as `<pid>-<n>`."""
        return sorted(p.stem for p in self.folder.glob("*.held"))

    def pending(self) -> list[str]:
        return [h for h in self.held() if not (self.folder / f"{h}.release").exists()]

    def wait_new(self, before: list[str], count: int = 1, timeout: float = 60.0) -> list[str]:
        """Until `count` compiles not in `before` (an earlier `held()`) have been held
        (`timeout` only guards against a hang); returns those."""
        deadline = time.monotonic() + timeout
        while len(new := sorted(set(self.held()) - set(before))) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(new)} of {count} compiles held after {timeout} s")
            time.sleep(0.01)
        return new

    def release_all(self) -> None:
        for name in self.pending():
            (self.folder / f"{name}.release").touch()

    @staticmethod
    def pid(name: str) -> int:
        return int(name.split("-")[0])


def _run_zygote() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("compile_worker", os.environ[ENV_REAL])
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    folder, min_chars = Path(os.environ[ENV_DIR]), int(os.environ[ENV_MIN_CHARS])
    compile_spec, count = worker.compile_spec, [0]

    def held_compile_spec(xgr, compiler, spec: dict, max_bytes: int):
        if len(json.dumps(spec)) < min_chars:
            return compile_spec(xgr, compiler, spec, max_bytes)
        count[0] += 1
        name = f"{os.getpid()}-{count[0]}"
        (folder / f"{name}.held").touch()
        try:
            return compile_spec(xgr, compiler, spec, max_bytes)
        finally:
            while not (folder / f"{name}.release").exists():
                time.sleep(0.01)

    worker.compile_spec = held_compile_spec  # what `serve` calls, in the forked processes
    worker.zygote(int(sys.argv[1]))


if __name__ == "__main__":
    try:
        _run_zygote()
    except (BrokenPipeError, KeyboardInterrupt):  # the parent went away
        pass

"""The package's layering, checked on its source (ast, not regexes):

`engine` imports nothing from `api`, `worker` or `devserver`; `api` imports only `engine`, and
only its public face (the `serverless_llm.engine` package itself); `worker` imports `api` and
`engine`; `devserver` imports `worker`; inside `engine`, `kernels/` import no other part of the
engine (each kernel module holds its Triton kernel and its torch reference, and `layers/`
choose between them).

And every module imports on its own in a fresh interpreter, so no import cycle is hidden by the
order in which modules happen to be imported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = "serverless_llm"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import of this package in `path`, relative ones
    resolved; `from X import name` counts as X.name when that is a module, else X."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                found.append((node.lineno, full if full in MODULES else base))
    return [(line, m) for line, m in found if m == PACKAGE or m.startswith(PACKAGE + ".")]


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("engine", "api", "worker", "devserver"):
        if parts[1] == "engine" and len(parts) > 2 and parts[2] == "kernels":
            return "kernels"
        return parts[1]
    return "top"  # the package root, the offline LLM and its CLI


def allowed(src: str, dst: str) -> bool:
    a, b = layer(src), layer(dst)
    if a == "kernels":
        return b == "kernels"
    if a == "engine":
        return b in ("engine", "kernels")
    if a == "api":
        return b == "api" or dst == f"{PACKAGE}.engine"
    if a == "worker":
        return b in ("worker", "api", "engine", "kernels") or dst == PACKAGE
    if a == "devserver":
        return b in ("devserver", "worker")
    return b in ("top", "engine", "kernels")


def test_imports_follow_the_layering():
    broken = [
        f"{path.relative_to(SRC.parent)}:{line}: {name} imports {dst}"
        for name, path in MODULES.items()
        for line, dst in imports_of(path)
        if not allowed(name, dst)
    ]
    assert not broken, "imports against the layering:\n" + "\n".join(broken)


def test_the_checker_sees_what_it_must():
    """The rule itself, on known cases: a checker that allowed everything would pass above."""
    assert not allowed("serverless_llm.engine.llm_engine", "serverless_llm.api.native")
    assert not allowed(
        "serverless_llm.engine.kernels.rms_norm", "serverless_llm.engine.layers.norm"
    )
    assert allowed("serverless_llm.engine.layers.norm", "serverless_llm.engine.kernels.rms_norm")
    assert not allowed("serverless_llm.api.native", "serverless_llm.worker.handler")
    assert not allowed("serverless_llm.api.native", "serverless_llm.engine.async_engine")
    assert allowed("serverless_llm.api.native", "serverless_llm.engine")
    assert allowed("serverless_llm.worker.handler", "serverless_llm.api.native")
    assert not allowed("serverless_llm.devserver.app", "serverless_llm.api.openai")
    assert not allowed("serverless_llm.devserver.app", "serverless_llm.engine")
    relative = imports_of(SRC / "devserver" / "__main__.py")
    assert any(dst.startswith("serverless_llm.worker") for _, dst in relative)


# Each module is imported by a forked child of one process that has already imported the
# third-party libraries (torch, transformers, ...): the child starts with none of this package
# loaded, which is what the cycle check needs, without paying seconds of imports per module.
_IMPORT_EACH = """
import importlib, os, sys
import fastapi, numpy, pydantic, torch, transformers, uvicorn  # noqa: F401 - shared, not ours
failed, running = [], {}
width = max(1, len(os.sched_getaffinity(0)))  # children at once, one a core: they share nothing


def reap():
    pid, status = os.wait()
    if status:
        failed.append(running[pid])
    del running[pid]


for name in sys.argv[1:]:
    if len(running) >= width:
        reap()
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException as e:
            print(f"{name}: {type(e).__name__}: {e}", flush=True)
            os._exit(1)
        os._exit(0)
    running[pid] = name
while running:
    reap()
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_alone():
    run = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, *sorted(MODULES)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, "modules that fail to import alone:\n" + run.stdout + run.stderr

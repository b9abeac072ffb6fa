"""The local endpoint serving the fake worker in a subprocess of its own: for tests that send
it signals (which reach only a main thread) or time it without sharing this process's
interpreter lock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SERVER = """
import sys
from serverless_llm.devserver.__main__ import GracefulServer, bind_socket
from serverless_llm.devserver.app import create_app
from tests.devserver.fake_worker import FakeWorker
import uvicorn

grace = float(sys.argv[1])
sock = bind_socket("127.0.0.1", 0)
app = create_app(
    FakeWorker(),
    on_ready=lambda: print(f"PORT {sock.getsockname()[1]}", flush=True),
)
config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
server = GracefulServer(config, app.state.drain, grace_s=grace)
server.run(sockets=[sock])
print("EXITED CLEANLY", flush=True)
"""


def start_fake_server(grace: float = 30.0) -> tuple[subprocess.Popen, str]:
    """The process and its base URL, once it is ready."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(grace)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("PORT "), line + proc.stdout.read()
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"

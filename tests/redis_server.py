"""A real `redis-server` (Debian's package; `make install-dev` installs it) on a free loopback
port, with no persistence, for the Responses store's tests. Import the `redis_url` fixture into
a test module (or conftest) to use it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

START_TIMEOUT_S = 30.0  # only guards against a hang: the wait ends when the server answers


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(workdir: Path) -> tuple[subprocess.Popen, int]:
    """A redis-server on 127.0.0.1 (no RDB snapshots, no AOF), once it answers PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "redis-server is not installed: `make install-dev` installs Debian's redis-server "
            "package (or run `apt-get install -y redis-server` as root)"
        )
    for _ in range(3):  # a port taken between choosing and binding: choose again
        port = _free_port()
        proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            if _ping(port):
                return proc, port
            time.sleep(0.02)
        stop_redis(proc)
    raise RuntimeError("redis-server did not start on a free loopback port")


def stop_redis(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """redis://127.0.0.1:{port}/0 of a redis-server started for the module, stopped after."""
    proc, port = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_redis(proc)

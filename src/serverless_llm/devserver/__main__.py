"""`python -m serverless_llm.devserver [--host H] [--port P]`: the local endpoint.

Serves the worker's handler over HTTP the way the hosted platform does (OpenAI routes under
`/openai/v1`, and `/run`, `/runsync`, `/stream/{id}`, `/status/{id}`, `/cancel/{id}`,
`/health`), so the official OpenAI client and raw-JSON job clients work against a laptop
unchanged. It is configured by the worker's own environment variables (MODEL_NAME,
MAX_MODEL_LEN, MAX_CONCURRENCY, ...; see docs/settings.md), plus:

- DEVSERVER_API_KEY: when set, every route requires `Authorization: Bearer <key>`; unset, the
  endpoint is open (it listens on 127.0.0.1 by default).
- DEVSERVER_HOST, DEVSERVER_PORT: defaults for --host (127.0.0.1) and --port (8000).
- DEVSERVER_MAX_BODY_BYTES: the largest request body taken (default 20 MiB, the hosted
  platform's /runsync limit; /run's there is 10 MB); a bigger one gets 413.

SIGTERM or SIGINT shuts it down gracefully (`GracefulServer`): new requests get 503, running
ones get SHUTDOWN_GRACE_SECONDS to finish, the rest end with an error, and it exits 0; a second
signal exits at once.

A bad environment value stops start-up with a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable

import uvicorn

from ..worker.handler import LOAD_ERRORS, Worker
from ..worker.heap import freeze_start_up_objects
from ..worker.settings import load_settings_or_exit
from .app import MAX_BODY_BYTES, create_app

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def bind_socket(host: str, port: int) -> socket.socket:
    """Binds before the model loads, so a taken port fails in a second, not after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections made while the model loads wait in the backlog
    except OSError:
        sock.close()
        raise
    return sock


def banner(host: str, port: int, model: str, api_key_set: bool) -> str:
    """How to call the endpoint; never includes the key itself."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    if ":" in shown:
        shown = f"[{shown}]"
    base = f"http://{shown}:{port}"
    key = '"$DEVSERVER_API_KEY"' if api_key_set else '"unused"'
    auth = ' -H "Authorization: Bearer $DEVSERVER_API_KEY"' if api_key_set else ""
    job = '{"input": {"prompt": "Hello, who are you?", "sampling_params": {"max_tokens": 32}}}'
    return "\n".join(
        [
            f"Local endpoint ready at {base}, serving model {model!r}",
            "  OpenAI client:",
            f'    OpenAI(base_url="{base}/openai/v1", api_key={key})',
            f"    model={model!r}",
            "  Job API (POST /run, /runsync; GET /stream/{id}, /status/{id}; POST /cancel/{id}):",
            f"    curl -s {base}/runsync -H 'Content-Type: application/json'{auth} -d '{job}'",
            f"  Health: curl -s {base}/health{auth}",
        ]
    )


class GracefulServer(uvicorn.Server):
    """uvicorn, with the shutdown the platform's workers need. On the first SIGTERM or SIGINT
    the app drains (`app.state.drain`: new requests get 503, running ones get `grace_s` seconds
    to finish, the rest end with an error), then the server closes and the process exits 0;
    uvicorn's own handling would refuse new connections at once, cut open streams after a
    fixed 5 s without an error, and re-raise the signal (exit status -15). A second signal
    exits at once."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Callable[[float], Awaitable[None]],
        grace_s: float,
    ) -> None:
        super().__init__(config)
        self.drain, self.grace_s = drain, grace_s
        self._signalled = False
        self._draining: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self._signalled or self._loop is None or not self.started:
            logger.warning("signal %d again: exiting now", sig)
            os._exit(128 + sig)
        self._signalled = True
        logger.info("signal %d: finishing running requests (up to %gs)", sig, self.grace_s)
        # A signal handler runs between two bytecodes of the loop's thread: hand over safely.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._draining = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain(self.grace_s)
        except Exception:
            logger.exception("draining failed; exiting")
        finally:
            self.should_exit = True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m serverless_llm.devserver",
        description="Serve the worker's handler locally: OpenAI routes and the RunPod job API.",
    )
    ap.add_argument("--host", default=os.environ.get("DEVSERVER_HOST", DEFAULT_HOST))
    ap.add_argument("--port", default=os.environ.get("DEVSERVER_PORT", str(DEFAULT_PORT)))
    ap.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    args = ap.parse_args(argv)
    try:
        port = int(args.port)
        if not 0 <= port <= 65535:
            raise ValueError
    except ValueError:
        print(f"error: port={args.port!r}: allowed an integer in 0..65535", file=sys.stderr)
        return 2

    settings = load_settings_or_exit()  # a bad value: one line on stderr, exit status 2
    raw_limit = os.environ.get("DEVSERVER_MAX_BODY_BYTES", "") or str(MAX_BODY_BYTES)
    if not raw_limit.isdigit() or int(raw_limit) < 1:
        print(
            f"error: DEVSERVER_MAX_BODY_BYTES={raw_limit!r}: allowed an integer >= 1",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        sock = bind_socket(args.host, port)
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]  # --port 0 picks a free one
    worker = Worker(settings)
    try:
        worker.load()  # once, before serving; the app's start-up then finds it loaded
    except LOAD_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        sock.close()
        return 1
    freeze_start_up_objects()  # full collections then skip the model (see worker.heap)
    api_key = os.environ.get("DEVSERVER_API_KEY") or None
    app = create_app(
        worker,
        api_key=api_key,
        max_concurrency=settings.max_concurrency,
        max_body_bytes=int(raw_limit),
        on_ready=lambda: print(
            banner(args.host, port, settings.served_model_name, api_key is not None), flush=True
        ),
    )
    config = uvicorn.Config(
        app, log_level=args.log_level, lifespan="on", timeout_graceful_shutdown=5
    )
    server = GracefulServer(config, app.state.drain, grace_s=settings.shutdown_grace_seconds)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it caught, after a clean shutdown
        return 130
    return 0 if server.started else 1


if __name__ == "__main__":
    raise SystemExit(main())

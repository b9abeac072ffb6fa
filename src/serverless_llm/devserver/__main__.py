"""`python -m serverless_llm.devserver [--host H] [--port P]`: the local endpoint.

Serves the worker's handler over HTTP the way the hosted platform does (OpenAI routes under
`/openai/v1`, and `/run`, `/runsync`, `/stream/{id}`, `/status/{id}`, `/cancel/{id}`,
`/health`), so the official OpenAI client and raw-JSON job clients work against a laptop
unchanged. It is configured by the worker's own environment variables (MODEL_NAME,
MAX_MODEL_LEN, MAX_CONCURRENCY, ...; see docs/settings.md), plus:

- DEVSERVER_API_KEY: when set, every route requires `Authorization: Bearer <key>`; unset, the
  endpoint is open (it listens on 127.0.0.1 by default).
- DEVSERVER_HOST, DEVSERVER_PORT: defaults for --host (127.0.0.1) and --port (8000).

A bad environment value stops start-up with a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

import uvicorn

from ..worker.handler import LOAD_ERRORS, Worker
from ..worker.settings import load_settings_or_exit
from .app import create_app

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
    api_key = os.environ.get("DEVSERVER_API_KEY") or None
    app = create_app(
        worker,
        api_key=api_key,
        max_concurrency=settings.max_concurrency,
        on_ready=lambda: print(
            banner(args.host, port, settings.served_model_name, api_key is not None), flush=True
        ),
    )
    config = uvicorn.Config(
        app, log_level=args.log_level, lifespan="on", timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it caught, after a clean shutdown
        return 130
    return 0 if server.started else 1


if __name__ == "__main__":
    raise SystemExit(main())

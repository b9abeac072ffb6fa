"""The local endpoint's HTTP app: the hosted platform's routes in front of the worker's handler.

Every route builds the same job the platform would hand the worker and drives the very same
`Worker.handle`, so what works here works deployed:

- `/openai/v1/chat/completions`, `/openai/v1/completions`, `/openai/v1/responses`,
  `/openai/v1/embeddings` (TASK=embed), `/openai/v1/models` (and
  `/v2/{endpoint_id}/openai/v1/...`): OpenAI requests relayed as `openai_route` jobs. Streams are
  real server-sent events, one write per item the handler yields. A client that goes away
  mid-request closes the handler's generator, which aborts the engine request and frees its KV
  blocks.
- `/rerank`, `/v1/rerank`, `/v2/rerank`, `/score`, `/v1/score`, `/classify`, `/pooling` (vLLM's
  pooling routes, at the root as in vLLM and under `/openai`, `/openai/v1`; TASK=score,
  classify or embed): relayed as `openai_route` jobs like the OpenAI routes.
- `/tokenize`, `/detokenize`, `/version`, `/metrics` (vLLM's utility routes, at the root as in
  vLLM and under `/openai/v1` as the platform relays them): `openai_route` jobs answered
  directly, outside the job slots, so a scrape never waits behind generation.
- `/v1/load_lora_adapter`, `/v1/unload_lora_adapter` (vLLM's runtime LoRA routes, also under
  `/openai/v1`; ALLOW_RUNTIME_LORA_UPDATING): answered the same way; success is vLLM's
  plain-text line.
- `/v1/messages`, `/v1/messages/count_tokens` (Anthropic's Messages API: the `anthropic` client
  with `base_url` the endpoint's root; also under `/openai` and `/v2/{endpoint_id}`): relayed as
  `openai_route` jobs the same way, answered and failed in Anthropic's shapes, streams without
  `[DONE]`.
- `/run`, `/runsync`, `/stream/{id}`, `/status/{id}`, `/cancel/{id}`, `/health` (and
  `/v2/{endpoint_id}/...`): the platform's job API. Unlike runpod's `--rp_serve_api`, `/stream`
  returns only what is new since the last poll, as the platform does.

With an API key set, every route wants `Authorization: Bearer <key>` (a bare key works too, as
on the platform; or `x-api-key: <key>`, as the Anthropic client sends it); a wrong or missing one
gets 401 in the route's error shape.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager, suppress
from typing import Any, Protocol, TypeVar
from urllib.parse import quote

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from ..worker.handler import (
    METRICS_CONTENT_TYPE,
    SSE_DONE,
    UTILITY_ROUTES,
    anthropic_error,
    http_status,
    is_error,
    openai_error,
    sse_event,
    sse_events,
)
from .body import BodyError, parse_json_off_loop
from .job_store import COMPLETED, FAILED, SHUTDOWN_MESSAGE, Job, JobManager, unless

logger = logging.getLogger(__name__)

T = TypeVar("T")

STREAM_POLL_WAIT_S = 2.0  # how long GET /stream waits for something new before answering
RUNSYNC_WAIT_MS = 90_000  # /runsync's default wait, as on the platform; ?wait= overrides it
RUNSYNC_MAX_WAIT_MS = 300_000
# The largest request body taken (DEVSERVER_MAX_BODY_BYTES): the hosted platform's own payload
# limits are 10 MB for /run and 20 MB for /runsync; bigger bodies get 413 before being read
# whole, so a huge prompt never reaches the JSON parser, the tokenizer or memory.
MAX_BODY_BYTES = 20 * 1024 * 1024


class WorkerLike(Protocol):
    """What the app needs from `serverless_llm.worker.handler.Worker`."""

    async def start(self) -> None: ...

    def handle(self, job: dict[str, Any]) -> AsyncIterator[Any]: ...

    async def shutdown(self) -> None: ...


class ApiError(Exception):
    """An error answered in the shape of the route it happened on (see `_error_response`)."""

    def __init__(self, status: int, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


# vLLM's runtime LoRA routes (ALLOW_RUNTIME_LORA_UPDATING), at /v1/... as in vLLM and under
# /openai/v1: answered directly like the utility routes, success as vLLM's plain-text line.
LORA_ROUTES = ("load_lora_adapter", "unload_lora_adapter")


# vLLM's pooling routes, at the root (and /v1/..., /v2/rerank) as in vLLM.
POOLING_ROUTES = ("rerank", "score", "classify", "pooling")
POOLING_PATHS = (
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/score",
    "/v1/score",
    "/classify",
    "/v1/classify",
    "/pooling",
    "/v1/pooling",
)


def _is_openai_path(path: str) -> bool:
    last = path.rstrip("/").rsplit("/", 1)[-1]
    return (
        "/openai/" in path
        or last in UTILITY_ROUTES
        or last in LORA_ROUTES
        or last in POOLING_ROUTES
    )


# Anthropic's Messages routes, as the job's openai_route.
ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")


def _is_anthropic_path(path: str) -> bool:
    return path.rstrip("/").endswith(ANTHROPIC_ROUTES)


def _not_json_type(content_type: str | None) -> str | None:
    """Why a body sent with `content_type` is not taken as JSON (a 415), or None when it is:
    `application/json` or a `+json` type, its charset (if named) UTF-8, as JSON's RFC has it.
    A body without a Content-Type is read as JSON, as vLLM's FastAPI server does."""
    if content_type is None or not content_type.strip():
        return None
    media, *params = (p.strip() for p in content_type.split(";"))
    media = media.lower()
    if media != "application/json" and not (
        media.startswith("application/") and media.endswith("+json")
    ):
        return (
            f"the request body must be JSON, sent with Content-Type: application/json "
            f"(got {media or 'an empty type'!r})"
        )
    for param in params:
        key, _, value = param.partition("=")
        charset = value.strip().strip('"').lower()
        if key.strip().lower() == "charset" and charset not in ("utf-8", "utf8"):
            return f"a JSON body must be UTF-8 (got charset {charset!r})"
    return None


def _error_response(path: str, status: int, message: str, code: str | None = None) -> Response:
    """OpenAI routes answer in OpenAI's error object (what its client parses), Anthropic's
    routes in Anthropic's; job routes in the platform's `{"error": "..."}`."""
    if _is_anthropic_path(path):
        err = anthropic_error(openai_error(message, code=code, status=status))
        return JSONResponse(err, status_code=http_status(err))
    if _is_openai_path(path):
        err = openai_error(message, code=code, status=status)  # the type follows the status
        return JSONResponse(err, status_code=http_status(err))
    return JSONResponse({"error": message}, status_code=status)


def _openai_error_response(err: dict[str, Any]) -> JSONResponse:
    return JSONResponse(err, status_code=http_status(err))


def _sse(item: Any) -> str:
    """One handler item as SSE text: strings are already SSE (RAW_OPENAI_OUTPUT on), lists are
    chunk objects (off), anything else is one event. The API layer frames them (api/openai/sse.py),
    as it does its own output."""
    if isinstance(item, str):
        return item
    if isinstance(item, list):
        return sse_events(item)
    return sse_event(item)


async def _first(items: AsyncIterator[Any]) -> Any:
    return await anext(items, None)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(aw: Awaitable[T], receive: Receive) -> T:
    """Awaits `aw` unless the client disconnects first; then cancels it and raises ClientGone.
    (Starlette does not notice a disconnect until it writes, and a request waiting for a slot
    or for a long generation writes nothing.)"""
    gone, result = await unless(aw, _wait_disconnect(receive))
    if gone:
        raise ClientGone()
    return result  # type: ignore[return-value]


class EventStream(StreamingResponse):
    """Server-sent events from a handler generator, one write per item.

    Unlike StreamingResponse, it always listens for the client going away while it waits for
    the next item, and closes the generator in every case, so the engine request is aborted at
    once rather than when some later write fails.
    """

    media_type = "text/event-stream"

    def __init__(self, first: Any, items: AsyncIterator[Any], done_marker: bool = True) -> None:
        """`done_marker`: end with `data: [DONE]` (chat and completions do; the Responses
        stream ends with its `response.completed` event instead)."""
        self._items = items
        super().__init__(
            self._events(first, items, done_marker),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            media_type=self.media_type,
        )

    @staticmethod
    async def _events(
        first: Any, items: AsyncIterator[Any], done_marker: bool
    ) -> AsyncIterator[str]:
        last = ""
        async with aclosing(items):  # type: ignore[type-var]
            item = first
            try:
                while True:
                    if text := _sse(item):
                        last = text
                        yield text
                    try:
                        item = await anext(items)
                    except StopAsyncIteration:
                        break
            except Exception as exc:  # the handler broke mid-stream: say so in-band
                logger.exception("stream failed")
                last = _sse(
                    openai_error(f"{type(exc).__name__}: {exc}", type="server_error", status=500)
                )
                yield last
        # RAW_OPENAI_OUTPUT on: the handler's text already ends with [DONE]; off: we add it.
        if done_marker and not last.endswith(SSE_DONE):
            yield SSE_DONE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self.stream_response(send))
        listener = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({sender, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sender, listener):
                task.cancel()
            await asyncio.wait({sender, listener})
            # The generator is idle now (its task is done), so closing it is safe; this is what
            # aborts the engine request when the client left while we waited on a send.
            with suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            with suppress(Exception):
                await self._items.aclose()  # type: ignore[attr-defined]
        if not sender.cancelled() and (exc := sender.exception()) is not None:
            if not isinstance(exc, OSError):  # OSError: the client is gone, nothing to tell
                raise exc


def create_app(
    worker: WorkerLike,
    *,
    api_key: str | None = None,
    max_concurrency: int = 300,
    max_finished_jobs: int = 1000,
    finished_job_ttl_s: float = 600.0,
    stream_poll_wait_s: float = STREAM_POLL_WAIT_S,
    on_ready: Callable[[], None] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The app; its lifespan starts the worker (loads the model once) before serving and calls
    `on_ready` then, and shuts the worker down at exit."""
    jobs: JobManager | None = None

    def job_manager() -> JobManager:
        if jobs is None:
            raise ApiError(503, "the worker is not started yet")
        return jobs

    def taking_work() -> JobManager:
        """The job manager, for a route that starts work: refused once shutdown has begun."""
        jm = job_manager()
        if jm.draining:
            raise ApiError(503, "the worker is shutting down", code="shutting_down")
        return jm

    async def drain(grace_s: float) -> None:
        """Graceful shutdown (see JobManager.drain); the server calls it on SIGTERM/SIGINT."""
        if jobs is not None:
            await jobs.drain(grace_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal jobs
        await worker.start()
        jobs = JobManager(
            worker.handle,
            max_concurrency=max_concurrency,
            max_finished=max_finished_jobs,
            finished_ttl_s=finished_job_ttl_s,
        )
        app.state.jobs = jobs
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await jobs.shutdown()
            await worker.shutdown()

    def check_api_key(request: Request) -> None:
        if not api_key:
            return
        given = request.headers.get("authorization", "").strip()
        if given[:7].lower() == "bearer ":
            given = given[7:].strip()
        if not given:  # the Anthropic client's header
            given = request.headers.get("x-api-key", "").strip()
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise ApiError(401, "missing or incorrect API key", code="invalid_api_key")

    app = FastAPI(
        title="serverless-llm local endpoint",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.worker = worker
    app.state.drain = drain

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return _error_response(request.url.path, exc.status, exc.message, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return _error_response(request.url.path, exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(request.url.path, 400, f"invalid request: {exc.errors()}")

    router = APIRouter(dependencies=[Depends(check_api_key)])

    # -- OpenAI -------------------------------------------------------------------------------

    async def relay(
        request: Request, route: str, body: dict[str, Any], method: str | None = None
    ) -> Response:
        job_input: dict[str, Any] = {"openai_route": route, "openai_input": body}
        if method is not None:
            job_input["openai_method"] = method
        items = taking_work().run_direct(
            {"id": f"oai-{uuid.uuid4().hex}", "input": job_input},
            on_shutdown=openai_error(SHUTDOWN_MESSAGE, type="server_error", status=503),
        )
        try:
            first = await _unless_disconnected(_first(items), request.receive)
        except ClientGone:
            await items.aclose()
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        except BaseException:
            await items.aclose()
            raise
        if first is None or isinstance(first, dict):
            # Not a stream: one response object or one error object. The handler ends after it;
            # it is run to that end rather than closed, so the request counts as completed (or
            # failed), not cancelled.
            try:
                async for _ in items:
                    pass
            finally:
                await items.aclose()
            if first is None:
                raise ApiError(500, "the worker produced no output")
            if is_error(first):  # (a Response object carries `"error": null`)
                return _openai_error_response(first)
            return JSONResponse(first)
        # The Responses and Messages streams end with their own closing event, not [DONE].
        done = route in ("/v1/chat/completions", "/v1/completions")
        return EventStream(first, items, done_marker=done)

    async def read_body(request: Request) -> bytes:
        """The body, or 413 in the route's shape as soon as it is known to exceed the limit
        (from Content-Length, or while reading a body sent without one); 415 for a body that
        is not sent as JSON (see `_not_json_type`)."""
        not_json = _not_json_type(request.headers.get("content-type"))
        if not_json is not None:
            raise ApiError(415, not_json, code="unsupported_media_type")
        too_big = ApiError(
            413,
            f"the request body is larger than {max_body_bytes} bytes",
            code="request_too_large",
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    async def read_openai_body(request: Request) -> dict[str, Any]:
        raw = await read_body(request)
        try:
            body = await parse_json_off_loop(raw)
        except BodyError as exc:
            raise ApiError(400, str(exc)) from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    @router.post("/openai/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await relay(request, "/v1/chat/completions", await read_openai_body(request))

    @router.post("/openai/v1/completions")
    async def completions(request: Request) -> Response:
        return await relay(request, "/v1/completions", await read_openai_body(request))

    @router.post("/openai/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await relay(request, "/v1/embeddings", await read_openai_body(request))

    def pooling_endpoint(route: str) -> Callable[[Request], Awaitable[Response]]:
        async def pool(request: Request) -> Response:
            return await relay(request, route, await read_openai_body(request))

        return pool

    for path in POOLING_PATHS:
        for prefix in ("", "/openai", "/openai/v1"):
            if prefix == "/openai/v1" and path.startswith("/v"):
                continue  # /openai/v1/v1/... is no one's spelling
            router.add_api_route(prefix + path, pooling_endpoint(path), methods=["POST"])

    @router.post("/openai/v1/responses")
    async def responses(request: Request) -> Response:
        return await relay(request, "/v1/responses", await read_openai_body(request))

    # Stored responses (the worker's response store): retrieve, delete, list input items.
    @router.get("/openai/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str) -> Response:
        return await relay(request, f"/v1/responses/{quote(response_id, safe='')}", {}, "GET")

    @router.delete("/openai/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        route = f"/v1/responses/{quote(response_id, safe='')}"
        return await relay(request, route, {}, "DELETE")

    @router.get("/openai/v1/responses/{response_id}/input_items")
    async def response_input_items(request: Request, response_id: str) -> Response:
        route = f"/v1/responses/{quote(response_id, safe='')}/input_items"
        if request.url.query:
            route += f"?{request.url.query}"
        return await relay(request, route, {}, "GET")

    # Anthropic's Messages API: the `anthropic` client posts to {base_url}/v1/messages, so
    # base_url is the endpoint's root (or .../openai, the prefix the platform relays).
    def anthropic_endpoint(route: str) -> Callable[[Request], Awaitable[Response]]:
        async def messages(request: Request) -> Response:
            return await relay(request, route, await read_openai_body(request))

        return messages

    for prefix in ("", "/openai"):
        for route in ANTHROPIC_ROUTES:
            router.add_api_route(prefix + route, anthropic_endpoint(route), methods=["POST"])

    @router.get("/openai/v1/models")
    async def list_models(request: Request) -> Response:
        return await relay(request, "/v1/models", {})

    @router.get("/openai/v1/models/{model:path}")
    async def retrieve_model(request: Request, model: str) -> Response:
        """`client.models.retrieve(name)`: the matching entry of the model list, or 404."""
        listed = await relay(request, "/v1/models", {})
        if listed.status_code != 200 or not isinstance(listed, JSONResponse):
            return listed
        for entry in json.loads(bytes(listed.body)).get("data", []):
            if entry.get("id") == model:
                return JSONResponse(entry)
        err = openai_error(
            f"The model `{model}` does not exist.",
            type="invalid_request_error",
            param="model",
            code="model_not_found",
            status=404,
        )
        return _openai_error_response(err)

    # -- vLLM's utility routes ----------------------------------------------------------------

    async def utility(route: str, body: dict[str, Any]) -> Response:
        """Runs the worker's handler on the route's job directly: no job slot, and answered
        while draining too (a scrape or a token count never waits behind generation)."""
        job_manager()  # 503 until the worker has started
        job = {
            "id": f"util-{uuid.uuid4().hex}",
            "input": {"openai_route": route, "openai_input": body},
        }
        async with aclosing(worker.handle(job)) as items:
            first = await anext(items, None)
            async for _ in items:
                pass
        if isinstance(first, str):  # /metrics: Prometheus' text format; LoRA updates: a line
            media = METRICS_CONTENT_TYPE if route == "/metrics" else "text/plain; charset=utf-8"
            return Response(first, media_type=media)
        if not isinstance(first, dict):
            raise ApiError(500, "the worker produced no output")
        if is_error(first):
            return _openai_error_response(first)
        return JSONResponse(first)

    for prefix in ("", "/openai/v1"):

        @router.post(f"{prefix}/tokenize")
        async def tokenize(request: Request) -> Response:
            return await utility("/tokenize", await read_openai_body(request))

        @router.post(f"{prefix}/detokenize")
        async def detokenize(request: Request) -> Response:
            return await utility("/detokenize", await read_openai_body(request))

        @router.get(f"{prefix}/version")
        async def version() -> Response:
            return await utility("/version", {})

        @router.get(f"{prefix}/metrics")
        async def metrics() -> Response:
            return await utility("/metrics", {})

    def lora_update(route: str) -> Callable[[Request], Awaitable[Response]]:
        async def update(request: Request) -> Response:
            return await utility(route, await read_openai_body(request))

        return update

    for prefix in ("/v1", "/openai/v1"):
        for name in LORA_ROUTES:
            router.add_api_route(f"{prefix}/{name}", lora_update(f"/v1/{name}"), methods=["POST"])

    # -- the platform's job API ---------------------------------------------------------------

    async def read_job_input(request: Request) -> Any:
        raw = await read_body(request)
        try:
            body = await parse_json_off_loop(raw)
        except BodyError as exc:
            raise ApiError(400, str(exc)) from None
        if not isinstance(body, dict) or "input" not in body:
            raise ApiError(400, 'the request body must be a JSON object with an "input" field')
        if not isinstance(body["input"], dict):
            raise ApiError(400, '"input" must be a JSON object')
        return body["input"]

    def find(job_id: str) -> Job:
        job = job_manager().get(job_id)
        if job is None:
            raise ApiError(404, f"job {job_id!r} not found (unknown, or finished long ago)")
        return job

    def view(job: Job) -> dict[str, Any]:
        out: dict[str, Any] = {"id": job.id, "status": job.status, **job.timings()}
        if job.status == COMPLETED:
            out["output"] = job.output
        elif job.status == FAILED:
            out["error"] = job.error
        return out

    @router.post("/run")
    async def run(request: Request) -> dict[str, Any]:
        job = taking_work().submit(await read_job_input(request))
        return {"id": job.id, "status": job.status}

    @router.post("/runsync")
    async def runsync(request: Request, wait: int | None = None) -> dict[str, Any]:
        """Waits for the job (up to `wait` ms, 90 s by default); a job still running answers
        with its status, to be polled with /status or /stream, as on the platform."""
        jm = taking_work()
        job = jm.submit(await read_job_input(request))
        wait_ms = RUNSYNC_WAIT_MS if wait is None else min(max(wait, 0), RUNSYNC_MAX_WAIT_MS)
        await jm.wait_done(job, wait_ms / 1000)
        return view(job)

    @router.api_route("/stream/{job_id}", methods=["GET", "POST"])
    async def stream(job_id: str) -> dict[str, Any]:
        job = find(job_id)
        items = await job_manager().next_stream_items(job, stream_poll_wait_s)
        out: dict[str, Any] = {
            "id": job.id,
            "status": job.status,
            "stream": [{"output": item} for item in items],
        }
        if job.status == FAILED:
            out["error"] = job.error
        return out

    @router.api_route("/status/{job_id}", methods=["GET", "POST"])
    async def status(job_id: str) -> dict[str, Any]:
        return view(find(job_id))

    @router.post("/cancel/{job_id}")
    async def cancel(job_id: str) -> dict[str, Any]:
        job = find(job_id)
        await job_manager().cancel(job)
        return {"id": job.id, "status": job.status}

    @router.get("/health")
    async def health() -> dict[str, Any]:
        jm = job_manager()
        counts = jm.health_counts()
        busy = counts["inProgress"] > 0
        out: dict[str, Any] = {
            "ok": not jm.draining and getattr(worker, "fatal", None) is None,
            "jobs": counts,
            "workers": {
                "ready": 1,
                "idle": 0 if busy else 1,
                "running": 1 if busy else 0,
                "concurrency": jm.max_concurrency,
            },
        }
        if (engine_stats := _engine_stats(worker)) is not None:
            out["engine"] = engine_stats
        return out

    app.include_router(router)
    app.include_router(router, prefix="/v2/{endpoint_id}")
    return app


def _engine_stats(worker: Any) -> dict[str, Any] | None:
    """KV pool occupancy and requests in flight, when the worker has an engine loaded: what
    tells a stuck or leaking engine apart from a busy one."""
    stats = worker.engine_stats()
    if stats is None:
        return None
    out = {
        "kvBlocksFree": stats.num_free_kv_blocks,
        "kvBlocksTotal": stats.num_kv_blocks,
        "requests": stats.num_requests,
    }
    if stats.ranks:  # tensor parallelism: each rank's process, device and weights
        out["ranks"] = [
            {
                "rank": r["rank"],
                "alive": r["alive"],
                "device": r["device"],
                "paramBytes": r["param_bytes"],
            }
            for r in stats.ranks
        ]
    if (fatal := getattr(worker, "fatal", None)) is not None:
        out["error"] = str(fatal)
    return out

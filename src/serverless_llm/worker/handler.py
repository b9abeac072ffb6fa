"""The RunPod entry point: one engine, loaded once, serving many concurrent jobs.

`Worker.handle` is an async generator, so RunPod streams what it yields (and, with
`return_aggregate_stream`, also returns the list of items from `/run` and `/runsync`). It never
blocks the event loop: the engine steps in its own thread and the model loads before the SDK
starts (or in a thread, from `start()`). A job can fail, never the worker: every error is
yielded in its route's shape, and only CancelledError escapes, so the SDK can cancel a job;
closing the generator aborts the job's engine requests and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from .. import __version__
from ..api.anthropic import anthropic_error
from ..api.errors import native_error
from ..api.lora import LoRAAdapters
from ..api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ..api.metrics import EngineMetrics
from ..api.native import NativeServing
from ..api.offload import prepare
from ..api.openai import (
    SSE_DONE,
    UTILITY_ROUTES,
    OpenAIServing,
    http_status,
    is_error,
    openai_error,
    sse_event,
    sse_events,
)
from ..engine import (
    AsyncEngine,
    ConfigError,
    EngineStats,
    InvalidRequestError,
    LoRARequest,
    ModelLoadError,
    UnsupportedModelError,
)
from . import triton_cache
from .baked import BakedModelError, apply_baked_model
from .heap import freeze_start_up_objects
from .job_input import JobError, NativeJob, OpenAIJob, parse_job
from .settings import Settings, load_settings_or_exit
from .shutdown import GracefulShutdown, serve
from .start_phases import StartPhases

# The devserver reaches the API layer's error shapes and SSE framing through the worker (it
# imports nothing else).
__all__ = [
    "LOAD_ERRORS",
    "anthropic_error",
    "METRICS_CONTENT_TYPE",
    "SSE_DONE",
    "UTILITY_ROUTES",
    "Worker",
    "http_status",
    "is_error",
    "main",
    "openai_error",
    "sse_event",
    "sse_events",
]

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 10.0
# Guided decoding's warm-up (the tokenizer's grammar tables, a compile process) starts at the
# first output, or this long after the model is ready if no job comes first: started at ready
# it ran beside the first request and, on 2 cores, slowed its one forward ~2x (issue 42,
# docs/benchmarks.md). A structured first request builds what it needs itself, as before.
GRAMMAR_WARM_UP_DELAY_S = 5.0

# What loading raises for a model or settings the worker cannot serve: reported in one line,
# never as a traceback.
LOAD_ERRORS = (ModelLoadError, ConfigError, UnsupportedModelError)


class Worker:
    """The handler and its state: settings, the engine and the two serving layers."""

    def __init__(self, settings: Settings | None = None, engine: AsyncEngine | None = None) -> None:
        self.settings = settings if settings is not None else Settings.from_env()
        self.engine: AsyncEngine | None = engine
        self.start_phases = StartPhases()  # the cold-start line's marks
        # The adapters served (LORA_MODULES, those that read), once the engine exists.
        self.loras: list[LoRARequest] = [] if engine is None else self._load_loras(engine)
        # Prometheus metrics (ENABLE_METRICS), observing the engine from when it exists.
        self.metrics: EngineMetrics | None = None if engine is None else self._metrics(engine)
        self._load_lock = threading.Lock()
        self._native: NativeServing | None = None
        self._openai: Any = None
        self._adapters: LoRAAdapters | None = None
        self._stats_task: asyncio.Task | None = None
        self.active_jobs = 0
        self.finished_jobs = 0
        # Set when the engine can never serve again; `on_fatal` (main's: exit non-zero) is told.
        self.fatal: BaseException | None = None
        self.on_fatal = None
        # Set by load: the grammar warm-up's timer (an engine handed in is not warmed up).
        self._grammar_warm_up: threading.Timer | None = None
        self._grammar_lock = threading.Lock()

    # -- life cycle -------------------------------------------------------------------------

    def load(self) -> AsyncEngine:
        """Loads the model (once; later calls return the same engine). Blocking: call it before
        the event loop runs, or through `start()`."""
        with self._load_lock:
            if self.engine is None:
                self.settings.log_startup(logger)
                self.start_phases.load_start = self.start_phases.now()
                triton_cache.configure(self.settings.base_path)  # before Triton is imported
                self.engine = AsyncEngine.from_config(self.settings.engine_config())
                self.start_phases.ready = self.start_phases.now()
                self.start_phases.engine = dict(getattr(self.engine.core, "start_phases", {}))
                logger.info("%s", self.start_phases.line())
                self.engine.on_fatal = self._engine_stopped
                self._grammar_warm_up = threading.Timer(
                    GRAMMAR_WARM_UP_DELAY_S, self._warm_up_grammars
                )
                self._grammar_warm_up.daemon = True
                self._grammar_warm_up.start()
                logger.info("%s", sampling_defaults_line(self.settings, self.engine))
                self.loras = self._load_loras(self.engine)
                self.metrics = self._metrics(self.engine)
            return self.engine

    def _warm_up_grammars(self) -> None:
        """The engine's grammar warm-up (in its own thread), once: at the first output or on
        the timer, whichever comes first."""
        with self._grammar_lock:
            timer, self._grammar_warm_up = self._grammar_warm_up, None
        if timer is None or self.engine is None:
            return
        timer.cancel()
        self.engine.warm_up_grammars()

    def _metrics(self, engine: AsyncEngine) -> EngineMetrics | None:
        if not self.settings.enable_metrics:
            return None
        return EngineMetrics(engine, self.settings.served_model_name).attach()

    def _load_loras(self, engine: AsyncEngine) -> list[LoRARequest]:
        """Reads each LORA_MODULES adapter now; one that cannot be served is logged with its
        reason and left out (the worker serves the model and the other adapters)."""
        served = []
        for req in self.settings.lora_requests():
            try:
                engine.load_lora(req)
            except InvalidRequestError as e:
                logger.error("LoRA adapter %r is not served: %s", req.lora_name, e)
                continue
            served.append(req)
        if served:
            logger.info("LoRA adapters: %s", ", ".join(r.lora_name for r in served))
        return served

    @property
    def adapters(self) -> LoRAAdapters:
        """The adapters requests may name, shared by the OpenAI and native routes: those of
        LORA_MODULES that read, and, with ALLOW_RUNTIME_LORA_UPDATING, those loaded since."""
        if self._adapters is None:
            self._adapters = LoRAAdapters(
                self.loras, runtime_updates=self.settings.allow_runtime_lora_updating
            )
        return self._adapters

    def _engine_stopped(self, exc: BaseException) -> None:
        self.fatal = exc
        if self.on_fatal is not None:
            self.on_fatal(exc)

    async def start(self) -> None:
        """Loads the model in a thread (the event loop keeps serving health checks); idempotent
        and safe to call from concurrent jobs."""
        if self.engine is None:
            await asyncio.to_thread(self.load)
        if not self.settings.disable_log_stats and self._stats_task is None:
            self._stats_task = asyncio.get_running_loop().create_task(self._log_stats())

    async def shutdown(self) -> None:
        if self._grammar_warm_up is not None:
            self._grammar_warm_up.cancel()
        if self._stats_task is not None:
            self._stats_task.cancel()
            await asyncio.gather(self._stats_task, return_exceptions=True)
            self._stats_task = None
        if self.engine is not None:
            await self.engine.shutdown()

    def concurrency_modifier(self, current: int) -> int:
        """Constant: a changed value makes the SDK wait for every running job to end before it
        rescales, which would stall a busy worker."""
        return self.settings.max_concurrency

    # -- jobs -------------------------------------------------------------------------------

    async def handle(self, job: dict[str, Any]) -> AsyncIterator[Any]:
        """The RunPod handler: `job` is `{"id": ..., "input": {...}}`."""
        job_id = str(job.get("id") or "job") if isinstance(job, dict) else "job"
        openai = False
        self.active_jobs += 1
        try:
            try:
                # Off the event loop: checking and validating a large input takes a while.
                settings = self.settings
                parsed = await prepare(
                    parse_job, job, settings.batch_sizes, settings.request_limits
                )
            except JobError as e:
                yield e.payload
                return
            openai = isinstance(parsed, OpenAIJob) and not parsed.native
            try:
                await self.start()
            except LOAD_ERRORS as e:
                message = f"the model could not be loaded: {e}"
                yield openai_error(message) if openai else native_error(message)
                return
            if isinstance(parsed, OpenAIJob):
                stream = self._openai_serving().handle(
                    parsed.route, parsed.body, parsed.batch, parsed.method
                )
            else:
                assert isinstance(parsed, NativeJob)
                stream = self._native_serving().handle(parsed.request, parsed.batch, job_id)
            native_pooling = isinstance(parsed, OpenAIJob) and parsed.native
            async with aclosing(stream) as items:
                async for item in items:
                    if native_pooling and is_error(item):  # a pooling job's native shape
                        item = native_error(str(item["error"].get("message")))
                    if self.start_phases.first_token is None:
                        self.start_phases.first_token = self.start_phases.now()
                        logger.info("first output %.1fs after process start (ready at %.1fs)",
                                    self.start_phases.first_token, self.start_phases.ready or 0.0)  # fmt: skip
                        self._warm_up_grammars()
                    yield item
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug below: this job fails, the worker keeps serving
            logger.exception("job %s failed", job_id)
            message = f"internal error: {type(e).__name__}: {e}"
            yield _internal_openai_error(message) if openai else native_error(message)
        finally:
            self.active_jobs -= 1
            self.finished_jobs += 1

    def engine_stats(self) -> EngineStats | None:
        """The engine's load now, or None before the model is loaded."""
        return None if self.engine is None else self.engine.stats()

    async def handle_aggregate(self, job: dict[str, Any]) -> list[Any]:
        """All of `handle`'s items as one list, for SDK modes that call the handler once and
        do not iterate generators (`--test_input`, realtime)."""
        async with aclosing(self.handle(job)) as items:
            return [item async for item in items]

    def _native_serving(self) -> NativeServing:
        if self._native is None:
            assert self.engine is not None
            self._native = NativeServing(
                self.engine,
                chat_template=self.settings.custom_chat_template,
                log_requests=not self.settings.disable_log_requests,
                limits=self.settings.request_limits,
                served_model_name=self.settings.served_model_name,
                model_aliases=self.settings.served_model_names + self.settings.model_name_aliases,
                lora_modules=self.adapters,
                media=self.settings.media_config,
            )
        return self._native

    def _openai_serving(self) -> OpenAIServing:
        """Made on the first OpenAI job."""
        if self._openai is None:
            assert self.engine is not None
            self._openai = OpenAIServing(
                self.engine,
                served_model_name=self.settings.served_model_name,
                model_aliases=self.settings.served_model_names[1:],
                unlisted_aliases=self.settings.model_name_aliases,
                response_role=self.settings.openai_response_role,
                chat_template=self.settings.custom_chat_template,
                raw_output=self.settings.raw_openai_output,
                enable_auto_tool_choice=self.settings.enable_auto_tool_choice,
                tool_call_parser=self.settings.tool_call_parser,
                limits=self.settings.request_limits,
                reasoning_parser=self.settings.reasoning_parser or "auto",
                structured_in_reasoning=self.settings.structured_outputs_enable_in_reasoning,
                lora_modules=self.adapters,
                media=self.settings.media_config,
                response_store=self.settings.response_store(),
                metrics=self.metrics.render if self.metrics is not None else None,
                version=__version__,
            )
        return self._openai

    async def _log_stats(self) -> None:
        """DISABLE_LOG_STATS=0: a line every few seconds while there is work."""
        last_finished = -1
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            engine = self.engine
            if engine is None or (self.active_jobs == 0 and self.finished_jobs == last_finished):
                continue
            last_finished = self.finished_jobs
            stats = engine.stats()
            alive = sum(1 for r in stats.ranks if r["alive"])
            logger.info(
                "stats: %d jobs running, %d finished; engine: %d running, %d waiting requests; "
                "KV cache %d/%d blocks in use%s%s",
                self.active_jobs,
                self.finished_jobs,
                stats.num_running,
                stats.num_waiting,
                stats.num_used_kv_blocks,
                stats.num_kv_blocks,
                f"; tensor-parallel ranks {alive}/{len(stats.ranks)} alive" if stats.ranks else "",
                speculation_line(stats),
            )


def speculation_line(stats: Any) -> str:
    """The stats line's speculative decoding part ('' when it is off or has verified nothing
    yet): the share of drafts kept and the tokens a verification step gives."""
    spec = stats.speculation
    if not stats.speculative or spec.acceptance_rate is None:
        return ""
    return (
        f"; speculation: {spec.acceptance_rate:.0%} of {spec.draft_tokens} drafts accepted, "
        f"{spec.mean_accepted_length:.2f} tokens a verification"
    )


def _internal_openai_error(message: str) -> dict[str, Any]:
    return openai_error(message, type="server_error", status=500)


def _iterates_generators(argv: Sequence[str], environ: Any) -> bool:
    """Whether the SDK will iterate a generator handler in this mode. The API server
    (`--rp_serve_api`) and the platform's job loop do; `--test_input`, `test_input.json` and the
    realtime server call the handler once and would get a generator object back."""
    if "--rp_serve_api" in argv:
        return True
    if environ.get("RUNPOD_REALTIME_PORT", "0") not in ("", "0"):
        return False
    if any(a == "--test_input" or a.startswith("--test_input=") for a in argv):
        return False
    return environ.get("RUNPOD_WEBHOOK_GET_JOB") is not None


MODEL_NAME_MISSING = (
    "MODEL_NAME is not set: set it to the Hugging Face repo id (or local path) of the model to "
    "serve, or build the image with --build-arg MODEL_NAME=...; for a local run without a model, "
    "python -m serverless_llm.devserver serves the embedded SmolLM2"
)


def sampling_defaults_line(settings: Settings, engine: Any) -> str:
    """The start-up line saying which sampling defaults came from the model's
    generation_config.json (GENERATION_CONFIG) and which from OVERRIDE_GENERATION_CONFIG."""
    defaults = engine.model_info.sampling_defaults
    where = {"model": [], "override": []}
    for name, value in defaults.values.items():
        where[defaults.sources[name]].append(f"{name}={value:g}")
    parts = []
    if where["model"]:
        source = (
            "the model's generation_config.json"
            if settings.generation_config == "auto"
            else f"{settings.generation_config}/generation_config.json"
        )
        parts.append(f"{', '.join(where['model'])} from {source}")
    if where["override"]:
        parts.append(f"{', '.join(where['override'])} from OVERRIDE_GENERATION_CONFIG")
    if not parts:
        why = (
            "GENERATION_CONFIG=vllm"
            if settings.generation_config == "vllm"
            else "the model's generation_config.json sets none"
        )
        return f"sampling defaults: the engine's own ({why})"
    tail = " (GENERATION_CONFIG=vllm turns the model's off)" if where["model"] else ""
    return "sampling defaults for parameters a request leaves unset: " + "; ".join(parts) + tail


def ready_line(worker: Worker) -> str:
    """The one start-up line: what is served, how, and how many jobs at once."""
    assert worker.engine is not None
    info = worker.engine.model_info
    return (
        f"worker ready: model={worker.settings.served_model_name} "
        f"(from {info.source}) dtype={info.dtype} "
        f"device={info.device} kv_blocks={info.num_kv_blocks} "
        f"(block_size {info.block_size}) max_model_len={info.max_model_len} "
        f"tensor_parallel_size={info.tensor_parallel_size} "
        f"max_concurrency={worker.settings.max_concurrency}"
    )


def main() -> None:
    """`python -m serverless_llm.worker`: validate the env, load the model, start the SDK."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        apply_baked_model()  # a model baked into the image: its local files, the hub off
    except BakedModelError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    settings = load_settings_or_exit()
    if settings.model_name is None:  # the embedded model is for local runs, not a deployment
        print(f"error: {MODEL_NAME_MISSING}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    worker = Worker(settings)
    try:
        worker.load()
    except LOAD_ERRORS as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    freeze_start_up_objects()  # full collections then skip the model (see worker.heap)
    logger.info("%s", ready_line(worker))

    import runpod

    config = {"concurrency_modifier": worker.concurrency_modifier, "return_aggregate_stream": True}
    if not _iterates_generators(sys.argv[1:], os.environ):
        runpod.serverless.start({**config, "handler": worker.handle_aggregate})
        return
    shutdown = GracefulShutdown(worker, settings.shutdown_grace_seconds)
    worker.on_fatal = shutdown.fail
    serve(shutdown, config)
    logger.info("worker stopped")
    if shutdown.exit_code:
        raise SystemExit(shutdown.exit_code)

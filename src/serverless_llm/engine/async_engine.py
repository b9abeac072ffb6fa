"""The asyncio front of the engine: many concurrent `generate` calls, one stepping loop.

One background task owns the engine. It applies queued additions and aborts between steps and
runs each step in a single worker thread, so the event loop stays free while the model computes
and the engine's state is only ever touched by one party at a time. Each request has a queue its
`generate` call reads from; a consumer that stops listening (break, cancel, disconnect) aborts
its request, which frees its KV blocks at the next step boundary.

All of the engine's torch work, building the model included, happens on that one step thread.
On CPU this matters a great deal: libgomp keeps a separate pool of OpenMP workers for every
thread that runs a parallel region, and once the pools hold more threads than there are cores
it stops spinning between regions, so each of the ~1,000 parallel regions of a decode step pays
a futex wake-up. Loading the model on one thread and stepping on another made SmolLM2's batch-32
decode ~60% slower on 2 cores (see docs/engine.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from .client import ModelInfo
from .config import EngineConfig
from .input_processor import InvalidRequestError, PreparedPrompt, PromptInput
from .llm_engine import LLMEngine
from .lora_adapters import LoRARequest
from .multimodal import MultiModalInput
from .outputs import EngineOutput, EngineStats
from .parallel.group import TensorParallelError
from .pooling import embed_params, instructed_text
from .request import Request
from .sampling.params import SamplingParams
from .sampling.structured.grammar import CompiledGrammar
from .sampling.structured.spec import StructuredOutputSpec

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class RequestFailedError(EngineDeadError):
    """One request failed on its own (its output processing raised); the engine serves on."""


def _step_executor() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-step")


class AsyncEngine:
    """The `EngineClient` the API routes and the worker use (client.py): their only way in."""

    def __init__(
        self,
        engine: LLMEngine,
        executor: concurrent.futures.ThreadPoolExecutor | None = None,
    ) -> None:
        self.core = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending_adds: list = []
        self._pending_aborts: list[str] = []
        self._pending_lora_removals: list[int] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._executor = executor or _step_executor()
        self._ids = itertools.count()
        self._closed = False
        self.dead: Exception | None = None  # set when the engine can never step again
        self.on_fatal = None  # called with that error, once
        self._observers: list[Callable[[list[EngineOutput]], None]] = []

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Builds the engine on the thread that will step it (blocking)."""
        executor = _step_executor()
        try:
            engine = executor.submit(LLMEngine, config).result()
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(engine, executor)

    # -- the public face (EngineClient) -----------------------------------------------------

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def model_config(self):
        return self.core.hf_config

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def model_info(self) -> ModelInfo:
        core = self.core
        return ModelInfo(
            source=core.resolved.source,
            dtype=str(core.dtype).removeprefix("torch."),
            device=str(core.device),
            max_model_len=core.max_model_len,
            vocab_size=core.vocab_size,
            block_size=core.block_size,
            num_kv_blocks=core.block_pool.num_blocks,
            tensor_parallel_size=core.tp.size,
            image_input=core.inputs.images is not None,
            image_placeholder=core.inputs.image_placeholder(),
            sampling_defaults=core.sampling_defaults,
        )

    def load_lora(self, lora_request: LoRARequest) -> None:
        if self.core.lora is None:
            raise InvalidRequestError("LoRA is not enabled (enable_lora / ENABLE_LORA)")
        self.core.lora.get(lora_request)

    def remove_lora(self, lora_request: LoRARequest) -> None:
        """Forgets an adapter (its host copy and slot) once its requests in flight have
        finished; they run to their end with it. Returns at once: applied at the next step
        boundary."""
        self._pending_lora_removals.append(lora_request.lora_int_id)
        self._ensure_loop()

    def check_priority(self, priority: int) -> None:
        """InvalidRequestError naming `priority` unless `generate` would take it."""
        self.core.check_priority(priority)

    def stats(self) -> EngineStats:
        """A snapshot (read between steps without a lock: counts may be one step old)."""
        return self.core.stats()

    def add_output_observer(self, observer: Callable[[list[EngineOutput]], None]) -> None:
        """Calls `observer` on the event loop with every step's outputs (and each abort's),
        before the next step starts, so their `times` hold still while it reads them (the
        serving layer's metrics). It must be quick; what it raises is logged, never the
        requests'."""
        self._observers.append(observer)

    def _observe(self, outputs: list[EngineOutput]) -> None:
        for observer in self._observers:
            try:
                observer(outputs)
            except Exception:
                logger.exception("an output observer failed")

    def tokenize_prompt(self, prompt: str | list[int]) -> PromptInput:
        return self.core.inputs.tokenize_prompt(prompt)

    def check_token_ids(self, token_ids: list[int], param: str | None = None) -> None:
        self.core.inputs.check_token_ids(token_ids, param)

    async def compile_grammar(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """Compiled off the event loop and the step thread (a cache hit resolves at once).
        Cancelling the awaiting task withdraws the request from the compilation, which stops
        when no request waits for it."""
        return await asyncio.wrap_future(self.core.inputs.compile_grammar(spec))

    def warm_up_grammars(self) -> None:
        """Builds the tokenizer's grammar tables and starts a compile process in the background,
        so the first structured request waits for neither (about 3 s on 2 cores). Not for a
        model served for pooling only (TASK embed, classify, score): it generates nothing, so
        no grammar is ever compiled, and those seconds of CPU would go from its first
        requests."""
        if self.core.task != "generate":
            return

        def warm_up() -> None:
            try:
                self.core.inputs.grammar_compiler.warm_up()
            except Exception:  # the first structured request will report it
                logger.warning("grammar warm-up failed", exc_info=True)

        threading.Thread(target=warm_up, name="grammar-warm-up", daemon=True).start()

    def prepare_prompt(
        self, prompt: str | list[int] | MultiModalInput, params: SamplingParams
    ) -> PreparedPrompt:
        """A prompt validated once for requests with `params`: tokenized or checked, fitted
        (ContextLengthError when it does not fit); each request's own parameters are checked
        when it is built. Blocking (the tokenizer): the routes call it off the event loop."""
        return self.core.inputs.prepare(prompt, params)

    async def prepare(
        self,
        prompt: str | list[int] | MultiModalInput | PreparedPrompt,
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> PreparedPrompt:
        """`prepare_prompt`, then what the requests need compiled or read: the grammar of the
        structured output (off the event loop; InvalidRequestError naming the field) and the
        adapter (off the event loop; LoRAError). A prompt prepared already is only completed."""
        prepared = self.core.inputs.prepare(prompt, params)
        if params.structured is not None and prepared.grammar is None:
            grammar = await self.compile_grammar(params.structured)
            prepared = dataclasses.replace(prepared, grammar=grammar)
        if lora_request is not None and prepared.lora != lora_request:
            prepared = await asyncio.to_thread(self.core.with_adapter, prepared, lora_request)
        return prepared

    async def generate(
        self,
        prompt: str | list[int] | PreparedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> AsyncIterator[EngineOutput]:
        """Yields one EngineOutput per step that produced tokens for this request; the last
        has `finished` set. Invalid input raises InvalidRequestError before anything is queued
        (a bad or unknown adapter among them: LoRAError, read off the event loop; a non-zero
        `priority` without the priority scheduling policy). A prompt prepared by `prepare`
        (the routes') is not validated again."""
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        if request_id is None:
            request_id = f"async-{next(self._ids)}"
        if request_id in self._queues:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        self.core.check_generates()
        self.core.check_priority(priority)
        prepared = await self.prepare(prompt, params, lora_request)
        if request_id in self._queues:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        req = self.core.inputs.build_request(prepared, params, request_id)
        req.priority = priority
        async with aclosing(self._outputs(req)) as outputs:
            async for item in outputs:
                yield item

    async def _outputs(self, req: Request) -> AsyncIterator[EngineOutput]:
        """Queues `req` for the loop and yields its outputs up to the finished one; a caller
        that stops early (closes this) aborts the request."""
        request_id = req.request_id
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._pending_adds.append(req)
        self._ensure_loop()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._pending_aborts.append(request_id)
                if self._wakeup is not None:
                    self._wakeup.set()

    @property
    def task(self) -> str:
        """The task served: "generate", "embed", "classify" or "score" (EngineConfig.task,
        "auto" resolved by the model)."""
        return self.core.task

    @property
    def labels(self) -> list[str]:
        """The classifier head's label names ([] without a head)."""
        return self.core.labels

    @property
    def prompts(self) -> dict[str, str]:
        """The model's named prompts (config_sentence_transformers.json)."""
        return self.core.prompts

    @property
    def embedding_size(self) -> int:
        """The width of an embedding (the model's hidden size)."""
        return int(self.core.hf_config.hidden_size)

    def check_pooling_task(self, task: str) -> None:
        """InvalidRequestError unless the model serves pooling `task` (classify and score need
        a classifier head; score a one-label one)."""
        self.core.check_pooling_task(task)

    def instructed(
        self, text: str, instruction: str | None = None, prompt_name: str | None = None
    ) -> str:
        """An embedding input with what the request asks before it: the model's named prompt
        (config_sentence_transformers.json, as sentence-transformers' `prompt_name`), or
        Qwen3-Embedding's "Instruct: <instruction>\nQuery:" form; InvalidRequestError for a
        prompt name the model does not have."""
        if prompt_name is not None:
            prompts = self.core.prompts
            if prompt_name not in prompts:
                have = ", ".join(sorted(prompts)) or "none"
                raise InvalidRequestError(
                    f"prompt_name {prompt_name!r} is not one of the model's prompts ({have}: "
                    "config_sentence_transformers.json)",
                    "prompt_name",
                )
            text = prompts[prompt_name] + text
        if instruction is not None:
            text = instructed_text(text, instruction)
        return text

    def score_prompt(self, text_1: str, text_2: str, instruction: str | None = None) -> list[int]:
        """One (query, document) pair's token ids for a score request (blocking: the
        tokenizer); see LLMEngine.score_prompt."""
        return self.core.score_prompt(text_1, text_2, instruction)

    def prepare_embed_prompt(
        self, prompt: str | list[int], truncate_prompt_tokens: int | None = None
    ) -> PreparedPrompt:
        """A pooling request's prompt tokenized or checked and fitted (up to max_model_len - 1
        tokens; ContextLengthError beyond). Blocking (the tokenizer)."""
        return self.core.inputs.prepare(prompt, embed_params(truncate_prompt_tokens))

    async def embed(
        self,
        prompt: str | list[int] | PreparedPrompt,
        request_id: str | None = None,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        task: str = "embed",
    ) -> EngineOutput:
        """One prompt's pooling result: a prefill-only request whose final hidden states are
        pooled (engine/pooling.py); the finished EngineOutput has `embedding` (`task` embed:
        the embedding, next to generation on a generating model too; classify: the label
        probabilities; score: [relevance] of a pair prompt from `score_prompt`).
        InvalidRequestError before anything is queued: a task the model has no head for, bad
        `dimensions`, a prompt that does not fit."""
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        if request_id is None:
            request_id = f"embed-{next(self._ids)}"
        if request_id in self._queues:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not isinstance(prompt, PreparedPrompt):
            prompt = self.prepare_embed_prompt(prompt, truncate_prompt_tokens)
        req = self.core.build_embed_request(prompt, request_id, dimensions, task)
        async with aclosing(self._outputs(req)) as outputs:
            async for item in outputs:
                if item.finished:
                    return item
        raise AssertionError("a request's outputs end with its finished one")

    async def abort(self, request_id: str) -> None:
        self._pending_aborts.append(request_id)
        self._ensure_loop()

    async def shutdown(self) -> None:
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)
        self.core.close()

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    # -- the stepping loop ------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        self._wakeup.set()

    def _apply_pending(self) -> None:
        """Adds and aborts since the last step. One that raises fails its own request, never
        the loop (every request in flight would wait forever)."""
        adds, self._pending_adds = self._pending_adds, []
        for req in adds:
            if req.request_id in self._queues:
                try:
                    self.core.add(req)
                except Exception as exc:
                    logger.exception("request %s could not be queued", req.request_id)
                    self._queues[req.request_id].put_nowait(
                        RequestFailedError(f"generation failed: {exc}")
                    )
        aborts, self._pending_aborts = self._pending_aborts, []
        for rid in aborts:
            try:
                out = self.core.abort_request(rid)
            except Exception as exc:
                logger.exception("request %s could not be aborted", rid)
                out = None
                queue = self._queues.get(rid)
                if queue is not None:
                    queue.put_nowait(RequestFailedError(f"generation failed: {exc}"))
            queue = self._queues.get(rid)
            if out is not None and queue is not None:
                queue.put_nowait(out)
            if out is not None and self._observers:
                self._observe([out])
        # After the adds: a request queued just before its adapter was unloaded still counts.
        removals, self._pending_lora_removals = self._pending_lora_removals, []
        for lid in removals:
            try:
                self.core.remove_lora(lid)
            except Exception:  # the adapter stays read; no request is hurt
                logger.exception("adapter %d could not be removed", lid)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_pending()
            if not self.core.has_unfinished_requests():
                self._wakeup.clear()
                if self._pending_adds or self._pending_aborts:
                    continue
                await self._wakeup.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self.core.step)
            except asyncio.CancelledError:
                raise
            except TensorParallelError as exc:  # a rank is gone: no step can run again
                logger.error("engine stopped: %s; failing the requests in flight", exc)
                self._fail_all(exc)
                self._die(exc)
                return
            except Exception as exc:  # a step failed: fail its requests, keep serving others
                logger.exception("engine step failed; aborting the requests in flight")
                self._fail_all(exc)
                continue
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            if self._observers and outputs:
                self._observe(outputs)
            failed, self.core.failed = self.core.failed, {}
            for rid, exc in failed.items():
                queue = self._queues.get(rid)
                if queue is not None:
                    queue.put_nowait(RequestFailedError(f"generation failed: {exc}"))
            # No yield here: the next step starts at once and the consumers turn these outputs
            # into responses while it computes (its tensor work releases the GIL). What they add
            # or abort meanwhile is applied at the following step boundary.

    def _die(self, exc: Exception) -> None:
        """The engine cannot serve again: later requests fail at once, and `on_fatal` (the
        worker's: exit non-zero so the platform replaces it) is told."""
        self.dead = exc
        for rid in list(self._queues):
            self._queues[rid].put_nowait(EngineDeadError(f"generation failed: {exc}"))
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _fail_all(self, exc: Exception) -> None:
        for rid in list(self.core.requests):
            self.core.abort_request(rid)
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(EngineDeadError(f"generation failed: {exc}"))

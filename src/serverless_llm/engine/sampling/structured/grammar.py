"""Compiling a spec for one tokenizer (`GrammarCompiler` -> `CompiledGrammar`), and matching one
sequence against it (`GrammarMatcher`).

Grammar syntax (`guided_grammar`): a grammar containing `::=` is EBNF in xgrammar's dialect,
which is llama.cpp's GBNF (`root ::= ...`, "literals", [classes], `* + ?`, `{m,n}`, `#`
comments; the start rule must be called `root`). Anything else is read as Lark (`start: ...`,
UPPER terminals, /regex/ terminals, `%import common.X`, `%ignore`), the syntax outlines and
guidance users send. Regexes follow xgrammar's (ECMAScript-like) dialect; Python's named groups
`(?P<name>...)` are accepted; lookaround, backreferences and `\\b` are not (a clear error).

JSON schemas compile in xgrammar's strict mode (no properties or items beyond the schema's, as
vLLM does), with properties in the schema's order. Whitespace between JSON tokens is free by
default (vLLM's default); `guided_whitespace_pattern` replaces it with a regex of its own (for
example `[ ]?` or `[\\n ]{0,8}`), and the backend option `disable-any-whitespace` forbids it;
both are ignored for regex, choice and grammar constraints. The schema goes through xgrammar's
EBNF text, where JSON strings are hardened (see `compile_worker.harden_json_ebnf`): xgrammar 0.2.8 lets raw
control characters into strings with minLength/maxLength and forbids escapes there (upstream
issue #800), and admits surrogate code points, which detokenize to U+FFFD. The hardened
bounded strings also compile ~20x faster (maxLength 32: ~10 ms instead of ~230 ms on a 49k
vocabulary). xgrammar ignores minLength/maxLength on a string that also has a `pattern`.

Special tokens (<|im_start|>, ...) are never allowed inside a constraint, only the stop tokens
where the grammar may end; the model's vocab size (the LM head's) sets the bitmask's width, and
ids past the tokenizer's vocabulary are never allowed.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .bitmask import allow_only
from .compile_pool import (
    CompileAbandoned,
    CompilePool,
    CompileProcessError,
    CompileStartError,
    CompileTimeout,
    shared_pool,
)
from .compile_worker import WHAT, SpecError, compile_spec
from .spec import StructuredOutputError, StructuredOutputSpec
from .xgrammar_import import require_xgrammar, xgr

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarMatcher"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Compilation
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompiledGrammar:
    """A spec compiled for one tokenizer; shared, read-only, by every matcher made from it."""

    spec: StructuredOutputSpec
    compiled: Any  # xgrammar.CompiledGrammar
    stop_token_ids: tuple[int, ...]

    @property
    def memory_size_bytes(self) -> int:
        return int(self.compiled.memory_size_bytes)

    def matcher(self, extra_stop_token_ids: Iterable[int] = ()) -> GrammarMatcher:
        return GrammarMatcher(self, extra_stop_token_ids)


@dataclass
class CacheInfo:
    hits: int = 0
    misses: int = 0
    entries: int = 0
    bytes: int = 0


def _special_token_ids(tokenizer: Any) -> set[int]:
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for idx, added in decoder.items():
        if getattr(added, "special", False):
            ids.add(int(idx))
    return ids


def build_tokenizer_info(
    tokenizer: Any, vocab_size: int | None = None, stop_token_ids: Iterable[int] | None = None
) -> Any:
    """xgrammar's view of the tokenizer, with the model's vocab size (the LM head's, which may be
    larger than the tokenizer's: the extra ids are never allowed) and the engine's stop ids.

    Special tokens (<|im_start|>, <s>, ...) are blanked out of the vocabulary so that xgrammar
    treats them as control tokens, never as their literal text: otherwise a JSON string could
    "contain" <|im_start|>, which detokenization then drops, and the text would no longer match
    what the grammar saw. Stop tokens stay allowed where the grammar may end."""
    require_xgrammar()
    stops = sorted({int(t) for t in stop_token_ids or ()})
    base = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stops or None
    )
    if not isinstance(tokenizer, _fast_tokenizer_class()):
        return base  # slow/tiktoken tokenizers: xgrammar builds the vocabulary its own way
    vocab = tokenizer.get_vocab()
    size = base.vocab_size
    encoded = [""] * size
    for token, idx in vocab.items():
        if 0 <= idx < size:
            encoded[idx] = token
    for idx in _special_token_ids(tokenizer):
        if 0 <= idx < size:
            encoded[idx] = ""
    return xgr.TokenizerInfo.from_vocab_and_metadata(encoded, base.dump_metadata())


def _fast_tokenizer_class() -> type:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast


class _CompileFailure(Exception):
    """Why a spec did not compile, before it is told to a request: `param` is the field to name
    when the failure is about a field of its own (guided_whitespace_pattern...), else None (the
    asking request's field: two requests may ask for one spec through different fields).
    `permanent`: a property of the spec (invalid, over a limit, accepts nothing), remembered;
    otherwise (a timeout, a dead compile process: the machine's state) the next request for the
    spec compiles it again."""

    def __init__(self, message: str, param: str | None, *, permanent: bool) -> None:
        super().__init__(message)
        self.message, self.param, self.permanent = message, param, permanent

    def for_request(self, spec: StructuredOutputSpec) -> StructuredOutputError:
        return StructuredOutputError(self.message, self.param or spec.param)


@dataclass
class _Job:
    """One spec's compilation under way, shared by every request waiting for it. When the last
    of them stops waiting, `abandoned` is set and the compile process is killed."""

    future: Future[CompiledGrammar]
    waiters: int = 0
    abandoned: threading.Event = field(default_factory=threading.Event)


def _spec_chars(spec: StructuredOutputSpec) -> int:
    texts = (spec.json, spec.regex, spec.grammar, spec.whitespace_pattern)
    return sum(len(t) for t in texts if t) + sum(len(c) for c in spec.choice or ())


def _spec_payload(spec: StructuredOutputSpec) -> dict[str, Any]:
    """The spec as the compile process reads it (compile_worker.build_grammar)."""
    return {
        "json": spec.json,
        "regex": spec.regex,
        "choice": list(spec.choice) if spec.choice is not None else None,
        "grammar": spec.grammar,
        "json_object": spec.json_object,
        "whitespace_pattern": spec.whitespace_pattern,
        "any_whitespace": spec.any_whitespace,
    }


class GrammarCompiler:
    """Compiles specs for one tokenizer, once each: an LRU cache keyed by the spec (bounded in
    entries and bytes), one compilation shared by concurrent requests for the same spec, and a
    small cache of the specs that failed (so a request repeated by a client fails at once).

    Thread-safe. `compile_async` returns a Future and never blocks: the compilation runs in a
    compile process (see `compile_pool`) watched by a thread here, with
    - `compile_timeout` seconds at most (None or 0: no limit), after which the process is killed
      and the request gets an error naming the limit;
    - `max_spec_chars` characters of schema, regex, grammar or choices at most, refused before
      any work;
    - `max_bytes` for the compiled grammar (also the cache's budget);
    - abandonment: cancelling the returned Future (as an asyncio task's cancellation does,
      through `asyncio.wrap_future`) withdraws that request; when none is left the process is
      killed.
    With `isolate=False`, or when no compile process can start, it compiles in this process
    instead, without the time limit. The tokenizer view is built on first use (about 0.1 s for a
    50k vocabulary), so an engine that never sees a structured request never pays for it."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        stop_token_ids: Iterable[int] | None = None,
        *,
        max_entries: int = 256,
        max_bytes: int = 512 << 20,
        compile_timeout: float | None = 15.0,
        max_spec_chars: int = 256 << 10,
        isolate: bool = True,
        pool: CompilePool | None = None,
        workers: int = 2,
    ) -> None:
        require_xgrammar()
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = tuple(sorted({int(t) for t in stop_token_ids or ()}))
        self._max_entries = max(1, max_entries)
        self._max_bytes = max_bytes
        self.compile_timeout = compile_timeout or None
        self.max_spec_chars = max_spec_chars
        self._isolate = isolate
        self._pool = pool
        self._key = uuid.uuid4().hex  # this tokenizer's name in the compile processes
        self._info_json: str | None = None
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        self._xgr_compiler: Any = None
        self._info: Any = None
        self._cache: OrderedDict[StructuredOutputSpec, CompiledGrammar] = OrderedDict()
        self._failed: OrderedDict[StructuredOutputSpec, _CompileFailure] = OrderedDict()
        self._inflight: dict[StructuredOutputSpec, _Job] = {}
        self._stats = CacheInfo()
        self._workers = max(1, workers)
        self._executor: ThreadPoolExecutor | None = None

    # -- setup --------------------------------------------------------------------------------

    def _compiler(self) -> Any:
        if self._xgr_compiler is None:
            with self._init_lock:
                if self._xgr_compiler is None:
                    self._info = build_tokenizer_info(
                        self._tokenizer, self._vocab_size, self._stop_token_ids
                    )
                    # xgrammar's own cache is off: ours is keyed by spec and bounded.
                    self._xgr_compiler = xgr.GrammarCompiler(
                        self._info, max_threads=1, cache_enabled=False
                    )
        return self._xgr_compiler

    def _tokenizer_json(self) -> str:
        self._compiler()
        with self._init_lock:
            if self._info_json is None:
                self._info_json = self._info.serialize_json()
            return self._info_json

    @property
    def pool(self) -> CompilePool:
        return self._pool if self._pool is not None else shared_pool()

    def warm_up(self) -> None:
        """Builds the tokenizer view and starts a compile process now (say in the background at
        startup), so the first structured request waits for neither."""
        self._compiler()
        if self._isolate:
            self.pool.prestart()

    @property
    def vocab_size(self) -> int:
        """The bitmask's width: the model's vocab size."""
        self._compiler()
        return int(self._info.vocab_size)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        self._compiler()
        return tuple(int(t) for t in self._info.stop_token_ids)

    # -- compile ------------------------------------------------------------------------------

    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """The compiled grammar for `spec`, from the cache or compiled now (waiting for a
        compilation of the same spec already under way). Raises StructuredOutputError."""
        return self.compile_async(spec).result()

    def compile_async(self, spec: StructuredOutputSpec) -> Future[CompiledGrammar]:
        """A Future of the compiled grammar, resolved at once on a cache hit; its exception is a
        StructuredOutputError for an invalid schema, regex or grammar, one over a limit, or one
        that accepts nothing. Cancel it to stop waiting (see the class docstring)."""
        out: Future[CompiledGrammar] = Future()
        with self._lock:
            hit = self._cache.get(spec)
            failure = self._failed.get(spec) if hit is None else None
            if hit is not None or failure is not None:
                self._stats.hits += 1
                if hit is not None:
                    self._cache.move_to_end(spec)
                    out.set_result(hit)
                else:
                    self._failed.move_to_end(spec)
                    out.set_exception(failure.for_request(spec))
                return out
            job = self._inflight.get(spec)
            if job is None or job.abandoned.is_set():
                job = _Job(Future())
                self._inflight[spec] = job
                self._stats.misses += 1
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(
                        max_workers=self._workers, thread_name_prefix="grammar-compile"
                    )
                self._executor.submit(self._run, spec, job)
            else:
                self._stats.hits += 1
            job.waiters += 1

        def deliver(done: Future[CompiledGrammar]) -> None:
            if not out.set_running_or_notify_cancel():
                return
            exc = done.exception()
            if isinstance(exc, _CompileFailure):
                out.set_exception(exc.for_request(spec))  # this request's field
            elif exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(done.result())

        def withdraw(f: Future[CompiledGrammar]) -> None:
            if f.cancelled():
                with self._lock:
                    job.waiters -= 1
                    if job.waiters <= 0 and not job.future.done():
                        job.abandoned.set()

        out.add_done_callback(withdraw)
        job.future.add_done_callback(deliver)
        return out

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(
                self._stats.hits,
                self._stats.misses,
                len(self._cache),
                sum(c.memory_size_bytes for c in self._cache.values()),
            )

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self._failed.clear()

    def close(self) -> None:
        """Stops the compile threads (pending compilations finish first)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def _run(self, spec: StructuredOutputSpec, job: _Job) -> None:
        try:
            if job.abandoned.is_set():
                raise CompileAbandoned()
            compiled = self._compile_uncached(spec, job.abandoned)
        except BaseException as exc:
            with self._lock:
                if self._inflight.get(spec) is job:
                    del self._inflight[spec]
                if isinstance(exc, _CompileFailure) and exc.permanent:
                    self._failed[spec] = exc
                    while len(self._failed) > self._max_entries:
                        self._failed.popitem(last=False)
            job.future.set_exception(exc)
            return
        with self._lock:
            if self._inflight.get(spec) is job:
                del self._inflight[spec]
            self._insert(spec, compiled)
        job.future.set_result(compiled)

    def _insert(self, spec: StructuredOutputSpec, compiled: CompiledGrammar) -> None:
        self._cache[spec] = compiled
        total = sum(c.memory_size_bytes for c in self._cache.values())
        while len(self._cache) > 1 and (
            len(self._cache) > self._max_entries or total > self._max_bytes
        ):
            _, evicted = self._cache.popitem(last=False)
            total -= evicted.memory_size_bytes

    def _compile_uncached(
        self, spec: StructuredOutputSpec, abandoned: threading.Event
    ) -> CompiledGrammar:
        what = WHAT[spec.kind]
        chars = _spec_chars(spec)
        if self.max_spec_chars and chars > self.max_spec_chars:
            raise _CompileFailure(
                f"the {what} is {chars} characters long, over the limit of "
                f"{self.max_spec_chars} (GRAMMAR_MAX_CHARS)",
                None,
                permanent=True,
            )
        compiler = self._compiler()
        payload = _spec_payload(spec)
        try:
            if self._isolate:
                try:
                    text = self.pool.compile(
                        self._key,
                        self._tokenizer_json,
                        payload,
                        max_bytes=self._max_bytes,
                        timeout=self.compile_timeout,
                        abandoned=abandoned,
                    )
                    compiled = xgr.CompiledGrammar.deserialize_json(text, self._info)
                    return CompiledGrammar(spec, compiled, self.stop_token_ids)
                except CompileStartError as exc:
                    logger.warning("%s; compiling grammars in the worker's process instead", exc)
                    self._isolate = False
            compiled = compile_spec(xgr, compiler, payload, self._max_bytes)
        except SpecError as exc:
            raise _CompileFailure(str(exc), exc.param, permanent=True) from None
        except CompileTimeout:
            # Not remembered: a busy machine may be what made it slow.
            raise _CompileFailure(
                f"the {what} took more than {self.compile_timeout:g} s to compile (the limit, "
                "GRAMMAR_COMPILE_TIMEOUT): simplify it",
                None,
                permanent=False,
            ) from None
        except CompileProcessError as exc:
            # Not remembered: the process may have been killed from outside (out of memory).
            raise _CompileFailure(
                f"the {what} could not be compiled ({exc}): simplify it", None, permanent=False
            ) from None
        return CompiledGrammar(spec, compiled, self.stop_token_ids)


# ---------------------------------------------------------------------------------------------
# Matching
# ---------------------------------------------------------------------------------------------


class GrammarMatcher:
    """One sequence's position in its grammar.

    Per step: `fill_bitmask(bitmask, row)` before sampling (or `fill_bitmasks` for the batch),
    `accept_token(sampled)` after. When the grammar is complete only stop tokens are allowed;
    accepting one terminates the matcher (`is_terminated`), and the sequence should finish.

    The state covers the sequence's output tokens only. Preemption by recompute keeps the
    output tokens, so the matcher is kept as it is (neither reset nor re-fed); a sequence that
    drops its output and starts over calls `reset()`, and one rebuilt from saved token ids calls
    `resync(ids)`."""

    def __init__(self, compiled: CompiledGrammar, extra_stop_token_ids: Iterable[int] = ()):
        extra = {int(t) for t in extra_stop_token_ids}
        stops = None
        if extra - set(compiled.stop_token_ids):
            stops = sorted(extra | set(compiled.stop_token_ids))
        self.compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled.compiled, override_stop_tokens=stops)
        self.num_accepted = 0

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self._matcher.stop_token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> bool:
        """Writes the allowed next tokens into `bitmask[row]` (a CPU int32 tensor from
        `allocate_bitmask`). Returns False when every token is allowed (nothing to apply).
        A terminated matcher allows its stop tokens only (the sequence should have ended)."""
        if self._matcher.is_terminated():
            allow_only(bitmask, row, self._matcher.stop_token_ids)
            return True
        return bool(self._matcher.fill_next_token_bitmask(bitmask, row))

    def accept_token(self, token_id: int) -> bool:
        """Advances by the sampled token. False (state unchanged) when the grammar forbids it:
        with the mask applied that means a bug or a constraint conflict; end the sequence."""
        ok = bool(self._matcher.accept_token(int(token_id)))
        if ok:
            self.num_accepted += 1
        return ok

    def accept_tokens(self, token_ids: Iterable[int]) -> bool:
        return all(self.accept_token(t) for t in token_ids)

    def is_terminated(self) -> bool:
        """A stop token was accepted: the output is complete."""
        return bool(self._matcher.is_terminated())

    def is_completed(self) -> bool:
        """The text so far is a complete match (a stop token would be accepted now)."""
        return bool(self._matcher.is_completed())

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (speculative decoding)."""
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)
            self.num_accepted = max(0, self.num_accepted - num_tokens)

    def reset(self) -> None:
        self._matcher.reset()
        self.num_accepted = 0

    def resync(self, token_ids: Iterable[int]) -> bool:
        """Resets and re-feeds `token_ids` (the sequence's output so far)."""
        self.reset()
        return self.accept_tokens(token_ids)

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same position (for sequences that branch)."""
        twin = GrammarMatcher.__new__(GrammarMatcher)
        twin.compiled = self.compiled
        twin._matcher = self._matcher.fork()
        twin.num_accepted = self.num_accepted
        return twin

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
EBNF text, where JSON strings are hardened (see `_harden_json_ebnf`): xgrammar 0.2.8 lets raw
control characters into strings with minLength/maxLength and forbids escapes there (upstream
issue #800), and admits surrogate code points, which detokenize to U+FFFD. The hardened
bounded strings also compile ~20x faster (maxLength 32: ~10 ms instead of ~230 ms on a 49k
vocabulary). xgrammar ignores minLength/maxLength on a string that also has a `pattern`.

Special tokens (<|im_start|>, ...) are never allowed inside a constraint, only the stop tokens
where the grammar may end; the model's vocab size (the LM head's) sets the bitmask's width, and
ids past the tokenizer's vocabulary are never allowed.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .bitmask import allow_only
from .spec import StructuredOutputError, StructuredOutputSpec
from .xgrammar_import import require_xgrammar, xgr

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarMatcher"]


# ---------------------------------------------------------------------------------------------
# Compilation
# ---------------------------------------------------------------------------------------------

_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


def _xgr_message(exc: BaseException) -> str:
    """xgrammar's error text without its C++ log prefix (timestamp, source file, line)."""
    text = str(exc).strip()
    return _XGR_PREFIX.sub("", text).strip() or type(exc).__name__


def _ebnf_literal(text: str) -> str:
    """A string as a literal of xgrammar's EBNF."""
    out = ['"']
    for ch in text:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _python_regex_to_xgrammar(regex: str) -> str:
    """Drops the names of Python's named groups, `(?P<name>` and `(?<name>`, which xgrammar's
    regex parser does not read; everything else is passed through for xgrammar to judge."""
    out: list[str] = []
    i, n, in_class = 0, len(regex), False
    while i < n:
        ch = regex[i]
        if ch == "\\":
            out.append(regex[i : i + 2])
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(" and regex.startswith("(?", i):
            m = re.match(r"\(\?P?<([A-Za-z_][A-Za-z0-9_]*)>", regex[i:])
            if m:
                out.append("(")
                i += m.end()
                continue
        out.append(ch)
        i += 1
    return "".join(out)


_RULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _rename_rules(ebnf: str, prefix: str) -> str:
    """Renames `root`, `root_1`, ... in an xgrammar EBNF text to `prefix`, `prefix_1`, ...,
    outside string literals and character classes (so a regex's text is never touched)."""
    out: list[str] = []
    i, n = 0, len(ebnf)
    while i < n:
        ch = ebnf[i]
        if ch in '"[':
            close = '"' if ch == '"' else "]"
            j = i + 1
            while j < n and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i : j + 1])
            i = j + 1
            continue
        m = _RULE_NAME.match(ebnf, i)
        if m:
            name = m.group(0)
            if name == "root" or re.fullmatch(r"root_\d+", name):
                name = prefix + name[4:]
            out.append(name)
            i = m.end()
            continue
        out.append(ch)
        i += 1
    return "".join(out)


# The free-whitespace construct in xgrammar's JSON grammars (any_whitespace=True).
_ANY_WS = "[ \\n\\r\\t]*"

# xgrammar 0.2.8's JSON string characters, as it prints them, and what they become here:
# - a string with minLength/maxLength repeats `[^\"\\\r\n]`, which lets raw control characters
#   through (invalid JSON) and forbids escapes (xgrammar issue #800, fixes not released);
# - every string class admits U+D800-U+DFFF, whose UTF-8 form is invalid: detokenized, one such
#   "character" becomes three U+FFFD, breaking maxLength and regexes over the text.
_BOUNDED_STRING_RULE = re.compile(r'^(\S+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_JSON_CHAR = r"[^\0-\x1f\"\\\ud800-\udfff]"
# \u escapes of surrogates are left out too: a pair would count twice against minLength.
_JSON_ESCAPE = (
    r'("\\" ([\"\\/bfnrt] | "u" (([0-9A-Ca-cEeFf] [0-9A-Fa-f]) | ([Dd] [0-7])) [0-9A-Fa-f]{2}))'
)
_STRING_CLASS = r"[^\0-\x1f\"\\\r\n]"


def _harden_json_ebnf(ebnf: str) -> str:
    """Valid JSON strings in xgrammar's JSON grammar text (see above): one JSON character per
    repetition of a bounded string (an escape counts as one, as in the decoded length), no
    control characters, no surrogate code points."""
    ebnf = _BOUNDED_STRING_RULE.sub(
        lambda m: f"{m.group(1)} ::= {_JSON_CHAR} | {_JSON_ESCAPE}", ebnf
    )
    return ebnf.replace(_STRING_CLASS, _JSON_CHAR)


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


class GrammarCompiler:
    """Compiles specs for one tokenizer, once each: an LRU cache keyed by the spec (bounded in
    entries and bytes), and one compilation shared by concurrent requests for the same spec.

    Thread-safe. `compile_async` runs on a small thread pool and returns a Future: the engine
    (or the async layer, before the request reaches the engine) waits on it instead of the step
    loop compiling. The tokenizer view is built on first use (about 0.1 s for a 50k vocabulary),
    so an engine that never sees a structured request never pays for it."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        stop_token_ids: Iterable[int] | None = None,
        *,
        max_entries: int = 256,
        max_bytes: int = 512 << 20,
        compile_threads: int = 2,
        workers: int = 2,
    ) -> None:
        require_xgrammar()
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = tuple(sorted({int(t) for t in stop_token_ids or ()}))
        self._compile_threads = max(1, compile_threads)
        self._max_entries = max(1, max_entries)
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        self._xgr_compiler: Any = None
        self._info: Any = None
        self._cache: OrderedDict[StructuredOutputSpec, CompiledGrammar] = OrderedDict()
        self._inflight: dict[StructuredOutputSpec, Future[CompiledGrammar]] = {}
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
                        self._info, max_threads=self._compile_threads, cache_enabled=False
                    )
        return self._xgr_compiler

    def warm_up(self) -> None:
        """Builds the tokenizer view now (e.g. in the background at startup)."""
        self._compiler()

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
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self._stats.hits += 1
                return hit
            pending = self._inflight.get(spec)
            owner = pending is None
            if owner:
                pending = Future()
                pending.set_running_or_notify_cancel()
                self._inflight[spec] = pending
                self._stats.misses += 1
            else:
                self._stats.hits += 1
        if not owner:
            return pending.result()
        try:
            compiled = self._compile_uncached(spec)
        except BaseException as exc:
            with self._lock:
                self._inflight.pop(spec, None)
            pending.set_exception(exc)
            raise
        with self._lock:
            self._inflight.pop(spec, None)
            self._insert(spec, compiled)
        pending.set_result(compiled)
        return compiled

    def compile_async(self, spec: StructuredOutputSpec) -> Future[CompiledGrammar]:
        """A Future of `compile(spec)`, resolved at once on a cache hit. Its exception is a
        StructuredOutputError for an invalid schema, regex or grammar."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self._stats.hits += 1
                done: Future[CompiledGrammar] = Future()
                done.set_result(hit)
                return done
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self._workers, thread_name_prefix="grammar-compile"
                )
            executor = self._executor
        return executor.submit(self.compile, spec)

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

    def close(self) -> None:
        """Stops the compile threads (pending compilations finish first)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def _insert(self, spec: StructuredOutputSpec, compiled: CompiledGrammar) -> None:
        self._cache[spec] = compiled
        total = sum(c.memory_size_bytes for c in self._cache.values())
        while len(self._cache) > 1 and (
            len(self._cache) > self._max_entries or total > self._max_bytes
        ):
            _, evicted = self._cache.popitem(last=False)
            total -= evicted.memory_size_bytes

    def _compile_uncached(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        compiler = self._compiler()
        try:
            compiled = self._compile_with(compiler, spec)
        except StructuredOutputError:
            raise
        except Exception as exc:  # xgrammar reports bad input as RuntimeError/ValueError
            raise StructuredOutputError(
                spec.param, f"invalid {_WHAT[spec.kind]}: {_xgr_message(exc)}"
            ) from exc
        return CompiledGrammar(spec, compiled, tuple(int(t) for t in self._info.stop_token_ids))

    def _compile_with(self, compiler: Any, spec: StructuredOutputSpec) -> Any:
        kind = spec.kind
        if kind in ("json", "json_object"):
            schema = spec.json if kind == "json" else '{"type":"object"}'
            strict = kind == "json"
            return compiler.compile_grammar(self._json_ebnf(spec, schema, strict))
        if kind == "regex":
            return compiler.compile_regex(_python_regex_to_xgrammar(spec.regex or ""))
        if kind == "choice":
            body = " | ".join(_ebnf_literal(c) for c in spec.choice or ())
            return compiler.compile_grammar(f"root ::= {body}")
        grammar = spec.grammar or ""
        if "::=" in grammar:
            return compiler.compile_grammar(grammar, root_rule_name="root")
        return compiler.compile_lark(grammar)

    @staticmethod
    def _json_ebnf(spec: StructuredOutputSpec, schema: str, strict: bool) -> str:
        """The schema as xgrammar's EBNF, its strings hardened, and every free-whitespace gap
        replaced by the whitespace pattern's rule when one is given."""
        pattern = spec.whitespace_pattern
        grammar = xgr.Grammar.from_json_schema(
            schema, any_whitespace=spec.any_whitespace or pattern is not None, strict_mode=strict
        )
        ebnf = _harden_json_ebnf(str(grammar))
        if pattern is None:
            return ebnf
        try:
            ws = str(xgr.Grammar.from_regex(_python_regex_to_xgrammar(pattern)))
        except Exception as exc:
            raise StructuredOutputError(
                "guided_whitespace_pattern", f"invalid whitespace pattern: {_xgr_message(exc)}"
            ) from exc
        name = "json_ws_pattern"
        return ebnf.replace(_ANY_WS, name) + "\n" + _rename_rules(ws, name) + "\n"


_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


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

"""Grammar compilation under hostile specs (issue 14 item 3): a time limit that kills the compile
process, a size limit checked before any work, abandonment when no request waits, grammars that
accept nothing refused, and a compile process that cannot start or crashes.

The compile processes here hold the answer of every large spec until the test releases it
(tests/held_compiles.py): a "slow" grammar can never beat its limit, however fast this machine
compiles it, and a test acts on a compile once it is known to be running, not after a sleep."""

from __future__ import annotations

import json
import os
import select
import signal
import threading
import time

import pytest
import xgrammar as xgr

from serverless_llm.engine.sampling.structured import compile_pool
from serverless_llm.engine.sampling.structured.compile_pool import CompilePool
from serverless_llm.engine.sampling.structured.compile_worker import accepts_nothing
from serverless_llm.engine.sampling.structured.grammar import GrammarCompiler
from serverless_llm.engine.sampling.structured.spec import (
    StructuredOutputError,
    StructuredOutputSpec,
)
from tests.held_compiles import HeldCompiles
from tests.tiny_models import build_tokenizer

MODEL_VOCAB = 400
EOS = 2

# Seconds to compile on a 2-core machine (about 7 s alone), whatever the vocabulary: xgrammar's
# work grows with the square of the alternatives, not with the tokens. Held (see above), so they
# never finish on their own on a faster machine either.
SLOW_REGEX = "(a|b|c|d|e|f|g)" * 3000
SLOW_SCHEMA = {"enum": [f"value-{i}" for i in range(30000)]}

# a -> b -> a with every property required: no finite JSON value fits.
CYCLE = {
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/A"}},
    "required": ["a"],
    "$defs": {
        "A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}, "required": ["b"]},
        "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]},
    },
}
# A tree: recursive, but a node's children are optional, so it has finite values.
TREE = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "children": {"type": "array", "items": {"$ref": "#"}},
    },
    "required": ["name"],
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module", autouse=True)
def held(tmp_path_factory):
    """Every compile pool of this module (its zygote) holds the specs of 5,000 chars or more."""
    held = HeldCompiles(tmp_path_factory.mktemp("held"))
    with pytest.MonkeyPatch.context() as mp:
        held.install(mp)
        yield held
        held.release_all()


@pytest.fixture(scope="module")
def shared(held):
    p = CompilePool(2)
    yield p
    p.close()


@pytest.fixture()
def pool(shared):
    """The module's pool (starting children costs seconds), with both children started."""
    shared.prestart(idle=2)
    assert len(shared.pids()) == 2
    return shared


def make(tokenizer, pool, **kwargs) -> GrammarCompiler:
    return GrammarCompiler(
        tokenizer, vocab_size=MODEL_VOCAB, stop_token_ids=[EOS], pool=pool, **kwargs
    )


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# -- grammars that accept nothing -----------------------------------------------------------


def ebnf_of_schema(schema: dict) -> str:
    return str(xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=True))


def test_accepts_nothing_finds_a_required_ref_cycle_and_only_that():
    assert accepts_nothing(ebnf_of_schema(CYCLE))
    assert not accepts_nothing(ebnf_of_schema(TREE))
    assert not accepts_nothing(ebnf_of_schema({"type": "object"}))  # lookaheads inside
    assert accepts_nothing('root ::= "x" a\na ::= "y" a')
    assert not accepts_nothing('root ::= "x" a\na ::= "y" a | "z"')
    assert not accepts_nothing('root ::= ("x" a)*\na ::= "y" a')  # may repeat zero times
    assert not accepts_nothing('root ::= ("x" a){0, 3}\na ::= a')
    assert accepts_nothing('root ::= ("x" a){1, 3}\na ::= a')
    assert accepts_nothing('root ::= ("x" a)+\na ::= "[" a "]"')
    assert not accepts_nothing(str(xgr.Grammar.from_regex("(ab|c[^x]){2,5}d*")))
    assert not accepts_nothing("this is not xgrammar's printed form ::= ((")  # unproved: allowed


def test_a_grammar_that_accepts_nothing_is_an_error(tokenizer, pool):
    comp = make(tokenizer, pool)
    spec = StructuredOutputSpec.from_request(guided_json=CYCLE)
    with pytest.raises(StructuredOutputError, match="accepts no output") as info:
        comp.compile(spec)
    assert info.value.param == "guided_json"
    gbnf = StructuredOutputSpec.from_request(guided_grammar='root ::= "(" root ")"')
    with pytest.raises(StructuredOutputError, match="accepts no output"):
        comp.compile(gbnf)
    assert comp.compile(StructuredOutputSpec.from_request(guided_json=TREE)) is not None


# -- time limit and abandonment -------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [("guided_regex", SLOW_REGEX), ("guided_json", SLOW_SCHEMA)],
    ids=["regex", "json"],
)
def test_a_slow_grammar_is_stopped_at_the_time_limit(tokenizer, pool, field, value):
    comp = make(tokenizer, pool, compile_timeout=0.3, max_spec_chars=0)
    killed, pids = pool.killed, set(pool.pids())
    spec = StructuredOutputSpec.from_request(**{field: value})
    t0 = time.monotonic()
    with pytest.raises(StructuredOutputError, match="took more than 0.3 s") as info:
        comp.compile(spec)
    assert time.monotonic() - t0 < 2.0
    assert info.value.param == field
    assert pool.killed == killed + 1
    assert wait_for(lambda: sum(map(_gone, pids)) == 1, timeout=2)  # the child that compiled it
    # And the compiler still serves (a replacement child).
    assert comp.compile(StructuredOutputSpec.from_request(guided_regex="[0-9]+")) is not None


def test_a_timed_out_compile_is_compiled_again_when_asked_again(tokenizer, pool, held):
    """A time limit reached is not remembered as the spec's failure (a busy machine may have
    made it slow): asked again, the spec is compiled again, and compiles once it is let."""
    comp = make(tokenizer, pool, compile_timeout=0.5, max_spec_chars=0)
    killed = pool.killed
    schema = {"enum": [f"again-{i}" for i in range(2000)]}  # held: over 5,000 chars
    before = held.held()
    with pytest.raises(StructuredOutputError, match="took more than 0.5 s") as info:
        comp.compile(StructuredOutputSpec.from_request(guided_json=schema))
    assert info.value.param == "guided_json" and pool.killed == killed + 1
    first = held.wait_new(before)
    # Asked again (through response_format this time): a second compile process takes it up.
    comp.compile_timeout = None
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    pending = comp.compile_async(StructuredOutputSpec.from_request(response_format=fmt))
    (second,) = held.wait_new(before + first)
    assert not pending.done()
    held.release_all()
    compiled = pending.result(timeout=60)
    assert compiled is not None and pool.killed == killed + 1
    # Compiled now, it is served from the cache to either field.
    again = comp.compile(StructuredOutputSpec.from_request(guided_json=schema))
    assert again is compiled


def test_a_failed_spec_reports_the_field_that_asked(tokenizer, pool):
    """A remembered failure (a property of the spec) names the asking request's field, not the
    field of the request that failed first."""
    comp = make(tokenizer, pool)
    fmt = {"type": "json_schema", "json_schema": {"name": "cycle", "schema": CYCLE}}
    with pytest.raises(StructuredOutputError, match="accepts no output") as info:
        comp.compile(StructuredOutputSpec.from_request(guided_json=CYCLE))
    assert info.value.param == "guided_json"
    misses = comp.cache_info().misses
    with pytest.raises(StructuredOutputError, match="accepts no output") as info:
        comp.compile(StructuredOutputSpec.from_request(response_format=fmt))
    assert info.value.param == "response_format"
    with pytest.raises(StructuredOutputError, match="accepts no output") as info:
        comp.compile(StructuredOutputSpec.from_request(guided_json=CYCLE))
    assert info.value.param == "guided_json"
    assert comp.cache_info().misses == misses  # remembered: not compiled again
    # Over the size limit: remembered too, and told to each field.
    small = make(tokenizer, pool, max_spec_chars=100)
    big = {"enum": [f"v{i}" for i in range(40)]}
    big_fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": big}}
    for kwargs, param in (
        ({"response_format": big_fmt}, "response_format"),
        ({"guided_json": big}, "guided_json"),
    ):
        with pytest.raises(StructuredOutputError, match="GRAMMAR_MAX_CHARS") as info:
            small.compile(StructuredOutputSpec.from_request(**kwargs))
        assert info.value.param == param


def test_requests_sharing_one_compile_each_get_their_own_field(tokenizer, pool, held):
    comp = make(tokenizer, pool, compile_timeout=None, max_spec_chars=0)
    # Accepts nothing (a required cycle), and held: over 5,000 chars of enum beside it.
    schema = {**CYCLE, "properties": {**CYCLE["properties"], "pad": {"enum": ["p" * 6000]}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    before = held.held()
    by_json = comp.compile_async(StructuredOutputSpec.from_request(guided_json=schema))
    held.wait_new(before)
    by_format = comp.compile_async(StructuredOutputSpec.from_request(response_format=fmt))
    held.release_all()
    for pending, param in ((by_json, "guided_json"), (by_format, "response_format")):
        with pytest.raises(StructuredOutputError, match="accepts no output") as info:
            pending.result(timeout=60)
        assert info.value.param == param


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


class PollCounter:
    """The compile pool's `select` module, counting the polls of the threads that wait for a
    compile (each poll is followed by a look at whether the compile was abandoned)."""

    def __init__(self) -> None:
        self.polls = 0

    def select(self, *args):
        if threading.current_thread().name.startswith("grammar-compile"):
            self.polls += 1
        return select.select(*args)


def test_an_abandoned_compilation_is_killed_and_others_do_not_queue_behind_it(
    tokenizer, pool, held, monkeypatch
):
    comp = make(tokenizer, pool, compile_timeout=60, max_spec_chars=0)
    killed = pool.killed
    before = held.held()
    slow = comp.compile_async(StructuredOutputSpec.from_request(guided_regex=SLOW_REGEX * 3))
    held.wait_new(before)  # a child is on it, and will not answer
    # The other child compiles another request's grammar meanwhile.
    t0 = time.monotonic()
    quick = comp.compile(StructuredOutputSpec.from_request(guided_choice=["yes", "no"]))
    assert quick is not None and time.monotonic() - t0 < 2.0
    assert not slow.done()
    assert slow.cancel()  # the only waiter leaves
    assert wait_for(lambda: pool.killed == killed + 1, timeout=2.0)
    # A spec two requests wait for survives one of them leaving: one waiter leaves while it
    # compiles, and it is released only after its compile's thread has looked twice more
    # whether it was abandoned.
    polls = PollCounter()
    monkeypatch.setattr(compile_pool, "select", polls)
    spec = StructuredOutputSpec.from_request(guided_regex="(a|b|c|d|e|f|g)" * 500)
    before = held.held()
    first, second = comp.compile_async(spec), comp.compile_async(spec)
    held.wait_new(before)
    first.cancel()
    seen = polls.polls
    assert wait_for(lambda: polls.polls >= seen + 2)
    assert not second.done() and pool.killed == killed + 1
    held.release_all()
    assert second.result(timeout=60) is not None and pool.killed == killed + 1


# -- size limit ---------------------------------------------------------------------------------


def test_a_spec_over_the_size_limit_is_refused_before_compiling(tokenizer, pool):
    comp = make(tokenizer, pool, max_spec_chars=1000)
    t0 = time.monotonic()
    with pytest.raises(StructuredOutputError, match="over the limit of 1000 .GRAMMAR_MAX_CHARS"):
        comp.compile(StructuredOutputSpec.from_request(guided_choice=["x" * 600, "y" * 600]))
    assert time.monotonic() - t0 < 0.5
    assert comp.compile(StructuredOutputSpec.from_request(guided_choice=["x" * 600]))


# -- the compile process failing ------------------------------------------------------------


def test_no_compile_process_means_compiling_in_process(tokenizer, monkeypatch, tmp_path):
    broken = tmp_path / "worker.py"
    broken.write_text("import sys; sys.exit(3)\n")
    monkeypatch.setattr(compile_pool, "WORKER_PATH", broken)
    comp = make(tokenizer, CompilePool(1))
    compiled = comp.compile(StructuredOutputSpec.from_request(guided_regex="[a-c]{2}"))
    matcher = compiled.matcher()
    assert not matcher.is_terminated()
    with pytest.raises(StructuredOutputError, match="accepts no output"):
        comp.compile(StructuredOutputSpec.from_request(guided_json=CYCLE))


def test_a_compile_process_that_dies_fails_that_grammar_only(tokenizer, held):
    pool = CompilePool(1)
    try:
        comp = make(tokenizer, pool, compile_timeout=60, max_spec_chars=0)
        pool.prestart()
        (pid,) = pool.pids()
        before = held.held()
        pending = comp.compile_async(StructuredOutputSpec.from_request(guided_regex=SLOW_REGEX))
        (compiling,) = held.wait_new(before)
        assert held.pid(compiling) == pid  # it is compiling there now
        os.kill(pid, signal.SIGKILL)  # as a crash inside xgrammar would end it
        with pytest.raises(StructuredOutputError, match="could not be compiled .*died"):
            pending.result(timeout=10)
        # This process is unharmed, and a new child compiles the next grammar.
        assert comp.compile(StructuredOutputSpec.from_request(guided_regex="[a-c]{3}"))
        # A child that dies while idle is replaced before a grammar is given to it.
        (pid,) = pool.pids()
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: _gone(pid), timeout=2)
        assert comp.compile(StructuredOutputSpec.from_request(guided_regex="[a-c]{4}"))
    finally:
        pool.close()

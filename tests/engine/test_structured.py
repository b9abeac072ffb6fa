"""Structured output over xgrammar: every constrained output of a noisy "model" (random logits,
a seeded generator per run) is in the language asked for, 50 seeds per kind; compilation is
cached and shared; bad schemas, regexes, grammars and backend names are clear errors."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest
import torch

from serverless_llm.engine.sampling.structured.bitmask import (
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
)
from serverless_llm.engine.sampling.structured.grammar import GrammarCompiler
from serverless_llm.engine.sampling.structured.spec import (
    BACKEND_NAMES,
    StructuredOutputError,
    StructuredOutputSpec,
    resolve_backend,
)
from tests.tiny_models import build_tokenizer

SEEDS = range(50)
MAX_STEPS = 400
MODEL_VOCAB = 400  # larger than the tokenizer's 384: the LM head is padded, as some models do
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    comp = GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, stop_token_ids=[EOS])
    yield comp
    comp.close()


def _closer_ids(tokenizer) -> list[int]:
    """Tokens that close JSON (quote, brackets) or end it: favoured late in a run so that
    unbounded constructs (free-form JSON objects) end in a bounded number of steps."""
    ids = [EOS]
    for tid in range(len(tokenizer)):
        text = tokenizer.decode([tid])
        if text and set(text) <= set('"]}'):
            ids.append(tid)
    return ids


def generate(
    compiler: GrammarCompiler,
    tokenizer,
    spec: StructuredOutputSpec,
    seed: int,
    *,
    greedy: bool = False,
    soft_limit: int | None = None,
) -> tuple[str, list[int]]:
    """Drives one matcher with random logits: mask, draw, accept, until the stop token."""
    compiled = compiler.compile(spec)
    matcher = compiled.matcher()
    bitmask = allocate_bitmask(1, MODEL_VOCAB)
    gen = torch.Generator().manual_seed(seed)
    closers = torch.tensor(_closer_ids(tokenizer)) if soft_limit is not None else None
    ids: list[int] = []
    for step in range(MAX_STEPS):
        matcher.fill_bitmask(bitmask, 0)
        logits = torch.randn(1, MODEL_VOCAB, generator=gen) * 3.0
        if closers is not None and step >= soft_limit:
            logits[0, closers] += 4.0 + (step - soft_limit)
        apply_bitmask(logits, bitmask)
        allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
        assert allowed, "the grammar left no token allowed"
        # Never a padded id nor a special token that is not a stop token.
        assert all(t < len(tokenizer) for t in allowed)
        assert not {0, 1, 3, 4} & set(allowed)
        if greedy:
            token = int(torch.argmax(logits[0]))
        else:
            token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen))
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            assert token == EOS
            return tokenizer.decode(ids, skip_special_tokens=True), ids
        ids.append(token)
    raise AssertionError(f"no end after {MAX_STEPS} steps: {tokenizer.decode(ids)!r}")


# ---------------------------------------------------------------------------------------------
# 50 seeds per kind
# ---------------------------------------------------------------------------------------------

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "member": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "nickname": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
    },
    "required": ["name", "age", "role", "address"],
}

ARRAY_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["id"],
    },
    "minItems": 1,
    "maxItems": 4,
}


@pytest.mark.parametrize("schema", [PERSON_SCHEMA, ARRAY_SCHEMA], ids=["object", "array"])
def test_guided_json_outputs_validate(compiler, tokenizer, schema):
    spec = StructuredOutputSpec.from_request(guided_json=schema)
    for seed in SEEDS:
        text, _ = generate(compiler, tokenizer, spec, seed)
        jsonschema.validate(json.loads(text), schema)


def test_guided_json_schema_as_string_and_response_format(compiler, tokenizer):
    as_text = StructuredOutputSpec.from_request(guided_json=json.dumps(PERSON_SCHEMA))
    via_format = StructuredOutputSpec.from_request(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        }
    )
    assert as_text == via_format  # one cache entry for both
    assert via_format.param == "response_format"
    for seed in range(10):
        text, _ = generate(compiler, tokenizer, via_format, seed)
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)


def test_json_object_outputs_are_objects(compiler, tokenizer):
    spec = StructuredOutputSpec.from_request(response_format={"type": "json_object"})
    for seed in SEEDS:
        text, _ = generate(compiler, tokenizer, spec, seed, soft_limit=30)
        assert isinstance(json.loads(text), dict)


def test_whitespace_pattern_replaces_free_whitespace(compiler, tokenizer):
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        },
        "required": ["a", "b"],
    }
    spec = StructuredOutputSpec.from_request(
        guided_json=schema, guided_whitespace_pattern=r"[ \n]{0,2}"
    )
    for seed in SEEDS:
        text, _ = generate(compiler, tokenizer, spec, seed)
        jsonschema.validate(json.loads(text), schema)
        outside_strings = re.sub(r'"[^"]*"', '""', text)
        assert not re.search(r"[\t\r]", outside_strings)
        assert not re.search(r"[ \n]{3}", outside_strings), text


@pytest.mark.parametrize(
    "backend",
    [None, "xgrammar:disable-any-whitespace", "xgrammar:any-whitespace,disable-any-whitespace"],
)
def test_compact_json_by_default_and_when_disabled(compiler, tokenizer, backend):
    """Free whitespace is off unless asked for (unlike vLLM; issue 14): JSON comes out with
    json.dumps's separators only."""
    spec = StructuredOutputSpec.from_request(
        guided_json=PERSON_SCHEMA, guided_decoding_backend=backend
    )
    assert not spec.any_whitespace
    for seed in range(10):
        text, _ = generate(compiler, tokenizer, spec, seed)
        value = json.loads(text)
        jsonschema.validate(value, PERSON_SCHEMA)
        assert "\n" not in re.sub(r'"(\\.|[^"\\])*"', "", text)
        outside = re.sub(r'"(\\.|[^"\\])*"', '""', text)
        assert not re.search(r"\s", outside.replace(", ", ",").replace(": ", ":")), text


def test_any_whitespace_is_asked_for():
    free = StructuredOutputSpec.from_request(
        guided_json=PERSON_SCHEMA, guided_decoding_backend="xgrammar:any-whitespace"
    )
    assert free.any_whitespace
    assert free != StructuredOutputSpec.from_request(guided_json=PERSON_SCHEMA)
    so = StructuredOutputSpec.from_request(
        structured_outputs={"json": PERSON_SCHEMA, "backend": "xgrammar:any-whitespace"}
    )
    assert so.any_whitespace


REGEXES = [
    r"[a-z]{1,8}@[a-z]{2,5}\.(com|org|net)",
    r"\d{3}-\d{4}",
    r"(?P<word>[A-Z][a-z]{0,5})( (?P<more>[a-z]{1,4})){0,3}\.",
    r"^(yes|no|maybe)$",
]


@pytest.mark.parametrize("pattern", REGEXES)
def test_guided_regex_outputs_fullmatch(compiler, tokenizer, pattern):
    spec = StructuredOutputSpec.from_request(guided_regex=pattern)
    python_pattern = pattern.strip("^$")
    for seed in SEEDS:
        text, _ = generate(compiler, tokenizer, spec, seed)
        assert re.fullmatch(python_pattern, text), (pattern, text)


def test_guided_choice_outputs_are_choices(compiler, tokenizer):
    choices = ["positive", "negative", 'neu"tral\\ 🙂', "pos"]
    spec = StructuredOutputSpec.from_request(guided_choice=choices)
    seen = set()
    for seed in SEEDS:
        text, _ = generate(compiler, tokenizer, spec, seed)
        assert text in choices
        seen.add(text)
    assert len(seen) >= 3  # the noise reaches several choices, the escaped one included


ARITH_GBNF = """
# integer arithmetic, llama.cpp GBNF style
root   ::= expr
expr   ::= term (ws [-+] ws term){0,3}
term   ::= factor (ws [*/] ws factor){0,2}
factor ::= number | "(" ws expr ws ")"
number ::= "-"? [0-9]{1,3}
ws     ::= " "?
"""

ARITH_LARK = r"""
?start: expr
expr: term ((PLUS | MINUS) term)~0..3
term: factor ((TIMES | DIV) factor)~0..2
factor: NUMBER | "(" expr ")"
NUMBER: /-?[0-9]{1,3}/
PLUS: "+"
MINUS: "-"
TIMES: "*"
DIV: "/"
"""


class _Arith:
    """A recursive-descent parser for the arithmetic language above (spaces allowed where the
    GBNF has `ws`); parse() raises ValueError on anything outside it."""

    def __init__(self, text: str) -> None:
        self.s, self.i = text, 0

    def parse(self) -> None:
        self.expr()
        if self.i != len(self.s):
            raise ValueError(f"trailing text at {self.i}: {self.s!r}")

    def ws(self) -> None:
        if self.s.startswith(" ", self.i):
            self.i += 1

    def expr(self) -> None:
        self.term()
        while True:
            save = self.i
            self.ws()
            if self.i < len(self.s) and self.s[self.i] in "+-":
                self.i += 1
                self.ws()
                self.term()
            else:
                self.i = save
                return

    def term(self) -> None:
        self.factor()
        while True:
            save = self.i
            self.ws()
            if self.i < len(self.s) and self.s[self.i] in "*/":
                self.i += 1
                self.ws()
                self.factor()
            else:
                self.i = save
                return

    def factor(self) -> None:
        if self.s.startswith("(", self.i):
            self.i += 1
            self.ws()
            self.expr()
            self.ws()
            if not self.s.startswith(")", self.i):
                raise ValueError(f"expected ) at {self.i}: {self.s!r}")
            self.i += 1
            return
        m = re.compile(r"-?[0-9]{1,3}").match(self.s, self.i)
        if not m:
            raise ValueError(f"expected a number at {self.i}: {self.s!r}")
        self.i = m.end()


@pytest.mark.parametrize("grammar", [ARITH_GBNF, ARITH_LARK], ids=["gbnf", "lark"])
def test_guided_grammar_outputs_parse(compiler, tokenizer, grammar):
    spec = StructuredOutputSpec.from_request(guided_grammar=grammar)
    for seed in SEEDS:
        text, _ = generate(compiler, tokenizer, spec, seed)
        _Arith(text).parse()


def test_greedy_and_sampled_differ_but_both_valid(compiler, tokenizer):
    spec = StructuredOutputSpec.from_request(guided_regex=r"[a-z]{2,6}")
    a, _ = generate(compiler, tokenizer, spec, 7, greedy=True)
    b, _ = generate(compiler, tokenizer, spec, 7, greedy=True)
    assert a == b  # same seed, same noise, same text
    assert re.fullmatch(r"[a-z]{2,6}", a)


# ---------------------------------------------------------------------------------------------
# Batches, stop tokens, state
# ---------------------------------------------------------------------------------------------


def test_batch_fill_and_apply_only_touch_structured_rows(compiler, tokenizer):
    specs = [
        StructuredOutputSpec.from_request(guided_choice=["yes", "no"]),
        StructuredOutputSpec.from_request(guided_regex=r"[0-9]+"),
        StructuredOutputSpec.from_request(guided_json=ARRAY_SCHEMA),
    ] * 3
    matchers = [compiler.compile(s).matcher() for s in specs]
    batch = len(matchers) + 3  # three free-text rows mixed in
    rows = [0, 2, 3, 5, 6, 7, 9, 10, 11]
    bitmask = allocate_bitmask(batch, MODEL_VOCAB)
    gen = torch.Generator().manual_seed(0)
    done = [False] * len(matchers)
    texts: list[list[int]] = [[] for _ in matchers]
    for _ in range(MAX_STEPS):
        live = [i for i, d in enumerate(done) if not d]
        if not live:
            break
        fill_bitmasks([matchers[i] for i in live], bitmask, [rows[i] for i in live])
        logits = torch.randn(batch, MODEL_VOCAB, generator=gen)
        free = logits[[1, 4, 8]].clone()
        apply_bitmask(logits, bitmask, [rows[i] for i in live])
        assert torch.equal(logits[[1, 4, 8]], free)  # free-text rows untouched
        for i in live:
            token = int(torch.argmax(logits[rows[i]]))
            assert matchers[i].accept_token(token)
            if matchers[i].is_terminated():
                done[i] = True
            else:
                texts[i].append(token)
    assert all(done)
    for spec, ids in zip(specs, texts):
        text = tokenizer.decode(ids)
        if spec.kind == "choice":
            assert text in ("yes", "no")
        elif spec.kind == "regex":
            assert re.fullmatch(r"[0-9]+", text)
        else:
            jsonschema.validate(json.loads(text), ARRAY_SCHEMA)


def test_apply_bitmask_dtypes_and_1d(compiler):
    matcher = compiler.compile(StructuredOutputSpec.from_request(guided_choice=["a"])).matcher()
    bitmask = allocate_bitmask(1, MODEL_VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        logits = torch.zeros(1, MODEL_VOCAB, dtype=dtype)
        apply_bitmask(logits, bitmask)
        assert int(torch.isfinite(logits).sum()) >= 1
    flat = torch.zeros(MODEL_VOCAB)
    apply_bitmask(flat, bitmask[0])
    assert int(torch.isfinite(flat).sum()) == int(torch.isfinite(logits).sum())
    with pytest.raises(ValueError, match="vocab size"):
        apply_bitmask(torch.zeros(1, MODEL_VOCAB + 64), bitmask)


def test_cpu_apply_matches_xgrammar_kernel():
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(3)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, 13), dtype=torch.int32, generator=gen)
    for rows in (None, [0, 2, 4], [3]):
        logits = torch.randn(5, MODEL_VOCAB, generator=gen)  # fewer rows than the bitmask
        expected = logits.clone()
        xgr.apply_token_bitmask_inplace(
            expected, bitmask[:5], vocab_size=MODEL_VOCAB, indices=rows, backend="torch_native"
        )
        apply_bitmask(logits, bitmask, rows)
        assert torch.equal(logits, expected)


def _accepts(compiler, tokenizer, spec, text: str) -> bool:
    matcher = compiler.compile(spec).matcher()
    return matcher.accept_tokens(tokenizer.encode(text, add_special_tokens=False))


def test_bounded_json_strings_are_valid_json(compiler, tokenizer):
    """xgrammar 0.2.8 lets raw control characters into strings with maxLength and forbids
    escapes there; the hardened grammar does neither, and counts an escape as one character."""
    spec = StructuredOutputSpec.from_request(
        guided_json={"type": "string", "minLength": 2, "maxLength": 3}
    )
    assert _accepts(compiler, tokenizer, spec, '"a\\"b"')
    assert _accepts(compiler, tokenizer, spec, '"\\u00e9xy"')
    assert _accepts(compiler, tokenizer, spec, '"é🙂"')
    assert not _accepts(compiler, tokenizer, spec, '"a\x01"')
    assert not _accepts(compiler, tokenizer, spec, '"a\tb"')
    assert not _accepts(compiler, tokenizer, spec, '"\\ud83d\\ude00"')
    assert not _accepts(compiler, tokenizer, spec, '"abcd"')
    free = StructuredOutputSpec.from_request(guided_json={"type": "string"})
    assert not _accepts(compiler, tokenizer, free, '"a\x01"')
    assert _accepts(compiler, tokenizer, free, '"a\\nb"')


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_apply_bitmask_cuda_matches_cpu(compiler):
    matcher = compiler.compile(StructuredOutputSpec.from_request(guided_regex="[a-f]+")).matcher()
    bitmask = allocate_bitmask(2, MODEL_VOCAB)
    matcher.fill_bitmask(bitmask, 1)
    logits = torch.randn(2, MODEL_VOCAB)
    on_gpu = logits.cuda()
    apply_bitmask(logits, bitmask, [1])
    apply_bitmask(on_gpu, bitmask, [1])
    assert torch.equal(on_gpu.cpu(), logits)


def test_extra_stop_tokens_end_the_grammar(compiler, tokenizer):
    compiled = compiler.compile(StructuredOutputSpec.from_request(guided_choice=["yes"]))
    matcher = compiled.matcher(extra_stop_token_ids=[4])  # e.g. a request's stop_token_ids
    assert set(matcher.stop_token_ids) == {EOS, 4}
    for tid in tokenizer.encode("yes", add_special_tokens=False):
        assert matcher.accept_token(tid)
    assert matcher.is_completed() and not matcher.is_terminated()
    bitmask = allocate_bitmask(1, MODEL_VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, MODEL_VOCAB)
    apply_bitmask(logits, bitmask)
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == {EOS, 4}
    assert matcher.accept_token(4) and matcher.is_terminated()


def test_terminated_matchers_allow_only_their_stop_tokens(compiler, tokenizer):
    compiled = compiler.compile(StructuredOutputSpec.from_request(guided_choice=["yes"]))
    ids = tokenizer.encode("yes", add_special_tokens=False)
    matchers = [compiled.matcher(extra_stop_token_ids=[31, 63]) for _ in range(5)]
    for m in matchers[:3]:
        assert m.accept_tokens([*ids, 63]) and m.is_terminated()
    bitmask = allocate_bitmask(5, MODEL_VOCAB)
    fill_bitmasks(matchers, bitmask)  # no error on the ended ones
    logits = torch.zeros(5, MODEL_VOCAB)
    apply_bitmask(logits, bitmask)
    for row in range(3):
        assert torch.isfinite(logits[row]).nonzero().flatten().tolist() == [EOS, 31, 63]
    assert matchers[3].fill_bitmask(bitmask, 3) and not matchers[3].is_terminated()


def test_rejected_token_leaves_state_and_rollback_reset_resync_fork(compiler, tokenizer):
    compiled = compiler.compile(StructuredOutputSpec.from_request(guided_regex=r"ab+c"))
    m = compiled.matcher()
    a, b, c = (tokenizer.convert_tokens_to_ids(x) for x in "abc")
    assert not m.accept_token(b)  # forbidden: state unchanged
    assert m.accept_tokens([a, b, b]) and m.num_accepted == 3
    twin = m.fork()
    m.rollback(2)
    assert m.num_accepted == 1 and not m.accept_token(c)  # "a" then "c" is not allowed
    assert twin.accept_token(c) and twin.is_completed()
    m.reset()
    assert m.num_accepted == 0 and m.accept_token(a)
    assert m.resync([a, b, c]) and m.is_completed() and m.num_accepted == 3


# ---------------------------------------------------------------------------------------------
# Compilation: cache, async, errors
# ---------------------------------------------------------------------------------------------


def _twenty_property_schema() -> dict:
    types = ["string", "integer", "number", "boolean"]
    props: dict = {f"field_{i}": {"type": types[i % 4]} for i in range(20)}
    props["field_1"] = {"enum": ["red", "green", "blue"]}
    props["field_2"] = {"type": "array", "items": {"type": "string"}}
    props["field_3"] = {
        "type": "object",
        "properties": {"x": {"type": "number"}, "y": {"type": "integer"}},
        "required": ["x", "y"],
    }
    return {"type": "object", "properties": props, "required": list(props)[:12]}


def test_twenty_property_schema_compiles_and_is_cached(tokenizer):
    comp = GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, stop_token_ids=[EOS])
    comp.warm_up()
    spec = StructuredOutputSpec.from_request(guided_json=_twenty_property_schema())
    t0 = time.perf_counter()
    first = comp.compile(spec)
    compile_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    again = comp.compile(StructuredOutputSpec.from_request(guided_json=_twenty_property_schema()))
    hit_ms = (time.perf_counter() - t0) * 1e3
    print(f"\n20-property schema: compile {compile_ms:.2f} ms, cache hit {hit_ms:.3f} ms")
    assert again is first
    info = comp.cache_info()
    assert (info.hits, info.misses, info.entries) == (1, 1, 1) and info.bytes > 0


def test_cache_is_bounded_lru(tokenizer):
    comp = GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, max_entries=2)
    specs = [StructuredOutputSpec.from_request(guided_regex=f"x{{{i}}}") for i in range(1, 4)]
    a = comp.compile(specs[0])
    comp.compile(specs[1])
    assert comp.compile(specs[0]) is a  # a is now the most recent
    comp.compile(specs[2])  # evicts specs[1]
    assert comp.cache_info().entries == 2
    assert comp.compile(specs[0]) is a
    misses = comp.cache_info().misses
    comp.compile(specs[1])
    assert comp.cache_info().misses == misses + 1


def test_compile_async_shares_one_compilation(tokenizer):
    comp = GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, workers=4)
    spec = StructuredOutputSpec.from_request(guided_json=PERSON_SCHEMA)
    futures = [comp.compile_async(spec) for _ in range(8)]
    results = {id(f.result(timeout=60)) for f in futures}
    assert len(results) == 1
    assert comp.cache_info().misses == 1
    done = comp.compile_async(spec)
    assert done.done()  # a hit resolves at once
    bad = comp.compile_async(StructuredOutputSpec.from_request(guided_regex="[a-"))
    with pytest.raises(StructuredOutputError) as err:
        bad.result(timeout=60)
    assert err.value.param == "guided_regex"
    comp.close()


def test_compile_from_threads_is_safe(tokenizer):
    comp = GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB)
    specs = [
        StructuredOutputSpec.from_request(guided_regex=f"[a-c]{{{i % 5 + 1}}}") for i in range(40)
    ]
    errors: list[BaseException] = []

    def work(chunk):
        try:
            for s in chunk:
                comp.compile(s).matcher()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(specs[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert comp.cache_info().misses == 5


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"guided_json": {"type": "nonsense"}}, "guided_json", "invalid JSON schema"),
        ({"guided_regex": "[a-"}, "guided_regex", "invalid regex"),
        ({"guided_regex": "(a)\\1"}, "guided_regex", "Backreference"),
        ({"guided_grammar": 'root ::= foo "x"'}, "guided_grammar", "foo"),
        ({"guided_grammar": 'start ::= "x"'}, "guided_grammar", "root"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "invalid grammar"),
        (
            {"guided_json": {"type": "object"}, "guided_whitespace_pattern": "[ "},
            "guided_whitespace_pattern",
            "whitespace",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format",
            "invalid JSON schema",
        ),
    ],
)
def test_invalid_constraints_are_errors_naming_the_field(compiler, fields, param, message):
    spec = StructuredOutputSpec.from_request(**fields)
    with pytest.raises(StructuredOutputError) as err:
        compiler.compile(spec)
    assert err.value.param == param
    assert message in str(err.value)
    assert "/project/cpp" not in str(err.value)  # xgrammar's log prefix is stripped


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_choice": ["a", 3]}, "guided_choice"),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_grammar": "  "}, "guided_grammar"),
        ({"guided_json": [1, 2]}, "guided_json"),
        ({"guided_json": '{"type": '}, "guided_json"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": "{"}}},
            "response_format",
        ),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"guided_regex": "a", "guided_decoding_backend": "llama-cpp"}, "guided_decoding_backend"),
        (
            {"guided_regex": "a", "guided_decoding_backend": "xgrammar:fast"},
            "guided_decoding_backend",
        ),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ],
)
def test_spec_validation_names_the_field(fields, param):
    with pytest.raises(StructuredOutputError) as err:
        StructuredOutputSpec.from_request(**fields)
    assert err.value.param == param
    assert isinstance(err.value, ValueError)


def test_spec_kinds_and_free_text():
    assert StructuredOutputSpec.from_request() is None
    assert StructuredOutputSpec.from_request(response_format={"type": "text"}) is None
    assert StructuredOutputSpec.from_request(guided_decoding_backend="outlines") is None
    assert StructuredOutputSpec.from_request(guided_choice=["a"]).kind == "choice"
    assert StructuredOutputSpec.from_request(guided_regex="a").kind == "regex"
    assert StructuredOutputSpec.from_request(guided_grammar='root ::= "a"').kind == "grammar"
    assert StructuredOutputSpec.from_request(guided_json={}).kind == "json"
    js = StructuredOutputSpec.from_request(response_format={"type": "json_object"})
    assert js.kind == "json_object" and js.param == "response_format"
    # vLLM's newer dicts, on the native route.
    so = StructuredOutputSpec.from_request(
        structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True}
    )
    assert so.kind == "json" and not so.any_whitespace and so.param == "structured_outputs"
    gd = StructuredOutputSpec.from_request(
        guided_decoding={"choice": ["x", "y"], "backend": "outlines"}
    )
    assert gd.choice == ("x", "y") and gd.backend == "xgrammar"
    # Key order is kept (it is the output's order); the same schema as text or dict is one key.
    a = StructuredOutputSpec.from_request(guided_json={"b": 1, "a": 2})
    b = StructuredOutputSpec.from_request(guided_json='{ "b": 1,  "a": 2 }')
    assert a == b and hash(a) == hash(b) and a.json == '{"b":1,"a":2}'

    class Model:
        @staticmethod
        def model_json_schema():
            return {"type": "object", "properties": {"x": {"type": "integer"}}}

    assert StructuredOutputSpec.from_request(guided_json=Model).json.startswith('{"type"')


@pytest.mark.parametrize(
    ("name", "backend", "options"),
    [
        (None, "xgrammar", set()),
        ("", "xgrammar", set()),
        ("auto", "xgrammar", set()),
        ("xgrammar", "xgrammar", set()),
        ("outlines", "xgrammar", set()),
        ("lm-format-enforcer", "xgrammar", set()),
        ("guidance", "xgrammar", set()),
        ("GUIDANCE:no-additional-properties", "xgrammar", {"no-additional-properties"}),
        (
            "xgrammar:disable-any-whitespace,no-fallback",
            "xgrammar",
            {"disable-any-whitespace", "no-fallback"},
        ),
    ],
)
def test_backend_name_mapping(name, backend, options):
    assert resolve_backend(name) == (backend, frozenset(options))


def test_every_vllm_backend_name_is_mapped():
    for name in ("xgrammar", "outlines", "lm-format-enforcer", "guidance", "auto"):
        assert BACKEND_NAMES[name] == "xgrammar"
    with pytest.raises(StructuredOutputError, match="unknown guided decoding backend 'vllm'"):
        resolve_backend("vllm")

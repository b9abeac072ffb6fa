"""Structured output through the engine on the tiny random model (its free output is noise):
50 seeds per kind (one request with n=50: sequence i samples with seed + i, one matcher each),
every output in the language asked for; errors name the field; preemption keeps matchers."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from serverless_llm.engine.async_engine import AsyncEngine
from serverless_llm.engine.llm_engine import InvalidRequestError
from serverless_llm.engine.sampling.params import (
    GuidedDecodingParams,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)
from serverless_llm.llm import LLM
from tests.engine.test_structured import ARITH_GBNF, ARRAY_SCHEMA, PERSON_SCHEMA, _Arith

N = 50
COMPACT = "xgrammar:disable-any-whitespace"


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=512, block_size=16, max_model_len=512, max_num_seqs=64)


def _run(llm, prompt="Hello", **kwargs):
    kwargs.setdefault("max_tokens", 400)
    params = SamplingParams(n=N, seed=1234, **kwargs)
    (out,) = llm.generate(prompt, params)
    assert len(out.outputs) == N
    return out.outputs


@pytest.mark.parametrize("schema", [PERSON_SCHEMA, ARRAY_SCHEMA], ids=["object", "array"])
def test_guided_json_validates(llm, schema):
    for o in _run(llm, guided_json=schema, guided_decoding_backend=COMPACT):
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)


def test_default_json_completes_within_a_small_max_tokens(llm):
    """Issue 14: with free whitespace (vLLM's default) the tiny random model spends max_tokens on
    whitespace and most outputs come back truncated; the default here is compact, and 20 of
    20 outputs within max_tokens=120 parse and validate."""

    def outputs(**kw):
        params = SamplingParams(n=20, seed=77, max_tokens=120, guided_json=ARRAY_SCHEMA, **kw)
        return llm.generate("Hello", params)[0].outputs

    for o in outputs():
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), ARRAY_SCHEMA)
    free = outputs(guided_decoding_backend="xgrammar:any-whitespace")
    assert sum(o.finish_reason == "length" for o in free) >= 10


def test_json_schema_response_format_and_structured_outputs(llm):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ARRAY_SCHEMA}}
    outs = _run(llm, response_format=fmt, guided_decoding_backend=COMPACT, temperature=0.7)
    for o in outs:
        jsonschema.validate(json.loads(o.text), ARRAY_SCHEMA)
    so = StructuredOutputsParams(json=ARRAY_SCHEMA, disable_any_whitespace=True)
    for o in _run(llm, structured_outputs=so, temperature=0.7):
        jsonschema.validate(json.loads(o.text), ARRAY_SCHEMA)
    assert [o.text for o in outs] == [
        o.text
        for o in _run(
            llm,
            guided_decoding=GuidedDecodingParams(json=ARRAY_SCHEMA, disable_any_whitespace=True),
            temperature=0.7,
        )
    ]


REGEXES = [
    r"[a-z]{1,8}@[a-z]{2,5}\.(com|org|net)",
    r"\d{3}-\d{4}",
    r"(yes|no|maybe)",
]


@pytest.mark.parametrize("pattern", REGEXES)
def test_guided_regex_fullmatches(llm, pattern):
    for o in _run(llm, guided_regex=pattern):
        assert o.finish_reason == "stop"
        assert re.fullmatch(pattern, o.text), (pattern, o.text)


def test_guided_choice_is_a_choice(llm):
    choices = ["positive", "negative", "neutral"]
    outs = _run(llm, guided_choice=choices)
    assert all(o.text in choices for o in outs)
    assert len({o.text for o in outs}) >= 2


def test_guided_grammar_parses(llm):
    for o in _run(llm, guided_grammar=ARITH_GBNF):
        assert o.finish_reason == "stop", o.text
        _Arith(o.text).parse()


def test_greedy_ignore_eos_min_tokens_and_stop_ids(llm):
    (out,) = llm.generate(
        "Hi",
        SamplingParams(temperature=0.0, guided_choice=["yes", "no"], ignore_eos=True, min_tokens=5),
    )
    o = out.outputs[0]
    assert o.text in ("yes", "no") and o.finish_reason == "stop"


def test_preemption_does_not_change_outputs(tiny_llama):
    params = SamplingParams(
        n=8, seed=7, max_tokens=200, guided_json=ARRAY_SCHEMA, guided_decoding_backend=COMPACT
    )
    roomy = LLM(tiny_llama, num_kv_blocks=256, block_size=16, max_model_len=256)
    tight = LLM(tiny_llama, num_kv_blocks=20, block_size=16, max_model_len=256)
    a = [o.text for o in roomy.generate("Hello there", params)[0].outputs]
    b = [o.text for o in tight.generate("Hello there", params)[0].outputs]
    assert a == b
    for t in a:
        jsonschema.validate(json.loads(t), ARRAY_SCHEMA)


def test_errors_name_the_field(llm):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(guided_choice=[])
    assert e.value.param == "guided_choice"
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(guided_json={"type": "object"}, guided_regex="a+")
    assert e.value.param == "guided_regex"
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(guided_regex="a", guided_decoding_backend="nope")
    assert e.value.param == "guided_decoding_backend"
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(use_beam_search=True, temperature=0, guided_regex="a+")
    assert e.value.param == "guided_regex"
    with pytest.raises(InvalidRequestError) as e:
        llm.generate("x", SamplingParams(guided_regex="(a"))
    assert e.value.param == "guided_regex"
    with pytest.raises(InvalidRequestError) as e:
        llm.generate("x", SamplingParams(guided_grammar="root ::= nothing_here"))
    assert e.value.param == "guided_grammar"


def test_async_engine_compiles_before_queueing(llm):
    engine = AsyncEngine(llm.engine)

    async def main():
        async def one(seed):
            text = ""
            params = SamplingParams(seed=seed, guided_regex=r"\d{3}-\d{4}", max_tokens=50)
            async for out in engine.generate("Hello", params):
                text += out.new_text
            return text

        texts = await asyncio.gather(*(one(s) for s in range(8)))
        assert all(re.fullmatch(r"\d{3}-\d{4}", t) for t in texts)
        with pytest.raises(InvalidRequestError) as e:
            async for _ in engine.generate("x", SamplingParams(guided_regex="(a")):
                pass
        assert e.value.param == "guided_regex"
        assert engine.num_unfinished == 0

    asyncio.run(main())


def test_logit_bias_and_allowed_ids_that_contradict_the_grammar(llm):
    tok = llm.get_tokenizer()
    banned = tok.encode("yes", add_special_tokens=False)
    bias = {t: -100.0 for t in banned}
    outs = _run(llm, guided_choice=["yes", "no"], logit_bias=bias, max_tokens=10)
    assert all(o.text in ("yes", "no") for o in outs)
    # allowed_token_ids with no token the grammar allows: the grammar's mask alone decides.
    outs = _run(llm, guided_regex=r"[0-9]{2}", allowed_token_ids=[5, 6], max_tokens=10)
    assert all(re.fullmatch(r"[0-9]{2}", o.text) for o in outs)


def test_stop_strings_and_streaming_with_a_grammar(llm):
    """A stop string cuts a constrained output where it appears (the grammar does not hide it),
    and the streamed increments of a guided request add up to the offline result."""
    params = SamplingParams(n=6, seed=5, guided_regex=r"\d{3}-\d{4}", stop=["-"], max_tokens=50)
    outs = llm.generate("Call me", params)[0].outputs
    for o in outs:
        assert re.fullmatch(r"\d{3}", o.text), o.text
        assert o.finish_reason == "stop" and o.stop_reason == "-"

    single = SamplingParams(
        seed=9, max_tokens=400, guided_json=PERSON_SCHEMA, guided_decoding_backend=COMPACT
    )
    (expected,) = llm.generate("Hello", single)
    aengine = AsyncEngine(llm.engine)

    async def stream():
        text, ids = "", []
        try:
            async for out in aengine.generate("Hello", single):
                text += out.new_text
                ids += out.new_token_ids
        finally:
            await aengine.shutdown()
        return text, ids

    text, ids = asyncio.run(stream())
    assert text == expected.outputs[0].text and ids == expected.outputs[0].token_ids
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)


def test_structured_after_leaves_the_output_free_until_its_tokens(llm):
    """A reasoning model's constraint starts after `</think>` (SamplingParams.structured_after):
    here the gate is the first three tokens the model writes freely, and what follows them is
    in the grammar's language."""
    tokenizer = llm.engine.tokenizer
    free = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    gate = tuple(free.token_ids[:3])
    params = SamplingParams(
        temperature=0, max_tokens=100, guided_regex="[ab]{4}", structured_after=gate
    )
    out = llm.generate("Hello", params)[0].outputs[0]
    assert tuple(out.token_ids[:3]) == gate  # greedy, unconstrained, until the gate
    assert re.fullmatch("[ab]{4}", tokenizer.decode(out.token_ids[3:], skip_special_tokens=True))
    assert out.finish_reason == "stop"
    # Without the gate the same request is constrained from its first token.
    (whole,) = llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=100, guided_regex="[ab]{4}")
    )[0].outputs
    assert re.fullmatch("[ab]{4}", whole.text)
    with pytest.raises(SamplingParamsError, match="structured_after"):
        SamplingParams(structured_after=[1, 2])

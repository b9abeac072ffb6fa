"""Property-based fuzzing of both job routes through the worker's real entry (issue 14 item 7).

Every generated input goes to `Worker.handle` as a RunPod job: native jobs (prompt, messages,
every sampling parameter `api.sampling.VLLMSamplingParams` declares, stream, batch knobs),
OpenAI jobs (chat and completions bodies built from the fields of `api.openai.protocol`'s request
models, the models routes, unknown routes), and arbitrary JSON-like junk. Values are mostly
well-typed and sane (so many requests run on the engine and finish within 1-4 tokens), with
edges (ints around 2**63 and beyond, negatives, inf and NaN, unicode with lone surrogates, huge
strings, deep nesting) and junk of the wrong type mixed in. Some jobs are abandoned after their
first items, as a disconnecting client does.

For every input: the items are the routes' documented shapes only (OpenAI's responses, chunks
and `[DONE]`, or an error object with a 4xx status; native `{"choices", "usage"}` items or
`{"error": str}`), never an internal error, nothing logged at ERROR, the engine's loop alive,
and once idle every KV block free. Derandomized, so CI runs the same inputs every time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import types
import typing
from contextlib import aclosing
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serverless_llm.api.native_sampling import VLLMSamplingParams
from serverless_llm.api.openai import http_status, is_error
from serverless_llm.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from serverless_llm.api.openai.responses import ResponsesRequest
from serverless_llm.worker.handler import Worker
from serverless_llm.worker.settings import Settings

MAX_MODEL_LEN = 64
NUM_BLOCKS = 32  # of 16 tokens: a few long sequences fill it, so n > 1 can preempt

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)

# -- building blocks -------------------------------------------------------------------------


def _deep(depth: int, leaf: Any, kind: str) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


HUGE_INTS = st.sampled_from(
    [
        2**31,
        2**53 + 1,
        2**63 - 1,
        2**63,
        2**64 - 1,
        2**64,
        -(2**63),
        -(2**63) - 1,
        10**30,
        -(10**30),
        10**400,
    ]
)
INTS = st.one_of(st.integers(-3, 8), HUGE_INTS, st.integers())
FLOATS = st.one_of(
    st.floats(-2.0, 2.0),
    st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e300, -1e300, math.inf, -math.inf, math.nan]),
    st.floats(),
)
# Lone surrogates included: a job built in Python (or JSON with \ud800 escapes) can carry them.
UNICODE = st.text(st.characters(exclude_categories=()), max_size=16)
SPECIAL_TEXT = st.sampled_from(
    [
        "",
        " ",
        "\x00",
        "\ud800",
        "a\udfffb",
        "🙂🚀",
        "<|im_start|>",
        "<|im_end|>",
        "</s>",
        "<s>",
        "<unk>",
        "{{ messages }}",
        "{% for %}",
        "null",
        "a" * 5_000,
        "日本語" * 3_000,
        "x" * 1_000_000,
    ]
)
TEXT = st.one_of(st.text(max_size=10), UNICODE, SPECIAL_TEXT)
SMALL_TEXT = st.text(max_size=8)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
DEEP = st.sampled_from(
    [_deep(900, 1, "list"), _deep(900, None, "dict"), _deep(60, "x", "list"), [[]] * 50]
)
JUNK = st.one_of(
    st.recursive(
        SCALARS,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
        max_leaves=8,
    ),
    DEEP,
)


# Junk for an output limit: null (or no sampling_params) would run to max_model_len.
BOUNDED_JUNK = JUNK.filter(lambda v: v is not None and v != {})
UNBOUNDING = ("max_tokens", "max_completion_tokens", "max_output_tokens", "sampling_params")


def typed(annotation: Any) -> st.SearchStrategy:
    """Values of `annotation`'s JSON type, edges included (out of range is still well typed)."""
    if annotation is Any:
        return JUNK
    if annotation is type(None) or annotation is None:
        return st.none()
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([typed(a) for a in args])
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is typing.Annotated:
        return typed(args[0])
    if origin is list:
        return st.lists(typed(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(typed(args[0]), typed(args[1]), max_size=3)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return INTS
    if annotation is float:
        return st.one_of(FLOATS, INTS)
    if annotation is str:
        return TEXT
    raise AssertionError(f"no strategy for {annotation!r}")


def field_strategies(
    model: type, sane: dict[str, st.SearchStrategy], special: dict[str, st.SearchStrategy]
) -> dict[str, tuple[st.SearchStrategy, st.SearchStrategy]]:
    """name -> (valid, junk) for every field of a pydantic model. Valid: mostly sane (the
    default when nothing better is known), sometimes any well-typed value (edges included)."""
    out = {}
    for name, info in model.model_fields.items():
        wide = special[name] if name in special else typed(info.annotation)
        if name in sane:
            calm = sane[name]
        elif info.is_required():
            calm = wide
        else:
            calm = st.just(info.default)
        out[name] = (
            st.one_of(calm, calm, calm, wide),
            BOUNDED_JUNK if name in UNBOUNDING else JUNK,
        )
    return out


def randoms() -> st.SearchStrategy:
    """A Random seeded by hypothesis (so derandomized and replayable) for the coin flips that
    shape a request: hypothesis's own draws lean hard to their simplest values (0, the first
    branch), which would take a "1 in 30" branch a third of the time."""
    return st.randoms(use_true_random=True)


@st.composite
def request_dict(
    draw,
    fields: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]],
    required: tuple[str, ...],
    small_output: tuple[str, ...] = ("max_tokens",),
    max_optional: int = 6,
) -> dict[str, Any]:
    """A dict of `fields`: "valid" mode draws a few well-typed fields, "one_bad" spoils one of
    them (junk value, or a missing required field), "chaos" spoils any number; the last two
    may add an unknown key."""
    rnd = draw(randoms())
    mode = rnd.choices(["valid", "one_bad", "chaos"], weights=[5, 4, 1])[0]
    optional = sorted(k for k in fields if k not in required)
    chosen = list(required)
    # An unset output limit runs to max_model_len: keep it set nearly always.
    if rnd.random() < 0.95:
        chosen.append(rnd.choice(small_output))
    chosen += rnd.sample(optional, rnd.randint(0, max_optional))
    chosen = list(dict.fromkeys(chosen))
    bad = rnd.choice(chosen) if mode == "one_bad" and chosen else None
    out: dict[str, Any] = {}
    for key in chosen:
        valid, junk = fields[key]
        spoil = key == bad or (mode == "chaos" and rnd.random() < 0.25)
        if spoil and key in required and key not in UNBOUNDING and rnd.random() < 0.3:
            continue  # missing
        out[key] = draw(junk if spoil else valid)
    if mode != "valid" and rnd.random() < 0.15:
        out[draw(TEXT)] = draw(JUNK)  # an unknown field
    return out


def small(lo: int, hi: int) -> st.SearchStrategy:
    return st.integers(lo, hi)


# -- sampling parameters (both routes' extras share the names) ------------------------------

TOKEN_IDS = st.lists(st.integers(-1, 400), max_size=6)  # vocab is 384
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["city"],
}
GUIDED_JSON = st.one_of(
    st.just(SCHEMA),
    st.just(json.dumps(SCHEMA)),
    st.just({"type": "string", "enum": ["a", "b"]}),
    st.just({"type": "nope"}),
    st.just("{not json"),
    st.dictionaries(TEXT, JUNK, max_size=2),
)
GUIDED_REGEX = st.one_of(st.sampled_from(["[a-z]{1,3}", "yes|no", "(", "a{99999999}", ""]), TEXT)
GUIDED_CHOICE = st.lists(st.one_of(st.sampled_from(["yes", "no", "🙂"]), TEXT), max_size=3)
GUIDED_GRAMMAR = st.one_of(
    st.sampled_from(['root ::= "yes" | "no"', 'root ::= foo "x"', "start: undefined_rule"]), TEXT
)
BACKENDS = st.one_of(
    st.sampled_from(
        ["xgrammar", "auto", "outlines", "guidance", "xgrammar:disable-any-whitespace", "nope"]
    ),
    TEXT,
)
RESPONSE_FORMAT = st.one_of(
    st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
            {"type": "json_schema"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": "nope"}},
            {"type": "nope"},
        ]
    ),
    st.dictionaries(st.sampled_from(["type", "json_schema", "schema"]), JUNK, max_size=2),
)
STRUCTURED_BLOB = st.dictionaries(
    st.one_of(
        st.sampled_from(
            [
                "json",
                "regex",
                "choice",
                "grammar",
                "json_object",
                "backend",
                "whitespace_pattern",
                "disable_any_whitespace",
            ]
        ),
        TEXT,
    ),
    st.one_of(GUIDED_JSON, GUIDED_REGEX, GUIDED_CHOICE, st.booleans(), JUNK),
    max_size=2,
)
LOGIT_BIAS = st.dictionaries(
    st.one_of(st.integers(-1, 400).map(str), TEXT),
    st.one_of(st.floats(-100, 100), FLOATS, INTS),
    max_size=3,
)
STOP = st.one_of(SMALL_TEXT, st.lists(st.one_of(SMALL_TEXT, TEXT), max_size=3), st.none())

SANE_SAMPLING: dict[str, st.SearchStrategy] = {
    "n": small(1, 3),
    "best_of": st.one_of(st.none(), small(1, 4)),
    "max_tokens": small(1, 4),
    "max_completion_tokens": small(1, 4),
    "min_tokens": small(0, 3),
    "temperature": st.one_of(st.floats(0.0, 2.0), st.none()),
    "top_p": st.floats(0.01, 1.0),
    "top_k": small(-1, 50),
    "min_p": st.floats(0.0, 1.0),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.5, 2.0),
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
    "stop": st.one_of(SMALL_TEXT, st.lists(SMALL_TEXT, max_size=3), st.none()),
    "stop_token_ids": st.lists(st.integers(0, 383), max_size=3),
    "allowed_token_ids": st.lists(st.integers(0, 383), min_size=1, max_size=5),
    "logit_bias": st.dictionaries(st.integers(0, 383).map(str), st.floats(-100, 100), max_size=3),
    "logprobs": st.one_of(st.none(), small(0, 5)),
    "prompt_logprobs": st.one_of(st.none(), small(0, 5)),
    "top_logprobs": st.one_of(st.none(), small(0, 5)),
    "truncate_prompt_tokens": st.one_of(st.none(), small(1, 10)),
    "use_beam_search": st.booleans(),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "length_penalty": st.floats(-2.0, 2.0),
    "early_stopping": st.sampled_from([True, False, "never"]),
}
SPECIAL_SAMPLING: dict[str, st.SearchStrategy] = {
    # Never null when valid: null runs to max_model_len (left out, it does so 1 time in 20).
    "max_tokens": INTS,
    "max_completion_tokens": INTS,
    "logit_bias": LOGIT_BIAS,
    "allowed_token_ids": TOKEN_IDS,
    "stop_token_ids": TOKEN_IDS,
    "stop": STOP,
    "guided_json": GUIDED_JSON,
    "guided_regex": GUIDED_REGEX,
    "guided_choice": GUIDED_CHOICE,
    "guided_grammar": GUIDED_GRAMMAR,
    "guided_decoding_backend": BACKENDS,
    "guided_whitespace_pattern": st.one_of(st.sampled_from([r"[ ]?", "(", ""]), TEXT),
    "response_format": RESPONSE_FORMAT,
    "structured_outputs": STRUCTURED_BLOB,
    "guided_decoding": STRUCTURED_BLOB,
    "early_stopping": st.one_of(st.booleans(), st.sampled_from(["never", "always"]), TEXT),
}

# -- native jobs -----------------------------------------------------------------------------

BATCH_KNOBS: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
    "max_batch_size": (st.one_of(small(1, 60), INTS), JUNK),
    "min_batch_size": (st.one_of(small(1, 5), INTS), JUNK),
    "batch_size_growth_factor": (
        st.one_of(st.floats(0.5, 4.0), st.sampled_from([1e-300, 1e300, 0.0]), FLOATS, INTS),
        JUNK,
    ),
}

NATIVE_MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), TEXT)},
    optional={
        "content": st.one_of(
            SMALL_TEXT,
            st.lists(st.dictionaries(TEXT, JUNK, max_size=2), max_size=2),
            st.none(),
            TEXT,
        ),
        "name": JUNK,
        "tool_calls": JUNK,
    },
)
SANE_NATIVE_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": SMALL_TEXT}
    ),
    min_size=1,
    max_size=3,
)


@st.composite
def native_inputs(draw) -> dict[str, Any]:
    sampling = draw(
        request_dict(
            field_strategies(VLLMSamplingParams, SANE_SAMPLING, SPECIAL_SAMPLING),
            required=(),
            max_optional=5,
        )
    )
    fields: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
        "prompt": (st.one_of(SMALL_TEXT, SMALL_TEXT, TEXT), JUNK),
        "messages": (
            st.one_of(SANE_NATIVE_MESSAGES, SANE_NATIVE_MESSAGES, st.lists(NATIVE_MESSAGE)),
            JUNK,
        ),
        "sampling_params": (st.just(sampling), BOUNDED_JUNK),
        "stream": (st.booleans(), JUNK),
        "apply_chat_template": (st.booleans(), JUNK),
        "reasoning_effort": (st.sampled_from(["low", "medium", "high"]), JUNK),
        "chat_template_kwargs": (st.dictionaries(TEXT, JUNK, max_size=2), JUNK),
        **BATCH_KNOBS,
    }
    rnd = draw(randoms())
    which = rnd.choices([("prompt",), ("messages",), ("prompt", "messages"), ()], [8, 8, 1, 1])[0]
    job = draw(
        request_dict(
            fields, required=(*which, "sampling_params"), small_output=("stream",), max_optional=3
        )
    )
    if rnd.random() < 0.03:
        job["openai_input"] = draw(JUNK)  # without openai_route: a native job's error
    return job


SANE_STRUCTURED: dict[str, st.SearchStrategy] = {
    "guided_choice": st.just(["yes", "no", "🙂"]),
    "guided_regex": st.just("[a-z]{1,3}"),
    "guided_json": st.just(SCHEMA),
    "guided_grammar": st.just('root ::= "yes" | "no"'),
    "response_format": st.sampled_from(
        [
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        ]
    ),
}
PROMPT = st.text(min_size=1, max_size=12)
SANE_KNOBS: dict[str, st.SearchStrategy] = {
    "max_batch_size": small(1, 60),
    "min_batch_size": small(1, 5),
    "batch_size_growth_factor": st.floats(0.5, 4.0),
}


@st.composite
def sane_params(draw, names: list[str], overrides: dict[str, st.SearchStrategy]) -> dict:
    """A few sampling parameters, each with a sane value (combinations may still be refused,
    best_of < n for one), one of them sometimes at an edge of its type (1e300, 2**63, -0.0),
    and now and then one structured-output constraint."""
    rnd = draw(randoms())
    out = {}
    chosen = rnd.sample(sorted(names), rnd.randint(0, 4))
    edge = rnd.choice(chosen) if chosen and rnd.random() < 0.3 else None
    for name in chosen:
        if name == edge and name in EDGES:
            out[name] = draw(EDGES[name])
        else:
            out[name] = draw(overrides[name] if name in overrides else SANE_SAMPLING[name])
    if rnd.random() < 0.15:  # beam search, its knobs at their edges now and then
        out.update(use_beam_search=True, n=rnd.randint(1, 3))
        out.pop("temperature", None)
        for name in ("length_penalty", "early_stopping"):
            if rnd.random() < 0.5:
                out[name] = draw(st.one_of(SANE_SAMPLING[name], EDGES[name]))
    if rnd.random() < 0.15:
        name = rnd.choice(sorted(SANE_STRUCTURED))
        out[name] = draw(SANE_STRUCTURED[name])
    return out


# Any well-typed value, out of range included, for the sampling parameters both routes share.
EDGES: dict[str, st.SearchStrategy] = {
    name: SPECIAL_SAMPLING[name] if name in SPECIAL_SAMPLING else typed(info.annotation)
    for name, info in VLLMSamplingParams.model_fields.items()
    if name != "logprobs"  # chat's logprobs is a flag
}


def _knobs(draw, rnd) -> dict[str, Any]:
    return {k: draw(v) for k, v in SANE_KNOBS.items() if rnd.random() < 0.15}


NATIVE_NAMES = [
    n for n in SANE_SAMPLING if n in VLLMSamplingParams.model_fields and n != "max_tokens"
]


@st.composite
def valid_native_inputs(draw) -> dict[str, Any]:
    """Native jobs meant to run: sane values (now and then one at an edge), 1-4 tokens."""
    rnd = draw(randoms())
    job: dict[str, Any] = {}
    if rnd.random() < 0.5:
        job["prompt"] = draw(PROMPT)
        if rnd.random() < 0.3:
            job["apply_chat_template"] = True
    else:
        job["messages"] = draw(SANE_NATIVE_MESSAGES)
    params = draw(sane_params(NATIVE_NAMES, {}))
    params["max_tokens"] = draw(small(1, 4))
    job["sampling_params"] = params
    job["stream"] = rnd.random() < 0.5
    job.update(_knobs(draw, rnd))
    return job


# -- OpenAI jobs -----------------------------------------------------------------------------

ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
CONTENT_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": SMALL_TEXT}),
    st.fixed_dictionaries(
        {"type": st.one_of(st.sampled_from(["text", "image_url", "input_audio", "refusal"]), TEXT)},
        optional={"text": JUNK, "image_url": JUNK},
    ),
    JUNK,
)
CONTENT = st.one_of(SMALL_TEXT, st.lists(CONTENT_PART, max_size=3), st.none(), TEXT, JUNK)
TOOL_CALL = st.one_of(
    st.fixed_dictionaries(
        {
            "id": SMALL_TEXT,
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {
                    "name": st.one_of(st.just("get_weather"), TEXT),
                    "arguments": st.one_of(st.just('{"city": "Paris"}'), TEXT, JUNK),
                }
            ),
        }
    ),
    JUNK,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(ROLES, ROLES, TEXT, JUNK)},
    optional={
        "content": CONTENT,
        "name": st.one_of(SMALL_TEXT, JUNK),
        "tool_calls": st.one_of(st.lists(TOOL_CALL, max_size=2), JUNK),
        "tool_call_id": st.one_of(SMALL_TEXT, JUNK),
        "reasoning_content": JUNK,
    },
)
SANE_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user", "assistant"]),
            "content": st.one_of(
                SMALL_TEXT,
                st.lists(
                    st.fixed_dictionaries({"type": st.just("text"), "text": SMALL_TEXT}), max_size=2
                ),
            ),
        }
    ),
    min_size=1,
    max_size=3,
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOL = st.one_of(
    st.just(WEATHER),
    st.fixed_dictionaries(
        {
            "type": st.one_of(st.just("function"), TEXT),
            "function": st.one_of(
                JUNK,
                st.fixed_dictionaries(
                    {"name": TEXT}, optional={"parameters": JUNK, "strict": JUNK}
                ),
            ),
        }
    ),
    JUNK,
)
TOOL_CHOICE = st.one_of(
    st.sampled_from(
        [
            "none",
            "auto",
            "required",
            {"type": "function", "function": {"name": "get_weather"}},
            {"type": "function", "function": {"name": "nope"}},
            {"type": "function"},
            "bogus",
        ]
    ),
    JUNK,
)
TEMPLATE_KWARG_KEYS = st.sampled_from(
    [
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "chat_template",
        "enable_thinking",
        "bos_token",
    ]
)
CHAT_TEMPLATE = st.one_of(
    st.sampled_from(
        [
            "{% for m in messages %}{{ m['content'] }}{% endfor %}",
            "{{ raise_exception('refused') }}",
            "{% if %}",
            "{{ messages[99] }}",
            "{{ tools | tojson }}{{ messages | length }}",
            "",
        ]
    ),
    TEXT,
)
SPECIAL_OPENAI: dict[str, st.SearchStrategy] = {
    **SPECIAL_SAMPLING,
    "messages": st.one_of(st.lists(MESSAGE, max_size=3), JUNK),
    "prompt": st.one_of(
        TEXT,
        st.lists(TEXT, max_size=3),
        TOKEN_IDS,
        st.lists(TOKEN_IDS, max_size=3),
        st.just([]),
        JUNK,
    ),
    "tools": st.lists(TOOL, max_size=2),
    "tool_choice": TOOL_CHOICE,
    "function_call": st.one_of(st.sampled_from(["none", "auto"]), JUNK),
    "stream_options": st.fixed_dictionaries(
        {},
        optional={
            "include_usage": st.one_of(st.booleans(), JUNK),
            "continuous_usage_stats": st.one_of(st.booleans(), JUNK),
            "include_obfuscation": st.one_of(st.booleans(), JUNK),
        },
    ),
    # OpenAI's moderation and prompt-cache objects (checked and ignored).
    "moderation": st.fixed_dictionaries(
        {"model": st.one_of(TEXT, JUNK)},
        optional={
            "policy": st.one_of(
                st.fixed_dictionaries(
                    {},
                    optional={
                        side: st.fixed_dictionaries(
                            {"mode": st.one_of(st.sampled_from(["score", "block"]), JUNK)}
                        )
                        for side in ("input", "output")
                    },
                ),
                JUNK,
            )
        },
    ),
    "prompt_cache_options": st.fixed_dictionaries(
        {},
        optional={
            "mode": st.one_of(st.sampled_from(["implicit", "explicit"]), JUNK),
            "ttl": st.one_of(st.just("30m"), JUNK),
        },
    ),
    "chat_template": CHAT_TEMPLATE,
    "chat_template_kwargs": st.dictionaries(st.one_of(TEMPLATE_KWARG_KEYS, TEXT), JUNK, max_size=2),
    "documents": st.lists(st.dictionaries(TEXT, JUNK, max_size=2), max_size=2),
    "metadata": st.dictionaries(TEXT, TEXT, max_size=2),
    "modalities": st.lists(st.one_of(st.sampled_from(["text", "audio"]), TEXT), max_size=2),
}
SANE_OPENAI: dict[str, st.SearchStrategy] = {
    **SANE_SAMPLING,
    "messages": SANE_MESSAGES,
    "prompt": st.one_of(
        PROMPT,
        st.lists(PROMPT, min_size=1, max_size=2),
        st.lists(st.integers(0, 383), min_size=1, max_size=6),
        st.lists(st.lists(st.integers(0, 383), min_size=1, max_size=4), min_size=1, max_size=2),
    ),
    "logprobs": st.one_of(st.none(), small(0, 5)),  # completions' int (chat's bool is typed)
    "tools": st.one_of(st.none(), st.just([WEATHER])),
    "tool_choice": st.sampled_from(
        [
            None,
            "none",
            "auto",
            "required",
            {"type": "function", "function": {"name": "get_weather"}},
        ]
    ),
    "stream": st.booleans(),
    "stream_options": st.one_of(
        st.none(),
        st.fixed_dictionaries(
            {"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
        ),
    ),
    "response_format": st.sampled_from([None, {"type": "text"}, {"type": "json_object"}]),
    "echo": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
}


# /v1/responses: input items and tools in the Responses shapes, sane and spoiled.
RESPONSES_WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": WEATHER["function"]["parameters"],
}
RESPONSES_ITEM = st.one_of(
    st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["user", "system", "developer", "assistant"]), TEXT)},
        optional={
            "type": st.one_of(st.just("message"), TEXT),
            "content": st.one_of(
                TEXT,
                st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["input_text", "output_text", "input_image"])},
                        optional={"text": st.one_of(TEXT, JUNK)},
                    ),
                    max_size=2,
                ),
                JUNK,
            ),
        },
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call")},
        optional={"call_id": SMALL_TEXT, "name": SMALL_TEXT, "arguments": st.one_of(TEXT, JUNK)},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output")},
        optional={"call_id": st.one_of(SMALL_TEXT, JUNK), "output": st.one_of(TEXT, JUNK)},
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["reasoning", "item_reference", "web_search_call"])},
        optional={"content": JUNK, "summary": JUNK, "id": TEXT},
    ),
    JUNK,
)
SPECIAL_RESPONSES: dict[str, st.SearchStrategy] = {
    **SPECIAL_OPENAI,
    "input": st.one_of(TEXT, st.lists(RESPONSES_ITEM, max_size=3), JUNK),
    "tools": st.lists(
        st.one_of(
            st.just(RESPONSES_WEATHER),
            st.fixed_dictionaries(
                {"type": st.one_of(st.just("function"), TEXT)}, optional={"name": TEXT}
            ),
        ),
        max_size=2,
    ),
    "tool_choice": st.one_of(
        st.sampled_from(
            ["none", "auto", "required", {"type": "function", "name": "get_weather"}, "bogus"]
        ),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "allowed_tools", "mcp"])},
            optional={"name": TEXT, "mode": TEXT, "tools": JUNK},
        ),
        JUNK,
    ),
    "text": st.one_of(
        st.fixed_dictionaries(
            {
                "format": st.one_of(
                    st.sampled_from([{"type": "text"}, {"type": "json_object"}]), JUNK
                )
            }
        ),
        JUNK,
    ),
    "reasoning": st.one_of(
        st.fixed_dictionaries({}, optional={"effort": st.one_of(TEXT, JUNK)}), JUNK
    ),
}
SANE_RESPONSES: dict[str, st.SearchStrategy] = {
    **SANE_OPENAI,
    "input": st.one_of(
        PROMPT,
        st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "developer"]), "content": PROMPT}
            ),
            min_size=1,
            max_size=2,
        ),
    ),
    "tools": st.one_of(st.none(), st.just([RESPONSES_WEATHER])),
    "tool_choice": st.sampled_from(
        [None, "none", "auto", "required", {"type": "function", "name": "get_weather"}]
    ),
    "max_output_tokens": st.one_of(st.none(), small(1, 4)),
}


def _model_field(served: str) -> st.SearchStrategy:
    return st.one_of(st.sampled_from([served, "", "gpt-4o", None]), TEXT)


ENVELOPE_KNOBS = st.fixed_dictionaries(
    {}, optional={k: st.one_of(valid, valid, junk) for k, (valid, junk) in BATCH_KNOBS.items()}
)


@st.composite
def openai_inputs(draw, route: st.SearchStrategy, model_cls: type, required: str) -> dict:
    """OpenAI jobs built from every field of `model_cls`, valid and junk mixed."""
    rnd = draw(randoms())
    if required == "input":
        fields = field_strategies(model_cls, SANE_RESPONSES, SPECIAL_RESPONSES)
    else:
        fields = field_strategies(model_cls, SANE_OPENAI, SPECIAL_OPENAI)
    fields["model"] = (_model_field(SERVED), JUNK)
    if required == "input":
        small_output: tuple[str, ...] = ("max_output_tokens",)
    elif required == "messages":
        small_output = ("max_tokens", "max_completion_tokens")
        fields["logprobs"] = (st.booleans(), JUNK)  # chat's is a flag; top_logprobs the count
    else:
        small_output = ("max_tokens",)
    body: Any = draw(request_dict(fields, required=(required,), small_output=small_output))
    if rnd.random() < 0.04:
        body = draw(JUNK)  # not an object at all
    job: dict[str, Any] = {"openai_route": draw(route), "openai_input": body}
    if rnd.random() < 0.2:
        job.update(draw(ENVELOPE_KNOBS))
    if rnd.random() < 0.03:
        job[draw(TEXT)] = draw(JUNK)
    return job


CHAT_NAMES = [n for n in SANE_SAMPLING if n not in ("max_tokens", "max_completion_tokens")]
COMPLETION_NAMES = [n for n in CHAT_NAMES if n != "top_logprobs"]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@st.composite
def valid_chat_inputs(draw) -> dict[str, Any]:
    """Chat requests meant to run: sane values (now and then one at an edge), 1-4 tokens."""
    rnd = draw(randoms())
    body: dict[str, Any] = {"messages": draw(SANE_MESSAGES)}
    body[rnd.choice(["max_tokens", "max_completion_tokens"])] = draw(small(1, 4))
    body.update(draw(sane_params(CHAT_NAMES, {"logprobs": st.booleans()})))
    if rnd.random() < 0.5:
        body["stream"] = True
        if rnd.random() < 0.5:
            body["stream_options"] = draw(SANE_OPENAI["stream_options"])
    if rnd.random() < 0.3:
        body["tools"] = [WEATHER]
        if rnd.random() < 0.7:
            body["tool_choice"] = draw(SANE_OPENAI["tool_choice"])
    for key, value in (
        ("model", st.just(SERVED)),
        ("echo", st.booleans()),
        ("add_generation_prompt", st.booleans()),
        ("continue_final_message", st.booleans()),
        ("chat_template", st.just(TEMPLATE)),
        ("chat_template_kwargs", st.fixed_dictionaries({"enable_thinking": st.booleans()})),
        ("documents", st.just([{"title": "t", "text": "a document"}])),
        ("user", SMALL_TEXT),
    ):
        if rnd.random() < 0.1:
            body[key] = draw(value)
    job = {"openai_route": draw(CHAT_ROUTES), "openai_input": body}
    job.update(_knobs(draw, rnd))
    return job


@st.composite
def valid_completion_inputs(draw) -> dict[str, Any]:
    """Completions meant to run: sane values (now and then one at an edge), 1-4 tokens."""
    rnd = draw(randoms())
    body: dict[str, Any] = {"prompt": draw(SANE_OPENAI["prompt"]), "max_tokens": draw(small(1, 4))}
    body.update(draw(sane_params(COMPLETION_NAMES, {})))
    if rnd.random() < 0.5:
        body["stream"] = True
        if rnd.random() < 0.5:
            body["stream_options"] = draw(SANE_OPENAI["stream_options"])
    for key, value in (
        ("model", st.just(SERVED)),
        ("echo", st.booleans()),
        ("suffix", st.just("")),
        ("user", SMALL_TEXT),
    ):
        if rnd.random() < 0.15:
            body[key] = draw(value)
    job = {"openai_route": draw(COMPLETION_ROUTES), "openai_input": body}
    job.update(_knobs(draw, rnd))
    return job


SERVED = "fuzz-model"
CHAT_ROUTES = st.sampled_from(
    [
        "/v1/chat/completions",
        "v1/chat/completions",
        "/openai/v1/chat/completions",
        "/chat/completions?x=1",
    ]
)
COMPLETION_ROUTES = st.sampled_from(["/v1/completions", "completions", "/openai/v1/completions/"])
RESPONSES_ROUTE_NAMES = ("/v1/responses", "responses", "/openai/v1/responses")
RESPONSES_ROUTES = st.sampled_from(RESPONSES_ROUTE_NAMES)
OTHER_ROUTES = st.one_of(
    st.sampled_from(
        [
            "/v1/models",
            f"/v1/models/{SERVED}",
            "/v1/models/nope",
            "/v1/models/",
            "/v1/models/%ZZ",
            "/v1/embeddings",
            "/v1/responses/resp_1",
            "",
            "/",
            "?",
        ]
    ),
    TEXT,
    JUNK,
)
CLOSE_AFTER = st.one_of(st.none(), st.none(), st.none(), st.integers(0, 2))

# -- checking what came back -----------------------------------------------------------------

INTERNAL = ("internal error", "generation failed")


def _no_nan(text: str) -> Any:
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in JSON output"))


def check_openai_error(item: Any) -> None:
    assert isinstance(item, dict) and set(item) == {"error"}, item
    error = item["error"]
    assert isinstance(error, dict), item
    assert {"message", "type", "param", "code"} <= set(error), item
    assert isinstance(error["message"], str) and error["message"], item
    assert isinstance(error["type"], str), item
    assert error["param"] is None or isinstance(error["param"], str), item
    assert error["code"] is None or isinstance(error["code"], (str, int)), item
    assert error["type"] not in ("server_error", "internal_error"), item
    assert 400 <= http_status(item) < 500, item
    # RunPod sends it as JSON: the status must survive the round trip.
    assert http_status(_no_nan(json.dumps(item))) == http_status(item), item


def _check_usage(usage: Any) -> None:
    assert isinstance(usage, dict), usage
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert isinstance(usage[key], int) and usage[key] >= 0, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage


def check_openai_response(item: dict) -> None:
    kind = item.get("object")
    if kind == "list":
        assert isinstance(item["data"], list), item
        assert all(card["object"] == "model" for card in item["data"]), item
        return
    if kind == "model":
        assert isinstance(item["id"], str), item
        return
    assert kind in ("chat.completion", "text_completion"), item
    assert isinstance(item["id"], str) and isinstance(item["model"], str), item
    assert isinstance(item["choices"], list) and item["choices"], item
    for choice in item["choices"]:
        assert isinstance(choice["index"], int), item
        assert choice["finish_reason"] in ("stop", "length", "tool_calls"), item
        if kind == "chat.completion":
            message = choice["message"]
            assert isinstance(message["role"], str), item
            assert message["content"] is None or isinstance(message["content"], str), item
            assert isinstance(message.get("tool_calls", []), list), item
        else:
            assert isinstance(choice["text"], str), item
    _check_usage(item["usage"])


def check_chunk(chunk: Any) -> None:
    assert isinstance(chunk, dict), chunk
    assert chunk["object"] in ("chat.completion.chunk", "text_completion"), chunk
    assert isinstance(chunk["choices"], list), chunk
    for choice in chunk["choices"]:
        assert isinstance(choice["index"], int), chunk
        assert choice["finish_reason"] in (None, "stop", "length", "tool_calls"), chunk
        if chunk["object"] == "chat.completion.chunk":
            assert isinstance(choice["delta"], dict), chunk
        else:
            assert isinstance(choice["text"], str), chunk
    if "usage" in chunk and chunk["usage"] is not None:
        _check_usage(chunk["usage"])


def check_openai_items(items: list[Any], complete: bool) -> None:
    assert items or not complete, "an OpenAI job yielded nothing"
    if not items:
        return
    *body, last = items
    if not any(isinstance(i, str) for i in items):  # one response or one error
        assert not body, items
        if isinstance(last, dict) and "error" in last:
            check_openai_error(last)
        else:
            check_openai_response(last)
        return
    # A stream: SSE strings, the last one ending in [DONE]; or an error after some strings.
    assert all(isinstance(i, str) for i in body), items
    strings = body if not isinstance(last, str) else items
    if not isinstance(last, str):
        check_openai_error(last)
    for n, text in enumerate(strings):
        events = text.split("\n\n")
        assert events[-1] == "", text
        for k, event in enumerate(events[:-1]):
            assert event.startswith("data: ") and "\n" not in event, text
            payload = event.removeprefix("data: ")
            if payload == "[DONE]":
                assert isinstance(last, str) and n == len(items) - 1, items
                assert k == len(events) - 2, text
                continue
            check_chunk(_no_nan(payload))
    if complete and isinstance(last, str):
        assert last.endswith("data: [DONE]\n\n"), last[-200:]


def check_responses_items(items: list[Any], complete: bool) -> None:
    """/v1/responses: one Response object or one error; streamed, SSE strings of `event:` and
    `data:` lines, numbered from 0, opened by response.created and closed (when the job ran to
    its end) by response.completed, response.incomplete or response.failed."""
    assert items or not complete, "a Responses job yielded nothing"
    if not items:
        return
    if not any(isinstance(i, str) for i in items):
        assert len(items) == 1, items
        (item,) = items
        if is_error(item):
            check_openai_error(item)
        else:
            check_response_object(item)
        return
    assert all(isinstance(i, str) for i in items), items
    events = []
    for text in items:
        blocks = text.split("\n\n")
        assert blocks[-1] == "", text
        for block in blocks[:-1]:
            head, data = block.split("\n")
            event = _no_nan(data.removeprefix("data: "))
            assert head == f"event: {event['type']}", block
            events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events))), events
    assert events[0]["type"] == "response.created", events[0]
    ends = ("response.completed", "response.incomplete", "response.failed")
    assert all(e["type"] not in ends for e in events[:-1]), events
    if complete:
        assert events[-1]["type"] in ends, events[-1]
        check_response_object(events[-1]["response"])
        assert events[-1]["type"] != "response.failed", events[-1]


def check_response_object(item: Any) -> None:
    assert isinstance(item, dict) and item["object"] == "response", item
    assert item["status"] in ("completed", "incomplete", "failed"), item
    assert isinstance(item["output"], list), item
    for out in item["output"]:
        assert out["type"] in ("message", "function_call", "reasoning"), out
        if out["type"] == "function_call":
            assert all(isinstance(out[k], str) for k in ("call_id", "name", "arguments")), out
        elif out["type"] == "message":
            assert all(isinstance(p["text"], str) for p in out["content"]), out
    usage = item["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"], usage
    assert 0 <= usage["output_tokens_details"]["reasoning_tokens"] <= usage["output_tokens"]


def check_native_items(items: list[Any], complete: bool) -> None:
    assert items or not complete, "a native job yielded nothing"
    for n, item in enumerate(items):
        assert isinstance(item, dict), item
        if "error" in item:
            assert set(item) == {"error"} and isinstance(item["error"], str), item
            assert item["error"], item
            assert not item["error"].startswith(INTERNAL), item
            assert n == len(items) - 1, items
            continue
        assert set(item) <= {"choices", "usage", "prompt_logprobs"}, item
        assert isinstance(item["choices"], list) and item["choices"], item
        for choice in item["choices"]:
            assert isinstance(choice["tokens"], list), item
            assert all(isinstance(t, str) for t in choice["tokens"]), item
            assert set(choice) <= {"tokens", "logprobs", "cumulative_logprob"}, item
        usage = item["usage"]
        assert set(usage) == {"input", "output"}, item
        assert all(isinstance(v, int) and v >= 0 for v in usage.values()), item
    json.dumps(items, allow_nan=False)


# -- the harness -----------------------------------------------------------------------------


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class Fuzz:
    """One worker on one event loop for a whole module; `check(input)` runs a job and checks
    the items, the logs, the engine loop and the KV blocks."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.loop = asyncio.new_event_loop()
        self.errors = _Errors()
        self.count = 0
        self.loop.run_until_complete(worker.start())

    def close(self) -> None:
        self.loop.run_until_complete(self.worker.shutdown())
        self.loop.close()

    async def _run(self, job: Any, close_after: int | None) -> tuple[list[Any], bool]:
        items: list[Any] = []
        async with aclosing(self.worker.handle(job)) as stream:
            async for item in stream:
                items.append(item)
                if close_after is not None and len(items) > close_after:
                    return items, False
        return items, True

    async def _run_all(self, jobs: tuple[tuple[Any, int | None], ...]) -> list:
        return await asyncio.gather(*(self._run(job, close_after) for job, close_after in jobs))

    async def _idle(self, timeout: float = 10.0) -> bool:
        core = self.worker.engine.core
        deadline = self.loop.time() + timeout
        while self.loop.time() < deadline:
            if core.block_pool.num_free == core.block_pool.num_blocks and not core.requests:
                return True
            await asyncio.sleep(0.002)
        return False

    def run(self, *jobs: tuple[Any, int | None]) -> list[tuple[list[Any], bool]]:
        """Runs `(job, close_after)` jobs at once: each one's items, and whether it ran to the
        end (or was closed after `close_after` + 1 items, as a client that goes away); then
        checks the logs, the engine loop and the KV blocks."""
        self.errors.records.clear()
        logger = logging.getLogger("serverless_llm")
        logger.addHandler(self.errors)
        try:
            results = self.loop.run_until_complete(asyncio.wait_for(self._run_all(jobs), 60))
            idle = self.loop.run_until_complete(self._idle())
        finally:
            logger.removeHandler(self.errors)
        engine = self.worker.engine
        logged = [r.getMessage() for r in self.errors.records]
        assert not logged, f"logged at ERROR: {logged}"
        assert idle, (
            f"KV blocks leaked: {engine.core.block_pool.num_free}/"
            f"{engine.core.block_pool.num_blocks} free, requests {list(engine.core.requests)}"
        )
        task = engine._loop_task
        assert task is None or not task.done(), "the engine loop died"
        assert not engine._closed and not engine.core.failed
        assert self.worker.active_jobs == 0
        return results

    def check(self, *inputs: tuple[Any, int | None]) -> list[list[Any]]:
        """Runs `(job input, close_after)` pairs at once as jobs and checks each one's items
        against its route's documented shapes."""
        jobs = []
        for job_input, close_after in inputs:
            self.count += 1
            jobs.append(({"id": f"fuzz-{self.count}", "input": job_input}, close_after))
        results = self.run(*jobs)
        for (job_input, _), (items, complete) in zip(inputs, results):
            route = job_input.get("openai_route") if isinstance(job_input, dict) else None
            if route in RESPONSES_ROUTE_NAMES:
                check_responses_items(items, complete)
            elif route is not None:
                check_openai_items(items, complete)
            else:
                check_native_items(items, complete)
        return [items for items, _ in results]


@pytest.fixture(scope="module")
def fuzz(tiny_llama, tmp_path_factory):
    env = {
        "MODEL_NAME": tiny_llama,
        "OPENAI_SERVED_MODEL_NAME_OVERRIDE": SERVED,
        "MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "NUM_GPU_BLOCKS_OVERRIDE": str(NUM_BLOCKS),
        "BASE_PATH": str(tmp_path_factory.mktemp("fuzz-base")),
        "DEVICE": "cpu",
        "ENABLE_AUTO_TOOL_CHOICE": "1",
        "TOOL_CALL_PARSER": "hermes",
    }
    # One torch thread for the engine built here (its step thread starts after this): the tiny
    # model gains nothing from two, and on a busy CI machine OpenMP's second thread made each
    # job ~15x slower (17 ms against 275 ms on 2 shared cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        harness = Fuzz(Worker(Settings.from_env(env)))
        yield harness
        harness.close()
    finally:
        torch.set_num_threads(threads)


# -- the properties --------------------------------------------------------------------------


@settings(FUZZ, max_examples=350)
@given(job=valid_native_inputs(), close_after=CLOSE_AFTER)
def test_fuzz_native_valid_jobs(fuzz, job, close_after):
    fuzz.check((job, close_after))


@settings(FUZZ, max_examples=400)
@given(job=native_inputs(), close_after=CLOSE_AFTER)
def test_fuzz_native_jobs(fuzz, job, close_after):
    fuzz.check((job, close_after))


@settings(FUZZ, max_examples=300)
@given(job=valid_chat_inputs(), close_after=CLOSE_AFTER)
def test_fuzz_chat_valid_requests(fuzz, job, close_after):
    fuzz.check((job, close_after))


@settings(FUZZ, max_examples=300)
@given(job=openai_inputs(CHAT_ROUTES, ChatCompletionRequest, "messages"), close_after=CLOSE_AFTER)
def test_fuzz_chat_completions(fuzz, job, close_after):
    fuzz.check((job, close_after))


@settings(FUZZ, max_examples=250)
@given(job=openai_inputs(RESPONSES_ROUTES, ResponsesRequest, "input"), close_after=CLOSE_AFTER)
def test_fuzz_responses(fuzz, job, close_after):
    fuzz.check((job, close_after))


@settings(FUZZ, max_examples=250)
@given(job=valid_completion_inputs(), close_after=CLOSE_AFTER)
def test_fuzz_completion_valid_requests(fuzz, job, close_after):
    fuzz.check((job, close_after))


@settings(FUZZ, max_examples=250)
@given(job=openai_inputs(COMPLETION_ROUTES, CompletionRequest, "prompt"), close_after=CLOSE_AFTER)
def test_fuzz_completions(fuzz, job, close_after):
    fuzz.check((job, close_after))


@settings(FUZZ, max_examples=300)
@given(
    job_input=st.one_of(
        openai_inputs(OTHER_ROUTES, CompletionRequest, "prompt"),
        JUNK,
        st.dictionaries(
            st.one_of(
                st.sampled_from(
                    [
                        "prompt",
                        "messages",
                        "sampling_params",
                        "stream",
                        "openai_route",
                        "openai_input",
                    ]
                ),
                TEXT,
            ),
            JUNK,
            max_size=4,
        ),
    ),
    job_id=st.one_of(st.none(), TEXT, INTS),  # RunPod's ids are strings
)
def test_fuzz_any_input(fuzz, job_input, job_id):
    [(items, complete)] = fuzz.run(({"id": job_id, "input": job_input}, None))
    if isinstance(job_input, dict) and job_input.get("openai_route") is not None:
        check_openai_items(items, complete)
    else:
        check_native_items(items, complete)


@settings(FUZZ, max_examples=150)
@given(
    jobs=st.lists(
        st.tuples(
            st.one_of(
                valid_native_inputs(),
                valid_chat_inputs(),
                valid_completion_inputs(),
                native_inputs(),
                openai_inputs(CHAT_ROUTES, ChatCompletionRequest, "messages"),
            ),
            CLOSE_AFTER,
        ),
        min_size=2,
        max_size=5,
    )
)
def test_fuzz_concurrent_jobs(fuzz, jobs):
    """Jobs of both routes at once on one engine (one batch: mixed sampling parameters,
    structured output, beams, prefix sharing, preemption), some abandoned part way."""
    fuzz.check(*jobs)


def test_worker_still_serves_after_fuzzing(fuzz):
    """The same worker, after every input above, still answers both routes."""
    [native, chat] = fuzz.check(
        ({"prompt": "Hello", "sampling_params": {"max_tokens": 3, "ignore_eos": True}}, None),
        (
            {
                "openai_route": "/v1/chat/completions",
                "openai_input": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            },
            None,
        ),
    )
    assert native[-1]["usage"]["output"] == 3
    assert chat[0]["object"] == "chat.completion"
    assert chat[0]["usage"]["completion_tokens"] >= 1

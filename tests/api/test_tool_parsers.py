"""Tool parsers on recorded model outputs: single and parallel calls, text before a call,
malformed calls (plain content, no crash); streaming in random-size pieces reassembles to what
`extract` finds, never leaking call markup into content. Plus the registry, plugins, and
`tools` / `tool_choice` (named and required calls constrained to the tools' schemas)."""

from __future__ import annotations

import json
import random
import re
import textwrap

import jsonschema
import pytest
import torch

from serverless_llm.api.openai.tool_parsers import (
    TOOL_PARSERS,
    NamedToolCallParser,
    RequiredToolCallParser,
    ToolChoice,
    ToolChoiceError,
    ToolParser,
    ToolParserError,
    get_tool_parser,
    load_tool_parser_plugin,
    merge_deltas,
    parser_for_tool_choice,
    resolve_tool_choice,
    tool_choice_spec,
    tool_parser_names,
    validate_tools,
)
from serverless_llm.engine.sampling.structured.bitmask import allocate_bitmask, apply_bitmask
from serverless_llm.engine.sampling.structured.grammar import GrammarCompiler
from tests.tiny_models import build_tokenizer

WEATHER = '{"city": "Paris", "unit": "celsius"}'
TIME = '{"timezone": "Europe/Paris"}'
NESTED = (
    '{"query": "say \\"hi\\" <tool_call> [TOOL_CALLS]", "filters": {"tags": ["a", "b"], "n": 3}}'
)

# (parser, recorded output, expected content, expected [(name, arguments)])
RECORDED: list[tuple[str, str, str | None, list[tuple[str, str]]]] = [
    # --- hermes (Hermes 2 Pro / Qwen 2.5 style)
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "get_time", "arguments": {TIME}}}\n</tool_call>',
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        "hermes",
        "I'll look that up for you.\n\n"
        f'<tool_call>\n{{"arguments": {NESTED}, "name": "search"}}\n</tool_call>',
        "I'll look that up for you.",
        [("search", NESTED)],
    ),
    (
        "hermes",  # no closing tag at the very end: still a call
        f'<tool_call>\n{{"name": "get_time", "arguments": {TIME}}}',
        None,
        [("get_time", TIME)],
    ),
    (
        "hermes",  # arguments as a JSON string holding JSON
        '<tool_call>{"name": "get_time", "arguments": "{\\"timezone\\": \\"UTC\\"}"}</tool_call>',
        None,
        [("get_time", '{"timezone": "UTC"}')],
    ),
    (
        "hermes",
        "The weather in Paris is 18°C. Anything else?\n",
        "The weather in Paris is 18°C. Anything else?\n",
        [],
    ),
    # --- mistral
    (
        "mistral",
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}]',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "mistral",
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
        f'{{"name": "get_time", "arguments": {TIME}}}]',
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        "mistral",
        f'Checking both.[TOOL_CALLS][{{"name": "get_time", "arguments": {TIME}}}]',
        "Checking both.",
        [("get_time", TIME)],
    ),
    (
        "mistral",  # newer tokenizers: name[ARGS]{...}, one marker per call
        f"[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]get_time[ARGS]{TIME}",
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    # --- llama3_json
    (
        "llama3_json",
        f'{{"name": "get_weather", "parameters": {WEATHER}}}',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "llama3_json",
        f'{{"name": "get_weather", "parameters": {WEATHER}}}; '
        f'{{"name": "get_time", "parameters": {TIME}}}',
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        "llama3_json",
        f'Let me check the time.<|python_tag|>{{"name": "get_time", "parameters": {TIME}}}',
        "Let me check the time.",
        [("get_time", TIME)],
    ),
    (
        "llama3_json",  # JSON that is not a call (no parameters) is content
        '{"name": "Alice", "age": 30}',
        '{"name": "Alice", "age": 30}',
        [],
    ),
    # --- internlm
    (
        "internlm",
        f'<|action_start|><|plugin|>\n{{"name": "get_weather", "parameters": {WEATHER}}}'
        "<|action_end|>",
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "internlm",
        "I need the current time first."
        f'<|action_start|><|plugin|>{{"name": "get_time", "parameters": {TIME}}}<|action_end|>',
        "I need the current time first.",
        [("get_time", TIME)],
    ),
    # --- jamba
    (
        "jamba",
        f'<tool_calls>[{{"name": "get_weather", "arguments": {WEATHER}}}]</tool_calls>',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "jamba",
        f'Sure.\n<tool_calls>[{{"name": "get_weather", "arguments": {WEATHER}}}, '
        f'{{"name": "get_time", "arguments": {TIME}}}]</tool_calls>',
        "Sure.",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
]

# Malformed calls: returned as plain content, whole.
MALFORMED: list[tuple[str, str]] = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>'),
    ("hermes", 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": "Par'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}} oops</tool_call>'),
    ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
    ("mistral", "[TOOL_CALLS] get the weather please"),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": [1, 2]}]'),
    ("mistral", '[TOOL_CALLS] ["get_weather"]'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"'),
    ("llama3_json", "{not json at all}"),
    ("internlm", '<|action_start|><|plugin|>{"name": "x", "parameters": {}}<|action_start|>'),
    ("jamba", '<tool_calls>{"name": "get_weather", "arguments": {}}</tool_calls>'),
    ("jamba", "<tool_calls>[]</tool_calls>"),
]

MARKUP = re.compile(
    r"<tool_call>|</tool_call>|\[TOOL_CALLS\]|\[ARGS\]|<\|python_tag\|>|<\|action_start\|>|"
    r"<\|plugin\|>|<\|action_end\|>|<tool_calls>|</tool_calls>|\"parameters\"|\"arguments\""
)


def stream(parser: ToolParser, text: str, rng: random.Random) -> tuple[list[dict], list[str]]:
    """Feeds `text` in random pieces (1-12 chars, some empty); returns the deltas and the
    content sent after each piece."""
    deltas: list[dict] = []
    progress: list[str] = []
    i = 0
    while i < len(text):
        k = rng.choice([0, 1, 1, 2, 3, 5, 8, 12])
        deltas += parser.feed(text[i : i + k])
        i += k
        progress.append("".join(d.get("content", "") for d in deltas))
    deltas += parser.finish()
    return deltas, progress


def reassemble(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]], list[str]]:
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for piece in d.get("tool_calls", []):
            entry = calls.get(piece["index"])
            if entry is None:
                assert piece["type"] == "function" and piece["id"] and piece["function"]["name"]
                entry = calls[piece["index"]] = {"id": piece["id"], "name": "", "args": ""}
            else:
                assert "id" not in piece and "name" not in piece["function"]
            entry["name"] += piece["function"].get("name", "")
            entry["args"] += piece["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))  # indexes from 0, no gaps
    ordered = [calls[i] for i in sorted(calls)]
    return content or None, [(c["name"], c["args"]) for c in ordered], [c["id"] for c in ordered]


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
def test_extract_recorded_outputs(name, text, content, calls):
    result = get_tool_parser(name)().extract(text)
    assert result.content == content
    assert [(c.name, c.arguments) for c in result.tool_calls] == calls
    assert result.tools_called == bool(calls)
    for call in result.tool_calls:
        json.loads(call.arguments)
        openai = call.to_openai()
        assert openai["type"] == "function" and openai["function"]["name"] == call.name
    ids = [c.id for c in result.tool_calls]
    assert len(set(ids)) == len(ids)
    if name == "mistral":
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    else:
        assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
def test_streaming_reassembles_to_extract(name, text, content, calls):
    parser_cls = get_tool_parser(name)
    for seed in range(60):
        parser = parser_cls()
        deltas, progress = stream(parser, text, random.Random(seed))
        got_content, got_calls, ids = reassemble(deltas)
        assert got_content == content, seed
        assert got_calls == calls, seed
        assert parser.tools_called == bool(calls)
        assert len(set(ids)) == len(ids)
        # Content only grows by text that stays content: each step's is a prefix of the last.
        final = content or ""
        assert all(final.startswith(p) for p in progress), seed
        if calls:
            assert not MARKUP.search(final), final


@pytest.mark.parametrize(("name", "text"), MALFORMED)
def test_malformed_calls_are_plain_content(name, text):
    result = get_tool_parser(name)().extract(text)
    assert result.tool_calls == []
    assert result.content == text
    # Streaming does not crash, and ends with the same text as content where no call was sent.
    for seed in range(20):
        parser = get_tool_parser(name)()
        deltas, _ = stream(parser, text, random.Random(seed))
        got_content, got_calls, _ = reassemble(deltas)
        if not got_calls:
            assert got_content == text


def test_streaming_holds_marker_prefixes_and_trailing_whitespace():
    parser = get_tool_parser("hermes")()
    assert parser.feed("Let me check. <tool") == [{"content": "Let me check."}]
    assert parser.feed("_ca") == []
    out = parser.feed('ll>{"name": "get_time", "arguments": {"tz"')
    assert out == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": out[0]["tool_calls"][0]["id"],
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"tz"'},
                }
            ]
        }
    ]
    assert parser.feed(': "UTC"}}') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ': "UTC"}'}}]}
    ]
    assert parser.feed("</tool_call>\n") == []
    assert parser.finish() == []
    assert parser.tools_called
    # A held "<" that turns out to be text is sent.
    plain = get_tool_parser("hermes")()
    assert plain.feed("a <") == [{"content": "a"}]
    assert plain.feed("b> c ") == [{"content": " <b> c"}]
    assert plain.finish() == [{"content": " "}]


def test_merge_deltas_gives_one_chunk():
    parser = get_tool_parser("hermes")()
    deltas = parser.feed(
        'Hi <tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", '
        '"arguments": {"x": 1'
    )
    merged = merge_deltas(deltas)
    assert merged["content"] == "Hi"
    assert [c["function"]["name"] for c in merged["tool_calls"]] == ["a", "b"]
    assert merged["tool_calls"][1]["function"]["arguments"] == '{"x": 1'
    later = merge_deltas(parser.feed("}}</tool_call>"))
    assert later == {"tool_calls": [{"index": 1, "function": {"arguments": "}"}}]}
    assert merge_deltas([]) is None


# ---------------------------------------------------------------------------------------------
# Registry and plugins
# ---------------------------------------------------------------------------------------------


def test_registry_has_the_builtin_parsers():
    assert {"hermes", "mistral", "llama3_json", "internlm", "jamba"} <= set(tool_parser_names())
    for name in ("hermes", "mistral", "llama3_json", "internlm", "jamba"):
        assert TOOL_PARSERS[name].needs_special_tokens
    with pytest.raises(ToolParserError, match="unknown tool call parser 'nope'.*hermes"):
        get_tool_parser("nope")


def test_plugin_registers_with_the_decorator(tmp_path):
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        textwrap.dedent(
            """
            from serverless_llm.api.openai.tool_parsers import (
                ExtractedToolCalls, ToolCall, ToolParser, register_tool_parser,
            )

            @register_tool_parser("pipe_calls")
            class PipeParser(ToolParser):
                '''CALL name|{json} lines; only extract: the base class streams it.'''

                def extract(self, text):
                    calls, content = [], []
                    for line in text.splitlines():
                        if line.startswith("CALL "):
                            name, _, args = line[5:].partition("|")
                            calls.append(ToolCall(self.new_call_id(), name, args))
                        else:
                            content.append(line)
                    return ExtractedToolCalls("\\n".join(content) or None, calls)
            """
        )
    )
    try:
        assert load_tool_parser_plugin(str(plugin)) == ["pipe_calls"]
        parser_cls = get_tool_parser("pipe_calls")
        text = 'Hello\nCALL f|{"a": 1}\nCALL g|{}'
        result = parser_cls().extract(text)
        assert result.content == "Hello"
        assert [(c.name, c.arguments) for c in result.tool_calls] == [
            ("f", '{"a": 1}'),
            ("g", "{}"),
        ]
        parser = parser_cls()
        deltas, progress = stream(parser, text, random.Random(0))
        assert all(p == "" for p in progress)  # held until the end: nothing leaks early
        assert reassemble(deltas)[:2] == (result.content, [("f", '{"a": 1}'), ("g", "{}")])
        assert parser.tools_called
    finally:
        TOOL_PARSERS.pop("pipe_calls", None)


def test_plugin_registers_with_a_dict_and_may_subclass_a_builtin(tmp_path):
    plugin = tmp_path / "qwen_like.py"
    plugin.write_text(
        textwrap.dedent(
            """
            from serverless_llm.api.openai.tool_parsers import HermesToolParser

            class FunctionTagParser(HermesToolParser):
                markers = ("<function_call>",)
                end_marker = "</function_call>"

            TOOL_PARSERS = {"function_tag": FunctionTagParser}
            """
        )
    )
    try:
        assert load_tool_parser_plugin(plugin) == ["function_tag"]
        text = f'Ok.<function_call>{{"name": "f", "arguments": {WEATHER}}}</function_call>'
        result = get_tool_parser("function_tag")().extract(text)
        assert result.content == "Ok." and result.tool_calls[0].arguments == WEATHER
        deltas, _ = stream(get_tool_parser("function_tag")(), text, random.Random(1))
        assert reassemble(deltas)[:2] == ("Ok.", [("f", WEATHER)])
    finally:
        TOOL_PARSERS.pop("function_tag", None)


def test_bad_plugins_are_clear_errors(tmp_path):
    with pytest.raises(ToolParserError, match="no such file"):
        load_tool_parser_plugin(tmp_path / "missing.py")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ToolParserError, match="RuntimeError: boom"):
        load_tool_parser_plugin(broken)
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n")
    with pytest.raises(ToolParserError, match="registers no tool parser"):
        load_tool_parser_plugin(empty)


# ---------------------------------------------------------------------------------------------
# tools / tool_choice
# ---------------------------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"offset": {"type": "integer", "minimum": -12, "maximum": 14}},
                "required": ["offset"],
            },
        },
    },
    {"type": "function", "function": {"name": "ping"}},  # no parameters
]


def test_validate_tools_and_resolve_tool_choice():
    tools = validate_tools(TOOLS)
    assert resolve_tool_choice(tools, None, auto_enabled=True) == ToolChoice("auto")
    assert resolve_tool_choice(tools, None, auto_enabled=False) == ToolChoice("none")
    assert resolve_tool_choice([], None, auto_enabled=True) == ToolChoice("none")
    assert resolve_tool_choice(tools, "none", auto_enabled=False) == ToolChoice("none")
    assert resolve_tool_choice(tools, "required", auto_enabled=False) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "get_time"}}
    assert resolve_tool_choice(tools, named, auto_enabled=False) == ToolChoice("named", "get_time")
    bad_choices = [
        ("auto", "ENABLE_AUTO_TOOL_CHOICE"),
        ({"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ({"type": "function"}, "named tool choice"),
        ("sometimes", "tool_choice must be"),
    ]
    for choice, message in bad_choices:
        with pytest.raises(ToolChoiceError, match=message) as err:
            resolve_tool_choice(tools, choice, auto_enabled=False)
        assert err.value.param == "tool_choice"
    with pytest.raises(ToolChoiceError, match="needs tools"):
        resolve_tool_choice([], "required", auto_enabled=True)
    bad_tools = [
        "x",
        [{"type": "retrieval"}],
        [{"type": "function", "function": {"name": "bad name!"}}],
        [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
        [{"type": "function", "function": {"name": "f"}}] * 2,
    ]
    for tools_value in bad_tools:
        with pytest.raises(ToolChoiceError) as err:
            validate_tools(tools_value)
        assert err.value.param == "tools"


def test_parser_for_tool_choice():
    tools = validate_tools(TOOLS)
    assert parser_for_tool_choice(ToolChoice("none"), get_tool_parser("hermes"), tools) is None
    assert parser_for_tool_choice(ToolChoice("auto"), None, tools) is None
    auto = parser_for_tool_choice(ToolChoice("auto"), get_tool_parser("hermes"), tools)
    assert auto.name == "hermes" and auto.tools == tools
    assert isinstance(
        parser_for_tool_choice(ToolChoice("named", "f"), None, tools), NamedToolCallParser
    )
    assert isinstance(
        parser_for_tool_choice(ToolChoice("required"), None, tools), RequiredToolCallParser
    )


@pytest.fixture(scope="module")
def compiler():
    comp = GrammarCompiler(build_tokenizer(), vocab_size=384, stop_token_ids=[2])
    yield comp
    comp.close()


def _constrained_text(compiler, spec, seed: int) -> str:
    tokenizer = compiler._tokenizer
    matcher = compiler.compile(spec).matcher()
    bitmask = allocate_bitmask(1, 384)
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for _ in range(600):
        matcher.fill_bitmask(bitmask, 0)
        logits = torch.randn(1, 384, generator=gen) * 3
        apply_bitmask(logits, bitmask)
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen))
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            return tokenizer.decode(ids)
        ids.append(token)
    raise AssertionError("no end")


@pytest.mark.parametrize("function", ["get_weather", "get_time", "ping"])
def test_named_tool_choice_constrains_to_the_parameters(compiler, function):
    tools = validate_tools(TOOLS)
    choice = resolve_tool_choice(
        tools, {"type": "function", "function": {"name": function}}, auto_enabled=False
    )
    spec = tool_choice_spec(tools, choice)
    assert spec.param == "tool_choice"
    schema = next(t for t in tools if t["function"]["name"] == function)["function"].get(
        "parameters", {"type": "object"}
    )
    for seed in range(20):
        text = _constrained_text(compiler, spec, seed)
        parser = parser_for_tool_choice(choice, None, tools)
        (call,) = parser.extract(text).tool_calls
        assert call.name == function
        jsonschema.validate(json.loads(call.arguments), schema)
        streamed = parser_for_tool_choice(choice, None, tools)
        deltas, _ = stream(streamed, text, random.Random(seed))
        assert reassemble(deltas)[:2] == (None, [(function, call.arguments)])


def test_required_tool_choice_gives_valid_calls(compiler):
    tools = validate_tools(TOOLS)
    choice = resolve_tool_choice(tools, "required", auto_enabled=False)
    spec = tool_choice_spec(tools, choice)
    schemas = {
        t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in tools
    }
    seen = set()
    for seed in range(30):
        text = _constrained_text(compiler, spec, seed)
        result = parser_for_tool_choice(choice, None, tools).extract(text)
        assert result.content is None and result.tool_calls, text
        for call in result.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            seen.add(call.name)
        deltas, _ = stream(parser_for_tool_choice(choice, None, tools), text, random.Random(seed))
        assert reassemble(deltas)[:2] == (None, [(c.name, c.arguments) for c in result.tool_calls])
    assert len(seen) >= 2
    assert tool_choice_spec(tools, ToolChoice("auto")) is None


FUZZ_PIECES = [
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
    "<|action_start|><|plugin|>",
    "<|action_end|>",
    "<tool_calls>",
    "</tool_calls>",
    *'{}[]":,; \n\\x1',
    '"name"',
    '"arguments"',
    '"parameters"',
]


def test_mutated_outputs_never_crash_and_stream_like_extract():
    """Recorded outputs with random edits (deletions, stray markup, truncation): no exception;
    streaming gives extract's content and calls, except that calls sent before their JSON broke
    stay in the stream (the documented limit: a broken list of calls is content for extract,
    while the stream had sent its first calls)."""
    rng = random.Random(1234)
    cases = [(r[0], r[1]) for r in RECORDED] + MALFORMED
    for it in range(1500):
        name, text = rng.choice(cases)
        chars = list(text)
        for _ in range(rng.randint(0, 3)):
            pos = rng.randint(0, len(chars))
            op = rng.random()
            if op < 0.4 and chars:
                del chars[min(pos, len(chars) - 1)]
            elif op < 0.8:
                chars.insert(pos, rng.choice(FUZZ_PIECES))
            else:
                chars = chars[:pos]
        text = "".join(chars)
        parser_cls = get_tool_parser(name)
        result = parser_cls().extract(text)
        expected = [(c.name, c.arguments) for c in result.tool_calls]
        deltas, progress = stream(parser_cls(), text, random.Random(it))
        content, calls, _ = reassemble(deltas)
        assert content == result.content, (name, text)
        assert calls[: len(expected)] == expected, (name, text)
        assert all((content or "").startswith(p) for p in progress), (name, text)


def test_the_parser_is_read_from_the_chat_template():
    from serverless_llm.api.openai.tool_parsers import detect_tool_parser

    cases = {
        "{% for t in tools %}{{ t }}{% endfor %}<tool_call>{...}</tool_call>": "hermes",
        "[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS] ... [TOOL_CALLS]": "mistral",
        "Environment: ipython\n{% if x %}<|python_tag|>{% endif %}": "llama3_json",
        "<|action_start|><|plugin|>\n{{ call }}<|action_end|>": "internlm",
        "{% for m in messages %}{{ m.content }}{% endfor %}": None,
        "": None,
        None: None,
    }
    for template, parser in cases.items():
        assert detect_tool_parser(template) == parser, template


def _item_ends(text: str) -> list[int]:
    """Where each element of the JSON array `text` ends (by the json module, not our parser)."""
    decoder, ends = json.JSONDecoder(), []
    i = text.index("[") + 1
    while True:
        while text[i] in " \n\t,":
            i += 1
        if text[i] == "]":
            return ends
        _, i = decoder.raw_decode(text, i)
        ends.append(i)


def test_a_cut_required_list_keeps_its_complete_calls(compiler):
    """Issue 15: with `tool_choice: "required"` a list cut off by max_tokens keeps the calls
    whose JSON closed, drops the cut one, and never turns the JSON into content, streamed or
    not."""
    tools = validate_tools(TOOLS)
    choice = resolve_tool_choice(tools, "required", auto_enabled=False)
    spec = tool_choice_spec(tools, choice)
    checked = 0
    for seed in range(40):
        text = _constrained_text(compiler, spec, seed)
        whole = parser_for_tool_choice(choice, None, tools).extract(text).tool_calls
        for cut in sorted({len(text) // 3, len(text) // 2, len(text) - 1}):
            prefix = text[:cut]
            result = parser_for_tool_choice(choice, None, tools).extract(prefix)
            assert result.content is None, prefix
            got = [(c.name, c.arguments) for c in result.tool_calls]
            # Exactly the calls whose object closed within the prefix, in order.
            assert got == [(c.name, c.arguments) for c in whole][: len(got)], prefix
            assert len(got) == sum(end <= cut for end in _item_ends(text)), (prefix, got)
            deltas, _ = stream(
                parser_for_tool_choice(choice, None, tools), prefix, random.Random(0)
            )
            content, streamed, _ = reassemble(deltas)
            assert content is None, prefix  # never the JSON again as content
            assert streamed[: len(got)] == got
            checked += 1
    assert checked >= 80


def test_parallel_tool_calls_false_makes_required_exactly_one_call(compiler):
    tools = validate_tools(TOOLS)
    choice = resolve_tool_choice(tools, "required", auto_enabled=False)
    assert "maxItems" not in json.loads(tool_choice_spec(tools, choice).json)
    spec = tool_choice_spec(tools, choice, parallel=False)
    schema = json.loads(spec.json)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    for seed in range(20):
        text = _constrained_text(compiler, spec, seed)
        assert len(parser_for_tool_choice(choice, None, tools).extract(text).tool_calls) == 1

"""Issue 38 item 10: tool-call and reasoning parsers for today's families (qwen3_coder, pythonic,
granite, deepseek_v3, deepseek_v31, kimi_k2, glm45; reasoning granite, glm45, deepseek_v3).

Outputs are written from each family's published chat template and examples. Each family has
a minimal chat template here with its template's markers: the parser is detected from it, and
an assistant turn with tool calls rendered by it (through transformers' template engine) is
read back by that parser to the same calls. Every output is parsed whole and streamed in random
small pieces, giving the same content and calls; malformed calls are content."""

from __future__ import annotations

import json
import random
import re

import pytest

from serverless_llm.api.openai.reasoning import REASONING_PARSERS, detect_reasoning_parser
from serverless_llm.api.openai.tool_parsers import detect_tool_parser, get_tool_parser
from tests.api.conftest import collect, parse_sse
from tests.api.test_tool_parsers import reassemble, stream
from tests.tiny_models import build_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "ratio": {"type": "number"},
                    "zip": {"type": "string"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "where": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]

DS = {
    "B": "<｜tool▁calls▁begin｜>",
    "E": "<｜tool▁calls▁end｜>",
    "b": "<｜tool▁call▁begin｜>",
    "e": "<｜tool▁call▁end｜>",
    "s": "<｜tool▁sep｜>",
}
W = '{"city": "Paris"}'
W_RAW = '{"city": "Paris", "where": {"lat": 48.8, "tags": ["a", "}"]}}'

# (parser, output, content, [(name, arguments)])
RECORDED: list[tuple[str, str, str | None, list[tuple[str, str]]]] = [
    # --- qwen3_coder: Qwen3-Coder's template example, values typed by the schema
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        None,
        [("get_weather", '{"city": "Paris", "days": 3}')],
    ),
    (
        "qwen3_coder",
        "I will check both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        "New York\nCity\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
        "<parameter=ratio>\n0.5\n</parameter>\n<parameter=zip>\n01234\n</parameter>\n"
        '<parameter=tags>\n["a", "b"]\n</parameter>\n<parameter=where>\n{"x": 1}\n'
        "</parameter>\n<parameter=note>\nnull\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "I will check both.",
        [
            (
                "get_weather",
                '{"city": "New York\\nCity", "metric": true, "ratio": 0.5, "zip": "01234", '
                '"tags": ["a", "b"], "where": {"x": 1}, "note": null}',
            ),
            ("get_time", "{}"),
        ],
    ),
    (
        "qwen3_coder",  # a parameter not in the schema stays text; no </parameter>: next one
        "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n<parameter=x>\n42\n"
        "</parameter>\n</function>\n</tool_call>",
        None,
        [("get_weather", '{"days": "three", "x": "42"}')],
    ),
    (
        "qwen3_coder",  # cut off after </function>: still a call
        "<tool_call>\n<function=get_time>\n</function>",
        None,
        [("get_time", "{}")],
    ),
    # --- glm45: GLM-4.5's template form
    (
        "glm45",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
        None,
        [("get_weather", '{"city": "Beijing", "days": 2}')],
    ),
    (
        "glm45",
        "Let me look.\n<tool_call>get_weather\n<arg_key>tags</arg_key>\n"
        '<arg_value>["x"]</arg_value>\n<arg_key>extra</arg_key>\n<arg_value>{"k": [1, 2]}'
        "</arg_value>\n<arg_key>zip</arg_key>\n<arg_value>007</arg_value>\n</tool_call>\n"
        "<tool_call>get_time\n</tool_call>",
        "Let me look.",
        [
            ("get_weather", '{"tags": ["x"], "extra": {"k": [1, 2]}, "zip": "007"}'),
            ("get_time", "{}"),
        ],
    ),
    # --- deepseek_v3: V3-0324 / R1 form, several calls
    (
        "deepseek_v3",
        f"{DS['B']}{DS['b']}function{DS['s']}get_weather\n```json\n{W_RAW}\n```{DS['e']}\n"
        f"{DS['b']}function{DS['s']}get_time\n```json\n{{}}\n```{DS['e']}{DS['E']}",
        None,
        [("get_weather", W_RAW), ("get_time", "{}")],
    ),
    (
        "deepseek_v3",
        f"Sure, checking.{DS['B']}{DS['b']}function{DS['s']}get_weather\n```json\n{W}\n```"
        f"{DS['e']}{DS['E']}",
        "Sure, checking.",
        [("get_weather", W)],
    ),
    # --- deepseek_v31: V3.1 form
    (
        "deepseek_v31",
        f"{DS['B']}{DS['b']}get_weather{DS['s']}{W_RAW}{DS['e']}{DS['b']}get_time{DS['s']}{{}}"
        f"{DS['e']}{DS['E']}",
        None,
        [("get_weather", W_RAW), ("get_time", "{}")],
    ),
    (
        "deepseek_v31",
        f"Checking.\n\n{DS['B']}{DS['b']}get_weather{DS['s']}{W}{DS['e']}",  # no calls end
        "Checking.",
        [("get_weather", W)],
    ),
    # --- kimi_k2
    (
        "kimi_k2",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        f"<|tool_call_argument_begin|>{W_RAW}<|tool_call_end|><|tool_call_begin|>"
        "functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>",
        None,
        [("get_weather", W_RAW), ("get_time", "{}")],
    ),
    (
        "kimi_k2",
        "I'll check. <|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_weather:0 "
        f"<|tool_call_argument_begin|> {W} <|tool_call_end|>\n<|tool_calls_section_end|>",
        "I'll check.",
        [("get_weather", W)],
    ),
    # --- granite
    (
        "granite",
        f'<|tool_call|>[{{"name": "get_weather", "arguments": {W_RAW}}}, '
        '{"name": "get_time", "arguments": {}}]',
        None,
        [("get_weather", W_RAW), ("get_time", "{}")],
    ),
    (
        "granite",
        f'[{{"name": "get_weather", "arguments": {W}}}]',  # a bare list opening the output
        None,
        [("get_weather", W)],
    ),
    (
        "granite",
        f'Let me see.<tool_call>[{{"name": "get_weather", "arguments": {W}}}]',
        "Let me see.",
        [("get_weather", W)],
    ),
    # --- pythonic: Llama 3.2's pythonic form and Llama 4's python tags
    (
        "pythonic",
        '[get_weather(city="San Francisco", days=3, metric=True), get_time()]',
        None,
        [
            ("get_weather", '{"city": "San Francisco", "days": 3, "metric": true}'),
            ("get_time", "{}"),
        ],
    ),
    (
        "pythonic",
        "[get_weather(city='a, b) [c]', where={'lat': -1.5, 'ok': None}, tags=('x',), "
        'note="""long\nnote"""), get_time(zone=null, metric=false)]',
        None,
        [
            (
                "get_weather",
                '{"city": "a, b) [c]", "where": {"lat": -1.5, "ok": null}, "tags": ["x"], '
                '"note": "long\\nnote"}',
            ),
            ("get_time", '{"zone": null, "metric": false}'),
        ],
    ),
    (
        "pythonic",
        'Let me check.<|python_start|>[get_weather(city="Paris")]<|python_end|>',
        "Let me check.",
        [("get_weather", W)],
    ),
    # --- no calls at all: plain content for every parser
    *[
        (name, "The weather is fine, no tools needed.", "The weather is fine, no tools needed.", [])
        for name in (
            "qwen3_coder",
            "glm45",
            "deepseek_v3",
            "deepseek_v31",
            "kimi_k2",
            "granite",
            "pythonic",
        )
    ],
]

MALFORMED: list[tuple[str, str]] = [
    ("qwen3_coder", "<tool_call>\n<function=get_weather\n<parameter=city>\nParis"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis"),  # cut
    ("qwen3_coder", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    ("qwen3_coder", "<tool_call>\n<function=get time>\n</function>\n</tool_call>"),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>"),
    ("glm45", '<tool_call>{"name": "get_time"}</tool_call>'),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Par"),
    ("deepseek_v3", f"{DS['B']}{DS['b']}function{DS['s']}get_weather\n{W}{DS['e']}{DS['E']}"),
    ("deepseek_v3", f'{DS["B"]}{DS["b"]}function{DS["s"]}get_weather\n```json\n{{"a": '),
    ("deepseek_v31", f"{DS['B']}{DS['b']}get_weather{DS['s']}[1, 2]{DS['e']}{DS['E']}"),
    ("deepseek_v31", f"{DS['B']}{DS['E']}"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0{}<|tool_call_end|>"),
    ("kimi_k2", "<|tool_calls_section_begin|>hello<|tool_calls_section_end|>"),
    ("granite", "[1, 2, 3] are numbers"),
    ("granite", '<|tool_call|>[{"arguments": {}}]'),
    ("pythonic", "[Note] this is a list"),
    ("pythonic", "[get_weather('Paris')]"),  # positional
    ("pythonic", "[get_weather(city=os.system('x'))]"),  # not a literal
    ("pythonic", "[get_weather(city='Paris')"),  # never closed
    ("pythonic", "[get_weather(city='Paris')] and more"),
    ("pythonic", "[]"),
]

MARKUP = re.compile(
    r"<tool_call>|</tool_call>|<function=|<parameter=|<arg_key>|<arg_value>|｜tool▁|"
    r"<\|tool_call|<\|tool_calls_section|<\|python_start\|>|get_weather\("
)


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
def test_whole_and_streamed_agree(name, text, content, calls):
    result = get_tool_parser(name)(TOOLS).extract(text)
    assert result.content == content
    assert [(c.name, c.arguments) for c in result.tool_calls] == calls
    for call in result.tool_calls:
        json.loads(call.arguments)
    if name == "kimi_k2":
        assert [c.id for c in result.tool_calls] == [
            f"functions.{n}:{i}" for i, (n, _) in enumerate(calls)
        ]
    else:
        assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id) for c in result.tool_calls)
    parser_cls = get_tool_parser(name)
    for seed in range(40):
        parser = parser_cls(TOOLS)
        deltas, progress = stream(parser, text, random.Random(seed))
        got_content, got_calls, _ = reassemble(deltas)
        assert (got_content, got_calls) == (content, calls), seed
        assert parser.tools_called == bool(calls)
        assert all((content or "").startswith(p) for p in progress), seed
        if calls:
            assert not MARKUP.search(content or ""), content
    # In one piece too.
    parser = parser_cls(TOOLS)
    got_content, got_calls, _ = reassemble(parser.feed(text) + parser.finish())
    assert (got_content, got_calls) == (content, calls)


def test_arguments_stream_as_they_come():
    """The JSON forms send the arguments' text as it arrives; the XML forms each parameter."""
    kimi = get_tool_parser("kimi_k2")()
    head = "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    assert kimi.feed(head) == []
    (first,) = kimi.feed('<|tool_call_argument_begin|>{"city": "Pa')
    assert first["tool_calls"][0]["id"] == "functions.get_weather:0"
    assert first["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Pa',
    }
    assert kimi.feed('ris"}') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}
    ]
    coder = get_tool_parser("qwen3_coder")(TOOLS)
    assert coder.feed("<tool_call>\n<function=get_weather>\n<parameter=days>\n1") != []
    assert coder.feed("2\n</parameter>\n") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"days": 12'}}]}
    ]
    assert coder.feed("</function>") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}
    ]
    # A text value streams as it is written, less what may be its end.
    coder = get_tool_parser("qwen3_coder")(TOOLS)
    coder.feed("<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n")
    sent = []
    for piece in ["<parameter=city>", "\n", 'Pa"', "ris\n", "</para", "meter>\n</function>"]:
        sent.append(
            "".join(p["function"]["arguments"] for d in coder.feed(piece) for p in d["tool_calls"])
        )
    assert sent == ["", ', "city": "', 'Pa\\"', "ris", "", '"}']


def test_untyped_values_without_a_schema():
    """No tools given: Qwen3-Coder's values stay text, GLM's read as JSON where they are."""
    coder = get_tool_parser("qwen3_coder")().extract(
        "<tool_call>\n<function=f>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>"
    )
    assert coder.tool_calls[0].arguments == '{"n": "5"}'
    glm = get_tool_parser("glm45")().extract(
        "<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>5</arg_value>\n<arg_key>s</arg_key>\n"
        "<arg_value>five</arg_value>\n</tool_call>"
    )
    assert glm.tool_calls[0].arguments == '{"n": 5, "s": "five"}'


@pytest.mark.parametrize(("name", "text"), MALFORMED)
def test_malformed_calls_are_content(name, text):
    result = get_tool_parser(name)(TOOLS).extract(text)
    assert result.tool_calls == [] and result.content == text
    for seed in range(20):
        deltas, _ = stream(get_tool_parser(name)(TOOLS), text, random.Random(seed))
        got_content, got_calls, _ = reassemble(deltas)
        if not got_calls:
            assert got_content == text, seed


FUZZ = ["<", ">", "\n", '"', "'", "{", "}", "[", "]", "(", ")", ",", "=", "`", "｜", "|", "x"]


def test_mutated_outputs_never_crash_and_stream_like_extract():
    rng = random.Random(38)
    cases = [(r[0], r[1]) for r in RECORDED] + MALFORMED
    for it in range(1500):
        name, text = rng.choice(cases)
        chars = list(text)
        for _ in range(rng.randint(1, 3)):
            pos = rng.randint(0, len(chars))
            op = rng.random()
            if op < 0.4 and chars:
                del chars[min(pos, len(chars) - 1)]
            elif op < 0.8:
                chars.insert(pos, rng.choice(FUZZ))
            else:
                chars = chars[:pos]
        text = "".join(chars)
        parser_cls = get_tool_parser(name)
        result = parser_cls(TOOLS).extract(text)
        expected = [(c.name, c.arguments) for c in result.tool_calls]
        for call in result.tool_calls:
            json.loads(call.arguments)
        deltas, progress = stream(parser_cls(TOOLS), text, random.Random(it))
        content, calls, _ = reassemble(deltas)
        assert content == result.content, (name, text)
        assert calls[: len(expected)] == expected, (name, text)
        assert all((content or "").startswith(p) for p in progress), (name, text)


# ---------------------------------------------------------------------------------------------
# Minimal chat templates with each family's markers: detection and a rendered round trip
# ---------------------------------------------------------------------------------------------

QWEN3_CODER = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}<function><name>"
    "{{ t.function.name }}</name></function>{% endfor %}</tools>\nIf you choose to call a "
    "function ONLY reply in the following format:\n<tool_call>\n<function=example_function_name>"
    "\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content or '' }}{% for tc in m.tool_calls or [] %}\n<tool_call>\n<function="
    "{{ tc.function.name }}>\n{% for k, v in tc.function.arguments.items() %}<parameter={{ k }}>"
    "\n{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}"
    "\n</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GLM45 = (
    "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}\nFor each function call, output the function name and arguments within the "
    "following XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n"
    "<arg_value>{arg-value-1}</arg_value>\n...\n</tool_call>{% endif %}{% for m in messages %}"
    "<|{{ m.role }}|>\n{% if m.role == 'assistant' %}<think></think>\n{% endif %}"
    "{{ m.content or '' }}{% for tc in m.tool_calls or [] %}\n<tool_call>{{ tc.function.name }}"
    "\n{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>\n<arg_value>"
    "{{ v | tojson if v is not string else v }}</arg_value>\n{% endfor %}</tool_call>"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{{ '\\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' }}"
    "{% endif %}"
)
DEEPSEEK_V3 = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜>{% if m.tool_calls %}<｜tool▁calls▁begin｜>"
    "{% for tc in m.tool_calls %}<｜tool▁call▁begin｜>{{ tc.type }}<｜tool▁sep｜>"
    "{{ tc.function.name }}\n```json\n{{ tc.function.arguments }}\n```<｜tool▁call▁end｜>"
    "{% if not loop.last %}\n{% endif %}{% endfor %}<｜tool▁calls▁end｜>{% else %}"
    "{{ m.content }}{% endif %}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
DEEPSEEK_V31 = (
    "{% if not thinking is defined %}{% set thinking = false %}{% endif %}{{ bos_token }}"
    "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜></think>{% if m.tool_calls %}"
    "<｜tool▁calls▁begin｜>{% for tc in m.tool_calls %}<｜tool▁call▁begin｜>"
    "{{ tc.function.name }}<｜tool▁sep｜>{{ tc.function.arguments }}<｜tool▁call▁end｜>"
    "{% endfor %}<｜tool▁calls▁end｜>{% else %}{{ m.content }}{% endif %}<｜end▁of▁sentence｜>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>"
    "{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}"
)
KIMI_K2 = (
    "{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content or '' }}"
    "{% if m.tool_calls %}<|tool_calls_section_begin|>{% for tc in m.tool_calls %}"
    "<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>{{ tc.function.arguments }}"
    "<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
GRANITE = (
    "{% if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}"
    "<|end_of_text|>\n{% endif %}{% if thinking %}<|start_of_role|>system<|end_of_role|>Write "
    "your thoughts after 'Here is my thought process:' and write your response after 'Here is "
    "my response:' for each user query.<|end_of_text|>\n{% endif %}{% for m in messages %}"
    "<|start_of_role|>{{ m.role }}<|end_of_role|>{% if m.tool_calls %}<|tool_call|>"
    "{{ m.tool_calls | map(attribute='function') | list | tojson }}{% else %}{{ m.content }}"
    "{% endif %}<|end_of_text|>\n{% endfor %}{% if add_generation_prompt %}<|start_of_role|>"
    "assistant<|end_of_role|>{% endif %}"
)
PYTHONIC = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nIf you decide to invoke any of "
    "the function(s), you MUST put it in the format of [func_name1(params_name1=params_value1, "
    "params_name2=params_value2...), func_name2(params)]\n{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}<|eot_id|>{% endif %}{% for m in messages %}<|start_header_id|>{{ m.role }}"
    "<|end_header_id|>\n\n{% if m.tool_calls %}[{% for tc in m.tool_calls %}"
    "{{ tc.function.name }}({% for k, v in tc.function.arguments.items() %}{{ k }}="
    "{{ v | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, "
    "{% endif %}{% endfor %}]{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
)
LLAMA4 = (
    "{% for m in messages %}<|header_start|>{{ m.role }}<|header_end|>\n\n{% if m.tool_calls %}"
    "<|python_start|>[{% for tc in m.tool_calls %}{{ tc.function.name }}("
    "{% for k, v in tc.function.arguments.items() %}{{ k }}={{ v | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}"
    "{% endfor %}]<|python_end|>{% else %}{{ m.content }}{% endif %}<|eot|>{% endfor %}"
)

# (template, parser, reasoning parser, assistant header, end of the assistant turn)
FAMILIES = {
    "qwen3_coder": (QWEN3_CODER, "qwen3_coder", None, "<|im_start|>assistant\n", "<|im_end|>"),
    "glm45": (GLM45, "glm45", "glm45", "<|assistant|>\n<think></think>\n", None),
    "deepseek_v3": (DEEPSEEK_V3, "deepseek_v3", None, "<｜Assistant｜>", "<｜end▁of"),
    "deepseek_v31": (
        DEEPSEEK_V31,
        "deepseek_v31",
        "deepseek_v3",
        "<｜Assistant｜></think>",
        "<｜end▁of",
    ),
    "kimi_k2": (KIMI_K2, "kimi_k2", None, "<|im_middle|>", "<|im_end|>"),
    "granite": (GRANITE, "granite", "granite", "assistant<|end_of_role|>", "<|end_of_text|>"),
    "pythonic": (PYTHONIC, "pythonic", None, "<|end_header_id|>\n\n", "<|eot_id|>"),
    "llama4": (LLAMA4, "pythonic", None, "<|header_end|>\n\n", "<|eot|>"),
}
# Families whose templates take the arguments as a mapping (the others as JSON text).
MAPPING_ARGS = {"qwen3_coder", "glm45", "granite", "pythonic", "llama4"}

ARGS = [
    ("get_weather", {"city": "São Paulo", "days": 2, "metric": False, "tags": ["rain", "w"]}),
    ("get_time", {}),
]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_detected_from_the_template_and_reads_what_it_renders(family):
    template, parser, reasoning, header, footer = FAMILIES[family]
    assert detect_tool_parser(template) == parser
    assert detect_reasoning_parser(template) == reasoning
    tok = build_tokenizer()
    tool_calls = [
        {
            "id": f"functions.{name}:{i}",
            "type": "function",
            "function": {
                "name": name,
                "arguments": args if family in MAPPING_ARGS else json.dumps(args),
            },
        }
        for i, (name, args) in enumerate(ARGS)
    ]
    messages = [
        {"role": "user", "content": "Weather in São Paulo, and the time?"},
        {"role": "assistant", "content": "", "tool_calls": tool_calls},
    ]
    rendered = tok.apply_chat_template(
        messages, tools=TOOLS, chat_template=template, tokenize=False
    )
    turn = rendered.rsplit(header, 1)[1]
    if footer:
        turn = turn.split(footer, 1)[0]
    result = get_tool_parser(parser)(TOOLS).extract(turn)
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == ARGS, turn
    assert result.content is None
    if parser == "kimi_k2":
        assert [c.id for c in result.tool_calls] == [tc["id"] for tc in tool_calls]
    for seed in range(10):
        deltas, _ = stream(get_tool_parser(parser)(TOOLS), turn, random.Random(seed))
        content, calls, _ = reassemble(deltas)
        assert content is None
        assert [(n, json.loads(a)) for n, a in calls] == ARGS


def test_detection_keeps_the_older_formats():
    qwen25 = "{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>\n{...}\n</tool_call>"
    assert detect_tool_parser(qwen25) == "hermes"
    assert detect_tool_parser("Environment: ipython\n<|python_tag|>") == "llama3_json"
    r1 = "<｜Assistant｜><think>\n{% if '</think>' in content %}{% endif %}"
    assert detect_reasoning_parser(r1) == "deepseek_r1"
    qwen3 = "<think>\n\n</think>\n\n{% if enable_thinking is false %}{% endif %}"
    assert detect_reasoning_parser(qwen3) == "qwen3"


# ---------------------------------------------------------------------------------------------
# Reasoning
# ---------------------------------------------------------------------------------------------

# (parser, template kwargs, output, reasoning, content)
REASONING = [
    (
        "granite",
        None,
        "Here is my thought process:\nThe user wants 2+2.\nHere is my response:\nIt is 4.",
        "The user wants 2+2.",
        "It is 4.",
    ),
    ("granite", None, "Here's my thought process: hmm. Here's my response: 4", "hmm.", "4"),
    ("granite", None, "It is 4.", None, "It is 4."),  # thinking off
    ("granite", None, "Here is my thought process:\nstill going", "still going", ""),  # cut
    ("granite", None, "Here is my answer: 4", None, "Here is my answer: 4"),
    ("glm45", None, "<think>Add them.</think>\nIt is 4.", "Add them.", "It is 4."),
    ("glm45", None, "It is 4.", None, "It is 4."),
    ("glm45", {"enable_thinking": False}, "It is 4.", None, "It is 4."),
    ("deepseek_v3", {"thinking": True}, "Add them.</think>\n\nIt is 4.", "Add them.", "It is 4."),
    ("deepseek_v3", {"thinking": True}, "Add them and", "Add them and", ""),
    ("deepseek_v3", {"thinking": False}, "It is 4.", None, "It is 4."),
    ("deepseek_v3", None, "It is </think> 4.", None, "It is </think> 4."),  # default: off
]


@pytest.mark.parametrize(("name", "kwargs", "text", "reasoning", "content"), REASONING)
def test_reasoning_whole_and_streamed(name, kwargs, text, reasoning, content):
    assert REASONING_PARSERS[name](kwargs).extract(text) == (reasoning, content)
    for seed in range(30):
        rng, parser = random.Random(seed), REASONING_PARSERS[name](kwargs)
        got_r, got_c, i = "", "", 0
        while i < len(text):
            k = rng.choice([1, 1, 2, 3, 5, 8])
            r, c = parser.feed(text[i : i + k], final=i + k >= len(text))
            got_r, got_c, i = got_r + r, got_c + c, i + k
        assert (got_r or None, got_c) == (reasoning, content), seed


def test_deepseek_v31_thinking_switch_through_the_chat_route(serve):
    """The route hands the request's chat_template_kwargs to the reasoning parser: with
    `thinking` the text before </think> is reasoning, without it everything is content."""
    forced = "two and two</think>four"
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "2+2?"}],
        "max_tokens": 40,
        "guided_regex": re.escape(forced),
    }

    async def run(s):
        on = {**body, "chat_template_kwargs": {"thinking": True}}
        (full,) = await collect(s, "/v1/chat/completions", on)
        streamed = await collect(s, "/v1/chat/completions", {**on, "stream": True})
        (off,) = await collect(s, "/v1/chat/completions", body)
        return full, streamed, off

    full, streamed, off = serve(
        run,
        served_model_name="tiny",
        chat_template=DEEPSEEK_V31,
        reasoning_parser="auto",
        structured_in_reasoning=True,
    )
    message = full["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("two and two", "four")
    deltas = [c["choices"][0]["delta"] for c in parse_sse(streamed) if c.get("choices")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "two and two"
    assert "".join(d.get("content") or "" for d in deltas) == "four"
    assert off["choices"][0]["message"]["content"] == forced
    assert not off["choices"][0]["message"].get("reasoning_content")


def _marked(marker: str) -> str:
    """A template short enough for the tiny model's context, naming a family's marker in a
    comment: detection reads the source."""
    return "{# " + marker + " #}{% for m in messages %}{{ m.content }}\n{% endfor %}"


@pytest.mark.parametrize(
    ("template", "call"),
    [
        (
            _marked("<|tool_calls_section_begin|>"),
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0"
            '<|tool_call_argument_begin|>{"zone": "utc"}<|tool_call_end|>'
            "<|tool_calls_section_end|>",
        ),
        (
            _marked("<tool_call>\n<function=example_function_name>"),
            "<tool_call>\n<function=get_time>\n<parameter=zone>\nutc\n</parameter>\n"
            "</function>\n</tool_call>",
        ),
        (_marked("[func_name1(params_name1=params_value1)]"), '[get_time(zone="utc")]'),
        (
            _marked("<｜tool▁calls▁begin｜>{{ name }}<｜tool▁sep｜>"),
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "utc"}'
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        ),
    ],
)
def test_auto_tool_calls_through_the_chat_route(serve, template, call):
    """No TOOL_CALL_PARSER: the parser read from the template turns the (forced) output into
    tool_calls, streamed and not."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "time?"}],
        "tools": [{"type": "function", "function": {"name": "get_time"}}],
        "max_tokens": 230,
        "guided_regex": re.escape(call),
    }

    async def run(s):
        (full,) = await collect(s, "/v1/chat/completions", body)
        streamed = await collect(s, "/v1/chat/completions", {**body, "stream": True})
        return full, streamed

    full, streamed = serve(
        run, served_model_name="tiny", chat_template=template, enable_auto_tool_choice=True
    )
    assert "choices" in full, full
    choice = full["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (tc,) = choice["message"]["tool_calls"]
    assert tc["function"]["name"] == "get_time"
    assert json.loads(tc["function"]["arguments"]) == {"zone": "utc"}
    assert not choice["message"]["content"]
    chunks = [c for c in parse_sse(streamed) if c.get("choices")]
    pieces = [p for c in chunks for p in c["choices"][0]["delta"].get("tool_calls") or []]
    assert pieces[0]["function"]["name"] == "get_time"
    args = "".join(p["function"].get("arguments", "") for p in pieces)
    assert json.loads(args) == {"zone": "utc"}
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert [f for f in finishes if f] == ["tool_calls"]
    assert not "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


def test_structured_output_waits_for_the_families_end_of_thinking(serve):
    """A constrained request's grammar starts after `</think>` for the `<think>` families and
    from the first token for Granite, whose answer follows a phrase instead (it then answers
    without thinking rather than never being constrained)."""
    body = {"messages": [{"role": "user", "content": "2+2?"}], "guided_regex": "[0-9]+"}

    def after(s):
        async def run():
            end = tuple(s.tokenizer.encode("</think>", add_special_tokens=False))
            return end, s._chat_plan(body).params.structured_after

        return run()

    for parser in ("glm45", "deepseek_v3"):
        end, got = serve(after, reasoning_parser=parser)
        assert got == end and end, parser
    assert serve(after, reasoning_parser="granite")[1] == ()


def test_glm45_thinks_then_calls_through_the_chat_route(serve):
    """Both parsers detected from one template: the reasoning goes to reasoning_content, the
    call after it to tool_calls, streamed and not."""
    template = _marked("[gMASK]<sop> <think></think> <arg_key>{k}</arg_key> enable_thinking")
    forced = (
        "<think>UTC is asked.</think>\n<tool_call>get_time\n<arg_key>zone</arg_key>\n"
        "<arg_value>utc</arg_value>\n</tool_call>"
    )
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "time?"}],
        "tools": [{"type": "function", "function": {"name": "get_time"}}],
        "max_tokens": 200,
        "guided_regex": re.escape(forced),
    }

    async def run(s):
        assert s.auto_tool_parser.name == "glm45"
        assert s.reasoning_parser.name == "glm45"
        (full,) = await collect(s, "/v1/chat/completions", body)
        streamed = await collect(s, "/v1/chat/completions", {**body, "stream": True})
        return full, streamed

    full, streamed = serve(
        run,
        served_model_name="tiny",
        chat_template=template,
        enable_auto_tool_choice=True,
        reasoning_parser="auto",
        structured_in_reasoning=True,
    )
    message = full["choices"][0]["message"]
    assert message["reasoning_content"] == "UTC is asked."
    assert not message["content"]
    (tc,) = message["tool_calls"]
    assert (tc["function"]["name"], tc["function"]["arguments"]) == ("get_time", '{"zone": "utc"}')
    deltas = [c["choices"][0]["delta"] for c in parse_sse(streamed) if c.get("choices")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "UTC is asked."
    assert not "".join(d.get("content") or "" for d in deltas)
    pieces = [p for d in deltas for p in d.get("tool_calls") or []]
    assert pieces[0]["function"]["name"] == "get_time"
    assert "".join(p["function"].get("arguments", "") for p in pieces) == '{"zone": "utc"}'

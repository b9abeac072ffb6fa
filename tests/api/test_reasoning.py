"""Reasoning output (issue 15 item 4): `<think>...</think>` split into `reasoning_content`,
streamed and not, for both parsers, and through the chat route on a tiny model whose text is
forced by a regex."""

from __future__ import annotations

import random
import re

import pytest

from serverless_llm.api.openai.reasoning import (
    REASONING_PARSERS,
    detect_reasoning_parser,
)
from tests.api.conftest import collect, parse_sse

CASES = [
    # (parser, output, reasoning, content)
    ("deepseek_r1", "<think>\nLet me add.\n</think>\n\nIt is 4.", "Let me add.", "It is 4."),
    ("deepseek_r1", "Let me add.</think>It is 4.", "Let me add.", "It is 4."),  # opened in prompt
    ("deepseek_r1", "Still thinking about it", "Still thinking about it", ""),  # cut off
    ("deepseek_r1", "</think>Answer only.", None, "Answer only."),
    ("qwen3", "<think>\nHmm.\n</think>\n\nYes.", "Hmm.", "Yes."),
    ("qwen3", "Yes, no thinking.", None, "Yes, no thinking."),
    ("qwen3", "<think>never closed", None, "<think>never closed"),
    ("qwen3", "<thinking> is a word here", None, "<thinking> is a word here"),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_split_whole_and_streamed(name, text, reasoning, content):
    assert REASONING_PARSERS[name]().extract(text) == (reasoning, content)
    for seed in range(20):
        rng, parser = random.Random(seed), REASONING_PARSERS[name]()
        got_r, got_c, i = "", "", 0
        while i < len(text):
            k = rng.choice([1, 1, 2, 3, 5, 8])
            r, c = parser.feed(text[i : i + k], final=i + k >= len(text))
            got_r, got_c, i = got_r + r, got_c + c, i + k
        # A stream cannot take back reasoning it sent for a qwen3 block that never closes.
        if not (name == "qwen3" and text.startswith("<think>") and "</think>" not in text):
            assert (got_r or None, got_c) == (reasoning, content), (seed, got_r, got_c)
        assert "</think>" not in got_r + got_c and "<think>\n" not in got_r


def test_the_parser_is_read_from_the_chat_template():
    assert detect_reasoning_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_reasoning_parser(None) is None
    r1 = "{{ bos }}{% for m in messages %}...{% endfor %}<｜Assistant｜><think>\n ... </think>"
    assert detect_reasoning_parser(r1) == "deepseek_r1"
    qwen3 = "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    assert detect_reasoning_parser(qwen3) == "qwen3"


def test_chat_route_splits_reasoning_streamed_and_not(serve):
    forced = "<think>two and two</think>four"
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "2+2?"}],
        "max_tokens": 60,
        "guided_regex": re.escape(forced),
    }

    async def run(s):
        (full,) = await collect(s, "/v1/chat/completions", body)
        streamed = await collect(s, "/v1/chat/completions", {**body, "stream": True})
        return full, streamed

    # The regex forces the reasoning too: structured output from the first token.
    full, streamed = serve(
        run, served_model_name="tiny", reasoning_parser="qwen3", structured_in_reasoning=True
    )
    message = full["choices"][0]["message"]
    assert message["reasoning_content"] == "two and two" and message["content"] == "four"
    chunks = parse_sse(streamed)
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "two and two"
    assert "".join(d.get("content") or "" for d in deltas) == "four"

    # No parser: the text is all content, as before.
    (plain,) = serve(lambda s: collect(s, "/v1/chat/completions", body), served_model_name="tiny")
    assert plain["choices"][0]["message"]["content"] == forced
    assert "reasoning_content" not in plain["choices"][0]["message"]


def test_reasoning_effort_reaches_the_template():
    from serverless_llm.api.openai.chat import render_chat_prompt
    from serverless_llm.api.openai.protocol import ChatCompletionRequest
    from tests.tiny_models import build_tokenizer

    tok = build_tokenizer()
    switch = "{{ reasoning_effort }}|{{ enable_thinking }}"
    plain = "{{ reasoning_effort }}|{{ kwargs | default('') }}"

    def render(template, **kw):
        request = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
        )
        return tok.decode(render_chat_prompt(request, tok, template), skip_special_tokens=True)

    assert render(switch, reasoning_effort="minimal") == "minimal|False"
    assert render(switch, reasoning_effort="high") == "high|True"
    kwargs = {"enable_thinking": True}
    assert render(switch, reasoning_effort="none", chat_template_kwargs=kwargs) == "none|True"
    assert render(plain, reasoning_effort="low") == "low|"  # no switch in it: none is added
    assert render(switch) == "|"  # unset: nothing added


def test_structured_output_waits_for_the_end_of_thinking(serve):
    """With a reasoning parser, a constrained request's grammar starts after `</think>`'s
    tokens, unless the prompt closed the thinking already (Qwen 3 with thinking off), there is
    no constraint, or STRUCTURED_OUTPUTS_ENABLE_IN_REASONING is on."""
    body = {"messages": [{"role": "user", "content": "2+2?"}], "guided_regex": "[0-9]+"}
    no_think = (
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<think>\n\n</think>\n\n{% endif %}"
    )

    def after(**kwargs):
        def plan(s):
            async def run():
                end = tuple(s.tokenizer.encode("</think>", add_special_tokens=False))
                return end, s._chat_plan({**body, **kwargs}).params.structured_after

            return run()

        return plan

    end, got = serve(after(), reasoning_parser="qwen3")
    assert got == end and len(end) >= 1
    assert serve(after(), reasoning_parser="deepseek_r1")[1] == end
    assert serve(after(), reasoning_parser="qwen3", structured_in_reasoning=True)[1] == ()
    assert serve(after())[1] == ()  # no reasoning parser
    assert serve(after(chat_template=no_think), reasoning_parser="qwen3")[1] == ()
    free = {"guided_regex": None}
    assert serve(after(**free), reasoning_parser="qwen3")[1] == ()

"""Reasoning output: a model's `<think>...</think>` text split from its answer, into chat's
`reasoning_content` (REASONING_PARSER; vLLM's field and parser names).

- `deepseek_r1`: the template opens the thinking in the prompt, so everything before `</think>`
  is reasoning (a leading `<think>` is dropped); an output with no `</think>` is all reasoning.
- `qwen3`: reasoning only inside `<think>...</think>` at the start of the output; an output
  that does not open with `<think>` (thinking switched off), or never closes it, is content.

- `glm45`: GLM-4.5 / 4.6, read as `qwen3` (the template closes an empty block in the prompt
  when thinking is off).
- `deepseek_v3`: DeepSeek V3.1, whose template thinks only when the chat template kwarg
  `thinking` is true: then as `deepseek_r1` (the prompt opens the block), else all content.
- `granite`: Granite 3.2+ with `thinking` on writes "Here is my thought process:" ... "Here is
  my response:" ... (or "Here's ..."); the thoughts are reasoning. An output that does not open
  with the first phrase is content; one that never reaches the second is all reasoning.

The answer after the end marker loses its leading whitespace. Streaming sends what each new
piece decides, holding back an end that may be the start of a marker.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

START, END = "<think>", "</think>"


class ReasoningParser:
    """A parser is made per output; `chat_template_kwargs` are the request's, for a family
    whose thinking a template switch turns on and off."""

    name: ClassVar[str] = ""
    starts: ClassVar[tuple[str, ...]] = (START,)  # what opens the reasoning
    ends: ClassVar[tuple[str, ...]] = (END,)  # what closes it
    starts_inside: ClassVar[bool] = False  # reasoning before the end without a start
    unclosed_is_reasoning: ClassVar[bool] = False  # no end at the end of the output: reasoning
    after_start: ClassVar[str] = "\n"  # what the reasoning loses after the start marker

    def __init__(self, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        self._text = ""
        self._sent = ("", "")

    def extract(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole output."""
        reasoning, content = self._split(text, final=True)
        return reasoning or None, content

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(new reasoning, new content) once `delta` is added to the output."""
        self._text += delta
        reasoning, content = self._split(self._text, final)
        sent_r, sent_c = self._sent
        new_r = reasoning[len(sent_r) :] if reasoning.startswith(sent_r) else ""
        new_c = content[len(sent_c) :] if content.startswith(sent_c) else ""
        self._sent = (sent_r + new_r, sent_c + new_c)
        return new_r, new_c

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        stripped = text.lstrip()
        opener = next((s for s in self.starts if stripped.startswith(s)), None)
        if opener is not None:
            body = stripped[len(opener) :].lstrip(self.after_start)
        elif not final and any(s.startswith(stripped) for s in self.starts):
            return "", ""  # may still open with the start marker
        elif self.starts_inside:
            body = text
        else:
            return "", text
        found = [(k, e) for e in self.ends if (k := body.find(e)) >= 0]
        if found:
            k, end = min(found)
            return body[:k].rstrip(), body[k + len(end) :].lstrip()
        if final:
            return (body.rstrip(), "") if self.unclosed_is_reasoning else ("", text)
        # Held back too: trailing whitespace, which the end of the reasoning drops.
        return body[: len(body) - _held(body, self.ends)].rstrip(), ""


def _held(text: str, ends: tuple[str, ...] = (END,)) -> int:
    """Length of the longest end of `text` that may be the start of one of `ends`."""
    held = 0
    for end in ends:
        for size in range(min(len(end) - 1, len(text)), held, -1):
            if text.endswith(end[:size]):
                held = size
                break
    return held


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_inside = True
    unclosed_is_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class GLM45ReasoningParser(Qwen3ReasoningParser):
    name = "glm45"


class DeepSeekV3ReasoningParser(DeepSeekR1ReasoningParser):
    """DeepSeek V3.1: `deepseek_r1` when the request sets the template's `thinking`, else
    the output is all content (the template closed the block in the prompt)."""

    name = "deepseek_v3"

    def __init__(self, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(chat_template_kwargs)
        self.thinking = bool((chat_template_kwargs or {}).get("thinking"))

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if not self.thinking:
            return "", text
        return super()._split(text, final)


class GraniteReasoningParser(ReasoningParser):
    name = "granite"
    starts = ("Here is my thought process:", "Here's my thought process:")
    ends = ("Here is my response:", "Here's my response:")
    after_start = " \n"
    unclosed_is_reasoning = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p
    for p in (
        DeepSeekR1ReasoningParser,
        Qwen3ReasoningParser,
        GLM45ReasoningParser,
        DeepSeekV3ReasoningParser,
        GraniteReasoningParser,
    )
}

# A template variable `thinking` (DeepSeek V3.1's switch), not `enable_thinking`.
_THINKING_SWITCH = re.compile(r"(?<![\w.])thinking\b")


def detect_reasoning_parser(template: str | None) -> str | None:
    """The parser a chat template calls for: `granite` for Granite's thought-process phrases;
    for one that writes `<think>` blocks, `deepseek_v3` where a DeepSeek template has a
    `thinking` switch (V3.1), `glm45` for GLM's (`[gMASK]`), `qwen3` where thinking can be
    switched off (`enable_thinking`), else `deepseek_r1`."""
    if not template:
        return None
    if GraniteReasoningParser.starts[0] in template:
        return "granite"
    if START not in template or END not in template:
        return None
    if "<｜Assistant｜>" in template and _THINKING_SWITCH.search(template):
        return "deepseek_v3"
    if "[gMASK]" in template:
        return "glm45"
    return "qwen3" if "enable_thinking" in template else "deepseek_r1"

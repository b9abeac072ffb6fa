"""Reasoning output: a model's `<think>...</think>` text split from its answer, into chat's
`reasoning_content` (REASONING_PARSER; vLLM's field and parser names).

- `deepseek_r1`: the template opens the thinking in the prompt, so everything before `</think>`
  is reasoning (a leading `<think>` is dropped); an output with no `</think>` is all reasoning.
- `qwen3`: reasoning only inside `<think>...</think>` at the start of the output; an output
  that does not open with `<think>` (thinking switched off), or never closes it, is content.

The answer after `</think>` loses its leading whitespace. Streaming sends what each new piece
decides, holding back an end that may be the start of a marker.
"""

from __future__ import annotations

from typing import ClassVar

START, END = "<think>", "</think>"


class ReasoningParser:
    name: ClassVar[str] = ""
    starts_inside: ClassVar[bool] = False  # reasoning before </think> without <think>
    unclosed_is_reasoning: ClassVar[bool] = False  # no </think> at the end: reasoning

    def __init__(self) -> None:
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
        opened = stripped.startswith(START)
        if opened:
            body = stripped[len(START) :].lstrip("\n")
        elif not final and START.startswith(stripped):
            return "", ""  # may still open with <think>
        elif self.starts_inside:
            body = text
        else:
            return "", text
        k = body.find(END)
        if k >= 0:
            return body[:k].rstrip(), body[k + len(END) :].lstrip()
        if final:
            return (body.rstrip(), "") if self.unclosed_is_reasoning else ("", text)
        # Held back too: trailing whitespace, which the end of the reasoning drops.
        return body[: len(body) - _held(body)].rstrip(), ""


def _held(text: str) -> int:
    """Length of the longest end of `text` that may be the start of END."""
    for size in range(min(len(END) - 1, len(text)), 0, -1):
        if text.endswith(END[:size]):
            return size
    return 0


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_inside = True
    unclosed_is_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def detect_reasoning_parser(template: str | None) -> str | None:
    """The parser a chat template calls for: one that writes `<think>` blocks; `qwen3` where
    thinking can be switched off (`enable_thinking`), else `deepseek_r1`."""
    if not template or START not in template or END not in template:
        return None
    return "qwen3" if "enable_thinking" in template else "deepseek_r1"

"""Which tool-call parser a model needs, read from its chat template (TOOL_CALL_PARSER unset).

A template that teaches the model a tool-call format names that format's markers; these are
the markers of the formats the built-in parsers read, most specific first."""

from __future__ import annotations

# (parser, markers any one of which identifies the format)
_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mistral", ("[TOOL_CALLS]",)),  # Mistral / Mixtral / Ministral v3+ templates
    ("hermes", ("<tool_call>",)),  # Qwen 2.5 / Qwen 3, Hermes 2 Pro / 3, SmolLM3, ...
    ("llama3_json", ("<|python_tag|>", "Environment: ipython")),  # Llama 3.1 - 3.3
    ("internlm", ("<|action_start|><|plugin|>",)),  # InternLM 2 / 2.5
)


def detect_tool_parser(template: str | None) -> str | None:
    """The parser for the format `template` (the chat template's source) teaches, or None."""
    if not template:
        return None
    for name, markers in _MARKERS:
        if any(m in template for m in markers):
            return name
    return None

"""Which tool-call parser a model needs, read from its chat template (TOOL_CALL_PARSER unset).

A template that teaches the model a tool-call format names that format's markers; these are
the markers of the formats the built-in parsers read, most specific first."""

from __future__ import annotations

# (parser, markers any one of which identifies the format). The XML forms that also write
# <tool_call> (Qwen3-Coder, GLM) and Granite come before hermes.
_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mistral", ("[TOOL_CALLS]",)),  # Mistral / Mixtral / Ministral v3+ templates
    ("kimi_k2", ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")),  # Kimi K2
    ("deepseek", ("<｜tool▁calls▁begin｜>",)),  # DeepSeek V3 / R1 / V3.1: see below
    ("qwen3_coder", ("<function=", "<parameter=")),  # Qwen3-Coder
    ("glm45", ("<arg_key>",)),  # GLM-4.5 / 4.6
    ("granite", ("<|tool_call|>",)),  # Granite 3.x
    ("hermes", ("<tool_call>",)),  # Qwen 2.5 / Qwen 3, Hermes 2 Pro / 3, SmolLM3, ...
    # Llama 4 (<|python_start|>), and Llama 3.2's pythonic system prompt
    ("pythonic", ("<|python_start|>", "[func_name1(")),
    ("llama3_json", ("<|python_tag|>", "Environment: ipython")),  # Llama 3.1 - 3.3
    ("internlm", ("<|action_start|><|plugin|>",)),  # InternLM 2 / 2.5
)


def detect_tool_parser(template: str | None) -> str | None:
    """The parser for the format `template` (the chat template's source) teaches, or None."""
    if not template:
        return None
    for name, markers in _MARKERS:
        if any(m in template for m in markers):
            if name == "deepseek":
                # V3 / R1 fence the arguments in ```json; V3.1 writes them after the name.
                return "deepseek_v3" if "```json" in template else "deepseek_v31"
            return name
    return None

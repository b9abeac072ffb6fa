"""Tools for a model whose chat template ignores them: a system message of our own describes
them and asks for calls in the hermes format (`<tool_call>{"name": ..., "arguments": ...}
</tool_call>`), which the hermes parser then reads. Without it such a model never hears of the
tools, and `tools` in a request would silently do nothing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from serverless_llm.engine import ChatTemplateError, apply_chat_template

DEFAULT_TOOL_PARSER = "hermes"
_PROBE_NAME = "probe_tool_5f3a9c"


def template_renders_tools(tokenizer: Any, template: str | None) -> bool:
    """Whether the chat template puts a request's tools into the prompt."""
    probe = [{"type": "function", "function": {"name": _PROBE_NAME, "parameters": {}}}]
    try:
        text = apply_chat_template(
            tokenizer, [{"role": "user", "content": "hi"}], chat_template=template, tools=probe
        )
    except ChatTemplateError:
        return False
    return _PROBE_NAME in text


def tool_system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "You can call functions to help answer. They are listed here, one JSON description "
        "per line:\n"
        f"<tools>\n{lines}\n</tools>\n"
        "To call one, write a JSON object with its name and its arguments between "
        "<tool_call> and </tool_call>, one call per block, for example:\n"
        '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n'
        "</tool_call>\n"
        "Answer in plain text when no function is needed."
    )


def with_tool_prompt(
    messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The conversation with the tools described: appended to a leading system message, or in
    a new one before the rest."""
    prompt = tool_system_prompt(tools)
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        content = first.get("content") or ""
        if isinstance(content, list):  # a template that reads parts (api.multimodal)
            joined = [*content, {"type": "text", "text": f"\n\n{prompt}" if content else prompt}]
            return [{**first, "content": joined}, *messages[1:]]
        return [
            {**first, "content": f"{content}\n\n{prompt}" if content else prompt},
            *messages[1:],
        ]
    if messages and isinstance(messages[0].get("content"), list):
        return [{"role": "system", "content": [{"type": "text", "text": prompt}]}, *messages]
    return [{"role": "system", "content": prompt}, *messages]

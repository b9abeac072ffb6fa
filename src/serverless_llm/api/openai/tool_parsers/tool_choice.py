"""`tools` and `tool_choice`: validation, the structured-output spec that forces a call, and the
constrained output turned back into `tool_calls`.

- "none": no constraint, no parsing (the tools still reach the chat template).
- "auto": no constraint; the text goes through the configured parser (TOOL_CALL_PARSER), which
  needs ENABLE_AUTO_TOOL_CHOICE.
- named ({"type": "function", "function": {"name": ...}}): the output is constrained to the
  function's parameter schema; the whole output is that call's arguments.
- "required": the output is constrained to a JSON list of one or more
  {"name": <one of the tools>, "parameters": <its schema>}; each element is a call.

Named and required need no parser and work with any model (the guarantee is a call that
parses and validates, not a good one).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from serverless_llm.engine import InvalidRequestError, StructuredOutputSpec

from .base import ExtractedToolCalls, ToolCall, ToolParser
from .formats import JSONToolParser

__all__ = [
    "NamedToolCallParser",
    "RequiredToolCallParser",
    "ToolChoice",
    "ToolChoiceError",
    "parser_for_tool_choice",
    "required_schema",
    "resolve_tool_choice",
    "tool_choice_spec",
    "validate_tools",
]

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_\-.]{1,64}$")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolChoiceError(InvalidRequestError):
    """A bad `tools` or `tool_choice`; `param` names the field (a 400 on the request)."""


class ToolChoice(NamedTuple):
    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None  # the function, for "named"


def validate_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]]:
    """OpenAI's `tools`: a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}. Returns them as plain dicts."""
    if tools is None:
        return []
    if not isinstance(tools, (list, tuple)):
        raise ToolChoiceError("tools must be a list", "tools")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ToolChoiceError(f"tools[{i}] must be an object", "tools")
        if tool.get("type", "function") != "function":
            raise ToolChoiceError(f"tools[{i}].type must be 'function'", "tools")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ToolChoiceError(f"tools[{i}].function must be an object", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise ToolChoiceError(
                f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-' or '.'",
                "tools",
            )
        if name in seen:
            raise ToolChoiceError(f"tools[{i}]: duplicate function name {name!r}", "tools")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise ToolChoiceError(f"tools[{i}].function.parameters must be an object", "tools")
        out.append({"type": "function", "function": dict(fn)})
    return out


def resolve_tool_choice(
    tools: Sequence[Mapping[str, Any]],
    tool_choice: Any,
    *,
    auto_enabled: bool,
    why_not: str | None = None,
) -> ToolChoice:
    """What the request asks for. Unset means "auto" when tools are given and auto tool choice
    is enabled (as OpenAI), else "none" (the tools still reach the chat template). An explicit
    "auto" where it is not enabled is an error, saying `why_not`."""
    names = [t["function"]["name"] for t in tools]
    if tool_choice is None:
        return ToolChoice("auto" if tools and auto_enabled else "none")
    if tool_choice == "none":
        return ToolChoice("none")
    if tool_choice == "auto":
        if not auto_enabled:
            why = why_not or (
                '"auto" tool choice needs the worker to run with ENABLE_AUTO_TOOL_CHOICE=true '
                "and a TOOL_CALL_PARSER"
            )
            raise ToolChoiceError(
                f'{why}; name a function or use "required" instead', "tool_choice"
            )
        return ToolChoice("auto" if tools else "none")
    if tool_choice == "required":
        if not tools:
            raise ToolChoiceError('"required" tool choice needs tools', "tool_choice")
        return ToolChoice("required")
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ToolChoiceError(
                'a named tool choice is {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in names:
            raise ToolChoiceError(
                f"tool_choice names {name!r}, which is not among the tools", "tool_choice"
            )
        return ToolChoice("named", name)
    raise ToolChoiceError(
        'tool_choice must be "none", "auto", "required" or a named function', "tool_choice"
    )


def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return dict(params) if params else dict(_EMPTY_PARAMETERS)


def required_schema(tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """A JSON list of one or more calls (exactly one unless `parallel`), each
    {"name": <a tool>, "parameters": <its schema>}."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    items = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_choice_spec(
    tools: Sequence[Mapping[str, Any]], choice: ToolChoice, parallel: bool = True
) -> StructuredOutputSpec | None:
    """The constraint for named and required choices (None for none/auto); `parallel=False`
    (`parallel_tool_calls: false`) makes "required" exactly one call. Combine it with no other
    structured output: a request with both is a 400 (naming tool_choice)."""
    if choice.mode == "named":
        tool = next(t for t in tools if t["function"]["name"] == choice.name)
        return StructuredOutputSpec(json=_parameters(tool), param="tool_choice")
    if choice.mode == "required":
        return StructuredOutputSpec(json=required_schema(tools, parallel), param="tool_choice")
    return None


class NamedToolCallParser(ToolParser):
    """The output of a named tool choice: all of it is the arguments of that one call."""

    name = "named"

    def __init__(self, function_name: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.function_name = function_name
        self._call_id: str | None = None

    def extract(self, text: str) -> ExtractedToolCalls:
        return ExtractedToolCalls(None, [ToolCall(self.new_call_id(), self.function_name, text)])

    @property
    def tools_called(self) -> bool:
        return self._call_id is not None

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        if self._call_id is None:
            self._call_id = self.new_call_id()
            header = {
                "index": 0,
                "id": self._call_id,
                "type": "function",
                "function": {"name": self.function_name, "arguments": delta_text},
            }
            return [{"tool_calls": [header]}]
        if not delta_text:
            return []
        return [{"tool_calls": [{"index": 0, "function": {"arguments": delta_text}}]}]

    def finish(self) -> list[dict[str, Any]]:
        return self.feed("") if self._call_id is None else []


class RequiredToolCallParser(JSONToolParser):
    """The output of a "required" tool choice: the JSON list the constraint produces. The
    grammar makes all of the output that list, so a list cut off (by max_tokens) is a
    truncation, not content: its complete calls are kept and the cut one is dropped."""

    name = "required"
    body = "array"
    bare_start = "["
    keep_complete_calls_of_a_cut_list = True


def parser_for_tool_choice(
    choice: ToolChoice,
    auto_parser: type[ToolParser] | None,
    tools: Sequence[Mapping[str, Any]],
    *,
    id_factory: Callable[[], str] | None = None,
) -> ToolParser | None:
    """The parser a request's output goes through: None for "none" (plain content)."""
    if choice.mode == "named":
        return NamedToolCallParser(choice.name or "", tools=tools, id_factory=id_factory)
    if choice.mode == "required":
        return RequiredToolCallParser(tools, id_factory=id_factory)
    if choice.mode == "auto" and auto_parser is not None:
        return auto_parser(tools, id_factory=id_factory)
    return None

"""Tool parsers: a model's text -> OpenAI `tool_calls`, whole or streamed.

A parser is made per request (it holds the stream's state). `extract(text)` reads a complete
output; `feed(delta)` / `finish()` read it as it streams and return OpenAI delta objects:

    {"content": "..."}
    {"tool_calls": [{"index": 0, "id": "call_...", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\\"ci"}}]}
    {"tool_calls": [{"index": 0, "function": {"arguments": "ty\\": \\"Paris\\"}"}}]}

A call's first delta carries its id, type and name (and the arguments written so far); later
ones carry more of its arguments. Text that may still turn out to be part of a call (a marker
cut in half, the JSON of a call not yet known to be one) is held back until it is known, so no
call markup reaches `content`.

Parsers are registered by name (`register_tool_parser`); `load_tool_parser_plugin(path)` imports
a Python file whose parsers register themselves the same way, or that defines a module attribute
`TOOL_PARSERS = {"name": ParserClass}`. A plugin parser may implement `extract` alone: the base
class then streams by holding the text until `finish()`.
"""

from __future__ import annotations

import importlib.util
import secrets
import string
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

_ALNUM = string.ascii_letters + string.digits


class ToolParserError(ValueError):
    """An unknown parser name or a plugin that cannot be loaded (a configuration error)."""


def random_id(length: int) -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(length))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ExtractedToolCalls(NamedTuple):
    """`content` is None when the model wrote nothing but calls."""

    content: str | None
    tool_calls: list[ToolCall]

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


class ToolParser:
    """Base class. Subclasses implement `extract`; the built-in ones also stream incrementally.

    `needs_special_tokens`: the format's markers are special tokens in its models' vocabularies,
    so the route must detokenize with skip_special_tokens=False for the parser to see them."""

    name: ClassVar[str] = ""
    needs_special_tokens: ClassVar[bool] = False

    def __init__(
        self,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        id_factory: Callable[[], str] | None = None,
    ) -> None:
        self.tools = list(tools or [])
        self._id_factory = id_factory
        self._buffer = ""
        self._called = False

    def new_call_id(self) -> str:
        """OpenAI-style `call_<24 alphanumerics>`; Mistral's parser overrides it (9 chars)."""
        if self._id_factory is not None:
            return self._id_factory()
        return "call_" + random_id(24)

    def extract(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    # Streaming. The default holds everything until the end, then sends what `extract` finds:
    # correct for any format, incremental for none.

    @property
    def tools_called(self) -> bool:
        """Whether the stream has produced a tool call so far (finish_reason "tool_calls")."""
        return self._called

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        self._buffer += delta_text
        return []

    def finish(self) -> list[dict[str, Any]]:
        result = self.extract(self._buffer)
        self._buffer = ""
        deltas: list[dict[str, Any]] = []
        if result.content:
            deltas.append({"content": result.content})
        for index, call in enumerate(result.tool_calls):
            deltas.append({"tool_calls": [{"index": index, **call.to_openai()}]})
        self._called = self._called or result.tools_called
        return deltas


def merge_deltas(deltas: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Deltas from one `feed` as a single OpenAI delta (one stream chunk): content joined, each
    call's pieces joined under its index. None when there is nothing to send."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        if delta.get("content"):
            content.append(delta["content"])
        for piece in delta.get("tool_calls") or ():
            entry = calls.get(piece["index"])
            if entry is None:
                entry = {k: v for k, v in piece.items() if k != "function"}
                entry["function"] = dict(piece.get("function") or {})
                calls[piece["index"]] = entry
                continue
            fn = piece.get("function") or {}
            if "name" in fn:
                entry["function"]["name"] = fn["name"]
            if fn.get("arguments"):
                entry["function"]["arguments"] = (
                    entry["function"].get("arguments", "") + fn["arguments"]
                )
            for key in ("id", "type"):
                if key in piece:
                    entry[key] = piece[key]
    if not content and not calls:
        return None
    merged: dict[str, Any] = {}
    if content:
        merged["content"] = "".join(content)
    if calls:
        merged["tool_calls"] = [calls[i] for i in sorted(calls)]
    return merged


# ---------------------------------------------------------------------------------------------
# Registry and plugins
# ---------------------------------------------------------------------------------------------

TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(*names: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator: `@register_tool_parser("myformat")` makes TOOL_CALL_PARSER=myformat
    select the class. A later registration of a name replaces the earlier one (so a plugin may
    override a built-in)."""

    def register(cls: type[ToolParser]) -> type[ToolParser]:
        if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
            raise ToolParserError(f"{cls!r} is not a ToolParser subclass")
        for name in names or (cls.name,):
            if not name:
                raise ToolParserError(f"{cls.__name__} needs a name to be registered")
            TOOL_PARSERS[name] = cls
        return cls

    return register


def tool_parser_names() -> list[str]:
    return sorted(TOOL_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ToolParserError(
            f"unknown tool call parser {name!r}; available: {', '.join(tool_parser_names())}"
        ) from None


def load_tool_parser_plugin(path: str | Path) -> list[str]:
    """Imports the Python file at `path` (TOOL_PARSER_PLUGIN) and returns the parser names it
    registered, through `@register_tool_parser(...)` or a `TOOL_PARSERS` dict attribute."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ToolParserError(f"TOOL_PARSER_PLUGIN: no such file: {file}")
    module_name = f"serverless_llm_tool_parser_plugin_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ToolParserError(f"TOOL_PARSER_PLUGIN: cannot import {file}")
    before = dict(TOOL_PARSERS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ToolParserError(
            f"TOOL_PARSER_PLUGIN: importing {file} failed: {type(exc).__name__}: {exc}"
        ) from exc
    declared = getattr(module, "TOOL_PARSERS", None)
    if isinstance(declared, Mapping) and declared is not TOOL_PARSERS:
        for name, cls in declared.items():
            register_tool_parser(str(name))(cls)
    names = sorted(n for n, cls in TOOL_PARSERS.items() if before.get(n) is not cls)
    if not names:
        raise ToolParserError(
            f"TOOL_PARSER_PLUGIN: {file} registers no tool parser (use @register_tool_parser "
            "or a TOOL_PARSERS dict)"
        )
    return names

"""Parsers for the tool-call formats of recent model families, each named as vLLM's
`--tool-call-parser` so a setting carries over:

    qwen3_coder  <tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>
    glm45        <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                 ```json {...} ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    deepseek_v31 <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
                 <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    kimi_k2      <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
                 <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>
    granite      <|tool_call|>[{"name": ..., "arguments": {...}}, ...]   (or a bare list)

They share the machinery of formats.py (JSONToolParser): a marker opens a region, the region's
body is read here, and the same parse serves `extract` and streaming. A body is read with a
cursor that raises `_Cut` where the text ends before the body does: while streaming that means
"wait for more"; on the whole output it is a call cut off (content), unless every call in the
region was complete and only the closing marker is missing.

The XML forms (qwen3_coder, glm45) write each argument as text; a value becomes the JSON type
the tool's schema gives the parameter (integer, number, boolean, null, object, array), and
stays a string where the schema says string or the text does not read as that type. Their
arguments stream one parameter at a time: `{"a": 1`, then `, "b": "x"`, then `}`; Qwen3-Coder's
text values (a file's contents, say) stream as they are written. The JSON forms stream the
arguments' text as the model writes it.

Kimi K2 names its calls `functions.NAME:INDEX`; that id is the call's OpenAI id, as its chat
template expects to read it back.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from typing import Any

from .base import register_tool_parser
from .formats import JSONToolParser, Malformed, PartialCall, Region
from .partial_json import WHITESPACE, parse_value

__all__ = [
    "DeepSeekV3ToolParser",
    "DeepSeekV31ToolParser",
    "GLM45ToolParser",
    "GraniteToolParser",
    "KimiK2ToolParser",
    "Qwen3CoderToolParser",
]

# A function or parameter name: no whitespace, no markup.
_NAME = re.compile(r"[^\s<>{}\[\]\"'`]+")


class _Cut(Exception):
    """The text ends before the region does."""


class _Cursor:
    def __init__(self, text: str, pos: int) -> None:
        self.text = text
        self.pos = pos

    def ws(self) -> None:
        text, n = self.text, len(self.text)
        while self.pos < n and text[self.pos] in WHITESPACE:
            self.pos += 1

    def at(self, literal: str) -> bool:
        """Whether `literal` is next; `_Cut` when the text ends inside what may be it."""
        rest = self.text[self.pos : self.pos + len(literal)]
        if rest == literal:
            return True
        if len(rest) < len(literal) and literal.startswith(rest):
            raise _Cut
        return False

    def take(self, literal: str) -> None:
        if not self.at(literal):
            raise Malformed(f"expected {literal!r}")
        self.pos += len(literal)

    def take_any(self, *literals: str) -> None:
        for literal in literals:
            if self.at(literal):
                self.pos += len(literal)
                return
        raise Malformed(f"expected {literals[0]!r}")

    def until(self, *ends: str) -> tuple[str, str]:
        """The text up to the nearest of `ends` (not consumed) and which one it is."""
        best: tuple[int, str] | None = None
        for end in ends:
            k = self.text.find(end, self.pos)
            if k >= 0 and (best is None or k < best[0]):
                best = (k, end)
        if best is None:
            raise _Cut
        piece = self.text[self.pos : best[0]]
        self.pos = best[0]
        return piece, best[1]

    def json_object(self, call: PartialCall) -> None:
        """A JSON object as the call's arguments, streamed as far as it goes."""
        if self.pos >= len(self.text):
            raise _Cut
        if self.text[self.pos] != "{":
            raise Malformed("the arguments must be a JSON object")
        node = parse_value(self.text, self.pos, final=False)
        call.arguments = self.text[node.start : node.end]
        if not node.complete:
            raise _Cut
        self.pos = node.end


def _name(raw: str) -> str:
    name = raw.strip()
    if not _NAME.fullmatch(name):
        raise Malformed(f"not a function name: {name!r}")
    return name


class _RegionParser(JSONToolParser):
    """A format whose region body `_read` reads with a cursor, appending calls as it goes."""

    def _read(self, cur: _Cursor, calls: list[PartialCall]) -> int:
        raise NotImplementedError

    def _parse_body(self, text: str, i: int, final: bool) -> Region:
        calls: list[PartialCall] = []
        try:
            end = self._read(_Cursor(text, i), calls)
        except _Cut:
            if not final:
                return Region(calls, None)
            if calls and all(c.complete for c in calls):
                return Region(calls, len(text))  # only the closing marker is missing
            raise Malformed("the output ends inside a call") from None
        if not calls:
            raise Malformed("no call")
        return Region(calls, end)

    # -- arguments written as text, typed by the tool's schema ------------------------------

    def _schema(self, function: str, parameter: str) -> Mapping[str, Any] | None:
        for tool in self.tools:
            fn = tool.get("function") if isinstance(tool, Mapping) else None
            if isinstance(fn, Mapping) and fn.get("name") == function:
                params = fn.get("parameters")
                props = params.get("properties") if isinstance(params, Mapping) else None
                if isinstance(props, Mapping) and isinstance(props.get(parameter), Mapping):
                    return props[parameter]
                return None
        return None

    def _typed(self, function: str, parameter: str, raw: str) -> Any:
        """The value of an argument written as `raw`, as the schema types it."""
        types = _schema_types(self._schema(function, parameter))
        if not types:
            return self._untyped(raw)
        for kind in sorted(types, key=_TYPE_ORDER.index):
            ok, value = _convert(kind, raw)
            if ok:
                return value
        return raw

    def _untyped(self, raw: str) -> Any:
        """A parameter the schema does not type."""
        return raw

    @staticmethod
    def _member(key: str, value: Any) -> str:
        return json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)


_TYPE_ORDER = ["null", "boolean", "integer", "number", "object", "array", "string"]


def _schema_types(schema: Mapping[str, Any] | None) -> set[str]:
    if not schema:
        return set()
    declared = schema.get("type")
    if isinstance(declared, str):
        found = {declared}
    elif isinstance(declared, list):
        found = {t for t in declared if isinstance(t, str)}
    else:
        found = set()
        for key in ("anyOf", "oneOf"):
            for option in schema.get(key) or ():
                if isinstance(option, Mapping):
                    found |= _schema_types(option)
        if not found and "enum" in schema:
            return {"string"} if all(isinstance(v, str) for v in schema["enum"]) else set()
    return found & set(_TYPE_ORDER)


def _convert(kind: str, raw: str) -> tuple[bool, Any]:
    text = raw.strip()
    if kind == "string":
        return True, raw
    if kind == "null":
        return (True, None) if text.lower() in ("null", "none") else (False, None)
    if kind == "boolean":
        low = text.lower()
        return (True, low == "true") if low in ("true", "false") else (False, None)
    if kind == "integer":
        try:
            return True, int(text)
        except ValueError:
            return False, None
    if kind == "number":
        try:
            return True, int(text)
        except ValueError:
            pass
        try:
            value = float(text)
        except ValueError:
            return False, None
        return (True, value) if value == value and abs(value) != float("inf") else (False, None)
    # object / array: JSON, else a Python literal (the model may write either)
    want = dict if kind == "object" else list
    try:
        value = json.loads(text)
    except ValueError:
        try:
            value = ast.literal_eval(text)
            json.dumps(value, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return False, None
    return (True, value) if isinstance(value, want) else (False, None)


# ---------------------------------------------------------------------------------------------
# Qwen3-Coder
# ---------------------------------------------------------------------------------------------

_VALUE_ENDS = ("</parameter>", "<parameter=", "</function>")


def _open_text(key: str, partial: str) -> str:
    """`"key": "text so far` for a text value still being written: what may yet be its
    template newlines or the start of its end marker is held back."""
    if not partial:
        return ""  # its first newline (the template's) may be next
    if partial.startswith("\n"):
        partial = partial[1:]
    held = 0
    for end in _VALUE_ENDS:
        for size in range(min(len(end) - 1, len(partial)), held, -1):
            if partial.endswith(end[:size]):
                held = size
                break
    partial = partial[: len(partial) - held]
    if partial.endswith("\n"):
        partial = partial[:-1]
    return _RegionParser._member(key, partial)[:-1]  # without the closing quote


@register_tool_parser("qwen3_coder")
class Qwen3CoderToolParser(_RegionParser):
    """Qwen3-Coder: XML parameters; a value's first and last newline are the template's."""

    name = "qwen3_coder"
    needs_special_tokens = True
    markers = ("<tool_call>",)

    def _is_text(self, function: str, parameter: str) -> bool:
        """Whether the value stays text, whatever it reads as (then it streams as written)."""
        return _schema_types(self._schema(function, parameter)) <= {"string"}

    def _read(self, cur: _Cursor, calls: list[PartialCall]) -> int:
        cur.ws()
        cur.take("<function=")
        raw, _ = cur.until(">", "\n")
        name = _name(raw)
        cur.take(">")
        call = PartialCall(name, "", True, False)
        calls.append(call)
        members: list[str] = []
        while True:
            cur.ws()
            if cur.at("<parameter="):
                cur.pos += len("<parameter=")
                raw, _ = cur.until(">", "\n")
                key = _name(raw)
                cur.take(">")
                # A value missing its </parameter> ends where the next parameter or the
                # function's end starts.
                try:
                    value, end = cur.until(*_VALUE_ENDS)
                except _Cut:
                    opened = _open_text(key, cur.text[cur.pos :])
                    if opened and self._is_text(name, key):  # stream the text so far
                        call.arguments = "{" + "".join(m + ", " for m in members) + opened
                    raise
                if end == "</parameter>":
                    cur.pos += len(end)
                if value.startswith("\n"):
                    value = value[1:]
                if value.endswith("\n"):
                    value = value[:-1]
                members.append(self._member(key, self._typed(name, key, value)))
                call.arguments = "{" + ", ".join(members)
                continue
            cur.take("</function>")
            break
        call.arguments = "{" + ", ".join(members) + "}"
        call.complete = True
        cur.ws()
        cur.take("</tool_call>")
        return cur.pos


# ---------------------------------------------------------------------------------------------
# GLM-4.5 / 4.6
# ---------------------------------------------------------------------------------------------


@register_tool_parser("glm45")
class GLM45ToolParser(_RegionParser):
    """GLM-4.5 / GLM-4.6: the name on the tag's first line, then key / value pairs. A value
    the schema does not type is read as JSON where it is JSON (the template writes non-string
    values with `tojson`), else kept as text."""

    name = "glm45"
    needs_special_tokens = True
    markers = ("<tool_call>",)

    def _untyped(self, raw: str) -> Any:
        try:
            return json.loads(raw)
        except ValueError:
            return raw

    def _read(self, cur: _Cursor, calls: list[PartialCall]) -> int:
        raw, _ = cur.until("\n", "<arg_key>", "</tool_call>")
        if not raw.strip() and cur.at("\n"):  # a blank first line: the name is on the next
            cur.ws()
            raw, _ = cur.until("\n", "<arg_key>", "</tool_call>")
        name = _name(raw)
        call = PartialCall(name, "", True, False)
        calls.append(call)
        members: list[str] = []
        while True:
            cur.ws()
            if cur.at("<arg_key>"):
                cur.pos += len("<arg_key>")
                raw, _ = cur.until("</arg_key>")
                key = raw.strip()
                if not key:
                    raise Malformed("an empty argument name")
                cur.pos += len("</arg_key>")
                cur.ws()
                cur.take("<arg_value>")
                value, _ = cur.until("</arg_value>")
                cur.pos += len("</arg_value>")
                members.append(self._member(key, self._typed(name, key, value)))
                call.arguments = "{" + ", ".join(members)
                continue
            cur.take("</tool_call>")
            break
        call.arguments = "{" + ", ".join(members) + "}"
        call.complete = True
        return cur.pos


# ---------------------------------------------------------------------------------------------
# DeepSeek V3 / R1 and V3.1
# ---------------------------------------------------------------------------------------------

DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"


class _DeepSeekParser(_RegionParser):
    needs_special_tokens = True
    markers = (DS_CALLS_BEGIN,)

    def _head(self, cur: _Cursor) -> str:
        raise NotImplementedError

    def _tail(self, cur: _Cursor) -> None:
        pass

    def _read(self, cur: _Cursor, calls: list[PartialCall]) -> int:
        while True:
            cur.ws()
            if calls and cur.at(DS_CALLS_END):
                return cur.pos + len(DS_CALLS_END)
            cur.take(DS_CALL_BEGIN)
            call = PartialCall(self._head(cur), "", True, False)
            calls.append(call)
            cur.ws()
            cur.json_object(call)
            self._tail(cur)
            cur.ws()
            cur.take(DS_CALL_END)
            call.complete = True


@register_tool_parser("deepseek_v3")
class DeepSeekV3ToolParser(_DeepSeekParser):
    """DeepSeek V3 / V3-0324 / R1: `function<｜tool▁sep｜>NAME`, then the arguments in a
    ```json fence."""

    name = "deepseek_v3"

    def _head(self, cur: _Cursor) -> str:
        kind, _ = cur.until(DS_SEP, "\n")
        if kind.strip() != "function":
            raise Malformed("expected function<｜tool▁sep｜>")
        cur.take(DS_SEP)
        raw, _ = cur.until("\n", "```")
        name = _name(raw)
        cur.ws()
        cur.take("```json")
        return name

    def _tail(self, cur: _Cursor) -> None:
        cur.ws()
        cur.take("```")


@register_tool_parser("deepseek_v31")
class DeepSeekV31ToolParser(_DeepSeekParser):
    """DeepSeek V3.1 (and later): `NAME<｜tool▁sep｜>{...}`."""

    name = "deepseek_v31"

    def _head(self, cur: _Cursor) -> str:
        raw, _ = cur.until(DS_SEP, "\n", "{")
        name = _name(raw)
        cur.take(DS_SEP)
        return name


# ---------------------------------------------------------------------------------------------
# Kimi K2
# ---------------------------------------------------------------------------------------------

KIMI_SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
KIMI_SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")


@register_tool_parser("kimi_k2")
class KimiK2ToolParser(_RegionParser):
    """Kimi K2: calls named `functions.NAME:INDEX` (the id), JSON arguments."""

    name = "kimi_k2"
    needs_special_tokens = True
    markers = KIMI_SECTION_BEGIN

    def _read(self, cur: _Cursor, calls: list[PartialCall]) -> int:
        while True:
            cur.ws()
            if calls:
                for end in KIMI_SECTION_END:
                    if cur.at(end):
                        return cur.pos + len(end)
            cur.take("<|tool_call_begin|>")
            raw, _ = cur.until("<|tool_call_argument_begin|>", "<|tool_call_end|>", "{")
            call_id = _name(raw)
            head = call_id.rpartition(":")[0] if ":" in call_id else call_id
            name = _name(head.removeprefix("functions."))
            cur.take("<|tool_call_argument_begin|>")
            call = PartialCall(name, "", True, False, call_id=call_id)
            calls.append(call)
            cur.ws()
            cur.json_object(call)
            cur.ws()
            cur.take("<|tool_call_end|>")
            call.complete = True


# ---------------------------------------------------------------------------------------------
# Granite
# ---------------------------------------------------------------------------------------------


@register_tool_parser("granite")
class GraniteToolParser(JSONToolParser):
    """IBM Granite 3.x: a JSON list of calls after `<|tool_call|>` (Granite 3.0's special
    token) or `<tool_call>`, or a bare list opening the output."""

    name = "granite"
    needs_special_tokens = True
    markers = ("<|tool_call|>", "<tool_call>")
    body = "array_or_object"
    bare_start = "["

"""`pythonic` (vLLM's name): Llama 3.2 / Llama 4 calls written as a Python list of calls,

    [get_weather(city="Paris", unit="celsius"), get_time()]

opening the output, or inside Llama 4's `<|python_start|>...<|python_end|>`. Each call is read
with Python's `ast`: keyword arguments only, literal values only (strings, numbers, True /
False / None, lists, tuples, dicts; JSON's true / false / null are taken too), nothing is ever
evaluated. The arguments are the keywords as a JSON object.

While streaming, the list is split at its top-level commas as it arrives (strings and brackets
tracked), and each call is sent whole once its closing parenthesis is there.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from .base import register_tool_parser
from .formats import JSONToolParser, Malformed, PartialCall, Region
from .partial_json import skip_ws

__all__ = ["PythonicToolParser"]

_JSON_NAMES = {"true": True, "false": False, "null": None}
_CLOSERS = {"(": ")", "[": "]", "{": "}"}
# What an unfinished item must look like so far: a (dotted) name, then its "(".
_CALL_START = re.compile(r"[A-Za-z_][\w.]*\s*(?:\(|$)")


@register_tool_parser("pythonic")
class PythonicToolParser(JSONToolParser):
    name = "pythonic"
    needs_special_tokens = True
    markers = ("<|python_start|>",)
    end_marker = "<|python_end|>"
    bare_start = "["

    def _parse_body(self, text: str, i: int, final: bool) -> Region:
        j = skip_ws(text, i)
        if j >= len(text):
            if final:
                raise Malformed("empty call list")
            return Region([], None)
        if text[j] != "[":
            raise Malformed("expected [")
        items, end, pending = _split_list(text, j + 1)
        calls = [_call(item) for item in items]
        if end is None:
            if final:
                raise Malformed("the list of calls is not closed")
            rest = text[pending:].lstrip()
            if rest and not _CALL_START.match(rest):
                raise Malformed("not a call")
            return Region(calls, None)
        if not calls:
            raise Malformed("no call in the list")
        return self._close(text, calls, end, final)


def _split_list(text: str, i: int) -> tuple[list[str], int | None, int]:
    """The complete top-level items of the list whose `[` is before `text[i]`, the index
    after its `]` (None while the list is open) and where the unfinished item starts."""
    items: list[str] = []
    stack: list[str] = []
    start = i
    n = len(text)
    k = i
    while k < n:
        ch = text[k]
        if ch in "\"'":
            quote = ch * 3 if text.startswith(ch * 3, k) else ch
            k += len(quote)
            while True:
                if k >= n:
                    return items, None, start
                if text[k] == "\\":
                    k += 2
                    continue
                if text.startswith(quote, k):
                    k += len(quote)
                    break
                if len(quote) == 1 and text[k] == "\n":
                    raise Malformed("a newline in a string")
                k += 1
            continue
        if ch in _CLOSERS:
            stack.append(_CLOSERS[ch])
        elif ch in ")]}":
            if stack:
                if stack.pop() != ch:
                    raise Malformed("brackets do not match")
            elif ch == "]":
                piece = text[start:k].strip()
                if piece:
                    items.append(piece)
                elif items:
                    raise Malformed("an empty item")
                return items, k + 1, start
            else:
                raise Malformed("brackets do not match")
        elif ch == "," and not stack:
            piece = text[start:k].strip()
            if not piece:
                raise Malformed("an empty item")
            items.append(piece)
            start = k + 1
        k += 1
    return items, None, start


def _call(item: str) -> PartialCall:
    try:
        tree = ast.parse(item, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise Malformed("not a Python call") from None
    node = tree.body
    if not isinstance(node, ast.Call):
        raise Malformed("not a call")
    name = _dotted(node.func)
    if node.args:
        raise Malformed("positional arguments")
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise Malformed("** arguments")
        arguments[keyword.arg] = _literal(keyword.value)
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise Malformed("a value JSON cannot hold") from None
    return PartialCall(name, text, True, True)


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise Malformed("the function must be a name")


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, (str, int, float, bool)) or node.value is None:
            return node.value
        raise Malformed("not a JSON value")
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for key, value in zip(node.keys, node.values, strict=True):
            if key is None:
                raise Malformed("** in a dict")
            k = _literal(key)
            if not isinstance(k, str):
                raise Malformed("a dict key must be a string")
            out[k] = _literal(value)
        return out
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, (ast.USub, ast.UAdd))
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
    ):
        value = node.operand.value
        return -value if isinstance(node.op, ast.USub) else value
    raise Malformed("not a literal")

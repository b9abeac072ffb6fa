"""A strict JSON parser that also reads prefixes: where a value is cut off it says so, with the
spans of what it has seen, and a syntax error is reported as soon as the text cannot be the
start of any JSON value. Tool parsers use it to stream a call's name and arguments while the
model is still writing them, and to tell a broken call from an unfinished one."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

WHITESPACE = " \t\n\r"
_MAX_DEPTH = 256
# A run of string characters needing no attention: no quote, backslash or control character.
_PLAIN = re.compile(r'[^"\\\x00-\x1f]*')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_HEX = frozenset("0123456789abcdefABCDEF")


class JSONSyntaxError(ValueError):
    """The text cannot be (the start of) a JSON value; `pos` is where that became certain."""

    def __init__(self, message: str, pos: int) -> None:
        super().__init__(f"{message} at {pos}")
        self.pos = pos


@dataclass
class Node:
    """One JSON value as far as the text goes.

    `end` is the index after the value when `complete`, else the end of the text. Objects keep
    `members` as (key or None while the key is unfinished, value node or None before it starts);
    arrays keep `items`; complete strings keep their decoded `value`."""

    kind: str  # object, array, string, number, literal
    start: int
    end: int = 0
    complete: bool = False
    value: Any = None
    members: list[tuple[str | None, Node | None]] = field(default_factory=list)
    items: list[Node] = field(default_factory=list)

    def member(self, *keys: str) -> Node | None:
        """The value of the first member named one of `keys` (an unfinished one included)."""
        for key, value in self.members:
            if key in keys:
                return value
        return None

    def has_key(self, *keys: str) -> bool:
        return any(key in keys for key, _ in self.members)


def skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in WHITESPACE:
        i += 1
    return i


def parse_value(text: str, i: int, *, final: bool, depth: int = 0) -> Node:
    """Parses the JSON value starting at `text[i]` (no leading whitespace). With `final`, the
    text is complete: a value cut off is an error. Raises JSONSyntaxError."""
    if depth > _MAX_DEPTH:
        raise JSONSyntaxError("nesting too deep", i)
    n = len(text)
    if i >= n:
        if final:
            raise JSONSyntaxError("a value was expected", i)
        return Node("literal", i, i)
    ch = text[i]
    if ch == "{":
        return _parse_object(text, i, final, depth)
    if ch == "[":
        return _parse_array(text, i, final, depth)
    if ch == '"':
        return parse_string(text, i, final=final)
    if ch == "-" or ch.isdigit():
        return _parse_number(text, i, final)
    for word in ("true", "false", "null"):
        if ch == word[0]:
            piece = text[i : i + len(word)]
            if piece == word:
                return Node("literal", i, i + len(word), True, json.loads(word))
            if word.startswith(piece) and i + len(piece) == n and not final:
                return Node("literal", i, n)
            raise JSONSyntaxError(f"invalid literal (expected {word})", i)
    raise JSONSyntaxError(f"unexpected character {ch!r}", i)


def parse_string(text: str, i: int, *, final: bool) -> Node:
    n = len(text)
    j = i + 1
    while True:
        j = _PLAIN.match(text, j).end()
        if j >= n:
            break
        ch = text[j]
        if ch == '"':
            node = Node("string", i, j + 1, True)
            node.value = json.loads(text[i : j + 1])
            return node
        if ch == "\\":
            if j + 1 >= n:
                break
            esc = text[j + 1]
            if esc in '"\\/bfnrt':
                j += 2
                continue
            if esc == "u":
                digits = text[j + 2 : j + 6]
                if not set(digits) <= _HEX:
                    raise JSONSyntaxError("invalid \\u escape", j)
                if len(digits) < 4:
                    break
                j += 6
                continue
            raise JSONSyntaxError("invalid escape", j)
        raise JSONSyntaxError("control character in a string", j)
    if final:
        raise JSONSyntaxError("unterminated string", n)
    return Node("string", i, n)


def _parse_number(text: str, i: int, final: bool) -> Node:
    n = len(text)
    j = i
    while j < n and text[j] in _NUMBER_CHARS:
        j += 1
    raw = text[i:j]
    m = _NUMBER.fullmatch(raw)
    if m is not None and (j < n or final):
        return Node("number", i, j, True, json.loads(raw))
    if j == n and not final and _number_prefix(raw):
        return Node("number", i, n)
    raise JSONSyntaxError("invalid number", i)


def _number_prefix(raw: str) -> bool:
    """Whether `raw` can still grow into a JSON number."""
    return re.fullmatch(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?", raw) is not None


def _parse_array(text: str, i: int, final: bool, depth: int) -> Node:
    node = Node("array", i)
    n = len(text)
    j = skip_ws(text, i + 1)
    if j < n and text[j] == "]":
        node.end, node.complete = j + 1, True
        return node
    while True:
        if j >= n:
            return _cut(node, n, final)
        item = parse_value(text, j, final=final, depth=depth + 1)
        node.items.append(item)
        if not item.complete:
            return _cut(node, n, final)
        j = skip_ws(text, item.end)
        if j >= n:
            return _cut(node, n, final)
        if text[j] == "]":
            node.end, node.complete = j + 1, True
            return node
        if text[j] != ",":
            raise JSONSyntaxError("expected , or ]", j)
        j = skip_ws(text, j + 1)


def _parse_object(text: str, i: int, final: bool, depth: int) -> Node:
    node = Node("object", i)
    n = len(text)
    j = skip_ws(text, i + 1)
    if j < n and text[j] == "}":
        node.end, node.complete = j + 1, True
        return node
    while True:
        if j >= n:
            return _cut(node, n, final)
        if text[j] != '"':
            raise JSONSyntaxError("expected a key", j)
        key = parse_string(text, j, final=final)
        if not key.complete:
            node.members.append((None, None))
            return _cut(node, n, final)
        j = skip_ws(text, key.end)
        if j >= n:
            node.members.append((key.value, None))
            return _cut(node, n, final)
        if text[j] != ":":
            raise JSONSyntaxError("expected :", j)
        j = skip_ws(text, j + 1)
        if j >= n:
            node.members.append((key.value, None))
            return _cut(node, n, final)
        value = parse_value(text, j, final=final, depth=depth + 1)
        node.members.append((key.value, value))
        if not value.complete:
            return _cut(node, n, final)
        j = skip_ws(text, value.end)
        if j >= n:
            return _cut(node, n, final)
        if text[j] == "}":
            node.end, node.complete = j + 1, True
            return node
        if text[j] != ",":
            raise JSONSyntaxError("expected , or }", j)
        j = skip_ws(text, j + 1)


def _cut(node: Node, n: int, final: bool) -> Node:
    if final:
        raise JSONSyntaxError(f"unterminated {node.kind}", n)
    node.end = n
    return node

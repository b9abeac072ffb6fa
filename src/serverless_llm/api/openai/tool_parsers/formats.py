"""The built-in parsers: formats where calls are JSON objects inside markers.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (one per tag)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
                 [TOOL_CALLS]name[ARGS]{...}                               (newer tokenizers)
    llama3_json  {"name": ..., "parameters": {...}}; {...}                 (at the start, or
                 after <|python_tag|>)
    internlm     <|action_start|><|plugin|>{"name": ..., "parameters": {...}}<|action_end|>
    jamba        <tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>

Every format takes "arguments" or "parameters" for the arguments; the arguments of a call are
the exact JSON text the model wrote (a JSON string holding JSON is decoded), "{}" when absent.

One parse, used for both modes: `_parse(text, final)` reads the text from the start and says
what is content and what are calls so far. `extract` runs it once with final=True; streaming
runs it on the text so far and sends what is new since the last time. Text that is not yet
decided (a marker cut in half, trailing whitespace before what may be a call, a call whose JSON
is still open) is held. A call that turns out malformed (bad JSON, no name, text where its end
marker should be) is content, from its marker on, and so is everything after it.

Content around calls is trimmed: the text before a call loses its trailing whitespace, the text
after one its leading whitespace, and the output's end its trailing whitespace when there were
calls. The same rules in both modes make the streamed content equal to `extract`'s.

Known limit of streaming: a call is sent once its name is known, so if its JSON breaks later
(or the output is cut off by max_tokens inside it) the stream has already sent the start of that
call, while `extract` on the same text returns it as content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from .base import ExtractedToolCalls, ToolCall, ToolParser, random_id, register_tool_parser
from .partial_json import JSONSyntaxError, Node, parse_value, skip_ws

__all__ = [
    "HermesToolParser",
    "InternLMToolParser",
    "JSONToolParser",
    "JambaToolParser",
    "Llama3JSONToolParser",
    "MistralToolParser",
]

ARG_KEYS = ("arguments", "parameters")


class Malformed(ValueError):
    """A call region that is not a valid call."""


@dataclass
class PartialCall:
    name: str | None  # None until the name string is complete
    arguments: str  # the arguments' text so far
    confirmed: bool  # known to be a call: safe to start streaming it
    complete: bool
    call_id: str | None = None  # the id the model gave the call (Kimi K2), else one is made


@dataclass
class Region:
    calls: list[PartialCall]
    end: int | None  # index after the region, None while it is open


class JSONToolParser(ToolParser):
    """Calls as JSON objects in a region that a marker opens (and maybe an end marker closes).

    Subclasses set the class attributes; `_parse_body` reads one region."""

    markers: ClassVar[tuple[str, ...]] = ()
    end_marker: ClassVar[str | None] = None
    body: ClassVar[str] = "object"  # object | array | array_or_object | objects_semicolon
    bare_start: ClassVar[str] = ""  # chars that open a region without marker at the output start
    require_arguments_key: ClassVar[bool] = False  # without it the object is not a call
    # An array body cut off at the end of the output: keep its complete calls (else content).
    keep_complete_calls_of_a_cut_list: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._text = ""
        self._sent_content = ""
        self._sent_calls: list[tuple[str, str]] = []  # (name, arguments sent)

    # -- public API ---------------------------------------------------------------------------

    def extract(self, text: str) -> ExtractedToolCalls:
        content, calls = self._parse(text, final=True)
        tool_calls = [
            ToolCall(c.call_id or self.new_call_id(), c.name or "", c.arguments) for c in calls
        ]
        return ExtractedToolCalls(content or None, tool_calls)

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        self._text += delta_text
        return self._diff(*self._parse(self._text, final=False))

    def finish(self) -> list[dict[str, Any]]:
        return self._diff(*self._parse(self._text, final=True))

    @property
    def tools_called(self) -> bool:
        return bool(self._sent_calls)

    # -- streaming: what is new since the last parse --------------------------------------------

    def _diff(self, content: str, calls: list[PartialCall]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        sent = self._sent_content
        if len(content) > len(sent) and content.startswith(sent):
            deltas.append({"content": content[len(sent) :]})
            self._sent_content = content
        for index, call in enumerate(calls):
            if index < len(self._sent_calls):
                name, args = self._sent_calls[index]
                if call.name != name or not call.arguments.startswith(args):
                    continue  # cannot be taken back; nothing more for it
                if len(call.arguments) > len(args):
                    piece = call.arguments[len(args) :]
                    deltas.append(
                        {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
                    )
                    self._sent_calls[index] = (name, call.arguments)
            elif index == len(self._sent_calls) and call.confirmed and call.name:
                header = {
                    "index": index,
                    "id": call.call_id or self.new_call_id(),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                deltas.append({"tool_calls": [header]})
                self._sent_calls.append((call.name, call.arguments))
        return deltas

    # -- the parse ------------------------------------------------------------------------------

    def _parse(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        """(content, calls) as far as `text` decides them."""
        segments: list[tuple[str, bool, bool]] = []  # (text, follows a call, precedes a call)
        calls: list[PartialCall] = []
        pos, after = 0, False
        if self.bare_start:
            j = skip_ws(text, 0)
            if j == len(text) and not final:
                return "", []
            if j < len(text) and text[j] in self.bare_start:
                outcome = self._try_region(text, j, final)
                if outcome is None:  # not calls: all of it is content
                    return self._join([(text, False, False)], final, False), []
                if outcome.end is None:
                    return "", outcome.calls
                calls.extend(outcome.calls)
                pos, after = outcome.end, True
        while True:
            found = self._find_marker(text, pos)
            if found is None:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - self._held_suffix(tail)]
                segments.append((tail, after, False))
                break
            start, body_start = found
            outcome = self._try_region(text, body_start, final)
            if outcome is None:  # malformed: content from here on
                segments.append((text[pos:], after, False))
                break
            segments.append((text[pos:start], after, True))
            calls.extend(outcome.calls)
            if outcome.end is None:
                break
            pos, after = outcome.end, True
        return self._join(segments, final, bool(calls)), calls

    @staticmethod
    def _join(segments: list[tuple[str, bool, bool]], final: bool, have_calls: bool) -> str:
        out = []
        for i, (seg, follows, precedes) in enumerate(segments):
            if follows:
                seg = seg.lstrip()
            last = i == len(segments) - 1
            if precedes or (last and (not final or have_calls)):
                seg = seg.rstrip()
            out.append(seg)
        return "".join(out)

    def _find_marker(self, text: str, pos: int) -> tuple[int, int] | None:
        best: tuple[int, int] | None = None
        for marker in self.markers:
            k = text.find(marker, pos)
            if k >= 0 and (best is None or k < best[0]):
                best = (k, k + len(marker))
        return best

    def _held_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that may be the start of a marker."""
        held = 0
        for marker in self.markers:
            for size in range(min(len(marker) - 1, len(text)), held, -1):
                if text.endswith(marker[:size]):
                    held = size
                    break
        return held

    def _try_region(self, text: str, i: int, final: bool) -> Region | None:
        try:
            return self._parse_body(text, i, final)
        except (JSONSyntaxError, Malformed):
            return None

    # -- region bodies --------------------------------------------------------------------------

    def _parse_body(self, text: str, i: int, final: bool) -> Region:
        j = skip_ws(text, i)
        if j >= len(text):
            if final:
                raise Malformed("empty call")
            return Region([], None)
        body = self.body
        if body == "array_or_object":
            body = "array" if text[j] == "[" else "object"
        if body == "array":
            return self._array_body(text, j, final)
        if body == "objects_semicolon":
            return self._objects_body(text, j, final)
        node = self._value(text, j, final, "object")
        call = self._call(text, node, final)
        if not node.complete:
            return Region([call], None)
        return self._close(text, [call], node.end, final)

    def _array_body(self, text: str, j: int, final: bool) -> Region:
        try:
            node = self._value(text, j, final, "array")
        except JSONSyntaxError:
            if not (final and self.keep_complete_calls_of_a_cut_list):
                raise
            node = self._value(text, j, False, "array")  # as far as it goes
            if node.complete:
                raise  # whole, yet not JSON: malformed after all
            done = [item for item in node.items if item.complete]
            if any(item.kind != "object" for item in done):
                raise Malformed("a call must be an object") from None
            return Region([self._call(text, item, True) for item in done], len(text))
        calls = []
        for item in node.items:
            if item.kind != "object":
                raise Malformed("a call must be an object")
            calls.append(self._call(text, item, final))
        if not node.complete:
            return Region(calls, None)
        if not calls:
            raise Malformed("no call in the list")
        return self._close(text, calls, node.end, final)

    def _objects_body(self, text: str, j: int, final: bool) -> Region:
        calls: list[PartialCall] = []
        n = len(text)
        while True:
            node = self._value(text, j, final, "object")
            calls.append(self._call(text, node, final))
            if not node.complete:
                return Region(calls, None)
            k = skip_ws(text, node.end)
            if k >= n:
                return Region(calls, node.end if final else None)
            if text[k] != ";":
                return Region(calls, node.end)
            k2 = skip_ws(text, k + 1)
            if k2 >= n:
                return Region(calls, n if final else None)
            if text[k2] != "{":
                return Region(calls, k + 1)
            j = k2

    def _close(self, text: str, calls: list[PartialCall], end: int, final: bool) -> Region:
        """After the calls: the end marker (if the format has one), else the region ends."""
        if self.end_marker is None:
            return Region(calls, end)
        k = skip_ws(text, end)
        rest = text[k:]
        if rest.startswith(self.end_marker):
            return Region(calls, k + len(self.end_marker))
        if not rest and final:
            return Region(calls, len(text))  # the output ended without its closing tag
        if not final and self.end_marker.startswith(rest):
            return Region(calls, None)
        raise Malformed(f"expected {self.end_marker}")

    @staticmethod
    def _value(text: str, j: int, final: bool, kind: str) -> Node:
        opener = "{" if kind == "object" else "["
        if text[j] != opener:
            raise Malformed(f"expected {opener}")
        return parse_value(text, j, final=final)

    def _call(self, text: str, node: Node, final: bool) -> PartialCall:
        """A call object {"name": ..., "arguments" | "parameters": ...} as far as it goes."""
        name_node = node.member("name")
        name = None
        if name_node is not None and name_node.complete:
            if name_node.kind != "string" or not name_node.value:
                raise Malformed("the name must be a non-empty string")
            name = name_node.value
        elif node.complete:
            raise Malformed("a call needs a name")
        has_args_key = node.has_key(*ARG_KEYS)
        if node.complete and self.require_arguments_key and not has_args_key:
            raise Malformed("not a call: no arguments")
        args = self._arguments(text, node.member(*ARG_KEYS), node.complete)
        return PartialCall(
            name=name,
            arguments=args,
            confirmed=name is not None and (has_args_key or not self.require_arguments_key),
            complete=node.complete,
        )

    @staticmethod
    def _arguments(text: str, value: Node | None, call_complete: bool) -> str:
        if value is None:
            return "{}" if call_complete else ""
        if value.kind == "object":
            return text[value.start : value.end]
        if value.kind == "string":
            return value.value if value.complete else ""  # JSON in a string: sent when whole
        if value.kind == "literal" and value.complete and value.value is None:
            return "{}"
        if not value.complete and value.kind == "literal":
            return ""
        raise Malformed("the arguments must be an object")


@register_tool_parser("hermes")
class HermesToolParser(JSONToolParser):
    """Hermes 2 Pro / Hermes 3, Qwen 2.5+: one call per <tool_call> tag."""

    name = "hermes"
    needs_special_tokens = True
    markers = ("<tool_call>",)
    end_marker = "</tool_call>"
    body = "object"


@register_tool_parser("mistral")
class MistralToolParser(JSONToolParser):
    """Mistral: [TOOL_CALLS] then a JSON list of calls (or one call), or the newer
    `[TOOL_CALLS]name[ARGS]{...}` form. Mistral's chat template wants ids of 9 alphanumerics."""

    name = "mistral"
    needs_special_tokens = True
    markers = ("[TOOL_CALLS]",)
    body = "array_or_object"
    _NAME = re.compile(r"[A-Za-z0-9_.\-]*")
    _ID = re.compile(r"[A-Za-z0-9]*")

    def new_call_id(self) -> str:
        if self._id_factory is not None:
            return self._id_factory()
        return random_id(9)

    def _parse_body(self, text: str, i: int, final: bool) -> Region:
        j = skip_ws(text, i)
        if j >= len(text) or text[j] in "[{":
            return super()._parse_body(text, i, final)
        # name[ARGS]{...} (optionally name[CALL_ID]id[ARGS]{...})
        name = self._NAME.match(text, j).group(0)
        k = j + len(name)
        if text.startswith("[CALL_ID]", k):
            k += len("[CALL_ID]")
            k += len(self._ID.match(text, k).group(0))
        rest = text[k:]
        if not rest.startswith("[ARGS]"):
            if not final and ("[ARGS]".startswith(rest) or "[CALL_ID]".startswith(rest)):
                return Region([PartialCall(None, "", False, False)], None)
            raise Malformed("expected [ARGS]")
        if not name:
            raise Malformed("a call needs a name")
        a = skip_ws(text, k + len("[ARGS]"))
        if a >= len(text):
            if final:
                raise Malformed("no arguments")
            return Region([PartialCall(name, "", True, False)], None)
        node = self._value(text, a, final, "object")
        call = PartialCall(name, text[node.start : node.end], True, node.complete)
        return Region([call], node.end if node.complete else None)


@register_tool_parser("llama3_json")
class Llama3JSONToolParser(JSONToolParser):
    """Llama 3.1/3.2 JSON tool calling: the output starts with {"name": ..., "parameters": ...}
    (several separated by ';'), or they follow <|python_tag|>. An object without parameters is
    plain JSON content, not a call."""

    name = "llama3_json"
    needs_special_tokens = True
    markers = ("<|python_tag|>",)
    body = "objects_semicolon"
    bare_start = "{"
    require_arguments_key = True


@register_tool_parser("internlm")
class InternLMToolParser(JSONToolParser):
    """InternLM 2 / 2.5: <|action_start|><|plugin|>{...}<|action_end|>."""

    name = "internlm"
    needs_special_tokens = True
    markers = ("<|action_start|><|plugin|>",)
    end_marker = "<|action_end|>"
    body = "object"


@register_tool_parser("jamba")
class JambaToolParser(JSONToolParser):
    """AI21 Jamba 1.5+: <tool_calls>[...]</tool_calls>."""

    name = "jamba"
    needs_special_tokens = True
    markers = ("<tool_calls>",)
    end_marker = "</tool_calls>"
    body = "array"

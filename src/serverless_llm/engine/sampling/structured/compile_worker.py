"""From a spec's text to xgrammar's compiled grammar: the work of one compile process.

Compiling runs in a child process (see `compile_pool`), never in the worker's own: an adversarial
schema or regex (an enormous enum, huge repetition counts) can keep xgrammar's C++ busy for
minutes, and a thread cannot be stopped, while a process can be killed when its time limit
passes or when every request waiting for it has gone. A crash inside xgrammar kills only the
child, too.

This file is both a module of the package (the parent imports its text helpers and its message
format) and a program, run by path (`python compile_worker.py FD`), so it imports nothing of the
package: importing the package would cost seconds and hundreds of MB. Run so, it is the
*zygote*: it imports xgrammar once (about 3 s and 260 MB, as xgrammar imports torch) and forks a
compile process on request, in milliseconds, so a killed one is replaced at once.

A compile process reads and writes frames on its socket; a frame is an 8-byte big-endian length
and that many bytes of JSON. It first writes `{"ready": true}`. Then, per request:

- `{"op": "info", "key": k, "info": <TokenizerInfo.serialize_json()>}` -> `{"ok": true}`;
- `{"op": "compile", "key": k, "spec": {...}, "max_bytes": n}` -> `{"ok": <CompiledGrammar
  .serialize_json()>}`, `{"error": message, "param": name or null}`, or `{"need_info": true}`
  when the tokenizer `k` is not loaded (the parent sends it and asks again).

EOF on its socket ends a compile process, and EOF on the control socket the zygote, so neither
outlives the worker.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
from collections import OrderedDict
from typing import Any, BinaryIO

# ---------------------------------------------------------------------------------------------
# Frames
# ---------------------------------------------------------------------------------------------

_HEADER = struct.Struct(">Q")


def encode_frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return _HEADER.pack(len(body)) + body


def write_frame(out: BinaryIO, message: dict[str, Any]) -> None:
    out.write(encode_frame(message))
    out.flush()


def read_exact(inp: BinaryIO, n: int) -> bytes | None:
    """`n` bytes, or None at EOF."""
    chunks, left = [], n
    while left:
        chunk = inp.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(inp: BinaryIO) -> dict[str, Any] | None:
    header = read_exact(inp, _HEADER.size)
    if header is None:
        return None
    body = read_exact(inp, _HEADER.unpack(header)[0])
    return None if body is None else json.loads(body)


# ---------------------------------------------------------------------------------------------
# Spec text -> xgrammar Grammar
# ---------------------------------------------------------------------------------------------

_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


def xgr_message(exc: BaseException) -> str:
    """xgrammar's error text without its C++ log prefix (timestamp, source file, line)."""
    text = str(exc).strip()
    return _XGR_PREFIX.sub("", text).strip() or type(exc).__name__


def ebnf_literal(text: str) -> str:
    """A string as a literal of xgrammar's EBNF."""
    out = ['"']
    for ch in text:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def python_regex_to_xgrammar(regex: str) -> str:
    """Drops the names of Python's named groups, `(?P<name>` and `(?<name>`, which xgrammar's
    regex parser does not read; everything else is passed through for xgrammar to judge."""
    out: list[str] = []
    i, n, in_class = 0, len(regex), False
    while i < n:
        ch = regex[i]
        if ch == "\\":
            out.append(regex[i : i + 2])
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(" and regex.startswith("(?", i):
            m = re.match(r"\(\?P?<([A-Za-z_][A-Za-z0-9_]*)>", regex[i:])
            if m:
                out.append("(")
                i += m.end()
                continue
        out.append(ch)
        i += 1
    return "".join(out)


_RULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def rename_rules(ebnf: str, prefix: str) -> str:
    """Renames `root`, `root_1`, ... in an xgrammar EBNF text to `prefix`, `prefix_1`, ...,
    outside string literals and character classes (so a regex's text is never touched)."""
    out: list[str] = []
    i, n = 0, len(ebnf)
    while i < n:
        ch = ebnf[i]
        if ch in '"[':
            close = '"' if ch == '"' else "]"
            j = i + 1
            while j < n and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i : j + 1])
            i = j + 1
            continue
        m = _RULE_NAME.match(ebnf, i)
        if m:
            name = m.group(0)
            if name == "root" or re.fullmatch(r"root_\d+", name):
                name = prefix + name[4:]
            out.append(name)
            i = m.end()
            continue
        out.append(ch)
        i += 1
    return "".join(out)


# The free-whitespace construct in xgrammar's JSON grammars (any_whitespace=True).
ANY_WS = "[ \\n\\r\\t]*"

# xgrammar 0.2.8's JSON string characters, as it prints them, and what they become here:
# - a string with minLength/maxLength repeats `[^\"\\\r\n]`, which lets raw control characters
#   through (invalid JSON) and forbids escapes (xgrammar issue #800, fixes not released);
# - every string class admits U+D800-U+DFFF, whose UTF-8 form is invalid: detokenized, one such
#   "character" becomes three U+FFFD, breaking maxLength and regexes over the text.
_BOUNDED_STRING_RULE = re.compile(r'^(\S+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_JSON_CHAR = r"[^\0-\x1f\"\\\ud800-\udfff]"
# \u escapes of surrogates are left out too: a pair would count twice against minLength.
_JSON_ESCAPE = (
    r'("\\" ([\"\\/bfnrt] | "u" (([0-9A-Ca-cEeFf] [0-9A-Fa-f]) | ([Dd] [0-7])) [0-9A-Fa-f]{2}))'
)
_STRING_CLASS = r"[^\0-\x1f\"\\\r\n]"


def harden_json_ebnf(ebnf: str) -> str:
    """Valid JSON strings in xgrammar's JSON grammar text (see above): one JSON character per
    repetition of a bounded string (an escape counts as one, as in the decoded length), no
    control characters, no surrogate code points."""
    ebnf = _BOUNDED_STRING_RULE.sub(
        lambda m: f"{m.group(1)} ::= {_JSON_CHAR} | {_JSON_ESCAPE}", ebnf
    )
    return ebnf.replace(_STRING_CLASS, _JSON_CHAR)


WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


class SpecError(Exception):
    """The spec cannot be compiled; str() is the message for the client, `param` the field to
    name (None: the request's own field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def spec_kind(spec: dict[str, Any]) -> str:
    if spec.get("json_object"):
        return "json_object"
    for kind in ("json", "regex", "choice", "grammar"):
        if spec.get(kind) is not None:
            return kind
    raise SpecError("no structured output kind given")


def build_grammar(xgr: Any, spec: dict[str, Any]) -> Any:
    """The xgrammar Grammar of a spec (the fields of StructuredOutputSpec, as a dict). Raises
    SpecError for a spec xgrammar refuses."""
    kind = spec_kind(spec)
    try:
        if kind in ("json", "json_object"):
            return xgr.Grammar.from_ebnf(_json_ebnf(xgr, spec, kind))
        if kind == "regex":
            return xgr.Grammar.from_regex(python_regex_to_xgrammar(spec["regex"]))
        if kind == "choice":
            body = " | ".join(ebnf_literal(c) for c in spec["choice"])
            return xgr.Grammar.from_ebnf(f"root ::= {body}")
        grammar = spec["grammar"]
        if "::=" in grammar:
            return xgr.Grammar.from_ebnf(grammar, root_rule_name="root")
        return xgr.Grammar.from_lark(grammar)
    except SpecError:
        raise
    except RecursionError:
        raise SpecError(f"invalid {WHAT[kind]}: it is nested too deeply") from None
    except Exception as exc:  # xgrammar reports bad input as RuntimeError/ValueError
        raise SpecError(f"invalid {WHAT[kind]}: {xgr_message(exc)}") from exc


def _json_ebnf(xgr: Any, spec: dict[str, Any], kind: str) -> str:
    """The schema as xgrammar's EBNF, its strings hardened, and every free-whitespace gap
    replaced by the whitespace pattern's rule when one is given."""
    schema = spec["json"] if kind == "json" else '{"type":"object"}'
    pattern = spec.get("whitespace_pattern")
    grammar = xgr.Grammar.from_json_schema(
        schema,
        any_whitespace=bool(spec.get("any_whitespace")) or pattern is not None,
        strict_mode=kind == "json",
    )
    ebnf = harden_json_ebnf(str(grammar))
    if pattern is None:
        return ebnf
    try:
        ws = str(xgr.Grammar.from_regex(python_regex_to_xgrammar(pattern)))
    except Exception as exc:
        raise SpecError(
            f"invalid whitespace pattern: {xgr_message(exc)}", "guided_whitespace_pattern"
        ) from exc
    name = "json_ws_pattern"
    return ebnf.replace(ANY_WS, name) + "\n" + rename_rules(ws, name) + "\n"


# ---------------------------------------------------------------------------------------------
# Grammars that accept nothing
# ---------------------------------------------------------------------------------------------
#
# xgrammar compiles a grammar whose root can never finish (a rule that only recurses, such as a
# JSON schema $ref cycle whose properties are all required) without complaint; the matcher then
# lets the model start and strands it, and the request "succeeds" with nothing. So the printed
# grammar (xgrammar's normal form: one rule a line, `name ::= body`) is checked here: a rule is
# productive when one of its alternatives is made only of literals, character classes, optional
# or starred parts, and productive rules; the root must be productive.

_TOKEN = re.compile(
    r'\s*(?:("(?:[^"\\]|\\.)*")|(\[(?:[^\]\\]|\\.)*\])|([A-Za-z_][A-Za-z0-9_.]*)'
    r"|(\{\s*(\d+)\s*,\s*(-?\d+)\s*\})|(\(=)|([()|*+?]))",
    re.S,
)


def _tokens(body: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(body):
        m = _TOKEN.match(body, i)
        if m is None:
            if body[i:].strip():
                raise ValueError(f"unexpected text at {body[i : i + 20]!r}")
            break
        i = m.end()
        if m.group(1) is not None or m.group(2) is not None:
            out.append(("term", None))
        elif m.group(3) is not None:
            out.append(("rule", m.group(3)))
        elif m.group(4) is not None:
            out.append(("repeat", int(m.group(5))))
        elif m.group(7) is not None:
            out.append(("look", None))
        else:
            out.append((m.group(8), None))
    return out


class _Parser:
    """Builds `("alt", [seq, ...])`, `("seq", [item, ...])`, `("rule", name)`, `("term",)`
    and `("opt",)` (something that may match nothing)."""

    def __init__(self, tokens: list[tuple[str, Any]]) -> None:
        self.tokens = tokens
        self.i = 0

    def peek(self) -> str | None:
        return self.tokens[self.i][0] if self.i < len(self.tokens) else None

    def alternatives(self) -> tuple:
        seqs = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            seqs.append(self.sequence())
        return ("alt", seqs)

    def sequence(self) -> tuple:
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.item())
        return ("seq", items)

    def item(self) -> tuple:
        kind, value = self.tokens[self.i]
        self.i += 1
        if kind == "look":  # a lookahead consumes nothing: read past it
            self.alternatives()
            self.expect(")")
            node: tuple = ("term",)
        elif kind == "(":
            node = self.alternatives()
            self.expect(")")
        elif kind == "rule":
            node = ("rule", value)
        elif kind == "term":
            node = ("term",)
        else:
            raise ValueError(f"unexpected {kind!r}")
        kind = self.peek()
        while kind in ("*", "?", "+", "repeat"):
            low = self.tokens[self.i][1]
            self.i += 1
            if kind in ("*", "?") or (kind == "repeat" and low == 0):
                node = ("opt",)
            kind = self.peek()
        return node

    def expect(self, kind: str) -> None:
        if self.peek() != kind:
            raise ValueError(f"expected {kind!r}")
        self.i += 1


def _productive(node: tuple, done: set[str]) -> bool:
    kind = node[0]
    if kind in ("term", "opt"):
        return True
    if kind == "rule":
        return node[1] in done
    if kind == "seq":
        return all(_productive(item, done) for item in node[1])
    return any(_productive(seq, done) for seq in node[1])


def _references(node: tuple) -> set[str]:
    refs, stack = set(), [node]
    while stack:
        item = stack.pop()
        if item[0] == "rule":
            refs.add(item[1])
        elif item[0] in ("seq", "alt"):
            stack.extend(item[1])
    return refs


def accepts_nothing(ebnf: str, root: str = "root") -> bool:
    """Whether the grammar (xgrammar's printed form) can never produce a complete output.
    Text this reader does not follow counts as productive: the check only ever refuses what it
    has proved empty."""
    rules: dict[str, tuple] = {}
    try:
        for line in ebnf.splitlines():
            if "::=" not in line:
                continue
            name, body = line.split("::=", 1)
            parser = _Parser(_tokens(body))
            rules[name.strip()] = parser.alternatives()
            if parser.peek() is not None:
                return False
    except (ValueError, IndexError, RecursionError):
        return False
    if root not in rules:
        return False
    # A worklist: a rule is looked at again only when a rule it refers to becomes productive.
    referrers: dict[str, set[str]] = {name: set() for name in rules}
    for name, node in rules.items():
        for ref in _references(node):
            referrers.setdefault(ref, set()).add(name)
    done: set[str] = set()
    queue = [name for name, node in rules.items() if _productive(node, done)]
    done.update(queue)
    while queue:
        for name in referrers.get(queue.pop(), ()):
            if name not in done and _productive(rules[name], done):
                done.add(name)
                queue.append(name)
    return root not in done


# ---------------------------------------------------------------------------------------------
# The child's loop
# ---------------------------------------------------------------------------------------------

MAX_TOKENIZERS = 4


def compile_spec(xgr: Any, compiler: Any, spec: dict[str, Any], max_bytes: int) -> Any:
    """The xgrammar CompiledGrammar of a spec; SpecError when it is invalid, accepts nothing, or
    compiles to more than `max_bytes`."""
    grammar = build_grammar(xgr, spec)
    kind = spec_kind(spec)
    if accepts_nothing(str(grammar)):
        raise SpecError(
            f"invalid {WHAT[kind]}: it accepts no output at all (every way through it recurses "
            "forever, as in a $ref cycle whose properties are all required)"
        )
    try:
        compiled = compiler.compile_grammar(grammar)
    except Exception as exc:
        raise SpecError(f"invalid {WHAT[kind]}: {xgr_message(exc)}") from exc
    size = int(compiled.memory_size_bytes)
    if size > max_bytes:
        raise SpecError(
            f"the {WHAT[kind]} compiles to {size / 2**20:.0f} MiB, over the limit of "
            f"{max_bytes / 2**20:.0f} MiB: simplify it"
        )
    return compiled


def serve(inp: BinaryIO, out: BinaryIO, xgr: Any) -> None:
    """One compile process's loop: frames in, frames out, until EOF."""
    compilers: OrderedDict[str, Any] = OrderedDict()
    write_frame(out, {"ready": True})
    while True:
        message = read_frame(inp)
        if message is None:
            return
        key = message.get("key", "")
        if message.get("op") == "info":
            info = xgr.TokenizerInfo.deserialize_json(message["info"])
            compilers[key] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            while len(compilers) > MAX_TOKENIZERS:
                compilers.popitem(last=False)
            write_frame(out, {"ok": True})
            continue
        compiler = compilers.get(key)
        if compiler is None:
            write_frame(out, {"need_info": True})
            continue
        compilers.move_to_end(key)
        try:
            compiled = compile_spec(xgr, compiler, message["spec"], int(message["max_bytes"]))
        except SpecError as exc:
            write_frame(out, {"error": str(exc), "param": exc.param})
            continue
        except Exception as exc:  # keep serving: one bad spec must not end the process
            write_frame(out, {"error": f"cannot compile it: {xgr_message(exc)}", "param": None})
            continue
        write_frame(out, {"ok": compiled.serialize_json()})


def zygote(control_fd: int) -> None:
    """The template process: imports xgrammar once (seconds: it imports torch), then forks a
    compile process, in milliseconds, for each `F` byte that arrives on the control socket with
    the compile process's own socket attached. It answers with the new pid (8 bytes). Forked
    children are reaped by the kernel (SIGCHLD ignored); EOF on the control socket ends it."""
    import signal
    import socket

    control = socket.socket(fileno=control_fd)
    sys.stdout = sys.stderr  # nothing but frames on the sockets, nothing on stdout
    try:
        os.nice(19)  # the engine's steps come first; the children inherit it
    except OSError:
        pass
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 20000))
    import xgrammar as xgr

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    control.sendall(b"R")
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 16, 1)
        except OSError:
            return
        if not message:
            return
        if not fds:
            continue
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                control.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                sock = socket.socket(fileno=fds[0])
                serve(sock.makefile("rb"), sock.makefile("wb"), xgr)
            except BaseException:  # the parent went away, or a bug: nothing to report to
                status = 1
            finally:
                os._exit(status)
        os.close(fds[0])
        control.sendall(struct.pack(">Q", pid))


if __name__ == "__main__":
    try:
        zygote(int(sys.argv[1]))
    except (BrokenPipeError, KeyboardInterrupt):  # the parent went away: nothing to report
        pass

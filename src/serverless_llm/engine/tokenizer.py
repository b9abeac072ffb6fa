"""Tokenizer side of the engine: loading, end-of-sequence ids, chat templates, the incremental
detokenizer that turns sampled token ids into streamable text, and the stop-string matcher that
sits on that text.

The detokenizer is on the hot path (every sequence, every step), so it decodes only a small window
of recent tokens per call and goes straight to the Rust `tokenizers` backend when there is one.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import tokenizers
import transformers

__all__ = [
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "StopStringMatcher",
    "apply_chat_template",
    "eos_token_ids",
    "load_generation_config",
    "load_tokenizer",
]

# What a decoder emits for bytes that are not (yet) a whole UTF-8 character.
_REPLACEMENT = "\ufffd"
# Prompt tokens with visible text that seed the decode window, so the first output token is
# decoded in context (a sentencepiece "▁word" at the start of a decode loses its space).
_PROMPT_CONTEXT_TOKENS = 5
# How far back into the prompt to look for that context past skipped special tokens.
_MAX_PROMPT_LOOKBACK = 32
# A UTF-8 character is at most 4 bytes, so at most 4 trailing tokens can hold an unfinished one.
_MAX_UTF8_TOKENS = 4
# Tokens before the window are dropped from memory once this many have piled up.
_WINDOW_TRIM = 256


class ChatTemplateError(ValueError):
    """A chat prompt cannot be rendered: no template, a template error, or conflicting options."""


# -- loading ---------------------------------------------------------------------------------


def load_tokenizer(
    path: str,
    revision: str | None = None,
    trust_remote_code: bool = False,
    *,
    gguf_file: str | None = None,
) -> transformers.PreTrainedTokenizerBase:
    """Loads a tokenizer with AutoTokenizer (transformers 5 always prefers the fast one).

    `path` may also name a `.gguf` file directly; the tokenizer is then read from the GGUF
    metadata, as for the embedded SmolLM2 model.
    """
    kwargs: dict[str, Any] = {"revision": revision, "trust_remote_code": trust_remote_code}
    if gguf_file is None and path.endswith(".gguf") and os.path.isfile(path):
        path, gguf_file = os.path.split(os.path.abspath(path))
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    return transformers.AutoTokenizer.from_pretrained(path, **kwargs)


def load_generation_config(model_dir: str) -> transformers.GenerationConfig | None:
    """The model's generation_config.json, or None without one (the model config's EOS ids
    are enough then)."""
    try:
        return transformers.GenerationConfig.from_pretrained(model_dir)
    except Exception:  # missing or unreadable: only its EOS ids were wanted
        return None


def eos_token_ids(tokenizer: Any, *configs: Any) -> set[int]:
    """Every id that ends generation.

    Models disagree on where they declare it: the tokenizer has one EOS token, while config.json
    and generation_config.json may list several (Llama-3 instruct ends on <|eot_id|> too), so the
    union is taken. `configs` may be config objects, plain dicts or None.
    """
    ids: set[int] = set()
    if tokenizer is not None:
        _collect_ids(ids, getattr(tokenizer, "eos_token_id", None))
    for config in configs:
        if config is None:
            continue
        if isinstance(config, Mapping):
            _collect_ids(ids, config.get("eos_token_id"))
            continue
        _collect_ids(ids, getattr(config, "eos_token_id", None))
        # Composite (multimodal) configs keep it on their text config.
        get_text_config = getattr(config, "get_text_config", None)
        if callable(get_text_config):
            text_config = get_text_config()
            if text_config is not None and text_config is not config:
                _collect_ids(ids, getattr(text_config, "eos_token_id", None))
    return ids


def _collect_ids(ids: set[int], value: Any) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if value >= 0:
            ids.add(value)
        return
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        for v in value:
            _collect_ids(ids, v)


# -- chat templates --------------------------------------------------------------------------

# apply_chat_template's own parameters: a template variable with one of these names would change
# what the call returns (tokens, tensors, ...) instead of reaching the template.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    chat_template_kwargs: dict | None = None,
) -> str:
    """Renders `messages` to a prompt string with the model's jinja chat template.

    `chat_template` replaces the model's (or names one of its templates). `chat_template_kwargs`
    become template variables and, as in vLLM, may override add_generation_prompt and
    continue_final_message. Every failure is a ChatTemplateError, so callers can answer 400.
    """
    options: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
    }
    if chat_template_kwargs:
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(chat_template_kwargs))
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        options.update(chat_template_kwargs)
    if options["add_generation_prompt"] and options["continue_final_message"]:
        raise ChatTemplateError(
            "add_generation_prompt and continue_final_message cannot both be true: continue the "
            "final message or start a new assistant turn, not both"
        )
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError(
            "this model has no chat template; pass chat_template or use completions"
        )
    if "developer" not in chat_template_source(tokenizer, chat_template):
        # OpenAI's `developer` messages are system instructions; a template that does not know
        # the role would render it as a turn of its own, which the model was never trained on.
        messages = [
            {**m, "role": "system"} if m.get("role") == "developer" else m for m in messages
        ]
    try:
        rendered = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            documents=documents,
            chat_template=chat_template,
            tokenize=False,
            **options,
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from e
    except Exception as e:  # noqa: BLE001 - templates run arbitrary code on user input
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
    if not isinstance(rendered, str):
        raise ChatTemplateError(f"chat template rendered {type(rendered).__name__}, not a string")
    return rendered


def chat_template_source(tokenizer: Any, chat_template: str | None) -> str:
    """The text of the template that will render (every named one when it is not known which)."""
    own = getattr(tokenizer, "chat_template", None)
    if chat_template is None:
        return " ".join(own.values()) if isinstance(own, dict) else (own or "")
    if isinstance(own, dict) and chat_template in own:  # the name of one of the model's templates
        return own[chat_template]
    return chat_template


# -- incremental detokenizer -----------------------------------------------------------------


@dataclass(frozen=True)
class _TokenizerFacts:
    """What the detokenizer needs from a tokenizer, computed once per tokenizer, not per request."""

    vocab_len: int
    backend: tokenizers.Tokenizer | None  # the Rust tokenizer, when there is one
    special_ids: frozenset[int]  # ids dropped by skip_special_tokens
    added_ids: frozenset[int]  # added tokens (special or not)


_FACTS: weakref.WeakKeyDictionary[Any, _TokenizerFacts] = weakref.WeakKeyDictionary()


def _tokenizer_facts(tokenizer: Any) -> _TokenizerFacts:
    vocab_len = len(tokenizer)
    try:
        facts = _FACTS.get(tokenizer)
    except TypeError:  # not weak-referenceable or not hashable: no cache
        facts = None
    if facts is not None and facts.vocab_len == vocab_len:
        return facts
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        backend = None
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    # The Rust backend skips added tokens flagged special; transformers' Python tokenizers skip
    # `all_special_ids`, which can differ from the flags.
    special = {i for i, tok in added.items() if getattr(tok, "special", False)}
    if backend is None:
        special.update(getattr(tokenizer, "all_special_ids", None) or ())
    facts = _TokenizerFacts(vocab_len, backend, frozenset(special), frozenset(added))
    try:
        _FACTS[tokenizer] = facts
    except TypeError:
        pass
    return facts


def _make_decoder(
    tokenizer: Any, facts: _TokenizerFacts, skip_special_tokens: bool, spaces_between: bool
) -> Callable[[list[int]], str]:
    """Returns ids -> text with the request's options bound, on the cheapest path available."""
    if facts.backend is not None:
        backend_decode = facts.backend.decode

        def decode_plain(ids: list[int]) -> str:
            return backend_decode(ids, skip_special_tokens=skip_special_tokens)

        def decode_segment(ids: list[int]) -> str:
            return backend_decode(ids, skip_special_tokens=False)
    else:
        # No Rust backend: go through transformers. Clean-up of tokenization spaces is off
        # because it rewrites text across token boundaries, which a stream cannot take back.
        def decode_plain(ids: list[int]) -> str:
            return tokenizer.decode(
                ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )

        def decode_segment(ids: list[int]) -> str:
            return tokenizer.decode(
                ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )

    if spaces_between or not facts.added_ids:
        return decode_plain

    added = facts.added_ids
    skipped = facts.special_ids if skip_special_tokens else frozenset()

    def decode_tight(ids: list[int]) -> str:
        # Some decoders (WordPiece, for one) put a space between two adjacent added tokens;
        # decoding the runs on either side of such a pair separately joins them without it.
        if skipped:
            ids = [i for i in ids if i not in skipped]
        parts: list[str] = []
        start = 0
        for k in range(1, len(ids)):
            if ids[k] in added and ids[k - 1] in added:
                parts.append(decode_segment(ids[start:k]))
                start = k
        if not parts:
            return decode_segment(ids)
        parts.append(decode_segment(ids[start:]))
        return "".join(parts)

    return decode_tight


def _window_start(prompt: Sequence[int], skipped: frozenset[int]) -> int:
    """Where the decode window starts in the prompt: a few tokens back that produce text."""
    start = len(prompt)
    floor = max(start - _MAX_PROMPT_LOOKBACK, 0)
    visible = 0
    while start > floor and visible < _PROMPT_CONTEXT_TOKENS:
        start -= 1
        if prompt[start] not in skipped:
            visible += 1
    return start


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text deltas, a few tokens at a time.

    Decoding the whole output every step would be O(sequence) per token, and decoding only the
    new token gets spaces and multi-byte characters wrong (sentencepiece drops the leading space
    of the first token of a decode; a character can span several byte tokens). So it keeps a
    small window: `window[prefix_offset:read_offset]` is text already emitted, and each call
    decodes the window with and without the new tokens and emits the difference. Text that ends
    in U+FFFD is held back until a later token completes the character.

    Concatenated deltas equal `tokenizer.decode(prompt + output)` minus the decoded prompt
    (for byte-level BPE that is just `decode(output)`) without clean-up of tokenization spaces.
    """

    __slots__ = (
        "_decode",
        "_window",
        "_prefix_offset",
        "_read_offset",
        "_prefix_text",
        "_output_ids",
        "_chunks",
    )

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        """`spaces_between_special_tokens=False` joins adjacent added tokens (those left after
        skipping) without the space some decoders put between them; decoders that add none
        (byte-level BPE, sentencepiece: most LLMs) give the same text either way."""
        facts = _tokenizer_facts(tokenizer)
        self._decode = _make_decoder(
            tokenizer,
            facts,
            skip_special_tokens,
            spaces_between_special_tokens,
        )
        skipped = facts.special_ids if skip_special_tokens else frozenset()
        start = _window_start(prompt_token_ids, skipped)
        # Never start inside a character: byte-fallback decoders turn a whole run of byte tokens
        # into U+FFFD when it starts with a continuation byte, output bytes included.
        for _ in range(_MAX_UTF8_TOKENS - 1):
            if start == 0 or not self._decode(list(prompt_token_ids[start:])).startswith(
                _REPLACEMENT
            ):
                break
            start -= 1
        self._window: list[int] = [int(t) for t in prompt_token_ids[start:]]
        self._prefix_offset = 0
        self._read_offset = len(self._window)
        self._prefix_text: str | None = None  # decode(window[prefix_offset:read_offset]), lazily
        self._output_ids: list[int] = []
        self._chunks: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """Output token ids so far."""
        return self._output_ids

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        chunks = self._chunks
        if len(chunks) > 1:
            chunks[:] = ["".join(chunks)]
        return chunks[0] if chunks else ""

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Appends output tokens; returns the text they complete (possibly "")."""
        if not new_token_ids:
            return ""
        self._output_ids.extend(new_token_ids)
        window = self._window
        window.extend(new_token_ids)
        return self._advance(flush=False)

    def flush(self) -> str:
        """Returns text still held back (an unfinished character, as U+FFFD); for the end of a
        sequence, after which `text` equals the full decode."""
        return self._advance(flush=True)

    def _advance(self, flush: bool) -> str:
        window = self._window
        decode = self._decode
        prefix_offset = self._prefix_offset
        read_offset = self._read_offset
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._prefix_text = decode(window[prefix_offset:read_offset])

        end = len(window)
        if end == read_offset:
            return ""
        new_text = decode(window[prefix_offset:end])
        if not flush:
            # An unfinished character at the end: emit what the tokens before it complete (a
            # multi-token add can finish text and start a character at once), else wait.
            floor = max(read_offset, end - _MAX_UTF8_TOKENS)
            while new_text.endswith(_REPLACEMENT):
                end -= 1
                if end <= floor:
                    return ""
                new_text = decode(window[prefix_offset:end])
        if len(new_text) <= len(prefix_text):
            # No visible text yet (a skipped special token, or a token whose text a decoder
            # only shows once it knows what follows): keep it in the window.
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = read_offset
        self._read_offset = end
        self._prefix_text = None
        if read_offset >= _WINDOW_TRIM:
            del window[:read_offset]
            self._prefix_offset = 0
            self._read_offset = end - read_offset
        self._chunks.append(delta)
        return delta


# -- stop strings ----------------------------------------------------------------------------


class StopStringMatcher:
    """Finds stop strings in a sequence's streamed text, also when one spans several tokens.

    Text that could be the start of a stop string is held back until the next text decides
    it, so nothing a client has been shown is ever taken back: `feed` returns only what is
    certain to stay. With `include_in_output` the stop string itself is part of the output, so
    nothing needs holding back; text after the stop string is never released either way.
    A match counts from the first occurrence in the text (the earliest start; at the same
    start, the stop string listed first).
    """

    __slots__ = ("stops", "include", "_pending", "_tail", "_longest")

    def __init__(self, stops: Sequence[str], include_in_output: bool = False) -> None:
        if not stops or any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = list(stops)
        self.include = include_in_output
        self._longest = max(len(s) for s in self.stops)
        self._pending = ""  # held back (not yet released)
        self._tail = ""  # the last released characters, where a match may start (include)

    def feed(self, text: str, active: bool = True) -> tuple[str, str | None]:
        """Takes the next text; returns (text released now, the stop string that ends the
        output or None). While not `active` (min_tokens not reached) stop strings are let
        through as ordinary text."""
        if not text:
            return "", None
        if self.include:
            window = self._tail + text
            offset = len(self._tail)
            hit = self._first_match(window, offset) if active else None
            if hit is not None:
                start, stop = hit
                released = window[offset : start + len(stop)]
                self._tail = ""
                return released, stop
            self._tail = window[-(self._longest - 1) :] if self._longest > 1 else ""
            return text, None
        buf = self._pending + text
        if active:
            hit = self._first_match(buf, 0)
            if hit is not None:
                self._pending = ""
                return buf[: hit[0]], hit[1]
        hold = self._held_suffix(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        """Releases what is held back (the output ended some other way)."""
        pending, self._pending = self._pending, ""
        return pending

    def _first_match(self, text: str, offset: int) -> tuple[int, str] | None:
        """The earliest stop string in `text` that ends past `offset`."""
        best: tuple[int, str] | None = None
        for stop in self.stops:
            i = text.find(stop, max(0, offset - len(stop) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that a stop string starts with (a proper
        prefix: a whole stop string is a match). Searched from the text's side, so the work
        grows with the text, never with the square of a stop string's length (a set of every
        prefix of a 1 MB stop string would hold 500 GB)."""
        best = 0
        for stop in self.stops:
            longest = min(len(text), len(stop) - 1)
            start = len(text) - longest  # the longest suffix that could still be a prefix
            j = text.find(stop[0], start) if longest > best else -1
            while j >= 0 and len(text) - j > best:
                if stop.startswith(text[j:]):
                    best = len(text) - j
                    break
                j = text.find(stop[0], j + 1)
        return best

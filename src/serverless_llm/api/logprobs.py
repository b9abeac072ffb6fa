"""Logprobs in the shapes each route reports them, from the engine's `TokenLogprob`s.

- OpenAI chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`; the
  top_logprobs are exactly the `top_logprobs` most likely tokens.
- OpenAI completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; each
  top_logprobs entry maps token text -> logprob for the top k and the sampled token (so up to
  k + 1 entries, as OpenAI documents).
- prompt_logprobs (vLLM's extension): per prompt token, None for the first, then
  `{"<token id>": {"logprob", "rank", "decoded_token"}}` for the token and the top k.
- native: per generated token `{"token_id", "token", "logprob", "top_logprobs": [{"token_id",
  "token", "logprob"}]}`, and prompt_logprobs the same with a "rank".

A token's text is its own decode (vLLM's choice: a token holding part of a character shows
U+FFFD); its `bytes` are the token's real bytes where the tokenizer is byte-level, so clients
can join them into characters.
"""

from __future__ import annotations

from typing import Any

from serverless_llm.engine import TokenLogprob

__all__ = ["TokenDecoder", "chat_logprobs", "completion_logprobs", "native_logprobs"]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: what byte-level BPE token strings spell."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _byte_decoder()


class TokenDecoder:
    """Token id -> its text and bytes, cached per request (the same ids come back often)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())

    def text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id])
        return text

    def bytes(self, token_id: int) -> list[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = None
            if self._byte_level and token_id not in self._added:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and all(c in _BYTE_DECODER for c in piece):
                    raw = [_BYTE_DECODER[c] for c in piece]
            if raw is None:
                raw = list(self.text(token_id).encode("utf-8"))
            self._bytes[token_id] = raw
        return raw


def chat_logprobs(
    entries: list[TokenLogprob], top: int, decoder: TokenDecoder
) -> list[dict[str, Any]]:
    """The `content` items of a chat choice's logprobs."""
    out = []
    for e in entries:
        out.append(
            {
                "token": decoder.text(e.token_id),
                "logprob": e.logprob,
                "bytes": decoder.bytes(e.token_id),
                "top_logprobs": [
                    {"token": decoder.text(t), "logprob": lp, "bytes": decoder.bytes(t)}
                    for t, lp in zip(e.top_ids[:top], e.top_logprobs[:top])
                ],
            }
        )
    return out


def completion_logprobs(
    entries: list[TokenLogprob | None],
    top: int,
    decoder: TokenDecoder,
    offset: int,
) -> tuple[dict[str, Any], int]:
    """A completions choice's logprobs for `entries` (None: the first prompt token, which has
    no logprob), text offsets starting at `offset`; returns it and the offset after it."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for e in entries:
        if e is None:
            continue
        text = decoder.text(e.token_id)
        tokens.append(text)
        values.append(e.logprob)
        best = {decoder.text(t): lp for t, lp in zip(e.top_ids[:top], e.top_logprobs[:top])}
        best.setdefault(text, e.logprob)
        tops.append(best)
        offsets.append(offset)
        offset += len(text)
    return (
        {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets},
        offset,
    )


def first_prompt_token(token_id: int, decoder: TokenDecoder, offset: int = 0) -> dict[str, Any]:
    """The first prompt token of an echo: text, no logprob."""
    return {
        "tokens": [decoder.text(token_id)],
        "token_logprobs": [None],
        "top_logprobs": [None],
        "text_offset": [offset],
    }


def merge_completion_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for part in parts:
        for key in out:
            out[key].extend(part[key])
    return out


def prompt_logprobs_vllm(
    entries: list[TokenLogprob | None], top: int, decoder: TokenDecoder
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt token, the token and the top k by id."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        item = {
            str(e.token_id): {
                "logprob": e.logprob,
                "rank": e.rank,
                "decoded_token": decoder.text(e.token_id),
            }
        }
        for rank, (t, lp) in enumerate(zip(e.top_ids[:top], e.top_logprobs[:top]), start=1):
            item.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": decoder.text(t)})
        out.append(item)
    return out


def native_logprobs(
    entries: list[TokenLogprob | None], top: int, decoder: TokenDecoder, with_rank: bool = False
) -> list[dict[str, Any] | None]:
    """The native route's logprobs: one object per token (None for the first prompt token)."""
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        item: dict[str, Any] = {
            "token_id": e.token_id,
            "token": decoder.text(e.token_id),
            "logprob": e.logprob,
        }
        if with_rank:
            item["rank"] = e.rank
        item["top_logprobs"] = [
            {"token_id": t, "token": decoder.text(t), "logprob": lp}
            for t, lp in zip(e.top_ids[:top], e.top_logprobs[:top])
        ]
        out.append(item)
    return out

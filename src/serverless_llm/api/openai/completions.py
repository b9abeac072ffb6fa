"""/v1/completions: prompts -> token ids, and engine outputs -> OpenAI's text_completion shapes.

A request may carry several prompts (a list of strings or of token-id lists); each gets `n`
choices, and choice `i` of prompt `p` has index `p * n + i`, as OpenAI numbers them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import OpenAIServingError
from .protocol import CompletionRequest


@dataclass
class PromptInput:
    token_ids: list[int]
    text: str | None  # the prompt as given, for echo; None for token ids
    param: str  # how errors name it: "prompt", or "prompt[i]" in a list of prompts


def split_prompts(prompt: Any) -> tuple[list[str | list[int]], bool]:
    """OpenAI's four prompt forms (already shape-checked) as a list of single prompts, and
    whether the request gave a list of them."""
    if isinstance(prompt, str):
        return [prompt], False
    if prompt and isinstance(prompt[0], (str, list)):
        return list(prompt), True
    return [prompt], False  # one list of token ids


def tokenize_prompts(
    request: CompletionRequest, tokenizer: Any, vocab_size: int
) -> list[PromptInput]:
    """Tokenizes text prompts and range-checks token-id prompts, naming the bad one."""
    prompts, is_list = split_prompts(request.prompt)
    out: list[PromptInput] = []
    for p, prompt in enumerate(prompts):
        param = f"prompt[{p}]" if is_list else "prompt"
        if isinstance(prompt, str):
            ids = list(tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens))
            out.append(PromptInput(ids, prompt, param))
            continue
        for t in prompt:
            if not 0 <= t < vocab_size:
                raise OpenAIServingError.bad_request(
                    f"Invalid value for '{param}': token id {t} is out of range (the vocabulary "
                    f"has {vocab_size} tokens).",
                    param,
                    "invalid_value",
                )
        out.append(PromptInput(list(prompt), None, param))
    return out


class CompletionFormatter:
    """Builds text_completion responses and chunks (OpenAI uses the same object for both)."""

    def __init__(
        self, response_id: str, created: int, model: str, echo: list[str] | None, n: int
    ) -> None:
        self.response_id = response_id
        self.created = created
        self.model = model
        self.echo = echo  # per prompt, when echo is on
        self.n = n

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def head_chunks(self, index: int) -> list[dict[str, Any]]:
        """With echo, each choice's stream opens with its prompt's text."""
        if self.echo is None:
            return []
        text = self.echo[index // self.n]
        return [
            self._chunk([{"index": index, "text": text, "logprobs": None, "finish_reason": None}])
        ]

    def delta_chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        stop_reason: int | str | None,
        usage: dict[str, int] | None,
    ) -> dict[str, Any] | None:
        if not text and finish_reason is None and usage is None:
            return None  # a token whose text is still held back (part of a character)
        choice: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        chunk = self._chunk([choice])
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage
        return chunk

    def response(
        self,
        texts: list[str],
        finish_reasons: list[str | None],
        stop_reasons: list[int | str | None],
        usage: dict[str, int],
    ) -> dict[str, Any]:
        choices = []
        for k, text in enumerate(texts):
            if self.echo is not None:
                text = self.echo[k // self.n] + text
            choices.append(
                {
                    "index": k,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish_reasons[k],
                    "stop_reason": stop_reasons[k],
                }
            )
        chunk = self._chunk(choices)
        chunk["usage"] = usage
        return chunk

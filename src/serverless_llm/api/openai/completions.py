"""/v1/completions: prompts -> token ids, and engine outputs -> OpenAI's text_completion shapes.

A request may carry several prompts (a list of strings or of token-id lists); each gets `n`
choices, and choice `i` of prompt `p` has index `p * n + i`, as OpenAI numbers them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from serverless_llm.engine import EngineOutput, PromptInput, TokenLogprob

from ..logprobs import (
    TokenDecoder,
    completion_logprobs,
    first_prompt_token,
    merge_completion_logprobs,
    prompt_logprobs_vllm,
)
from ..results import SequenceResult
from .errors import OpenAIServingError
from .harmony import HarmonyParser
from .protocol import CompletionRequest, ResponseFormatter


def split_prompts(prompt: Any) -> tuple[list[str | list[int]], bool]:
    """OpenAI's four prompt forms (already shape-checked) as a list of single prompts, and
    whether the request gave a list of them."""
    if isinstance(prompt, str):
        return [prompt], False
    if prompt and isinstance(prompt[0], (str, list)):
        return list(prompt), True
    return [prompt], False  # one list of token ids


# Fill-in-the-middle markers, (prefix, suffix, middle), in the prefix-suffix-middle order every
# one of these models was trained on: StarCoder / StarCoder2 / SantaCoder, Qwen2.5-Coder and
# CodeGemma, DeepSeek-Coder, Code Llama.
FIM_FORMATS: tuple[tuple[str, str, str], ...] = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),
)


def fim_token_ids(tokenizer: Any) -> tuple[int, int, int] | None:
    """The model's fill-in-the-middle token ids, or None when it has none of FIM_FORMATS."""
    for tokens in FIM_FORMATS:
        ids = tokenizer.convert_tokens_to_ids(list(tokens))
        if all(
            isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == t
            for i, t in zip(ids, tokens)
        ):
            return ids[0], ids[1], ids[2]
    return None


def fim_prompt(
    tokenizer: Any, fim: tuple[int, int, int], prefix_ids: list[int], suffix: str
) -> list[int]:
    """<prefix> prompt <suffix> suffix <middle>: the model writes what goes between. A BOS the
    tokenizer put first stays first."""
    lead: list[int] = []
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and prefix_ids[:1] == [bos]:
        lead, prefix_ids = [bos], prefix_ids[1:]
    suffix_ids = list(tokenizer.encode(suffix, add_special_tokens=False))
    pre, suf, mid = fim
    return [*lead, pre, *prefix_ids, suf, *suffix_ids, mid]


def tokenize_prompts(
    request: CompletionRequest, tokenizer: Any, vocab_size: int
) -> list[tuple[str, PromptInput]]:
    """Tokenizes text prompts and range-checks token-id prompts, naming the bad one. Each
    prompt comes with the name errors give it: "prompt", or "prompt[i]" in a list of them.
    With `suffix`, each prompt becomes a fill-in-the-middle prompt (a 400 where the model has
    no FIM tokens)."""
    fim = None
    if request.suffix:
        fim = fim_token_ids(tokenizer)
        if fim is None:
            raise OpenAIServingError.bad_request(
                "'suffix' needs a model trained for fill-in-the-middle (StarCoder, "
                "Qwen2.5-Coder, DeepSeek-Coder, Code Llama style FIM tokens); this model's "
                "tokenizer has none.",
                "suffix",
                "invalid_value",
            )
    prompts, is_list = split_prompts(request.prompt)
    out: list[tuple[str, PromptInput]] = []
    for p, prompt in enumerate(prompts):
        param = f"prompt[{p}]" if is_list else "prompt"
        if isinstance(prompt, str):
            ids = list(tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens))
            if fim is not None:
                ids = fim_prompt(tokenizer, fim, ids, request.suffix or "")
            out.append((param, PromptInput(ids, prompt)))
            continue
        for t in prompt:
            if not 0 <= t < vocab_size:
                raise OpenAIServingError.bad_request(
                    f"Invalid value for '{param}': token id {t} is out of range (the vocabulary "
                    f"has {vocab_size} tokens).",
                    param,
                    "invalid_value",
                )
        ids = list(prompt)
        if fim is not None:
            ids = fim_prompt(tokenizer, fim, ids, request.suffix or "")
        out.append((param, PromptInput(ids)))
    return out


class CompletionFormatter(ResponseFormatter):
    """Builds text_completion responses and chunks (OpenAI uses the same object for both).

    With `logprobs: k` each choice carries OpenAI's legacy logprobs object; with echo too, it
    starts with the prompt's tokens (the first without a logprob), so a streamed echo waits for
    the first engine output, which brings the prompt's logprobs.

    `prompt_only` (echo with max_tokens 0): each choice is its prompt and the prompt's logprobs
    alone, finish_reason "length" and no completion tokens in the usage; the one token the
    engine made while scoring the prompt is dropped.
    """

    object_name = "text_completion"

    def __init__(
        self,
        response_id: str,
        created: int,
        model: str,
        echo: list[str] | None,
        n: int,
        *,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        prompt_ids: list[list[int]] | None = None,
        decoder: TokenDecoder | None = None,
        harmony: list[Callable[[], HarmonyParser] | None] | None = None,
        prompt_only: bool = False,
    ) -> None:
        """`harmony`: per prompt, a gpt-oss model's output parser factory for a prompt that
        ends inside an assistant message (None: the output is plain text). Such a choice's
        `text` is the answer (final channel) and its reasoning (analysis channel) comes as
        `reasoning_content`; tool calls are left out; logprobs list every output token."""
        super().__init__(response_id, created, model)
        self.prompt_only = prompt_only
        self.harmony = None if prompt_only else harmony
        self._readers: dict[int, HarmonyParser | None] = {}
        self.echo = echo  # per prompt, when echo is on
        self.n = n
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.prompt_ids = prompt_ids
        self.decoder = decoder
        self._offsets: dict[int, int] = {}  # text offset reached by each streamed choice
        self._echo_pending: set[int] = set()

    @property
    def _echo_logprobs(self) -> bool:
        return self.echo is not None and self.logprobs is not None

    def _prompt_part(
        self, index: int, prompt_logprobs: list[TokenLogprob | None] | None
    ) -> tuple[dict[str, Any], int]:
        """The echoed prompt's logprobs: its first token (no logprob), then the others."""
        first = first_prompt_token(self.prompt_ids[index // self.n][0], self.decoder)
        rest, offset = completion_logprobs(
            (prompt_logprobs or [None])[1:],
            self.logprobs,
            self.decoder,
            len(first["tokens"][0]),
        )
        return merge_completion_logprobs([first, rest]), offset

    def head_chunks(self, index: int) -> list[dict[str, Any]]:
        """With echo, each choice's stream opens with its prompt's text."""
        if self.echo is None:
            return []
        if self._echo_logprobs:
            self._echo_pending.add(index)  # sent with the first output (and its logprobs)
            return []
        text = self.echo[index // self.n]
        return [
            self._chunk([{"index": index, "text": text, "logprobs": None, "finish_reason": None}])
        ]

    def _no_completion(self, usage: dict[str, int] | None) -> dict[str, int] | None:
        """`usage` without the dropped token of a prompt_only request."""
        if usage is None or not self.prompt_only:
            return usage
        prompt = usage["prompt_tokens"]
        return {**usage, "completion_tokens": 0, "total_tokens": prompt}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return super().usage_chunk(self._no_completion(usage) or usage)

    def delta_chunk(
        self, index: int, out: EngineOutput, usage: dict[str, int] | None
    ) -> dict[str, Any] | None:
        text, finish_reason = out.new_text, out.finish_reason
        stop_reason, new_logprobs = out.stop_reason, out.logprobs
        if self.prompt_only:
            text, new_logprobs, stop_reason = "", None, None
            finish_reason = "length" if out.finished else None
            usage = self._no_completion(usage)
        reasoning = None
        reader = self._reader(index)
        if reader is not None:
            delta = reader.feed(out.new_token_ids) or {}
            text, reasoning = delta.get("content", ""), delta.get("reasoning_content")
        logprobs = None
        if self.logprobs is not None:
            parts = []
            offset = self._offsets.get(index, 0)
            if index in self._echo_pending:
                self._echo_pending.discard(index)
                text = self.echo[index // self.n] + text
                part, offset = self._prompt_part(index, out.prompt_logprobs)
                offset = len(self.echo[index // self.n])
                parts.append(part)
            if new_logprobs:
                part, offset = completion_logprobs(
                    new_logprobs, self.logprobs, self.decoder, offset
                )
                parts.append(part)
            self._offsets[index] = offset
            if parts:
                logprobs = merge_completion_logprobs(parts)
        chunk = self._delta_chunk(index, "text", text, logprobs, finish_reason, stop_reason, usage)
        if reasoning:
            if chunk is None:
                chunk = self._chunk(
                    [{"index": index, "text": "", "logprobs": None, "finish_reason": None}]
                )
            chunk["choices"][0]["reasoning_content"] = reasoning
        return chunk

    def _reader(self, index: int) -> HarmonyParser | None:
        """Choice `index`'s harmony parser, made on its first output (None: plain text)."""
        if self.harmony is None:
            return None
        if index not in self._readers:
            make = self.harmony[index // self.n]
            self._readers[index] = make() if make is not None else None
        return self._readers[index]

    def response(
        self,
        results: list[SequenceResult],
        prompt_logprobs: list[list[TokenLogprob | None] | None],
        usage: dict[str, int],
    ) -> dict[str, Any]:
        choices = []
        usage = self._no_completion(usage) or usage
        for k, r in enumerate(results):
            text = r.text
            p = k // self.n
            finish_reason, stop_reason, token_logprobs = r.finish_reason, r.stop_reason, r.logprobs
            if self.prompt_only:
                text, finish_reason, stop_reason, token_logprobs = "", "length", None, []
            reasoning = None
            make = self.harmony[p] if self.harmony is not None else None
            if make is not None:
                parsed = make().parse(r.token_ids)
                text, reasoning = parsed.content or "", parsed.reasoning
            logprobs = None
            if self.echo is not None:
                text = self.echo[p] + text
            if self.logprobs is not None:
                parts = []
                offset = 0
                if self.echo is not None:
                    part, _ = self._prompt_part(k, prompt_logprobs[p])
                    offset = len(self.echo[p])
                    parts.append(part)
                if token_logprobs:
                    part, _ = completion_logprobs(
                        token_logprobs, self.logprobs, self.decoder, offset
                    )
                    parts.append(part)
                logprobs = merge_completion_logprobs(parts)
            choice = {
                "index": k,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
            if reasoning is not None:
                choice["reasoning_content"] = reasoning
            if self.prompt_logprobs is not None and prompt_logprobs[p] is not None:
                choice["prompt_logprobs"] = prompt_logprobs_vllm(
                    prompt_logprobs[p], self.prompt_logprobs, self.decoder
                )
            choices.append(choice)
        return self._chunk(choices, usage)

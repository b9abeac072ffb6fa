"""A job's engine outputs as choices, shared by the OpenAI and native routes.

A job runs each of its prompts as one engine request per sequence (n, or best_of when it is
larger), or as one beam search request whose final output holds all n choices. Here those
outputs are numbered as choices, gathered into whole results for a non-streamed answer, and,
with best_of > n, narrowed to the n best.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

from serverless_llm.engine import EngineOutput, SamplingParams, TokenLogprob, choose_sequences

from .streams import merge_streams

__all__ = ["SequenceResult", "choice_outputs", "gather_results", "results_per_prompt"]


@dataclass
class SequenceResult:
    """One sequence's whole output, gathered for a non-streamed answer."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def add(self, out: EngineOutput) -> None:
        if out.new_text:
            self.texts.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.cumulative_logprob is not None:
            self.cumulative_logprob = out.cumulative_logprob
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_tokens = out.num_output_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason


def results_per_prompt(params: SamplingParams, num_streams_per_prompt: int) -> int:
    """Results one prompt yields: one per engine request, or a beam search's n."""
    return params.n if params.use_beam_search else num_streams_per_prompt


def choice_outputs(
    stream: int, out: EngineOutput, params: SamplingParams
) -> list[tuple[int, EngineOutput]]:
    """(result index, output) pairs of engine stream `stream`'s output. Stream k is sequence
    k of its prompt, except with beam search (one stream per prompt), whose final output holds
    all n results of prompt k, numbered k * n + i."""
    if out.sequences is None:
        return [(stream, out)]
    return [(stream * params.n + i, seq) for i, seq in enumerate(out.sequences)]


async def gather_results(
    streams: Sequence[AsyncIterator[EngineOutput]], num_prompts: int, params: SamplingParams
) -> tuple[list[SequenceResult], list[list[TokenLogprob | None] | None]]:
    """Runs a non-streamed job's engine streams to the end. Returns n results per prompt,
    prompt by prompt (the n best of best_of when best_of > n), and each prompt's prompt
    logprobs (computed by its first sequence)."""
    count = results_per_prompt(params, len(streams) // num_prompts)
    results = [SequenceResult() for _ in range(num_prompts * count)]
    async with aclosing(merge_streams(streams)) as merged:
        async for k, out in merged:
            for index, result_out in choice_outputs(k, out, params):
                results[index].add(result_out)
    chosen: list[SequenceResult] = []
    prompt_logprobs = []
    for p in range(num_prompts):
        group = results[p * count : (p + 1) * count]
        chosen.extend(choose_sequences(group, lambda r: r.cumulative_logprob, params))
        prompt_logprobs.append(group[0].prompt_logprobs)
    return chosen, prompt_logprobs

"""What the engine hands back: per-step increments, and vLLM-shaped final results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .sampling.logprobs import TokenLogprob


@dataclass
class RequestTimes:
    """When things happened to one request, in `time.monotonic()` seconds, for the serving
    layer's metrics. The engine writes it on its step thread; read it when an output is handed
    over (between steps), since the next step moves `last_token` and `token_interval` on."""

    arrival: float  # the engine took the request
    scheduled: float | None = None  # first scheduled (None: still waiting)
    first_token: float | None = None  # end of the step that gave its first token
    last_token: float | None = None  # end of the step that gave its latest tokens
    token_interval: float | None = None  # last_token minus the output step before it

    def mark_tokens(self, now: float) -> None:
        """A step ending at `now` gave the request tokens."""
        if self.last_token is None:
            self.first_token = now
        else:
            self.token_interval = now - self.last_token
        self.last_token = now


@dataclass
class SpecDecodeStats:
    """Speculative decoding's counts: verification runs (a step that checked drafts), draft
    tokens verified, and those kept. For one request (`CompletionOutput.speculation`) or the
    engine (`EngineStats.spec_*`)."""

    verifications: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Kept drafts over drafts verified (None before any)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verification step gives: its kept drafts and the target's own next token
        (None before any)."""
        if not self.verifications:
            return None
        return (self.accepted_tokens + self.verifications) / self.verifications


@dataclass
class EngineOutput:
    """One request's progress in one step (or its end)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None  # the stop token id or stop string; None for EOS or length
    num_prompt_tokens: int
    num_output_tokens: int
    # When the request asked for logprobs: one per new token, and the running sum.
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    # When it asked for prompt_logprobs: all of them (None for the first prompt token), once,
    # with the first output token.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Beam search gives no per-step output: its one output, at the end, is the best sequence
    # whole, and `sequences` holds the n best (that one first), each a whole finished output.
    sequences: list[EngineOutput] | None = None
    # The request's times (shared with the engine, see RequestTimes); None where not tracked.
    times: RequestTimes | None = None
    # A pooling request's embedding (engine/pooling.py), with its one, finished output.
    embedding: list[float] | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load, for logs, health checks and tests."""

    num_running: int  # requests (beams included) in the running batch
    num_waiting: int  # queued, or preempted and waiting to resume
    num_requests: int  # unfinished requests as callers see them
    num_kv_blocks: int
    num_free_kv_blocks: int  # free, cached-but-unreferenced blocks included
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Speculative decoding: on or not; verification runs (one per request and step that had
    # drafts), draft tokens verified and accepted so far (0 when it is off).
    speculative: bool = False
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Tensor parallelism: each rank's state (rank, alive, device, param_bytes); empty without.
    ranks: list[dict] = field(default_factory=list)

    @property
    def num_used_kv_blocks(self) -> int:
        return self.num_kv_blocks - self.num_free_kv_blocks

    @property
    def speculation(self) -> SpecDecodeStats:
        """The speculative counts as one SpecDecodeStats (its acceptance rate and mean
        accepted length)."""
        return SpecDecodeStats(self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens)


@dataclass
class Logprob:
    """vLLM's per-token logprob entry (offline API): the value, the rank when known (1 = most
    likely) and the token's text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's shapes: per position, token id -> Logprob (the sampled or prompt token and the top k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    # Speculative decoding's counts for this sequence (None where it did not speculate).
    speculation: SpecDecodeStats | None = None


@dataclass
class RequestOutput:
    """The result of one prompt, shaped like vLLM's so offline users feel at home."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    prompt_logprobs: list[PositionLogprobs | None] | None = None


@dataclass
class BeamSearchSequence:
    """One result of `LLM.beam_search`, as vLLM shapes it: `tokens` are the prompt's and the
    output's, `text` the output's."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The beam_width best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def position_logprobs(entry: TokenLogprob, decode: Any) -> PositionLogprobs:
    """One position as vLLM reports it: the token itself first, then the top k by rank."""
    out: PositionLogprobs = {
        entry.token_id: Logprob(entry.logprob, entry.rank, decode(entry.token_id))
    }
    for rank, (token, value) in enumerate(zip(entry.top_ids, entry.top_logprobs), start=1):
        if token not in out:
            out[token] = Logprob(value, rank, decode(token))
    return out

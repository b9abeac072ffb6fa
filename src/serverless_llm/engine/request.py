"""One generation request as the engine tracks it: the core state scheduling reads and the step's
update changes (`Request`), and its output side (`OutputState`)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .outputs import RequestTimes, SpecDecodeStats
from .sampling.params import SamplingParams

if TYPE_CHECKING:
    from .beam_runner import BeamGroup
    from .lora_adapters import LoRAAdapter, LoRARequest
    from .multimodal import MultiModalPrompt
    from .pooling import PoolingParams, PoolState
    from .sampling.logits_processors import RequestSamplingState
    from .sampling.logprobs import TokenLogprob
    from .sampling.structured.grammar import GrammarMatcher
    from .stop_rule import StopRule
    from .tokenizer import IncrementalDetokenizer, StopStringMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + the most output this request may produce
    arrival: int = 0  # admission order; FCFS preemption picks the newest
    priority: int = 0  # lower first, under the priority scheduling policy (scheduler.py)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (blocks: kv_cache_manager)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS
    num_preemptions: int = 0
    stop_rule: StopRule | None = None  # when its output ends (stop_rule.py)
    sampling: RequestSamplingState | None = None  # generator, penalty counts, id tensors
    # Beam search: the group this request belongs to, as its handle (never scheduled) or as the
    # one-step request of live beam `beam_index`.
    beam: BeamGroup | None = None
    beam_index: int = 0
    # Structured output: this sequence's place in its grammar (kept across preemption).
    grammar: GrammarMatcher | None = None
    # False until the output reaches params.structured_after: the grammar waits (no mask, no
    # tokens fed to it) while a reasoning model thinks.
    grammar_open: bool = True
    lora: LoRARequest | None = None  # the adapter this request runs with
    lora_adapter: LoRAAdapter | None = None  # its weights, read when the request came in
    out: OutputState = field(default_factory=lambda: OutputState())  # what the caller sees
    # Images: their spans, processed data and hashes, and multimodal rotary positions.
    mm: MultiModalPrompt | None = None
    # For metrics: arrival (reset when the engine takes it), first scheduled, token steps.
    times: RequestTimes = field(default_factory=lambda: RequestTimes(time.monotonic()))
    # A pooling (embedding) request (pooling.py): prefill only, its rows pooled, no sampling.
    pooling: PoolingParams | None = None
    pool: PoolState | None = None
    embedding: list[float] | None = None  # the pooled vector, once its prompt is computed
    # Speculation (speculative.py's backoff): the share of its recent drafts kept (a running
    # average), and the output length before which it proposes none (after poor runs).
    spec_rate: float = 0.5  # speculative.SPEC_RATE_START
    spec_skip_until: int = 0
    spec_misses: int = 0  # poor runs in a row (each doubles the next backoff)
    spec_counts: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # its verifications

    @property
    def lora_id(self) -> int:
        return self.lora.lora_int_id if self.lora is not None else 0

    @property
    def cache_salt(self) -> bytes:
        """What else keys this request's prefix-cache blocks (its adapter)."""
        return self.lora.cache_salt if self.lora is not None else b""

    def prefix_salt(self, block_size: int):
        """What keys prefix-cache block i besides its tokens: the adapter's salt, and for a
        prompt with images a function of i adding the hashes of the images the block overlaps
        (two prompts that differ only in an image share no block from that image on)."""
        salt = self.cache_salt
        if self.mm is None or not self.mm.items:
            return salt
        items = self.mm.items

        def of_block(i: int) -> bytes:
            lo, hi = i * block_size, (i + 1) * block_size
            return salt + b"".join(it.hash for it in items if it.offset < hi and it.end > lo)

        return of_block

    @property
    def mrope_delta(self) -> int:
        return self.mm.mrope_delta if self.mm is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output, without building the concatenation."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions whose logprobs are still to compute (they need the prompt run
        through the model, so such a request does not start from cached blocks)."""
        pl = self.out.prompt_logprobs
        return pl is not None and len(pl) < len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(eq=False)
class OutputState:
    """A request's output side, apart from what scheduling reads: the detokenizer, stop strings,
    released text and logprobs (output_processor.py fills it token by token)."""

    detokenizer: IncrementalDetokenizer | None = None
    stop_matcher: StopStringMatcher | None = None  # when the request has stop strings
    prompt_text: str | None = None
    text_chunks: list[str] = field(default_factory=list)  # the output text, as released
    # Logprobs, when asked for: per output token, and per prompt token (None for the first).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    cumulative_logprob: float | None = None

    @property
    def text(self) -> str:
        chunks = self.text_chunks
        if len(chunks) > 1:
            chunks[:] = ["".join(chunks)]
        return chunks[0] if chunks else ""

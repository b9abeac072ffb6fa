"""What the engine hands back: per-step increments, and vLLM-shaped final results."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineOutput:
    """One request's progress in one step (or its end)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list | None = None


@dataclass
class RequestOutput:
    """The result of one prompt, shaped like vLLM's so offline users feel at home."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True

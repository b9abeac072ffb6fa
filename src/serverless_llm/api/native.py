"""The native route: worker-vllm's job schema in, batches of token text out.

Input: `prompt` or `messages` (rendered with the chat template; `apply_chat_template: true`
wraps a prompt as one user message), `sampling_params` (vLLM's and Aphrodite's names, see
`api.sampling`) and `stream`. Every yielded item is

    {"choices": [{"tokens": ["Hel", "lo"]}, ...], "usage": {"input": 12, "output": 3}}

with one choice per `n` and `usage.output` the running total over all choices. Streamed, each
item holds the next stream batch of tokens (one text piece per token, possibly "" while a
character is incomplete or text is held back because it may start a stop string; batch sizes
from `BatchSizes`, counted over all choices together, as worker-vllm did); otherwise one item
holds each choice's whole text.

With `logprobs: k` each choice also carries `"logprobs"`: one object per generated token (in a
stream, per token of that item), `{"token_id", "token", "logprob", "top_logprobs": [{"token_id",
"token", "logprob"}, ...k]}`, and `"cumulative_logprob"`, the sum so far. With
`prompt_logprobs: k` the first item carries `"prompt_logprobs"`: None for the first prompt
token, then the same objects with a `"rank"`. `best_of > n` runs best_of sequences and returns
the n with the highest cumulative logprob (not streamable: the best are known at the end).
`use_beam_search` returns its n beams together when the search ends: streamed, they come as one
item holding every choice's whole text.

Any failure is yielded as `{"error": "<message>"}`, once, and ends the job; the engine requests
are aborted when this generator closes, so nothing is left holding KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..engine import (
    EngineClient,
    EngineOutput,
    LoRARequest,
    PreparedPrompt,
    SamplingParams,
    SamplingParamsError,
    apply_chat_template,
    sequence_params,
)
from .batching import BatchSizes, batch_stream
from .errors import REQUEST_ERRORS, NativeJobError, describe_validation_error, native_error
from .limits import RequestLimits
from .logprobs import TokenDecoder, native_logprobs
from .native_sampling import VLLMSamplingParams, parse_sampling_params
from .offload import prepare
from .results import SequenceResult, choice_outputs, gather_results
from .streams import merge_streams

__all__ = ["DEFAULT_MAX_TOKENS", "ChatMessage", "NativeRequest", "NativeServing"]

logger = logging.getLogger(__name__)

# worker-vllm raised vLLM's default of 16 after users kept getting cut-off answers.
DEFAULT_MAX_TOKENS = 100


class ChatMessage(BaseModel):
    """One chat message; extra keys (name, tool_calls, ...) are passed to the template."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None


class NativeRequest(BaseModel):
    """A native job's input, without the stream batch knobs (those are shared with OpenAI jobs
    and parsed by `worker.job_input`)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    apply_chat_template: bool = False
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    # A served LoRA adapter's name (LORA_MODULES), or the model's own; unset: the model.
    model: str | None = None

    @model_validator(mode="after")
    def _needs_input(self) -> NativeRequest:
        if self.prompt is None and self.messages is None:
            raise ValueError("the job needs 'prompt' or 'messages'")
        return self

    @classmethod
    def parse(cls, data: dict[str, Any]) -> NativeRequest:
        """Validates a job input, raising NativeJobError with a message naming the field."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            errors = e.errors(include_url=False)
            if errors and errors[0]["type"] == "value_error" and not errors[0]["loc"]:
                raise NativeJobError(errors[0]["msg"].removeprefix("Value error, ")) from None
            path, message = describe_validation_error(e)
            if errors and errors[0]["type"] == "extra_forbidden":
                message = f"unknown input field '{path}'"
                if path in _SAMPLING_NAMES:
                    message += f" (sampling parameters go in sampling_params: {{'{path}': ...}})"
            raise NativeJobError(message) from None


# Top-level keys that belong in sampling_params: a hint for a common mistake.
_SAMPLING_NAMES = frozenset(VLLMSamplingParams.model_fields)


class NativeServing:
    """Serves native jobs on one AsyncEngine."""

    def __init__(
        self,
        engine: EngineClient,
        *,
        chat_template: str | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        log_requests: bool = False,
        limits: RequestLimits | None = None,
        served_model_name: str | None = None,
        lora_modules: Sequence[LoRARequest] = (),
    ) -> None:
        """`lora_modules`: the adapters a job may name in `model` (besides
        `served_model_name`, the model itself)."""
        self.engine = engine
        self.served_model_name = served_model_name
        self.loras = {r.lora_name: r for r in lora_modules}
        self.limits = limits or RequestLimits()
        self.chat_template = chat_template
        self.default_max_tokens = default_max_tokens
        self.log_requests = log_requests
        self._ids = itertools.count()

    async def handle(
        self, request: NativeRequest, batch: BatchSizes, job_id: str = "job"
    ) -> AsyncIterator[dict[str, Any]]:
        """Yields the job's items, or one `{"error": ...}`. Only CancelledError escapes."""
        try:
            async with aclosing(self._generate(request, batch, job_id)) as items:
                async for item in items:
                    yield item
        except asyncio.CancelledError:
            raise
        except REQUEST_ERRORS as e:
            yield native_error(str(e))
        except Exception as e:  # a bug or an engine failure: the job fails, the worker serves on
            logger.exception("native job %s failed", job_id)
            yield native_error(f"generation failed: {type(e).__name__}: {e}")

    # -- the pieces -------------------------------------------------------------------------

    def _prepare(self, request: NativeRequest) -> tuple[SamplingParams, PreparedPrompt]:
        """Limits, template, tokenizer and parameters: run off the event loop (see
        api.offload)."""
        self._check_limits(request)
        return self._sampling(request, self._prompt(request))

    def _check_limits(self, request: NativeRequest) -> None:
        """The request's size against the limits, before any tokenizing (see api.limits)."""
        if request.prompt is not None:
            self.limits.check_prompt_chars(len(request.prompt), "prompt")
        if request.messages is not None:
            self.limits.check_messages([m.model_dump(exclude_none=True) for m in request.messages])
        raw = request.sampling_params or {}
        self.limits.check_sampling(
            n=raw.get("n"),
            best_of=raw.get("best_of"),
            stop=raw.get("stop"),
            logit_bias=raw.get("logit_bias"),
        )

    def _prompt(self, request: NativeRequest) -> str | list[int]:
        """The prompt for the engine to prepare: the text itself, or a chat's token ids."""
        tokenizer = self.engine.tokenizer
        if request.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in request.messages]
        elif request.apply_chat_template:
            messages = [{"role": "user", "content": request.prompt}]
        else:
            return request.prompt
        text = apply_chat_template(tokenizer, messages, chat_template=self.chat_template)
        # The template writes its own special tokens (BOS included); adding them again would
        # double them.
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise NativeJobError("the chat prompt is empty")
        return list(ids)

    def _sampling(
        self, request: NativeRequest, prompt: str | list[int]
    ) -> tuple[SamplingParams, PreparedPrompt]:
        """The job's sampling parameters and its prompt as the model will see it (truncated
        as asked and checked against max_model_len before any engine request exists: the
        engine validates it once, here)."""
        parsed = parse_sampling_params(
            request.sampling_params, default_max_tokens=self.default_max_tokens
        )
        params = parsed.params
        if request.stream and params.ranks_by_logprob:
            raise SamplingParamsError(
                f"best_of ({params.best_of}) > n ({params.n}) cannot be streamed: the best "
                "sequences are known only at the end; set stream to false or best_of to n",
                "best_of",
            )
        if parsed.max_tokens_given:
            return params, self.engine.prepare_prompt(prompt, params)
        # The default is a convenience, not a demand: it shrinks to what fits.
        unbounded = dataclasses.replace(params, max_tokens=None)
        prepared = self.engine.prepare_prompt(prompt, unbounded)
        room = self.engine.max_model_len - len(prepared.token_ids)
        if room < params.max_tokens:
            params = dataclasses.replace(
                params, max_tokens=room, min_tokens=min(params.min_tokens, room)
            )
        return params, prepared.with_max_tokens(params.max_tokens)

    def _lora_of(self, model: str | None) -> LoRARequest | None:
        if model is None or model == self.served_model_name:
            return None
        if model in self.loras:
            return self.loras[model]
        names = [n for n in (self.served_model_name, *self.loras) if n]
        raise NativeJobError(f"unknown model {model!r}: this worker serves {', '.join(names)}")

    async def _generate(
        self, request: NativeRequest, batch: BatchSizes, job_id: str
    ) -> AsyncIterator[dict[str, Any]]:
        lora = self._lora_of(request.model)
        params, prepared = await prepare(self._prepare, request)
        prepared = await self.engine.prepare(prepared, params, lora)
        num_input = len(prepared.token_ids)
        if self.log_requests:
            logger.info(
                "job %s: native, %d prompt tokens, n=%d, stream=%s, %s",
                job_id,
                num_input,
                params.n,
                request.stream,
                params,
            )
        seq = next(self._ids)
        streams = [
            self.engine.generate(prepared, p, f"{job_id}#{seq}.{i}")
            for i, p in enumerate(sequence_params(params))
        ]
        view = _ChoiceView(params, TokenDecoder(self.engine.tokenizer))

        if not request.stream:
            chosen, (prompt_logprobs,) = await gather_results(streams, 1, params)
            item: dict[str, Any] = {
                "choices": [view.whole(r) for r in chosen],
                "usage": {"input": num_input, "output": sum(r.num_tokens for r in chosen)},
            }
            view.add_prompt_logprobs(item, prompt_logprobs)
            yield item
            return

        num_output = 0
        n = params.n
        async with (
            aclosing(merge_streams(streams)) as merged,
            aclosing(
                batch_stream(merged, batch, weight=lambda item: len(item[1].new_token_ids))
            ) as batches,
        ):
            async for group in batches:
                choices: list[dict[str, Any]] = [view.empty() for _ in range(n)]
                prompt_lp = None
                for i, out in group:
                    for j, choice_out in choice_outputs(i, out, params):
                        if choice_out.new_token_ids:  # an abort's final output carries no token
                            view.extend(choices[j], choice_out)
                            num_output += len(choice_out.new_token_ids)
                        if choice_out.prompt_logprobs is not None:
                            prompt_lp = choice_out.prompt_logprobs
                item = {"choices": choices, "usage": {"input": num_input, "output": num_output}}
                view.add_prompt_logprobs(item, prompt_lp)
                yield item


class _ChoiceView:
    """Shapes choices for what the job asked (logprobs only when asked for)."""

    def __init__(self, params: SamplingParams, decoder: TokenDecoder) -> None:
        self.top = params.logprobs
        self.prompt_top = params.prompt_logprobs
        self.decoder = decoder

    def empty(self) -> dict[str, Any]:
        choice: dict[str, Any] = {"tokens": []}
        if self.top is not None:
            choice["logprobs"] = []
        return choice

    def extend(self, choice: dict[str, Any], out: EngineOutput) -> None:
        choice["tokens"].append(out.new_text)
        if self.top is not None and out.logprobs:
            choice["logprobs"].extend(native_logprobs(out.logprobs, self.top, self.decoder))
            choice["cumulative_logprob"] = out.cumulative_logprob

    def whole(self, seq: SequenceResult) -> dict[str, Any]:
        choice: dict[str, Any] = {"tokens": [seq.text]}
        if self.top is not None:
            choice["logprobs"] = native_logprobs(seq.logprobs, self.top, self.decoder)
            choice["cumulative_logprob"] = seq.cumulative_logprob
        return choice

    def add_prompt_logprobs(self, item: dict[str, Any], entries: list | None) -> None:
        if self.prompt_top is not None and entries is not None:
            item["prompt_logprobs"] = native_logprobs(
                entries, self.prompt_top, self.decoder, with_rank=True
            )

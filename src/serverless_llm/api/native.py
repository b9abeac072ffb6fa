"""The native route: worker-vllm's job schema in, batches of token text out.

Input: `prompt` or `messages` (rendered with the chat template; `apply_chat_template: true`
wraps a prompt as one user message), `sampling_params` (vLLM's names, see `api.sampling`) and
`stream`. Every yielded item is

    {"choices": [{"tokens": ["Hel", "lo"]}, ...], "usage": {"input": 12, "output": 3}}

with one choice per `n` and `usage.output` the running total over all choices. Streamed, each
item holds the next stream batch of tokens (one text piece per token, possibly "" while a
character is incomplete; batch sizes from `BatchSizes`, counted over all choices together, as
worker-vllm did); otherwise one item holds each choice's whole text. Any failure is yielded as
`{"error": "<message>"}`, once, and ends the job; the engine requests are aborted when this
generator closes, so nothing is left holding KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..engine.async_engine import AsyncEngine
from ..engine.engine import InvalidRequestError
from ..engine.outputs import EngineOutput
from ..engine.sampling.params import SamplingParams
from ..engine.tokenizer import ChatTemplateError, apply_chat_template
from ..worker.batching import BatchSizes, batch_stream
from .errors import NativeJobError, describe_validation_error, native_error
from .sampling import SamplingParamError, VLLMSamplingParams, parse_sampling_params

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
    and parsed by `worker.jobs`)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    apply_chat_template: bool = False
    sampling_params: dict[str, Any] | None = None
    stream: bool = False

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
        engine: AsyncEngine,
        *,
        chat_template: str | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        log_requests: bool = False,
    ) -> None:
        self.engine = engine
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
        except (NativeJobError, SamplingParamError, InvalidRequestError, ChatTemplateError) as e:
            yield native_error(str(e))
        except Exception as e:  # a bug or an engine failure: the job fails, the worker serves on
            logger.exception("native job %s failed", job_id)
            yield native_error(f"generation failed: {type(e).__name__}: {e}")

    # -- the pieces -------------------------------------------------------------------------

    def _prompt_token_ids(self, request: NativeRequest) -> list[int]:
        tokenizer = self.engine.tokenizer
        if request.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in request.messages]
        elif request.apply_chat_template:
            messages = [{"role": "user", "content": request.prompt}]
        else:
            return self.engine.engine.tokenize_prompt(request.prompt).token_ids
        text = apply_chat_template(tokenizer, messages, chat_template=self.chat_template)
        # The template writes its own special tokens (BOS included); adding them again would
        # double them.
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise NativeJobError("the chat prompt is empty")
        return list(ids)

    def _sampling(
        self, request: NativeRequest, num_prompt_tokens: int
    ) -> tuple[SamplingParams, int]:
        parsed = parse_sampling_params(
            request.sampling_params, default_max_tokens=self.default_max_tokens
        )
        params = parsed.params
        if not parsed.max_tokens_given:
            # The default is a convenience, not a demand: it shrinks to what fits.
            room = self.engine.engine.max_model_len - num_prompt_tokens
            if room < 1:
                raise NativeJobError(
                    f"the prompt has {num_prompt_tokens} tokens, which leaves no room for output "
                    f"within max_model_len={self.engine.engine.max_model_len}"
                )
            if room < params.max_tokens:
                params = dataclasses.replace(params, max_tokens=room)
        return params, parsed.n

    async def _generate(
        self, request: NativeRequest, batch: BatchSizes, job_id: str
    ) -> AsyncIterator[dict[str, Any]]:
        prompt_ids = self._prompt_token_ids(request)
        num_input = len(prompt_ids)
        params, n = self._sampling(request, num_input)
        if self.log_requests:
            logger.info(
                "job %s: native, %d prompt tokens, n=%d, stream=%s, %s",
                job_id,
                num_input,
                n,
                request.stream,
                params,
            )
        seq = next(self._ids)
        streams = []
        for i in range(n):
            p = params
            if i and params.seed is not None:
                p = dataclasses.replace(params, seed=(params.seed + i) % 2**63)
            streams.append(self.engine.generate(prompt_ids, p, f"{job_id}#{seq}.{i}"))

        num_output = 0
        if not request.stream:
            texts: list[list[str]] = [[] for _ in range(n)]
            async with aclosing(_merge(streams)) as merged:
                async for i, out in merged:
                    texts[i].append(out.new_text)
                    num_output += len(out.new_token_ids)
            yield {
                "choices": [{"tokens": ["".join(t)]} for t in texts],
                "usage": {"input": num_input, "output": num_output},
            }
            return

        async with (
            aclosing(_merge(streams)) as merged,
            aclosing(
                batch_stream(merged, batch, weight=lambda item: len(item[1].new_token_ids))
            ) as batches,
        ):
            async for group in batches:
                choices: list[dict[str, list[str]]] = [{"tokens": []} for _ in range(n)]
                for i, out in group:
                    if out.new_token_ids:  # an abort's final output carries no token
                        choices[i]["tokens"].append(out.new_text)
                        num_output += len(out.new_token_ids)
                yield {"choices": choices, "usage": {"input": num_input, "output": num_output}}


async def _merge(
    streams: list[AsyncIterator[EngineOutput]],
) -> AsyncIterator[tuple[int, EngineOutput]]:
    """Interleaves the outputs of n engine requests as (choice index, output), in arrival order.

    One stream is iterated directly. Several get a task each feeding one queue; whatever way
    this generator ends (done, error, cancel, close), the tasks are cancelled and awaited, and a
    cancelled `generate` aborts its engine request, so no request outlives the job.
    """
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return

    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[EngineOutput]) -> None:
        try:
            async with aclosing(stream) as outs:
                async for out in outs:
                    queue.put_nowait((index, out))
            queue.put_nowait((index, done))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

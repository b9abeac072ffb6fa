"""`/v1/embeddings` in OpenAI's request and response shapes, served by a model run with
TASK=embed (the engine's pooling requests: engine/pooling.py).

    {"model": "...", "input": "text" | ["text", ...] | [token ids] | [[token ids], ...],
     "encoding_format": "float" | "base64", "dimensions": 256, "user": "...",
     "truncate_prompt_tokens": 512, "add_special_tokens": true,
     "instruction": "...", "prompt_name": "query"}
    -> {"object": "list", "model": "...", "usage": {"prompt_tokens": n, "total_tokens": n},
        "data": [{"object": "embedding", "index": 0, "embedding": [...] | "base64..."}]}

A model served with TASK=generate answers here too, beside its generation routes (one decoder
for chat and embeddings); TASK=classify and score do not.
`dimensions` keeps the first k dimensions (Matryoshka), renormalised when the model's pooling
normalises. base64 is the float32 vector's little-endian bytes, as OpenAI sends it. An input
longer than max_model_len - 1 tokens is a 400 naming the limit unless truncate_prompt_tokens
keeps its last k tokens. `instruction` puts Qwen3-Embedding's "Instruct: <instruction>\nQuery:"
before each text input, `prompt_name` one of the model's named prompts
(config_sentence_transformers.json), as sentence-transformers' encode does. Every bad input is
a 400 in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from pydantic import Field

from serverless_llm.engine import InvalidRequestError

from ..offload import prepare
from .errors import OpenAIServingError
from .protocol import TokenId, WholeInt, _Strict

if TYPE_CHECKING:
    from .serving import OpenAIServing

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs in one request

NOT_EMBEDDING = (
    "This model is served for {what} (TASK={task}): /v1/embeddings needs the worker "
    "started with TASK=embed (or TASK=generate, embedding beside generation)."
)
# The tasks /v1/embeddings answers: a model served for embeddings, and a generating model, which
# embeds its final hidden states next to its generations (its pooling: POOLING_TYPE and
# NORMALIZE, else its sentence-transformers files, else the last token's, normalised).
EMBEDDING_TASKS = ("embed", "generate")


class EmbeddingRequest(_Strict):
    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[WholeInt, Field(ge=1)] | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[WholeInt, Field(ge=1)] | None = None
    add_special_tokens: bool = True
    # Before each text input: Qwen3-Embedding's "Instruct: <instruction>\nQuery:" form, or
    # one of the model's named prompts (config_sentence_transformers.json's "query", ...).
    instruction: str | None = None
    prompt_name: str | None = None


def _inputs(request: EmbeddingRequest) -> list[str | list[int]]:
    value = request.input
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(v, int) for v in value):
        return [list(value)]  # one prompt of token ids
    return list(value)


def _prepare_all(serving: OpenAIServing, body: Any) -> tuple[EmbeddingRequest, str, list]:
    """Parses the body and prepares every input (blocking: the tokenizer): (request, model
    name, prepared prompts); OpenAIServingError for anything wrong."""
    if isinstance(body, dict):
        raw = body.get("input")
        if isinstance(raw, list) and len(raw) > MAX_EMBEDDING_INPUTS:
            raise OpenAIServingError.bad_request(
                f"'input' has {len(raw)} items, more than the {MAX_EMBEDDING_INPUTS} one "
                "request may embed",
                "input",
                "invalid_value",
            )
        if isinstance(raw, str):
            serving.limits.check_prompt_chars(len(raw), "input")
        elif isinstance(raw, list) and all(isinstance(v, str) for v in raw):
            serving.limits.check_prompt_chars(sum(len(v) for v in raw), "input")
    request: EmbeddingRequest = serving._parse(EmbeddingRequest, body)
    model = serving._check_model(request.model)
    engine = serving.engine
    if getattr(engine, "task", "generate") not in EMBEDDING_TASKS:
        task = getattr(engine, "task", "generate")
        what = "generation" if task == "generate" else task
        raise OpenAIServingError.bad_request(
            NOT_EMBEDDING.format(what=what, task=task), None, "model_not_embedding"
        )
    inputs = _inputs(request)
    if not inputs:
        raise OpenAIServingError.bad_request("'input' is empty", "input", "invalid_value")
    limit = serving.max_model_len - 1
    prepared = []
    tokenizer = serving.tokenizer
    for i, item in enumerate(inputs):
        where = "input" if isinstance(request.input, str) else f"input[{i}]"
        if len(item) == 0:
            raise OpenAIServingError.bad_request(f"'{where}' is empty", "input", "invalid_value")
        if isinstance(item, str):
            if request.instruction is not None or request.prompt_name is not None:
                try:
                    item = engine.instructed(item, request.instruction, request.prompt_name)
                except InvalidRequestError as e:
                    raise OpenAIServingError.bad_request(
                        str(e), "prompt_name", "invalid_value"
                    ) from None
            ids = list(tokenizer.encode(item, add_special_tokens=request.add_special_tokens))
        else:
            if request.instruction is not None or request.prompt_name is not None:
                raise OpenAIServingError.bad_request(
                    "instruction and prompt_name apply to text inputs, not token ids",
                    "instruction" if request.instruction is not None else "prompt_name",
                    "invalid_value",
                )
            ids = item
            try:
                engine.check_token_ids(ids, "input")
            except InvalidRequestError as e:
                raise OpenAIServingError.bad_request(str(e), "input", "invalid_value") from None
        if request.truncate_prompt_tokens is None and len(ids) > limit:
            raise OpenAIServingError.bad_request(
                f"'{where}' has {len(ids)} tokens, more than the {limit} this model embeds "
                f"(max_model_len {serving.max_model_len} less one); shorten it or set "
                "truncate_prompt_tokens",
                "input",
                "context_length_exceeded",
            )
        if request.truncate_prompt_tokens is not None and request.truncate_prompt_tokens > limit:
            raise OpenAIServingError.bad_request(
                f"truncate_prompt_tokens={request.truncate_prompt_tokens} is more than the "
                f"{limit} tokens this model embeds",
                "truncate_prompt_tokens",
                "invalid_value",
            )
        try:
            prepared.append(engine.prepare_embed_prompt(ids, request.truncate_prompt_tokens))
        except InvalidRequestError as e:
            raise OpenAIServingError.bad_request(str(e), "input", "invalid_value") from None
    return request, model, prepared


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def create_embedding(serving: OpenAIServing, body: Any) -> dict[str, Any]:
    """The embeddings response (OpenAIServingError or an engine error for a bad request)."""
    request, model, prompts = await prepare(_prepare_all, serving, body)
    engine = serving.engine
    tasks = [asyncio.ensure_future(engine.embed(p, dimensions=request.dimensions)) for p in prompts]
    try:
        outputs = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    data = []
    total = 0
    for i, out in enumerate(outputs):
        total += out.num_prompt_tokens
        data.append(
            {
                "object": "embedding",
                "index": i,
                "embedding": _encode(out.embedding, request.encoding_format),
            }
        )
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": total, "total_tokens": total},
    }

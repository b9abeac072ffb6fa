"""vLLM's pooling routes beside `/v1/embeddings` (embeddings.py), served by a model run with
TASK=score, classify or embed (the engine's pooling requests: engine/pooling.py):

    /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's shape)
      {"model", "query": "...", "documents": ["...", {"text": "..."}], "top_n": 3,
       "return_documents": true, "truncate_prompt_tokens": k, "instruction": "..."}
      -> {"id", "model", "usage": {"prompt_tokens", "total_tokens"},
          "results": [{"index", "relevance_score", "document": {"text"}}]}  (best first)
    /score, /v1/score
      {"model", "text_1": "..." | [...], "text_2": "..." | [...], "truncate_prompt_tokens",
       "instruction"}  (one text_1 against each text_2, or lists of one length, paired)
      -> {"id", "object": "list", "created", "model", "usage",
          "data": [{"index", "object": "score", "score"}]}
    /classify, /v1/classify
      {"model", "input": "..." | [...] | token ids, "truncate_prompt_tokens"}
      -> {"id", "object": "list", "created", "model", "usage",
          "data": [{"index", "label", "probs", "num_classes"}]}
    /pooling, /v1/pooling
      {"model", "input": as /v1/embeddings', "encoding_format", "dimensions",
       "truncate_prompt_tokens"}
      -> {"id", "object": "list", "created", "model", "usage",
          "data": [{"index", "object": "pooling", "data": [...] | "base64"}]}

A score comes from a one-label classifier head (a cross-encoder), a causal LM reranker served
with TASK=score (Qwen3-Reranker's recipe: its prompt, P(yes)), or, on an embedding model
(TASK=embed), the cosine similarity of the two texts' embeddings, as vLLM does. `/pooling`
returns the served task's vector: the embedding (TASK=embed), else the label probabilities.
Every bad input is a 400 in OpenAI's error shape; nothing is queued until every input of the
request is prepared.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from pydantic import Field

from serverless_llm.engine import InvalidRequestError

from ..offload import prepare
from .errors import OpenAIServingError
from .protocol import TokenId, WholeInt, _Strict

if TYPE_CHECKING:
    from .serving import OpenAIServing

# Inputs (texts, documents or pairs) one request may hold: as /v1/embeddings' OpenAI limit.
MAX_POOLING_INPUTS = 2048

POOLING_KINDS = ("rerank", "score", "classify", "pooling")

NOT_POOLING = (
    "This model is served for generation (TASK=generate): /{route} needs the worker started "
    "with TASK=score (a reranker or cross-encoder), classify or embed."
)


class _Document(_Strict):
    text: str


class RerankRequest(_Strict):
    model: str | None = None
    query: str
    documents: list[str | _Document]
    top_n: Annotated[WholeInt, Field(ge=0)] | None = None  # None or 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: Annotated[WholeInt, Field(ge=1)] | None = None
    instruction: str | None = None
    user: str | None = None


class ScoreRequest(_Strict):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Annotated[WholeInt, Field(ge=1)] | None = None
    instruction: str | None = None
    user: str | None = None


class ClassifyRequest(_Strict):
    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    truncate_prompt_tokens: Annotated[WholeInt, Field(ge=1)] | None = None
    add_special_tokens: bool = True
    user: str | None = None


class PoolingRequest(ClassifyRequest):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[WholeInt, Field(ge=1)] | None = None


def _check_count(body: Any, field: str) -> None:
    """10,000 inputs are refused before the schema walks them."""
    if isinstance(body, dict):
        raw = body.get(field)
        if isinstance(raw, list) and len(raw) > MAX_POOLING_INPUTS:
            raise OpenAIServingError.bad_request(
                f"'{field}' has {len(raw)} items, more than the {MAX_POOLING_INPUTS} one request "
                "may hold",
                field,
                "invalid_value",
            )


def _check_chars(serving: OpenAIServing, body: Any, fields: tuple[str, ...]) -> None:
    if not isinstance(body, dict):
        return
    total = 0
    for field in fields:
        raw = body.get(field)
        if isinstance(raw, str):
            total += len(raw)
        elif isinstance(raw, list):
            for v in raw:
                if isinstance(v, str):
                    total += len(v)
                elif isinstance(v, dict) and isinstance(v.get("text"), str):
                    total += len(v["text"])
    serving.limits.check_prompt_chars(total, fields[-1])


def _gate(serving: OpenAIServing, route: str, task: str) -> None:
    """A 400 unless the model serves `task`: naming what it serves and what is needed."""
    engine = serving.engine
    served = getattr(engine, "task", "generate")
    if task == "score" and served == "embed":
        return  # cosine similarity of embeddings
    if task == "embed":
        if served != "embed":
            raise OpenAIServingError.bad_request(
                f"This model is served for {served} (TASK={served}): /{route} returns "
                "embeddings only with TASK=embed.",
                None,
                "model_not_embedding",
            )
        return
    if served == "generate":
        raise OpenAIServingError.bad_request(
            NOT_POOLING.format(route=route), None, "model_not_pooling"
        )
    try:
        engine.check_pooling_task(task)
    except InvalidRequestError as e:
        raise OpenAIServingError.bad_request(
            f"/{route}: {e}",
            None,
            "model_not_" + ("classifier" if task == "classify" else "scorer"),
        ) from None


class _Prepared:
    """A request's inputs, each tokenized and fitted, ready to queue."""

    def __init__(self, model: str, task: str) -> None:
        self.model = model
        self.task = task
        self.prompts: list = []
        # Score on an embedding model: per pair, the rows of its two texts' embeddings.
        self.pair_rows: list[tuple[int, int]] | None = None


def _fit(
    serving: OpenAIServing,
    ids: list[int],
    where: str,
    param: str,
    truncate: int | None,
):
    """A token-id prompt checked against the pooling limit (max_model_len - 1 tokens) and
    prepared; OpenAIServingError naming `where` and the limit otherwise."""
    engine = serving.engine
    limit = serving.max_model_len - 1
    if truncate is not None and truncate > limit:
        raise OpenAIServingError.bad_request(
            f"truncate_prompt_tokens={truncate} is more than the {limit} tokens this model pools",
            "truncate_prompt_tokens",
            "invalid_value",
        )
    if truncate is None and len(ids) > limit:
        raise OpenAIServingError.bad_request(
            f"'{where}' has {len(ids)} tokens, more than the {limit} this model takes "
            f"(max_model_len {serving.max_model_len} less one); shorten it or set "
            "truncate_prompt_tokens",
            param,
            "context_length_exceeded",
        )
    try:
        return engine.prepare_embed_prompt(ids, truncate)
    except InvalidRequestError as e:
        raise OpenAIServingError.bad_request(str(e), param, "invalid_value") from None


def _input_items(value: Any) -> list:
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(v, int) for v in value):
        return [list(value)]
    return list(value)


def _prepare_inputs(
    serving: OpenAIServing, request: ClassifyRequest, task: str, model: str
) -> _Prepared:
    """/classify's and /pooling's `input`: texts or token ids, each a prompt."""
    items = _input_items(request.input)
    if not items:
        raise OpenAIServingError.bad_request("'input' is empty", "input", "invalid_value")
    out = _Prepared(model, task)
    for i, item in enumerate(items):
        where = "input" if isinstance(request.input, str) else f"input[{i}]"
        if len(item) == 0:
            raise OpenAIServingError.bad_request(f"'{where}' is empty", "input", "invalid_value")
        if isinstance(item, str):
            ids = list(
                serving.tokenizer.encode(item, add_special_tokens=request.add_special_tokens)
            )
        else:
            ids = item
            try:
                serving.engine.check_token_ids(ids, "input")
            except InvalidRequestError as e:
                raise OpenAIServingError.bad_request(str(e), "input", "invalid_value") from None
        out.prompts.append(_fit(serving, ids, where, "input", request.truncate_prompt_tokens))
    return out


def _prepare_pairs(
    serving: OpenAIServing,
    pairs: list[tuple[str, str]],
    wheres: list[tuple[str, str]],
    params: tuple[str, str],
    truncate: int | None,
    instruction: str | None,
    model: str,
) -> _Prepared:
    """Score pairs: on a scorer each pair is one prompt (the reranker template or the
    tokenizer's pair encoding); on an embedding model each text is embedded once."""
    engine = serving.engine
    for (a, b), (wa, wb) in zip(pairs, wheres):
        for text, where, param in ((a, wa, params[0]), (b, wb, params[1])):
            if not text:
                raise OpenAIServingError.bad_request(f"'{where}' is empty", param, "invalid_value")
    if getattr(engine, "task", "") == "embed":
        out = _Prepared(model, "embed")
        texts: dict[str, int] = {}  # each distinct text embedded once
        for (a, b), (wa, wb) in zip(pairs, wheres):
            for text, where, param in ((a, wa, params[0]), (b, wb, params[1])):
                if text in texts:
                    continue
                ids = list(serving.tokenizer.encode(text))
                texts[text] = len(out.prompts)
                out.prompts.append(_fit(serving, ids, where, param, truncate))
        out.pair_rows = [(texts[a], texts[b]) for a, b in pairs]
        return out
    out = _Prepared(model, "score")
    for (a, b), (wa, wb) in zip(pairs, wheres):
        ids = engine.score_prompt(a, b, instruction)
        where = f"{wb} (paired with {wa}, in the model's prompt)"
        out.prompts.append(_fit(serving, ids, where, params[1], truncate))
    return out


def _prepare_rerank(serving: OpenAIServing, body: Any) -> tuple[RerankRequest, _Prepared]:
    _check_count(body, "documents")
    _check_chars(serving, body, ("query", "documents"))
    request: RerankRequest = serving._parse(RerankRequest, body)
    model = serving._check_model(request.model)
    _gate(serving, "rerank", "score")
    if not request.documents:
        raise OpenAIServingError.bad_request(
            "'documents' is empty: rerank needs at least one document", "documents", "invalid_value"
        )
    if not request.query:
        raise OpenAIServingError.bad_request("'query' is empty", "query", "invalid_value")
    docs = [d if isinstance(d, str) else d.text for d in request.documents]
    pairs = [(request.query, d) for d in docs]
    wheres = [("query", f"documents[{i}]") for i in range(len(docs))]
    prepared = _prepare_pairs(
        serving,
        pairs,
        wheres,
        ("query", "documents"),
        request.truncate_prompt_tokens,
        request.instruction,
        model,
    )
    return request, prepared


def _prepare_score(serving: OpenAIServing, body: Any) -> tuple[ScoreRequest, _Prepared]:
    _check_count(body, "text_1")
    _check_count(body, "text_2")
    _check_chars(serving, body, ("text_1", "text_2"))
    request: ScoreRequest = serving._parse(ScoreRequest, body)
    model = serving._check_model(request.model)
    _gate(serving, "score", "score")
    ones = [request.text_1] if isinstance(request.text_1, str) else request.text_1
    twos = [request.text_2] if isinstance(request.text_2, str) else request.text_2
    if not ones:
        raise OpenAIServingError.bad_request("'text_1' is empty", "text_1", "invalid_value")
    if not twos:
        raise OpenAIServingError.bad_request("'text_2' is empty", "text_2", "invalid_value")
    if len(ones) != 1 and len(ones) != len(twos):
        raise OpenAIServingError.bad_request(
            f"text_1 has {len(ones)} texts and text_2 {len(twos)}: give one text_1, or as many "
            "as text_2 (paired one-to-one)",
            "text_2",
            "invalid_value",
        )
    if len(ones) == 1:
        pairs = [(ones[0], t) for t in twos]
        w1 = "text_1" if isinstance(request.text_1, str) else "text_1[0]"
        wheres = [(w1, f"text_2[{i}]") for i in range(len(twos))]
    else:
        pairs = list(zip(ones, twos))
        wheres = [(f"text_1[{i}]", f"text_2[{i}]") for i in range(len(twos))]
    if isinstance(request.text_2, str):
        wheres = [(a, "text_2") for a, _ in wheres]
    prepared = _prepare_pairs(
        serving,
        pairs,
        wheres,
        ("text_1", "text_2"),
        request.truncate_prompt_tokens,
        request.instruction,
        model,
    )
    return request, prepared


def _prepare_classify(serving: OpenAIServing, body: Any) -> tuple[ClassifyRequest, _Prepared]:
    _check_count(body, "input")
    _check_chars(serving, body, ("input",))
    request: ClassifyRequest = serving._parse(ClassifyRequest, body)
    model = serving._check_model(request.model)
    _gate(serving, "classify", "classify")
    return request, _prepare_inputs(serving, request, "classify", model)


def _prepare_pooling(serving: OpenAIServing, body: Any) -> tuple[PoolingRequest, _Prepared]:
    _check_count(body, "input")
    _check_chars(serving, body, ("input",))
    request: PoolingRequest = serving._parse(PoolingRequest, body)
    model = serving._check_model(request.model)
    served = getattr(serving.engine, "task", "generate")
    task = "embed" if served == "embed" else "classify"
    if served == "generate":
        raise OpenAIServingError.bad_request(
            NOT_POOLING.format(route="pooling"), None, "model_not_pooling"
        )
    _gate(serving, "pooling", task)
    if request.dimensions is not None and task != "embed":
        raise OpenAIServingError.bad_request(
            "dimensions applies to embeddings only (TASK=embed)", "dimensions", "invalid_value"
        )
    if request.dimensions is not None and request.dimensions > serving.engine.embedding_size:
        raise OpenAIServingError.bad_request(
            f"dimensions={request.dimensions} is larger than the model's "
            f"{serving.engine.embedding_size}",
            "dimensions",
            "invalid_value",
        )
    return request, _prepare_inputs(serving, request, task, model)


async def _run(serving: OpenAIServing, prepared: _Prepared, dimensions: int | None = None):
    """Every prepared prompt queued at once (batched by the scheduler); the finished outputs
    in order. A failure or cancellation aborts the others."""
    engine = serving.engine
    tasks = [
        asyncio.ensure_future(engine.embed(p, dimensions=dimensions, task=prepared.task))
        for p in prepared.prompts
    ]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _usage(outputs) -> dict[str, int]:
    total = sum(o.num_prompt_tokens for o in outputs)
    return {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0}


async def _scores(serving: OpenAIServing, prepared: _Prepared) -> tuple[list[float], dict]:
    outputs = await _run(serving, prepared)
    rows = prepared.pair_rows
    if rows is None:
        return [float(o.embedding[0]) for o in outputs], _usage(outputs)
    vecs = [np.asarray(o.embedding, dtype=np.float64) for o in outputs]
    scores = []
    for a, b in rows:
        na, nb = np.linalg.norm(vecs[a]), np.linalg.norm(vecs[b])
        scores.append(float(vecs[a] @ vecs[b] / max(na * nb, 1e-12)))
    return scores, _usage(outputs)


async def create_rerank(serving: OpenAIServing, body: Any) -> dict[str, Any]:
    request, prepared = await prepare(_prepare_rerank, serving, body)
    scores, usage = await _scores(serving, prepared)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if request.top_n:
        order = order[: request.top_n]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if request.return_documents:
            doc = request.documents[i]
            item["document"] = {"text": doc if isinstance(doc, str) else doc.text}
        results.append(item)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": prepared.model,
        "usage": usage,
        "results": results,
    }


async def create_score(serving: OpenAIServing, body: Any) -> dict[str, Any]:
    _, prepared = await prepare(_prepare_score, serving, body)
    scores, usage = await _scores(serving, prepared)
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": prepared.model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": usage,
    }


async def create_classify(serving: OpenAIServing, body: Any) -> dict[str, Any]:
    _, prepared = await prepare(_prepare_classify, serving, body)
    outputs = await _run(serving, prepared)
    labels = serving.engine.labels
    data = []
    for i, out in enumerate(outputs):
        probs = list(out.embedding)
        best = max(range(len(probs)), key=lambda k: probs[k])
        data.append({"index": i, "label": labels[best], "probs": probs, "num_classes": len(probs)})
    return {
        "id": f"classify-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": prepared.model,
        "data": data,
        "usage": _usage(outputs),
    }


async def create_pooling(serving: OpenAIServing, body: Any) -> dict[str, Any]:
    request, prepared = await prepare(_prepare_pooling, serving, body)
    outputs = await _run(serving, prepared, request.dimensions)
    data = []
    for i, out in enumerate(outputs):
        vec: Any = list(out.embedding)
        if request.encoding_format == "base64":
            vec = base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
        data.append({"index": i, "object": "pooling", "data": vec})
    return {
        "id": f"pool-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": prepared.model,
        "data": data,
        "usage": _usage(outputs),
    }


async def create_pooling_response(serving: OpenAIServing, kind: str, body: Any) -> dict:
    """The response of pooling route `kind` (POOLING_KINDS)."""
    handler = {
        "rerank": create_rerank,
        "score": create_score,
        "classify": create_classify,
        "pooling": create_pooling,
    }[kind]
    return await handler(serving, body)

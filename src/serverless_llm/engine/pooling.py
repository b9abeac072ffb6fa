"""Pooling requests: a prompt run through the model once, prefill only, whose final hidden
states (after the model's final norm) are pooled into one result; no token is sampled and the
request's KV blocks are freed as soon as its prompt is computed.

A pooling request is a `Request` with `pooling` set: the scheduler grants it prefill chunks like
any prompt (never from cached prefix blocks: mean pooling needs every row), the model runner
gathers its rows chunk by chunk (`PoolState`) instead of sampling, and the engine ends it the
step its last prompt token is computed, with `embedding` holding the task's vector:

- `embed`: the pooled hidden state (last / mean), Matryoshka-truncated, maybe L2-normalised;
- `classify`: the model's classifier head over its pooled row, as probabilities per label
  (softmax; a sigmoid for a one-label head);
- `score`: a (query, document) pair already joined into one prompt (`score_prompt`), one
  number: the sigmoid of a one-label head's logit.

The classifier head, as the pooling path sees it (a model, or a wrapper built by the engine):

    head.num_labels: int               # logits per row (1 for a cross-encoder / reranker)
    head.classifier_pooling: str       # the row the head reads: "last" (decoders, as
                                       # transformers' ...ForSequenceClassification), "cls"
                                       # (the first token: BERT-family cross-encoders), "mean"
    head.classify(rows: Tensor[N, hidden]) -> Tensor[N, num_labels]   # raw logits; rows are
                                       # the pooled final hidden states (model dtype); the head
                                       # does everything after that (BERT's pooler dense+tanh,
                                       # dropout-free classifier, ...)

A decoder `...ForSequenceClassification` checkpoint is the decoder with its `score` linear
(models/registry.py, `DecoderModel.classify`). A causal LM asked to score (TASK=score, e.g.
Qwen3-Reranker) is wrapped in `TokenPairHead`: its one logit is l(yes) - l(no) at the last
position, so sigmoid(logit) = softmax([l(no), l(yes)])[1], the published P(yes). Encoder
families give their model these three members and the pooling path serves them unchanged.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .outputs import EngineOutput
from .sampling.params import SamplingParams

if TYPE_CHECKING:
    from .request import Request

POOLING_TYPES = ("last", "mean", "cls")  # cls: the first token's row (BERT-family)
POOLING_TASKS = ("embed", "classify", "score")
HEAD_POOLINGS = ("last", "mean", "cls")  # the rows a classifier head may read


@dataclass(frozen=True)
class PoolingParams:
    """How one request's hidden rows become its result."""

    pooling_type: str = "last"  # "last" (the last prompt token's row) or "mean" (all rows)
    normalize: bool = True  # L2-normalise the pooled vector
    dimensions: int | None = None  # keep the first k dimensions (Matryoshka), then normalise
    task: str = "embed"  # one of POOLING_TASKS
    # Whether the prompt's leading blocks may come from the prefix cache: only the last row is
    # read (last-token pooling, a decoder's classifier) and the attention is causal, so rows
    # before the last need not be computed again (a reranker's shared template and query).
    reuse_prefix: bool = False

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}"
            )
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")


class PoolState:
    """A pooling request's running pool across its prefill chunks (float32)."""

    __slots__ = ("total", "count", "last", "first", "dtype")

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.count = 0
        self.last: torch.Tensor | None = None
        self.first: torch.Tensor | None = None  # the prompt's first row ("cls")
        self.dtype = torch.float32  # the hidden rows' own (a classifier head takes that back)

    def add(self, rows: torch.Tensor, mean: bool) -> None:
        """`rows`: the chunk's rows (all of them for a mean, else at least its last); the
        runner sets `first` from the chunk that starts the prompt."""
        self.dtype = rows.dtype
        rows = rows.float()
        if mean:
            s = rows.sum(dim=0)
            self.total = s if self.total is None else self.total + s
            self.count += rows.shape[0]
        self.last = rows[-1]

    def row(self, which: str) -> torch.Tensor:
        """The pooled row a classifier head reads (`HEAD_POOLINGS`), float32."""
        if which == "mean":
            assert self.total is not None and self.count
            return self.total / self.count
        vec = self.first if which == "cls" else self.last
        assert vec is not None
        return vec

    def result(self, params: PoolingParams) -> torch.Tensor:
        return finish_vector(self.row(params.pooling_type), params)


def pooled_result(pool: PoolState, params: PoolingParams, head) -> list[float]:
    """A finished pooling request's vector: the embedding, or the head's probabilities (one
    number for `score`). `head` is the classifier head (see the module's docstring)."""
    if params.task == "embed":
        return pool.result(params).tolist()
    row = pool.row(head.classifier_pooling)
    logits = head.classify(row.to(pool.dtype).unsqueeze(0)).float()[0]
    if params.task == "score" or logits.numel() == 1:
        return torch.sigmoid(logits).tolist()
    return torch.softmax(logits, dim=-1).tolist()


class TokenPairHead:
    """A causal LM as a yes/no scorer (Qwen3-Reranker's recipe): one logit, the LM head's
    l(yes) - l(no) at the last position; sigmoid of it is softmax([l(no), l(yes)])[1]."""

    num_labels = 1
    classifier_pooling = "last"

    def __init__(self, model, no_id: int, yes_id: int) -> None:
        self.model = model
        self.no_id = no_id
        self.yes_id = yes_id

    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(rows)
        return (logits[:, self.yes_id] - logits[:, self.no_id]).unsqueeze(-1)


def finish_vector(vec: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Matryoshka truncation to `dimensions`, then L2 normalisation when asked for."""
    if params.dimensions is not None:
        vec = vec[: params.dimensions]
    if params.normalize:
        vec = torch.nn.functional.normalize(vec, p=2.0, dim=-1)
    return vec


def sentence_transformers_pooling(model_dir: str | None) -> tuple[str | None, bool | None]:
    """(pooling type, normalise) read from a sentence-transformers layout in `model_dir`:
    `modules.json` names a Pooling module (its `1_Pooling/config.json`, or wherever its path
    says) and maybe a Normalize module. (None, None) where there is no such layout; a pooling
    mode this engine does not serve (max, weighted mean) raises ValueError naming it."""
    if not model_dir or not os.path.isdir(model_dir):
        return None, None
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return None, None
    with open(modules_path, encoding="utf-8") as f:
        modules = json.load(f)
    pooling: str | None = None
    normalize = False
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("Pooling"):
            cfg_path = os.path.join(model_dir, module.get("path") or "1_Pooling", "config.json")
            if not os.path.isfile(cfg_path):
                continue
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
            if cfg.get("pooling_mode_lasttoken"):
                pooling = "last"
            elif cfg.get("pooling_mode_mean_tokens"):
                pooling = "mean"
            elif cfg.get("pooling_mode_cls_token"):
                pooling = "cls"
            else:
                modes = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v]
                raise ValueError(
                    f"{cfg_path}: pooling {modes or 'none'} is not served; this engine pools "
                    "the last token, the mean or the CLS token (set POOLING_TYPE to override)"
                )
    return pooling, normalize


def sentence_transformers_prompts(model_dir: str | None) -> dict[str, str]:
    """The named prompts of `config_sentence_transformers.json` ({"query": "Instruct: ...\n
    Query:", ...}): a request's `prompt_name` puts that text before its input, as
    sentence-transformers' `encode(prompt_name=...)` does. {} where there are none."""
    path = os.path.join(model_dir or "", "config_sentence_transformers.json")
    if not model_dir or not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        prompts = json.load(f).get("prompts") or {}
    return {str(k): str(v) for k, v in prompts.items()} if isinstance(prompts, dict) else {}


def instructed_text(text: str, instruction: str) -> str:
    """Qwen3-Embedding's query form (its model card's `get_detailed_instruct`):
    "Instruct: <task>\nQuery:<text>"."""
    return f"Instruct: {instruction}\nQuery:{text}"


# Qwen3-Reranker's published prompt: a system turn asking for "yes" or "no", the user turn
# holding the instruction, query and document, and an empty thinking block before the answer.
RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def reranker_prompt_ids(
    tokenizer, query: str, document: str, instruction: str | None = None
) -> list[int]:
    """One pair's prompt for a causal LM scorer, as Qwen3-Reranker's recipe builds it: the
    prefix, "<Instruct>: ...\n<Query>: ...\n<Document>: ..." and the suffix, each tokenized
    without special tokens and joined."""
    body = (
        f"<Instruct>: {instruction or RERANKER_INSTRUCTION}\n<Query>: {query}\n"
        f"<Document>: {document}"
    )
    ids: list[int] = []
    for part in (RERANKER_PREFIX, body, RERANKER_SUFFIX):
        ids += list(tokenizer.encode(part, add_special_tokens=False))
    return ids


def score_pairs(text_1, text_2) -> list[tuple[str, str]]:
    """The (query, document) pairs of a score request, as vLLM pairs `text_1` and `text_2`:
    one with one, one with each of many, or many with as many (one-to-one). ValueError for an
    empty side or lists of different lengths."""
    ones = [text_1] if isinstance(text_1, str) else list(text_1)
    twos = [text_2] if isinstance(text_2, str) else list(text_2)
    if not ones or not twos:
        raise ValueError("text_1 and text_2 must each hold at least one text")
    if len(ones) == 1:
        return [(ones[0], t) for t in twos]
    if len(ones) != len(twos):
        raise ValueError(
            f"text_1 has {len(ones)} texts and text_2 {len(twos)}: give one text_1, or as many "
            "as text_2"
        )
    return list(zip(ones, twos))


@functools.lru_cache(maxsize=256)
def embed_params(truncate_prompt_tokens: int | None = None) -> SamplingParams:
    """The sampling parameters a pooling request is prepared and built with: one token of
    room (never sampled: the request ends when its prompt is computed), so its prompt holds
    up to max_model_len - 1 tokens; greedy, nothing detokenized past the prompt. One shared
    instance per truncation (nothing changes a request's parameters; validating a fresh one
    for each of a batch's thousands of inputs cost ~3% of an embedding step)."""
    return SamplingParams(
        max_tokens=1, temperature=0.0, truncate_prompt_tokens=truncate_prompt_tokens
    )


def embedding_output(req: Request) -> EngineOutput:
    """The one, finished output of a pooling request whose embedding is set."""
    return EngineOutput(
        request_id=req.request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="stop",
        stop_reason=None,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=0,
        times=req.times,
        embedding=req.embedding,
    )

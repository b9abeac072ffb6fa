"""Pooling (embedding) requests: a prompt run through the model once, prefill only, whose final
hidden states (after the model's final norm) are pooled into one vector; no token is sampled and
the request's KV blocks are freed as soon as its prompt is computed.

A pooling request is a `Request` with `pooling` set: the scheduler grants it prefill chunks like
any prompt (never from cached prefix blocks: mean pooling needs every row), the model runner
gathers its rows chunk by chunk (`PoolState`) instead of sampling, and the engine ends it the
step its last prompt token is computed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .outputs import EngineOutput
from .sampling.params import SamplingParams

if TYPE_CHECKING:
    from .request import Request

POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """How one request's hidden rows become its embedding."""

    pooling_type: str = "last"  # "last" (the last prompt token's row) or "mean" (all rows)
    normalize: bool = True  # L2-normalise the pooled vector
    dimensions: int | None = None  # keep the first k dimensions (Matryoshka), then normalise

    def __post_init__(self) -> None:
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

    __slots__ = ("total", "count", "last")

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.count = 0
        self.last: torch.Tensor | None = None

    def add(self, rows: torch.Tensor, mean: bool) -> None:
        rows = rows.float()
        if mean:
            s = rows.sum(dim=0)
            self.total = s if self.total is None else self.total + s
            self.count += rows.shape[0]
        self.last = rows[-1]

    def result(self, params: PoolingParams) -> torch.Tensor:
        if params.pooling_type == "mean":
            assert self.total is not None and self.count
            vec = self.total / self.count
        else:
            assert self.last is not None
            vec = self.last
        return finish_vector(vec, params)


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
    mode this engine does not serve (CLS, max, weighted mean) raises ValueError naming it."""
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
            else:
                modes = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v]
                raise ValueError(
                    f"{cfg_path}: pooling {modes or 'none'} is not served; this engine pools "
                    "the last token or the mean (set POOLING_TYPE to override)"
                )
    return pooling, normalize


def embed_params(truncate_prompt_tokens: int | None = None) -> SamplingParams:
    """The sampling parameters a pooling request is prepared and built with: one token of
    room (never sampled: the request ends when its prompt is computed), so its prompt holds
    up to max_model_len - 1 tokens; greedy, nothing detokenized past the prompt."""
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

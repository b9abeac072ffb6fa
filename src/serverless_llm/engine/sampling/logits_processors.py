"""What changes logit values before sampling: allowed_token_ids, logit_bias, min_tokens and the
three penalties; and the per-request state they need between steps.

All of them touch few entries of a row (the allowed ids, the biased ids, the stop ids, the
distinct tokens seen), so each is one sparse gather/scatter over the flattened batch rather than
a vocabulary-sized tensor per row. The token counts behind the penalties are kept per request
and updated with each sampled token (`RequestSamplingState.on_token`), never rebuilt from the
token lists.
"""

from __future__ import annotations

import copy
import itertools
from typing import TYPE_CHECKING

import numpy as np
import torch

from .params import SamplingParams

if TYPE_CHECKING:
    from ..stop_rule import StopRule

__all__ = ["RequestSamplingState", "SparseRows", "apply_processors"]

_serials = itertools.count()

# The truncation samplers in the order they apply (see truncation.py). The first one a request
# uses decides what the batch must precompute for it.
TRUNCATION_ORDER = ("top_k", "top_p", "top_a", "min_p", "tfs", "eta", "epsilon", "typical")


class _GrowingArray:
    """A numpy array with amortised O(1) append (a view of the filled part is `values`)."""

    __slots__ = ("_data", "_size")

    def __init__(self, initial: np.ndarray) -> None:
        self._data = np.array(initial, copy=True)
        self._size = len(initial)

    def append(self, value: float) -> None:
        if self._size == len(self._data):
            grown = np.empty(max(8, 2 * len(self._data)), dtype=self._data.dtype)
            grown[: self._size] = self._data[: self._size]
            self._data = grown
        self._data[self._size] = value
        self._size += 1

    def add_at(self, index: int, value: float) -> None:
        self._data[index] += value

    @property
    def values(self) -> np.ndarray:
        return self._data[: self._size]

    def __len__(self) -> int:
        return self._size


class RequestSamplingState:
    """One request's sampling state: its generator, its parameters as ready-made id tensors, and
    the token counts the penalties read. Built once per request by the engine."""

    __slots__ = (
        "serial",
        "params",
        "generator",
        "mode",
        "first_cut",
        "allowed_ids",
        "bias_ids",
        "bias_values",
        "min_tokens_ids",
        "_seen",
        "_rep_ids",
        "_out_slot",
        "_out_ids",
        "_out_counts",
    )

    def __init__(
        self, params: SamplingParams, prompt_token_ids: list[int], stop_rule: StopRule
    ) -> None:
        self.serial = next(_serials)  # identifies the request in the batch caches
        self.params = params
        # CPU generators on every device: one uniform per step is all a request draws.
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.mode = "greedy" if params.greedy else ("truncated" if params.truncates else "plain")
        self.first_cut = _first_cut(params) if self.mode == "truncated" else None
        self.allowed_ids = _ids(params.allowed_token_ids)
        self.bias_ids = self.bias_values = None
        if params.logit_bias:
            self.bias_ids = _ids(list(params.logit_bias))
            self.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        self.min_tokens_ids = None
        if params.min_tokens > 0:
            stops = stop_rule.masked_ids(0)  # masked while short of min_tokens
            self.min_tokens_ids = _ids(sorted(stops)) if stops else None
        # Repetition penalty: the distinct ids of prompt and output.
        self._seen: set[int] | None = None
        self._rep_ids: _GrowingArray | None = None
        if params.repetition_penalty != 1.0:
            distinct = np.unique(np.asarray(prompt_token_ids, dtype=np.int64))
            self._seen = set(distinct.tolist())
            self._rep_ids = _GrowingArray(distinct)
        # Frequency and presence penalties: the distinct output ids and their counts.
        self._out_slot: dict[int, int] | None = None
        self._out_ids: _GrowingArray | None = None
        self._out_counts: _GrowingArray | None = None
        if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
            self._out_slot = {}
            self._out_ids = _GrowingArray(np.empty(0, dtype=np.int64))
            self._out_counts = _GrowingArray(np.empty(0, dtype=np.float32))

    def on_token(self, token: int) -> None:
        """Records a sampled token in the penalty counts."""
        if self._seen is not None and token not in self._seen:
            self._seen.add(token)
            self._rep_ids.append(token)
        if self._out_slot is not None:
            slot = self._out_slot.get(token)
            if slot is None:
                self._out_slot[token] = len(self._out_ids)
                self._out_ids.append(token)
                self._out_counts.append(1.0)
            else:
                self._out_counts.add_at(slot, 1.0)

    def ahead(self, tokens: list[int]) -> RequestSamplingState:
        """This state as it would be once `tokens` are sampled too (speculative drafts taken as
        accepted), for sampling a draft's row; this one is left as it is. The generator is
        shared: the caller rewinds it to the tokens it keeps (sampling/verify.py)."""
        view = copy.copy(self)
        if self._seen is not None:
            view._seen = set(self._seen)
            view._rep_ids = _GrowingArray(self._rep_ids.values)
        if self._out_slot is not None:
            view._out_slot = dict(self._out_slot)
            view._out_ids = _GrowingArray(self._out_ids.values)
            view._out_counts = _GrowingArray(self._out_counts.values)
        for tok in tokens:
            view.on_token(tok)
        return view

    @property
    def repetition_ids(self) -> np.ndarray | None:
        return None if self._rep_ids is None else self._rep_ids.values

    @property
    def output_counts(self) -> tuple[np.ndarray, np.ndarray] | None:
        if self._out_ids is None:
            return None
        return self._out_ids.values, self._out_counts.values


def _ids(ids: list[int] | None) -> torch.Tensor | None:
    return None if not ids else torch.tensor(ids, dtype=torch.int64)


def _first_cut(p: SamplingParams) -> str:
    active = {
        "top_k": p.top_k > 0,
        "top_p": p.top_p < 1.0,
        "top_a": p.top_a > 0.0,
        "min_p": p.min_p > 0.0,
        "tfs": p.tfs < 1.0,
        "eta": p.eta_cutoff > 0.0,
        "epsilon": p.epsilon_cutoff > 0.0,
        "typical": p.typical_p < 1.0,
    }
    return next(name for name in TRUNCATION_ORDER if active[name])


class SparseRows:
    """(row, token id) pairs of a batch flattened into indices of the [N * V] logits, with one
    value or per-pair values; what each sparse processor scatters."""

    __slots__ = ("flat", "rows", "values")

    def __init__(
        self, flat: torch.Tensor, rows: torch.Tensor, values: torch.Tensor | None = None
    ) -> None:
        self.flat = flat
        self.rows = rows
        self.values = values

    @classmethod
    def build(
        cls,
        rows: list[int],
        ids: list[torch.Tensor | np.ndarray],
        vocab_size: int,
        device: torch.device,
        values: list[torch.Tensor | np.ndarray] | None = None,
    ) -> SparseRows:
        as_tensor = [torch.as_tensor(a) for a in ids]
        lengths = torch.tensor([len(a) for a in as_tensor], dtype=torch.int64)
        row_idx = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
        flat = row_idx * vocab_size + torch.cat(as_tensor)
        vals = None
        if values is not None:
            vals = torch.cat([torch.as_tensor(v, dtype=torch.float32) for v in values]).to(device)
        return cls(flat.to(device), row_idx.to(device), vals)


def apply_processors(
    logits: torch.Tensor,
    *,
    allowed: tuple[torch.Tensor, SparseRows] | None,
    bias: SparseRows | None,
    min_tokens: SparseRows | None,
    repetition: tuple[SparseRows, torch.Tensor] | None,
    frequency_presence: tuple[SparseRows, torch.Tensor, torch.Tensor] | None,
) -> None:
    """Applies, in place and in this order (vLLM's): allowed_token_ids, logit_bias, the
    min_tokens mask, the repetition penalty, the frequency and presence penalties.

    - allowed: (rows that restrict, their allowed (row, id) pairs): every other id gets -inf.
    - bias: logit += bias for the listed ids.
    - min_tokens: -inf for EOS and the stop ids while a request is short of min_tokens.
    - repetition: ((row, id) for the distinct ids of prompt and output, penalty per row of the
      batch): positive logits are divided by the penalty, negative ones multiplied.
    - frequency_presence: ((row, id, count) for the distinct output ids, frequency and presence
      per row of the batch): logit -= frequency * count + presence (OpenAI's definition).
    """
    flat_logits = logits.view(-1)
    if allowed is not None:
        rows, pairs = allowed
        kept = flat_logits.index_select(0, pairs.flat)
        logits.index_fill_(0, rows, float("-inf"))
        flat_logits.index_copy_(0, pairs.flat, kept)
    if bias is not None:
        flat_logits.index_add_(0, bias.flat, bias.values)
    if min_tokens is not None:
        flat_logits.index_fill_(0, min_tokens.flat, float("-inf"))
    if repetition is not None:
        pairs, penalty = repetition
        values = flat_logits.index_select(0, pairs.flat)
        per_pair = penalty.index_select(0, pairs.rows)
        values = torch.where(values > 0, values / per_pair, values * per_pair)
        flat_logits.index_copy_(0, pairs.flat, values)
    if frequency_presence is not None:
        pairs, frequency, presence = frequency_presence
        delta = frequency.index_select(0, pairs.rows) * pairs.values + presence.index_select(
            0, pairs.rows
        )
        flat_logits.index_add_(0, pairs.flat, -delta)

"""Sampling on the batch: per-request parameters become tensors, and one pass over the logits
of the whole batch applies them.

A step's `SamplingBatch` holds each parameter as a tensor over the rows that use it (None when
no row does, so the common case pays nothing). The sampler then:

1. computes the raw log-softmax (and its top-k) for rows that asked for logprobs: logprobs are
   the model's own distribution, vLLM's default `raw_logprobs`;
2. changes values in place: allowed_token_ids, logit_bias, the min_tokens mask, the repetition,
   frequency and presence penalties (logits_processors.py);
3. greedy rows take the argmax of that;
4. rows that truncate nothing draw from softmax(logits / temperature), smoothed if asked;
5. rows that truncate run truncation.py on their most likely tokens.

Draws are inverse-CDF with one uniform per row: a seeded request takes it from its own
generator, so its tokens do not depend on what else is in the batch (every row computation
is per row, and which path a row takes depends on its own parameters and logits only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..request import Request
from .logits_processors import RequestSamplingState, SparseRows, apply_processors
from .logprobs import TokenLogprob, finish_logprobs, prepare_logprobs
from .ops import NUMPY_FLOATS, argmax_rows, block_argmax
from .structured.bitmask import apply_bitmask
from .truncation import TruncationParams, sample_plain, sample_truncated

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch"]

# Aphrodite gives eta_cutoff and epsilon_cutoff in units of 1e-4.
_CUTOFF_UNIT = 1e-4


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)


@dataclass
class SamplingBatch:
    num_rows: int
    vocab_size: int
    all_greedy: bool  # every row greedy, no processor: a plain argmax
    greedy_rows: torch.Tensor | None
    plain_rows: torch.Tensor | None
    truncated_rows: torch.Tensor | None
    plain_temperature: torch.Tensor | None  # [p, 1]
    plain_smoothing: tuple[torch.Tensor, torch.Tensor] | None
    truncated_temperature: torch.Tensor | None  # [t, 1]
    truncation: TruncationParams | None
    allowed: tuple[torch.Tensor, SparseRows] | None
    bias: SparseRows | None
    min_tokens: SparseRows | None
    repetition: tuple[SparseRows, torch.Tensor] | None
    frequency_presence: tuple[SparseRows, torch.Tensor, torch.Tensor] | None  # counts in values
    sampled: list[int]  # rows that draw a uniform, in batch order
    generators: list[torch.Generator | None]  # per sampled row
    logprob_rows: list[int]  # rows that asked for logprobs
    logprob_top: list[int]  # their top-k count
    device: torch.device
    # Structured output: the grammar bitmask (CPU int32, row i = batch row i) and its rows.
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: list[int] | None = None

    def set_grammar(self, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Rows `rows` draw only tokens their bitmask row allows (applied after the
        processors, before temperature and truncation)."""
        self.grammar_bitmask = bitmask
        self.grammar_rows = list(rows)
        self.all_greedy = False

    @property
    def has_processors(self) -> bool:
        return self.grammar_rows is not None or any(
            x is not None
            for x in (
                self.allowed,
                self.bias,
                self.min_tokens,
                self.repetition,
                self.frequency_presence,
            )
        )

    @classmethod
    def build(
        cls,
        requests: list[Request],
        vocab_size: int,
        device: torch.device,
        cache: dict | None = None,
    ) -> SamplingBatch:
        """`cache`: a dict kept by the caller between steps. The (row, id) pairs of
        allowed_token_ids and logit_bias do not change while the same requests sit in the same
        rows (most decode steps), so they are reused instead of rebuilt."""
        states = [r.sampling for r in requests]
        if all(_plain_greedy(s) for s in states):
            return cls._all_greedy(len(states), vocab_size, device, cache)

        def cached(kind: str, rows: list[int], make):
            if cache is None:
                return make()
            key = tuple((i, states[i].serial) for i in rows)
            hit = cache.get(kind)
            if hit is not None and hit[0] == key:
                return hit[1]
            value = make()
            cache[kind] = (key, value)
            return value

        ps = [s.params for s in states]
        n = len(ps)
        greedy = [i for i, s in enumerate(states) if s.mode == "greedy"]
        plain = [i for i, s in enumerate(states) if s.mode == "plain"]
        trunc = [i for i, s in enumerate(states) if s.mode == "truncated"]
        sampled = [i for i, s in enumerate(states) if s.mode != "greedy"]

        allowed = bias = min_tokens = repetition = frequency_presence = None
        rows = [i for i, s in enumerate(states) if s.allowed_ids is not None]
        if rows:
            allowed = cached(
                "allowed",
                rows,
                lambda: (
                    _index(rows, device),
                    SparseRows.build(
                        rows, [states[i].allowed_ids for i in rows], vocab_size, device
                    ),
                ),
            )
        rows = [i for i, s in enumerate(states) if s.bias_ids is not None]
        if rows:
            bias = cached(
                "bias",
                rows,
                lambda: SparseRows.build(
                    rows,
                    [states[i].bias_ids for i in rows],
                    vocab_size,
                    device,
                    values=[states[i].bias_values for i in rows],
                ),
            )
        rows = [
            i
            for i, (s, r) in enumerate(zip(states, requests))
            if s.min_tokens_ids is not None
            and len(r.output_token_ids) < s.params.min_tokens
            # a complete grammar allows only stop tokens: min_tokens must not ban them all
            and not (r.grammar is not None and r.grammar_open and r.grammar.is_completed())
        ]
        if rows:
            min_tokens = SparseRows.build(
                rows, [states[i].min_tokens_ids for i in rows], vocab_size, device
            )
        rows = [i for i, s in enumerate(states) if s.repetition_ids is not None]
        if rows:
            pairs = SparseRows.build(
                rows, [states[i].repetition_ids for i in rows], vocab_size, device
            )
            penalty = torch.tensor(
                [p.repetition_penalty for p in ps], dtype=torch.float32, device=device
            )
            repetition = (pairs, penalty)
        rows = [i for i, s in enumerate(states) if s.output_counts is not None]
        rows = [i for i in rows if len(states[i].output_counts[0])]
        if rows:
            counts = [states[i].output_counts for i in rows]
            pairs = SparseRows.build(
                rows, [c[0] for c in counts], vocab_size, device, values=[c[1] for c in counts]
            )
            frequency = torch.tensor(
                [p.frequency_penalty for p in ps], dtype=torch.float32, device=device
            )
            presence = torch.tensor(
                [p.presence_penalty for p in ps], dtype=torch.float32, device=device
            )
            frequency_presence = (pairs, frequency, presence)

        def temps(rows: list[int]) -> torch.Tensor:
            return torch.tensor(
                [ps[i].temperature for i in rows], dtype=torch.float32, device=device
            ).unsqueeze(1)

        plain_smoothing = None
        if any(ps[i].smoothing_factor > 0.0 for i in plain):
            plain_smoothing = (
                torch.tensor([ps[i].smoothing_factor for i in plain], device=device),
                torch.tensor([ps[i].smoothing_curve for i in plain], device=device),
            )
        logprob_rows = [i for i, p in enumerate(ps) if p.logprobs is not None]
        all_greedy = len(greedy) == n
        batch = cls(
            num_rows=n,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            greedy_rows=_index(greedy, device) if greedy else None,
            plain_rows=_index(plain, device) if plain else None,
            truncated_rows=_index(trunc, device) if trunc else None,
            plain_temperature=temps(plain) if plain else None,
            plain_smoothing=plain_smoothing,
            truncated_temperature=temps(trunc) if trunc else None,
            truncation=_truncation_params(
                [ps[i] for i in trunc], [states[i].first_cut for i in trunc], vocab_size, device
            )
            if trunc
            else None,
            allowed=allowed,
            bias=bias,
            min_tokens=min_tokens,
            repetition=repetition,
            frequency_presence=frequency_presence,
            sampled=sampled,
            generators=[states[i].generator for i in sampled],
            logprob_rows=logprob_rows,
            logprob_top=[ps[i].logprobs for i in logprob_rows],
            device=device,
        )
        if all_greedy and batch.has_processors:
            batch.all_greedy = False
        return batch

    @classmethod
    def _all_greedy(
        cls, n: int, vocab_size: int, device: torch.device, cache: dict | None
    ) -> SamplingBatch:
        """`build`'s batch when every row is greedy with nothing that changes its logits or asks
        for logprobs (most decode steps): a plain argmax. The row index is reused across steps
        of the same size."""
        key = ("greedy_rows", n, device)
        rows = cache.get(key) if cache is not None else None
        if rows is None:
            rows = _index(list(range(n)), device)
            if cache is not None:
                cache[key] = rows
        return cls(
            num_rows=n,
            vocab_size=vocab_size,
            all_greedy=True,
            greedy_rows=rows,
            plain_rows=None,
            truncated_rows=None,
            plain_temperature=None,
            plain_smoothing=None,
            truncated_temperature=None,
            truncation=None,
            allowed=None,
            bias=None,
            min_tokens=None,
            repetition=None,
            frequency_presence=None,
            sampled=[],
            generators=[],
            logprob_rows=[],
            logprob_top=[],
            device=device,
        )


def _plain_greedy(s: RequestSamplingState) -> bool:
    """A greedy row that no processor touches and that asks for no logprobs."""
    return (
        s.mode == "greedy"
        and s.allowed_ids is None
        and s.bias_ids is None
        and s.min_tokens_ids is None
        and s.repetition_ids is None
        and s.output_counts is None
        and s.params.logprobs is None
    )


def _truncation_params(
    ps: list, first: list[str], vocab_size: int, device: torch.device
) -> TruncationParams:
    """The truncation samplers of the rows that truncate, each as a tensor or None if unused."""

    def column(values: list, neutral: float, dtype=torch.float32) -> torch.Tensor | None:
        if all(v == neutral for v in values):
            return None
        return torch.tensor(values, dtype=dtype, device=device)

    top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in ps]
    smoothing = column([p.smoothing_factor for p in ps], 0.0)
    tp = TruncationParams(
        top_k=column(top_k, 0, torch.int64),
        top_p=column([p.top_p for p in ps], 1.0),
        top_a=column([p.top_a for p in ps], 0.0),
        min_p=column([p.min_p for p in ps], 0.0),
        tfs=column([p.tfs for p in ps], 1.0),
        eta=column([p.eta_cutoff * _CUTOFF_UNIT for p in ps], 0.0),
        epsilon=column([p.epsilon_cutoff * _CUTOFF_UNIT for p in ps], 0.0),
        typical=column([p.typical_p for p in ps], 1.0),
        smoothing_factor=smoothing,
        smoothing_curve=None
        if smoothing is None
        else torch.tensor([p.smoothing_curve for p in ps], dtype=torch.float32, device=device),
        needs_lse=column([f in ("top_p", "top_a", "eta", "epsilon") for f in first], False, bool),
        needs_entropy=column([f == "eta" for f in first], False, bool),
        needs_full=column([f in ("tfs", "typical") for f in first], False, bool),
    )
    return tp


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None  # per row (None for rows that did not ask)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        # Uniforms are drawn on the CPU (one per row) and moved over once.
        self.generator = torch.Generator().manual_seed(seed)
        self.device = torch.device(device)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [N, V] -> one token per row (and the logprobs rows asked for). The logits are
        modified in place."""
        if (
            batch.all_greedy
            and not batch.logprob_rows
            and logits.device.type == "cpu"
            and logits.dtype in NUMPY_FLOATS
        ):  # plain argmax rows (most decode steps): one numpy pass, no tensors made
            return SamplerOutput(argmax_rows(logits).tolist(), None)
        return self._sample_batch(logits, batch)

    @torch.inference_mode()
    def _sample_batch(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        x = logits.float()
        lp_state = None
        if batch.logprob_rows:
            lp_state = prepare_logprobs(
                x, batch.logprob_rows, max(batch.logprob_top), copy=batch.has_processors
            )
        if batch.all_greedy:
            tokens = block_argmax(x)
        else:
            tokens = self._sample(x, batch, return_logits=False)[0]
        token_list = tokens.tolist()
        logprobs = None
        if lp_state is not None:
            logprobs = finish_logprobs(
                lp_state,
                tokens,
                token_list,
                batch.logprob_rows,
                batch.logprob_top,
                batch.num_rows,
            )
        return SamplerOutput(token_list, logprobs)

    @torch.inference_mode()
    def processed_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution each row draws from, as logits with -inf where removed (greedy rows:
        the penalised logits). For tests and references; `logits` is left untouched."""
        return self._sample(logits.float().clone(), batch, return_logits=True)[1]

    def _uniforms(self, batch: SamplingBatch) -> torch.Tensor:
        u = torch.empty(batch.num_rows, dtype=torch.float32)
        if batch.sampled:
            draws = torch.empty(len(batch.sampled), dtype=torch.float32)
            unseeded = [j for j, g in enumerate(batch.generators) if g is None]
            if unseeded:
                draws[unseeded] = torch.rand(len(unseeded), generator=self.generator)
            for j, g in enumerate(batch.generators):
                if g is not None:
                    draws[j] = torch.rand(1, generator=g)[0]
            u[batch.sampled] = draws
        return u.to(batch.device)

    def _sample(
        self, x: torch.Tensor, batch: SamplingBatch, return_logits: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raw = None
        rows = batch.grammar_rows
        if rows is not None and (batch.allowed is not None or batch.bias is not None):
            raw = x[rows].clone()  # the fallback for rows the processors leave empty
        apply_processors(
            x,
            allowed=batch.allowed,
            bias=batch.bias,
            min_tokens=batch.min_tokens,
            repetition=batch.repetition,
            frequency_presence=batch.frequency_presence,
        )
        if rows is not None:
            apply_bitmask(x, batch.grammar_bitmask[: batch.num_rows], rows)
            if raw is not None:
                empty = torch.isinf(x[rows]).all(dim=-1).nonzero().flatten().tolist()
                if empty:  # logit_bias / allowed_token_ids and the grammar disagree
                    sub = raw[empty]
                    idx = [rows[j] for j in empty]
                    apply_bitmask(sub, batch.grammar_bitmask[idx])
                    x[idx] = sub
        u = self._uniforms(batch)
        n = batch.num_rows
        tokens = torch.empty(n, dtype=torch.int64, device=x.device)
        final = x.clone() if return_logits else None
        if batch.greedy_rows is not None:
            rows = batch.greedy_rows
            tokens[rows] = block_argmax(x if len(rows) == n else x.index_select(0, rows))
        if batch.plain_rows is not None:
            rows = batch.plain_rows
            xs = x if len(rows) == n else x.index_select(0, rows)
            toks, out = sample_plain(
                xs / batch.plain_temperature, u[rows], batch.plain_smoothing, return_logits
            )
            tokens[rows] = toks
            if final is not None:
                final[rows] = out
        if batch.truncated_rows is not None:
            rows = batch.truncated_rows
            xs = x if len(rows) == n else x.index_select(0, rows)
            toks, out = sample_truncated(
                xs, batch.truncated_temperature, batch.truncation, u[rows], return_logits
            )
            tokens[rows] = toks
            if final is not None:
                final[rows] = out
        return tokens, final

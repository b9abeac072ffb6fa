"""Sampling on the batch: per-request parameters become tensors, and one pass over the logits
of the whole batch applies them.

Adding a parameter means: a tensor in `SamplingBatch.build` (or None when no request uses it,
so the common case pays nothing) and one transform in `Sampler.apply_transforms`.

Random draws use the exponential race (argmax of p / E with E ~ Exp(1) is a draw from p): it
needs no sort and no cumulative sum, and a seeded request draws its E from its own generator, so
its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..request import Request


@dataclass
class SamplingBatch:
    temperature: torch.Tensor | None  # [N, 1] float32, None when every row is greedy
    greedy: torch.Tensor  # [N] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [N] int64 (vocab size where off), None when no row uses it
    top_p: torch.Tensor | None  # [N] float32, None when no row uses it
    generators: list[torch.Generator | None]

    @classmethod
    def build(cls, requests: list[Request], vocab_size: int, device: torch.device) -> SamplingBatch:
        ps = [r.params for r in requests]
        greedy_list = [p.greedy for p in ps]
        all_greedy = all(greedy_list)
        greedy = torch.tensor(greedy_list, dtype=torch.bool, device=device)
        if all_greedy:
            return cls(None, greedy, True, None, None, [None] * len(ps))
        temperature = torch.tensor(
            [1.0 if p.greedy else p.temperature for p in ps], dtype=torch.float32, device=device
        ).unsqueeze(1)
        top_k = None
        if any(p.top_k > 0 for p in ps):
            top_k = torch.tensor(
                [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in ps],
                dtype=torch.int64,
                device=device,
            )
        top_p = None
        if any(p.top_p < 1.0 for p in ps):
            top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=device)
        return cls(temperature, greedy, False, top_k, top_p, [r.generator for r in requests])


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [N, V] -> sampled token ids [N] (int64)."""
        logits = logits.float()
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        greedy_ids = logits.argmax(dim=-1)
        logits = self.apply_transforms(logits, batch)
        probs = torch.softmax(logits, dim=-1)
        sampled = (probs / self._exponentials(probs, batch.generators)).argmax(dim=-1)
        return torch.where(batch.greedy, greedy_ids, sampled)

    def apply_transforms(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = logits / batch.temperature
        if batch.top_k is not None:
            logits = apply_top_k(logits, batch.top_k)
        if batch.top_p is not None:
            logits = apply_top_p(logits, batch.top_p)
        return logits

    def _exponentials(
        self, probs: torch.Tensor, generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        q = torch.empty_like(probs)
        seeded = [i for i, g in enumerate(generators) if g is not None]
        if len(seeded) < len(generators):
            q.exponential_(generator=self.generator)
        for i in seeded:
            q[i].exponential_(generator=generators[i])
        return q


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keeps the logits >= the k-th largest of each row (ties kept, as transformers does)."""
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Nucleus filtering as transformers defines it: sort ascending, drop the tokens whose
    cumulative probability stays <= 1 - top_p; the most likely token always survives."""
    sorted_logits, order = logits.sort(dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - p).unsqueeze(1)
    remove[:, -1] = False
    return logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))

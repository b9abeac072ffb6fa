"""Row-wise primitives of the sampler, written for what is cheap on a CPU.

On a [64, 50k] batch of logits, ATen's CPU `topk`, `argmax` and `cumsum` each cost as much as
several vectorised passes (`amax`, `softmax`), and a full `sort` more than a model decode step.
So these work on blocks of BLOCK tokens: a vectorised reduction per block first, then the
expensive operation on the few blocks that matter. Results equal the plain operations (the
same values; ties may pick a different one of equal tokens), and depend on each row alone.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "BLOCK",
    "NUMPY_FLOATS",
    "argmax_rows",
    "block_argmax",
    "block_topk",
    "draw",
    "row_logsumexp",
    "sort_descending",
]

BLOCK = 64


def _blocks(x: torch.Tensor, fill: float) -> torch.Tensor:
    """`x` [r, V] viewed as [r, V / BLOCK, BLOCK], padded with `fill` when BLOCK does not divide
    V (a copy; most vocabularies are multiples of 64)."""
    r, V = x.shape
    rem = V % BLOCK
    if rem:
        x = torch.cat([x, x.new_full((r, BLOCK - rem), fill)], dim=1)
    return x.reshape(r, -1, BLOCK)


def block_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row, sorted descending, and their indices.

    The k largest elements lie in the k blocks with the largest maxima (a block outside them
    has k blocks above it, so k larger elements), so `topk` only runs over k * BLOCK of them.
    """
    r, V = x.shape
    if k * BLOCK * 4 > V or not x.is_contiguous():
        return x.topk(k, dim=-1)
    xb = _blocks(x, float("-inf"))
    best_blocks = xb.amax(dim=-1).topk(k, dim=-1).indices  # [r, k]
    cand = xb.gather(1, best_blocks.unsqueeze(-1).expand(r, k, BLOCK)).reshape(r, k * BLOCK)
    values, j = cand.topk(k, dim=-1)
    index = best_blocks.gather(1, j // BLOCK) * BLOCK + j % BLOCK
    return values, index


def block_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum of each row, as `argmax`. On a CPU, float32/float64 rows go
    through numpy's SIMD argmax (one pass, 3-5x faster than the block reduction at 1 to 64
    rows of 49k); elsewhere the first block holding the maximum, then the first position in
    it. A NaN counts as the maximum, as in `argmax`."""
    if x.device.type == "cpu" and x.dtype in NUMPY_FLOATS:
        return torch.from_numpy(argmax_rows(x))
    r, V = x.shape
    if V < 4 * BLOCK or not x.is_contiguous():
        return x.argmax(dim=-1)
    xb = _blocks(x, float("-inf"))
    block = xb.amax(dim=-1).argmax(dim=-1)  # [r]
    inner = xb[torch.arange(r, device=x.device), block].argmax(dim=-1)
    return block * BLOCK + inner


NUMPY_FLOATS = (torch.float32, torch.float64)


def argmax_rows(x: torch.Tensor) -> np.ndarray:
    """numpy's argmax of each row of a CPU float32/float64 tensor [r, V] (int64): the first
    maximum; a NaN counts as the maximum, as torch's."""
    return x.detach().numpy().argmax(axis=-1).astype(np.int64, copy=False)


def sort_descending(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row sorted, largest first, and the indices. On a CPU through numpy, whose SIMD
    quicksort is several times faster than ATen's sort on 50k floats (the order among equal
    values is arbitrary but fixed for a given row)."""
    if x.device.type != "cpu":
        return x.sort(dim=-1, descending=True)
    order = torch.from_numpy(np.argsort(-x.numpy(), axis=-1))
    return x.gather(1, order), order


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(x))) per row, through the vectorised softmax (ATen's CPU logsumexp is about
    twice as slow): the largest probability is exp(max - lse)."""
    mx = x.amax(dim=-1)
    return mx - torch.softmax(x, dim=-1).amax(dim=-1).log()


def draw(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row from softmax(logits): the position where the cumulative
    probability passes u * total, never a token of probability 0. Long rows go through block
    sums (a cumulative sum over 50k entries is slow) and one block's cumulative sum."""
    probs = torch.softmax(logits, dim=-1)
    r, n = probs.shape
    rows = torch.arange(r, device=probs.device)
    if n <= 16 * BLOCK:
        return _search(probs, u)
    pb = _blocks(probs, 0.0)
    sums = pb.sum(dim=-1)  # [r, nb]
    cdf = sums.cumsum(dim=-1)
    target = u * cdf[:, -1]
    block = _search(sums, u, cdf=cdf)
    below = torch.where(block > 0, cdf[rows, (block - 1).clamp(min=0)], torch.zeros_like(target))
    inner_probs = pb[rows, block]  # [r, BLOCK]
    inner_u = ((target - below) / sums[rows, block]).clamp(0.0, 1.0)
    inner = _search(inner_probs, inner_u)
    return block * BLOCK + inner


def _search(
    weights: torch.Tensor, u: torch.Tensor, cdf: torch.Tensor | None = None
) -> torch.Tensor:
    """First position whose cumulative weight exceeds u * total (a position of weight 0 never
    is: its cumulative value equals the one before)."""
    if cdf is None:
        cdf = weights.cumsum(dim=-1)
    n = weights.shape[-1]
    pos = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    over = pos >= n
    if bool(over.any()):  # u * total rounded up to total: the last position with weight
        last = n - 1 - (weights > 0).flip(-1).int().argmax(dim=-1)
        pos = torch.where(over, last, pos)
    return pos

"""LoRA: adding each token's adapter delta to a linear layer's output, as a torch reference.

A layer holds every adapter slot's matrices stacked: A [slots, R, in] and B [out, slots, R],
B already scaled by the adapter's alpha / r (or alpha / sqrt(r), rsLoRA). A fused layer (q/k/v,
gate/up) gives each part its own R-wide block of A's rows and of B's columns, zero outside the
part's output rows, so one pair of matmuls serves every part. Token t with slot s gets

    out[t] += B[s] @ (A[s] @ x[t])

and tokens without an adapter get nothing. Two torch forms compute it:

- `add_lora_reference`: the step's tokens grouped by slot (`groups`: the slot and its rows, a
  slice when they are contiguous, else an index tensor), one shrink and one expand per adapter.
- `add_lora` (Triton, CUDA): the tokens sorted by slot and padded per slot to the row tile
  (`fused_moe.moe_align`, tokens without an adapter in a group of their own that is skipped),
  then the shrink and the expand as two launches of the grouped GEMM of kernels/fused_moe.py,
  the expand adding into the layer's output. No host synchronisation.
- `add_lora_masked`: every token against every slot at once, x @ A_all^T [T, slots x R], the
  columns of other slots zeroed by the step's mask, then one expand over all slots. Two
  matmuls per layer whatever the adapters, at slots times the (small) flops: the CPU path for
  steps of many tokens (prefill), where oneDNN's packed matrices carry the extra flops well.
- `add_lora_padded`: the tokens gathered slot-major into a [slots, m, in] batch (each slot's
  rows padded to the most any slot has), one batched shrink and one batched expand over the
  slots' own matrices, the deltas gathered back to token order: the CPU path for decode steps.
  Two matmuls again, but each slot multiplies only its own rows (a quarter of the masked
  form's flops at 4 slots), and the result lands in `out` by a gather, not a scatter-add
  (`index_add_` is several times slower on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .fused_moe import grouped_gemm, moe_align, moe_tiles


def add_lora_reference(
    out: Tensor,  # [T, out]
    x: Tensor,  # [T, in]
    lora_a: Tensor,  # [slots, R, in]
    lora_b: Tensor,  # [out, slots, R]
    groups: list[tuple[int, slice | Tensor]],
) -> Tensor:
    """`out` with each group's delta added in place (the shrink in x's dtype, the expand too)."""
    for slot, rows in groups:
        shrunk = x[rows] @ lora_a[slot].t()
        delta = shrunk @ lora_b[:, slot].t()
        if isinstance(rows, slice):
            out[rows] += delta
        else:
            out.index_add_(0, rows, delta)
    return out


def slot_mask(token_slots: Tensor, num_slots: int, width: int, dtype: torch.dtype) -> Tensor:
    """[T, slots x width]: 1 in the `width` columns of each token's slot, 0 elsewhere (a token
    with slot -1, no adapter, gets a row of zeros)."""
    hit = token_slots[:, None] == torch.arange(num_slots, device=token_slots.device)
    return hit.to(dtype)[:, :, None].expand(-1, -1, width).reshape(len(token_slots), -1)


def add_lora_masked(out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, mask: Tensor) -> Tensor:
    """`out` plus every token's delta, through all slots at once with `mask` (`slot_mask`)."""
    slots, ranks, k = lora_a.shape
    shrunk = (x @ lora_a.reshape(slots * ranks, k).t()).mul_(mask)
    return out.addmm_(shrunk, lora_b.reshape(lora_b.shape[0], slots * ranks).t())


@dataclass
class PaddedRows:
    """A step's tokens laid out slot-major for `add_lora_padded`: slots `lo`..`hi`-1, `m` rows
    each. `gather` [(hi - lo) x m]: the token each padded row reads (padding reads token 0 and
    is never read back); `scatter` [T]: the padded row each token's delta comes from, or
    (hi - lo) x m, a zero row, for a token without adapter (`zero_row` says one exists)."""

    lo: int
    hi: int
    m: int
    gather: Tensor
    scatter: Tensor
    zero_row: bool

    @property
    def rows(self) -> int:
        return (self.hi - self.lo) * self.m


def padded_rows(
    groups: list[tuple[int, slice | Tensor]],
    num_tokens: int,
    device: torch.device,
    max_rows: int | None = None,
) -> PaddedRows | None:
    """The slot-major layout of a step's `groups` (slot, its rows: a slice or an index tensor;
    at least one group), or None when it would have more than `max_rows` rows. The slots
    spanned are the groups' lowest to highest: a slot between them with no token costs `m`
    padded rows."""
    rows = [torch.arange(r.start, r.stop) if isinstance(r, slice) else r.cpu() for _, r in groups]
    slots = [s for s, _ in groups]
    lo, hi, m = min(slots), max(slots) + 1, max(len(r) for r in rows)
    n = (hi - lo) * m
    if max_rows is not None and n > max_rows:
        return None
    gather = torch.zeros(n, dtype=torch.int64)
    scatter = torch.full((num_tokens,), n, dtype=torch.int64)
    for slot, r in zip(slots, rows):
        start = (slot - lo) * m
        gather[start : start + len(r)] = r
        scatter[r] = torch.arange(start, start + len(r))
    zero_row = sum(len(r) for r in rows) < num_tokens
    return PaddedRows(lo, hi, m, gather.to(device), scatter.to(device), zero_row)


def add_lora_padded(
    out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, p: PaddedRows
) -> Tensor:
    """`out` plus every token's delta through the slot-major layout `p` (`padded_rows`): a
    batched shrink and expand over slots lo..hi-1 (views of the stacked matrices, no copy)."""
    s, n = p.hi - p.lo, p.rows
    xg = x.index_select(0, p.gather).view(s, p.m, x.shape[1])
    shrunk = torch.bmm(xg, lora_a[p.lo : p.hi].transpose(1, 2))  # [s, m, R]
    b = lora_b[:, p.lo : p.hi].permute(1, 2, 0)  # [s, R, out]
    if p.zero_row:
        delta = out.new_empty(n + 1, out.shape[1])
        delta[n].zero_()
        torch.bmm(shrunk, b, out=delta[:n].view(s, p.m, out.shape[1]))
    else:
        delta = torch.bmm(shrunk, b).view(n, out.shape[1])
    return out.add_(delta.index_select(0, p.scatter))


def add_lora(out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, token_slots: Tensor) -> Tensor:
    """The Triton path with `add_lora_reference`'s result: `out` [T, out] plus each token's
    delta, token_slots [T] the slot of each token (-1: none)."""
    slots = lora_a.shape[0]
    t = x.shape[0]
    groups = torch.where(token_slots < 0, slots, token_slots).reshape(t, 1)
    tiles = moe_tiles(t, slots + 1, x.dtype)
    rows, block_group = moe_align(groups, slots + 1, tiles[0])
    block_group = torch.where(block_group == slots, -1, block_group).to(torch.int32)
    x = x.contiguous()
    shrunk = grouped_gemm(x, lora_a, rows, block_group, None, t, 1, tiles)
    expand = lora_b.permute(1, 0, 2)  # [slots, out, R]: the expert-major view
    grouped_gemm(shrunk, expand, rows, block_group, None, t, 1, tiles, out=out, accumulate=True)
    return out

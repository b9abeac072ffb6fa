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
  matmuls per layer whatever the adapters, at slots times the (small) flops: the CPU path,
  where a step's cost is the number of ops, not their size.
"""

from __future__ import annotations

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

"""LoRA: adding each token's adapter delta to a linear layer's output, as a torch reference.

A layer holds every adapter slot's matrices stacked: A [slots, R, in] and B [slots, out, R],
B already scaled by the adapter's alpha / r (or alpha / sqrt(r), rsLoRA). A fused layer (q/k/v,
gate/up) gives each part its own R-wide block of A's rows and of B's columns, zero outside the
part's output rows, so one pair of matmuls serves every part. Token t with slot s gets

    out[t] += B[s] @ (A[s] @ x[t])

and tokens without an adapter get nothing. The step groups its tokens by slot (`groups`: the
slot and its rows, a slice when they are contiguous, else an index tensor), so the reference
runs one shrink and one expand per adapter in the step.
"""

from __future__ import annotations

from torch import Tensor


def add_lora_reference(
    out: Tensor,  # [T, out]
    x: Tensor,  # [T, in]
    lora_a: Tensor,  # [slots, R, in]
    lora_b: Tensor,  # [slots, out, R]
    groups: list[tuple[int, slice | Tensor]],
) -> Tensor:
    """`out` with each group's delta added in place (the shrink in x's dtype, the expand too)."""
    for slot, rows in groups:
        shrunk = x[rows] @ lora_a[slot].t()
        delta = shrunk @ lora_b[slot].t()
        if isinstance(rows, slice):
            out[rows] += delta
        else:
            out.index_add_(0, rows, delta)
    return out

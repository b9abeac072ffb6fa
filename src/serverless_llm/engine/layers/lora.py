"""LoRA slots on a linear layer: the base layer's output plus each token's adapter delta.

`LoRALinear` wraps a layer (nn.Linear, its CPU-packed form, or a quantized one) and holds
`max_loras` slots of adapter matrices (kernels/lora.py says how they are laid out). Which slot
each token uses is the step's business: the model's one `LoRAStep` says it for every wrapped
layer at once, so a step with no adapter costs one attribute check per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..kernels.lora import add_lora_reference


@dataclass
class LoRAStep:
    """The current step's tokens per adapter slot: (slot, rows), rows a slice or an index
    tensor into the step's flat token batch. Empty when no token of the step has an adapter."""

    groups: list[tuple[int, slice | Tensor]] = field(default_factory=list)


class LoRALinear(nn.Module):
    """`base(x)` plus the LoRA delta of each token's slot. `parts` are the (offset, size) row
    ranges of the output a checkpoint's separate modules fill (q, k, v of a fused qkv_proj;
    gate, up of gate_up_proj; one range for a plain layer): each part has its own rank block."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        parts: list[tuple[int, int]],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        step: LoRAStep,
    ) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.max_rank = max_rank
        self.step = step
        out = sum(size for _, size in parts)
        ranks = len(parts) * max_rank
        self.register_buffer(
            "lora_a", torch.zeros(max_loras, ranks, in_features, dtype=dtype, device=device)
        )
        self.register_buffer(
            "lora_b", torch.zeros(max_loras, out, ranks, dtype=dtype, device=device)
        )

    def forward(self, x: Tensor) -> Tensor:
        out = self.base(x)
        if self.step.groups:
            add_lora_reference(out, x, self.lora_a, self.lora_b, self.step.groups)
        return out

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def set_part(self, slot: int, part: int | None, a: Tensor, b: Tensor) -> None:
        """Part `part`'s adapter in `slot` (None: one adapter over the whole output, in the
        first rank block): a [r, in], b [size, r] (already scaled), r <= the slot's rank; the
        rest of its block stays zero."""
        r = a.shape[0]
        if part is None:
            off, size, lo = 0, self.lora_b.shape[1], 0
        else:
            off, size = self.parts[part]
            lo = part * self.max_rank
        self.lora_a[slot, lo : lo + r].copy_(a)
        self.lora_b[slot, off : off + size, lo : lo + r].copy_(b)

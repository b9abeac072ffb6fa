"""LoRA slots on a linear layer: the base layer's output plus each token's adapter delta.

`LoRALinear` wraps a layer (nn.Linear, its CPU-packed form, or a quantized one) and holds
`max_loras` slots of adapter matrices (kernels/lora_delta.py says how they are laid out). Which slot
each token uses is the step's business: the model's one `LoRAStep` says it for every wrapped
layer at once, so a step with no adapter costs one attribute check per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..kernels.lora_delta import (
    PaddedRows,
    add_lora,
    add_lora_masked,
    add_lora_padded,
    add_lora_reference,
    padded_rows,
    slot_mask,
)
from .linear import pack_weight, packed_linear, packed_ops_work

# The CPU's choice between its two forms (kernels/lora_delta.py): the slot-major batched matmuls
# while the padded batch has at most this many rows, the all-slots masked form above it. On a
# 2-core AVX2 EPYC (SmolLM2's seven projections, 4 slots of rank 16) the padded form took a
# third of the masked form's time per layer at 8 to 64 rows and 1.2-1.5x its time at 128-256,
# where the masked form's packed oneDNN matrices win despite their extra flops.
PADDED_MAX_ROWS = 64


@dataclass
class LoRAStep:
    """The current step's adapters: `groups`, (slot, rows) with rows a slice or an index tensor
    into the step's flat token batch (empty when no token of the step has an adapter), and
    `token_slots`, each token's slot or -1. `masked` marks the CPU, which runs the slot-major
    padded form (`padded`, laid out once per step) for small steps and the all-slots masked
    form for large ones; the masks are made once per step for each rank-block width.
    `use_kernels` picks the Triton grouped GEMM (CUDA; the interpreter in tests)."""

    groups: list[tuple[int, slice | Tensor]] = field(default_factory=list)
    token_slots: Tensor | None = None
    num_slots: int = 1
    masked: bool = False
    use_kernels: bool = False
    padded: PaddedRows | None = None
    _masks: dict = field(default_factory=dict)

    def set(self, groups, token_slots: Tensor | None) -> None:
        self.groups, self.token_slots = groups, token_slots
        self._masks = {}
        self.padded = None
        if self.masked and groups and not self.use_kernels:
            device = token_slots.device
            self.padded = padded_rows(groups, len(token_slots), device, PADDED_MAX_ROWS)

    def clear(self) -> None:
        self.set([], None)

    def mask(self, width: int, dtype: torch.dtype) -> Tensor:
        key = (width, dtype)
        if key not in self._masks:
            self._masks[key] = slot_mask(self.token_slots, self.num_slots, width, dtype)
        return self._masks[key]


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
            "lora_b", torch.zeros(out, max_loras, ranks, dtype=dtype, device=device)
        )
        self.packed: tuple[Tensor, list[Tensor]] | None = None  # `repack`
        self.whole: set[int] = set()  # slots holding one adapter over the whole output

    def forward(self, x: Tensor) -> Tensor:
        out = self.base(x)
        step = self.step
        if step.groups:
            if step.use_kernels:
                add_lora(out, x, self.lora_a, self.lora_b, step.token_slots)
            elif step.padded is not None:
                add_lora_padded(out, x, self.lora_a, self.lora_b, step.padded)
            elif step.masked:
                mask = step.mask(self.lora_a.shape[1], x.dtype)
                if self.packed is not None:
                    self._packed_delta(out, x)
                else:
                    add_lora_masked(out, x, self.lora_a, self.lora_b, mask)
            else:
                add_lora_reference(out, x, self.lora_a, self.lora_b, step.groups)
        return out

    def _packed_delta(self, out: Tensor, x: Tensor) -> None:
        """The masked form through the packed matrices: one shrink for every part and slot,
        then per part an expand over its own rank block of every slot into its own rows (a
        fused layer's other parts' zeros are never multiplied)."""
        pa, pbs = self.packed
        r = self.max_rank if len(pbs) > 1 else self.lora_a.shape[1]
        mask = self.step.mask(r, x.dtype)
        shrunk = packed_linear(x, pa)
        width = mask.shape[1]
        for p, pb in enumerate(pbs):
            off, size = self.parts[p] if len(pbs) > 1 else (0, out.shape[1])
            block = shrunk[:, p * width : (p + 1) * width] * mask
            out[:, off : off + size] += packed_linear(block, pb)

    def repack(self) -> None:
        """The all-slots matrices packed for oneDNN (float32 on CPU, the masked path), after the
        slots change. A part-major, [parts x slots x R, in]; B as one [size, slots x R] matrix
        per part (or one [out, slots x all ranks] when a slot holds an adapter over the whole
        output). The CPU's small matmuls through oneDNN's packed weights cost a fraction of
        F.linear's (layers/linear.py)."""
        a, b = self.lora_a, self.lora_b
        if not (self.step.masked and a.dtype == torch.float32 and packed_ops_work()):
            return
        s, ranks, k = a.shape
        parts = len(self.parts)
        if parts == 1 or self.whole:
            self.packed = (
                pack_weight(a.reshape(s * ranks, k)),
                [pack_weight(b.reshape(-1, s * ranks))],
            )
            return
        r = self.max_rank
        a_pm = a.reshape(s, parts, r, k).transpose(0, 1).reshape(parts * s * r, k)
        b_parts = [
            b[off : off + size].reshape(size, s, parts, r)[:, :, p].reshape(size, s * r)
            for p, (off, size) in enumerate(self.parts)
        ]
        self.packed = (pack_weight(a_pm), [pack_weight(bp) for bp in b_parts])

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[:, slot].zero_()
        self.whole.discard(slot)

    def set_part(self, slot: int, part: int | None, a: Tensor, b: Tensor) -> None:
        """Part `part`'s adapter in `slot` (None: one adapter over the whole output, in the
        first rank block): a [r, in], b [size, r] (already scaled), r <= the slot's rank; the
        rest of its block stays zero."""
        r = a.shape[0]
        if part is None:
            off, size, lo = 0, self.lora_b.shape[0], 0
            if len(self.parts) > 1:
                self.whole.add(slot)
        else:
            off, size = self.parts[part]
            lo = part * self.max_rank
        self.lora_a[slot, lo : lo + r].copy_(a)
        self.lora_b[off : off + size, slot, lo : lo + r].copy_(b)

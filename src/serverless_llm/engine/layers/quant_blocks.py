"""GPTQ, AWQ and compressed-tensors integer weights served on CPU from qb32 blocks (issue 39 item
2): QUANTIZED_WEIGHTS=packed on a CPU repacks each settled `PackedWeight` (layers/quant_linear.py)
into the block layout the GGUF path uses (kernels/gguf_blocks.py), so the same native kernels
(few-row linear with float inputs, many-row GEMM, whole-layer decode) run them.

The mapping is exact. A packed integer weight holds, per output row n and input column j of
group g, w = (q - z) * s with q and z unsigned integers of `bits` bits and s the group's scale;
qb32 holds w = d * u + c per 32 inputs. So u = q, d = s and c = -(s * z), for every 32-input
block inside one group. s * z is exact in float32 for float16 and bfloat16 scales (11 and 8
significant bits times at most 8), so d * u + c equals (q - z) * s as float32 computes it; a
float32 scale rounds s * z once. The packed weight's input columns are already sorted by group
(act-order checkpoints are permuted at load: `PackedWeight.perm`), so a block lies inside one
group wherever groups are multiples of 32 inputs; the input is permuted to match at each call,
as the packed form's torch path does.

Where a weight does not fit (bits other than 4 and 8, groups not a multiple of 32, inputs not a
multiple of 32) it keeps its packed form and torch path; the start-up line counts both.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..kernels.gguf_blocks import BLOCK, QB32, BlockKernels, _compact, _nibbles
from ..kernels.w4a16 import unpack_int32
from .gguf_linear import GGUFBlockLinear
from .quant_linear import PackedWeight, QuantLinear


def int_blocks(p: PackedWeight) -> QB32 | None:
    """`p`'s weight [out, in] (in its sorted input order) as qb32 blocks, or None where it does
    not fit the layout."""
    bits = p.bits
    k = p.g_idx.numel()
    if bits not in (4, 8) or k % BLOCK:
        return None
    groups = p.g_idx.long().reshape(k // BLOCK, BLOCK)
    if not bool((groups == groups[:, :1]).all()):
        return None  # a group boundary inside a block of 32
    q = unpack_int32(p.qweight, bits, dim=0)[:k].t().contiguous()  # [out, in], 0..2^bits - 1
    n = q.shape[0]
    g = groups[:, 0]
    s = p.scales.t()[:, g].float()  # [out, in / 32]
    z = p.zeros.t()[:, g].float()
    d, c = _compact(s.numpy(), (-(s * z)).numpy())
    u = q.reshape(n, k // BLOCK, BLOCK).numpy().astype(np.uint8)
    qs = _nibbles(u) if bits == 4 else u
    return QB32(torch.from_numpy(np.ascontiguousarray(qs)), d, c, bits, BLOCK)


class PermutedBlocks(nn.Module):
    """One packed run of a QuantLinear on blocks: the input permuted to the blocks' sorted
    order (act-order), then the block linear. Stands where a PackedWeight stood."""

    def __init__(self, inner: GGUFBlockLinear, perm: torch.Tensor | None) -> None:
        super().__init__()
        self.inner = inner
        self.perm = perm

    def forward(self, x: torch.Tensor, use_kernels: bool = False) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return self.inner(x.contiguous())


def take_int_blocks(model: nn.Module, kernels: BlockKernels) -> tuple[int, int]:
    """Every settled integer QuantLinear of `model` whose packed form runs its torch path (not
    the Triton GEMM) on qb32 blocks where its weights fit: a
    QuantLinear of one run in input order becomes a GGUFBlockLinear (so the whole-layer native
    decode can take it), others keep their QuantLinear with each run on blocks. Returns (linears
    on blocks, linears left in their packed form)."""
    done = left = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, QuantLinear) or child.packed is None or child.use_kernels:
                continue  # not settled packed, or served by the Triton GEMM (its backend)
            runs = list(child.packed)
            if not all(isinstance(p, PackedWeight) for p in runs):
                left += 1  # FP8: its own path
                continue
            blocks = [int_blocks(p) for p in runs]
            if any(b is None for b in blocks):
                left += 1
                continue
            bias = None if child.bias is None else child.bias.detach().float().contiguous()
            if len(runs) == 1 and runs[0].perm is None:
                setattr(parent, name, GGUFBlockLinear(blocks[0], kernels, "float", bias))
            else:
                child.packed = nn.ModuleList(
                    PermutedBlocks(GGUFBlockLinear(b, kernels, "float"), p.perm)
                    for b, p in zip(blocks, runs)
                )
            done += 1
    return done, left


def serve_int_blocks(model: nn.Module) -> str:
    """QUANTIZED_WEIGHTS=packed on CPU, after loading: the integer weights on blocks
    (`take_int_blocks`) with their row thresholds and whole-layer decode (`finish_gguf_blocks`).
    Returns the start-up line; without the block kernels (no compiler, a failed self-check:
    their own warning says which) the packed forms stay on their torch path."""
    from ..kernels import gguf_blocks
    from .gguf_linear import finish_gguf_blocks

    kernels = gguf_blocks.load()
    if kernels is None:
        return "quantized weights: packed forms on their torch path (no block kernels)"
    done, left = take_int_blocks(model, kernels)
    line = f"quantized weights: {done} linears on qb32 blocks, {left} in their packed form"
    if done:
        line += "; " + finish_gguf_blocks(model, kernels)
    return line

"""SiLU-and-mul: the gated MLP's activation over the fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.dispatch import use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [..., gate | up]: the Triton kernel where `use_triton` says so,
    the torch reference otherwise."""
    if use_triton(x):
        from ..kernels.activation import silu_and_mul as silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)

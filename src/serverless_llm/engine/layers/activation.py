"""SiLU-and-mul, the gated MLP's activation over the fused [gate | up] projection: the Triton
kernel or its torch reference, as the model was built (see kernels/activation.py)."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.activation import silu_and_mul, silu_and_mul_reference


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [..., gate | up]; `use_kernels` picks the Triton kernel."""

    def __init__(self, use_kernels: bool = False) -> None:
        super().__init__()
        self.use_kernels = use_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x) if self.use_kernels else silu_and_mul_reference(x)

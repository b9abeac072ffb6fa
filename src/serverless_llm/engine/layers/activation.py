"""The MLP's activation: gated (act(gate) * up over the fused [gate | up] projection) or plain,
by the Triton kernel or its torch reference as the model was built (see kernels/activation.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.activation import (
    ACTIVATIONS,
    act_and_mul,
    act_and_mul_reference,
    activation,
    activation_reference,
    silu_and_mul,
    silu_and_mul_reference,
)


class UnsupportedActivationError(ValueError):
    pass


def check_activation(act: str) -> str:
    if act not in ACTIVATIONS:
        raise UnsupportedActivationError(
            f"activation {act!r} is not supported; supported: {', '.join(sorted(ACTIVATIONS))}"
        )
    return act


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [..., gate | up]; `use_kernels` picks the Triton kernel."""

    def __init__(self, use_kernels: bool = False) -> None:
        super().__init__()
        self.use_kernels = use_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x) if self.use_kernels else silu_and_mul_reference(x)


class ActAndMul(nn.Module):
    """act(gate) * up for x = [..., gate | up], any activation of `ACTIVATIONS`."""

    def __init__(self, act: str, use_kernels: bool = False) -> None:
        super().__init__()
        self.act = check_activation(act)
        self.use_kernels = use_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernels:
            return act_and_mul(x, self.act)
        return act_and_mul_reference(x, self.act)


class Activation(nn.Module):
    """act(x), for the plain two-matrix MLP (GPT-2, OPT, StarCoder2, ...)."""

    def __init__(self, act: str, use_kernels: bool = False) -> None:
        super().__init__()
        self.act = check_activation(act)
        self.use_kernels = use_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernels:
            return activation(x, self.act)
        return activation_reference(x, self.act)


def gated_activation(act: str, use_kernels: bool) -> nn.Module:
    return SiluAndMul(use_kernels) if act in ("silu", "swish") else ActAndMul(act, use_kernels)

"""The MLP's activation: gated (act(gate) * up over the fused [gate | up] projection) or plain,
by the Triton kernel or its torch reference as the model was built (see kernels/activation.py),
or on CPU by the native kernel where it has the activation (`native`, set by
DecoderModel.optimize_for_cpu; float32 rows only, else the reference).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.activation import (
    ACT_CODES,
    ACTIVATIONS,
    ClampedSwiGLU,
    act_and_mul,
    act_and_mul_reference,
    activation,
    activation_reference,
    silu_and_mul,
    silu_and_mul_reference,
)


class UnsupportedActivationError(ValueError):
    pass


def native_activation(module, x: torch.Tensor, gated: bool) -> torch.Tensor | None:
    """The native CPU kernel's result when `module.native` is set and x is float32 rows with a
    contiguous last dim, else None."""
    native = module.native
    if native is None or x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1:
        return None
    return native.activation(x, ACT_CODES[module.act], gated)


def check_activation(act):
    """`act` when it is an activation's name (or gpt-oss's `ClampedSwiGLU`, a gated one)."""
    if isinstance(act, ClampedSwiGLU):
        return act
    if act not in ACTIVATIONS:
        raise UnsupportedActivationError(
            f"activation {act!r} is not supported; supported: {', '.join(sorted(ACTIVATIONS))}"
        )
    return act


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [..., gate | up]; `use_kernels` picks the Triton kernel."""

    act = "silu"

    def __init__(self, use_kernels: bool = False) -> None:
        super().__init__()
        self.use_kernels = use_kernels
        self.native = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernels:
            return silu_and_mul(x)
        out = native_activation(self, x, True)
        return silu_and_mul_reference(x) if out is None else out


class ActAndMul(nn.Module):
    """act(gate) * up for x = [..., gate | up], any activation of `ACTIVATIONS`."""

    def __init__(self, act: str, use_kernels: bool = False) -> None:
        super().__init__()
        self.act = check_activation(act)
        self.use_kernels = use_kernels
        self.native = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernels:
            return act_and_mul(x, self.act)
        out = native_activation(self, x, True)
        return act_and_mul_reference(x, self.act) if out is None else out


class Activation(nn.Module):
    """act(x), for the plain two-matrix MLP (GPT-2, OPT, StarCoder2, ...)."""

    def __init__(self, act: str, use_kernels: bool = False) -> None:
        super().__init__()
        self.act = check_activation(act)
        self.use_kernels = use_kernels
        self.native = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernels:
            return activation(x, self.act)
        out = native_activation(self, x, False)
        return activation_reference(x, self.act) if out is None else out


def gated_activation(act: str, use_kernels: bool) -> nn.Module:
    return SiluAndMul(use_kernels) if act in ("silu", "swish") else ActAndMul(act, use_kernels)

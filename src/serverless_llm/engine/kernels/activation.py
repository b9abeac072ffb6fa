"""The MLP's activations, gated over the fused [gate | up] projection (out = act(gate) * up, one
pass) or plain (act(x)), as Triton kernels with the activation a constexpr, and their torch
references.

The kernels' numerics follow the references: the activation is computed in float32 and rounded
to the input dtype, then (gated) the product is rounded again, as the two torch ops do. Every
name of `ACTIVATIONS` has a kernel code in `ACT_CODES`: gelu is the erf form; gelu_new,
gelu_fast and gelu_pytorch_tanh are one tanh approximation (tanh computed from exp). Triton is
imported at the kernel's first launch, never for the reference (see `triton_lazy`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .triton_common import rows_of, tanh
from .triton_lazy import cdiv, jit, next_power_of_2

tl = None  # triton.language, bound at the first launch (see triton_lazy)

ACT_BLOCK = 1024


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The torch reference: x: [..., gate | up] -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# transformers' activation names (config.hidden_act / hidden_activation) -> torch functions.
# gelu_new and gelu_fast are the tanh approximation written out; F.gelu(approximate="tanh")
# computes the same function.
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),  # Nemotron-H's squared ReLU
}


def activation_reference(x: torch.Tensor, act: str) -> torch.Tensor:
    """act(x), the plain (ungated) MLP's activation."""
    return ACTIVATIONS[act](x)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts' gated activation, named by its two constants where a gated
    activation's name goes (`act_and_mul`, the experts): the gate clamped from above at
    `limit`, the up part to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float


def clamped_swiglu_reference(gate: torch.Tensor, up: torch.Tensor, a: ClampedSwiGLU):
    """`ClampedSwiGLU` in gate's dtype, op by op as transformers' gpt-oss experts compute it."""
    gate = gate.clamp(max=a.limit)
    up = up.clamp(-a.limit, a.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * a.alpha))


def act_and_mul_reference(x: torch.Tensor, act) -> torch.Tensor:
    """x: [..., gate | up] -> act(gate) * up (`ClampedSwiGLU`: its own product)."""
    gate, up = x.chunk(2, dim=-1)
    if isinstance(act, ClampedSwiGLU):
        return clamped_swiglu_reference(gate, up, act)
    return ACTIVATIONS[act](gate) * up


# The kernels' activation codes (a constexpr each kernel is specialised on).
ACT_CODES = {
    "silu": 0,
    "swish": 0,
    "gelu": 1,
    "gelu_pytorch_tanh": 2,
    "gelu_new": 2,
    "gelu_fast": 2,
    "relu": 3,
    "relu2": 4,
}
CLAMPED_SWIGLU_CODE = 5  # `ClampedSwiGLU`'s code in the gated kernel (it has no name)


@jit
def _act(x, ACT: tl.constexpr):
    """The activation of code ACT on float32 x."""
    if ACT == 0:  # silu
        y = x / (1.0 + tl.exp(-x))
    elif ACT == 1:  # gelu, erf form
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 2:  # gelu, tanh approximation: sqrt(2 / pi) * (x + 0.044715 x^3)
        y = 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    elif ACT == 3:  # relu
        y = tl.maximum(x, 0.0)
    else:  # relu2, the squared relu
        y = tl.maximum(x, 0.0)
        y = y * y
    return y


@jit
def _act_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    n_cols,
    alpha,
    limit,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    if ACT == 5:  # ClampedSwiGLU (gpt-oss), in float32 and rounded once
        g = tl.minimum(gate.to(tl.float32), limit)
        u = tl.minimum(tl.maximum(up.to(tl.float32), -limit), limit)
        y = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    else:
        a = _act(gate.to(tl.float32), ACT).to(gate.dtype).to(tl.float32)
        y = a * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _activation_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    n_cols,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    y = _act(x.to(tl.float32), ACT)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(x: torch.Tensor, act) -> torch.Tensor:
    """x: [..., 2 * I] = [..., gate | up] -> act(gate) * up, [..., I] (`act` a name of
    ACT_CODES, or a `ClampedSwiGLU`)."""
    swiglu = act if isinstance(act, ClampedSwiGLU) else ClampedSwiGLU(0.0, 0.0)
    code = CLAMPED_SWIGLU_CODE if isinstance(act, ClampedSwiGLU) else ACT_CODES[act]
    two_i = x.shape[-1]
    if two_i % 2:
        raise ValueError(f"act_and_mul needs an even last dimension, got {two_i}")
    n = two_i // 2
    x2 = rows_of(x, two_i)
    rows = x2.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows and n:
        block = min(ACT_BLOCK, next_power_of_2(n))
        grid = (rows, cdiv(n, block))
        _act_and_mul_kernel[grid](
            x2,
            out,
            x2.stride(0),
            out.stride(0),
            n,
            float(swiglu.alpha),
            float(swiglu.limit),
            ACT=code,
            BLOCK=block,
            num_warps=4,
        )
    return out.view(*x.shape[:-1], n)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] -> [..., I]."""
    return act_and_mul(x, "silu")


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    """act(x), elementwise, in the input's dtype."""
    code = ACT_CODES[act]
    n = x.shape[-1]
    x2 = rows_of(x, n)
    rows = x2.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows and n:
        block = min(ACT_BLOCK, next_power_of_2(n))
        grid = (rows, cdiv(n, block))
        _activation_kernel[grid](
            x2, out, x2.stride(0), out.stride(0), n, ACT=code, BLOCK=block, num_warps=4
        )
    return out.view(x.shape)

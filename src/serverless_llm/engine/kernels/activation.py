"""SiLU-and-mul over the fused [gate | up] projection: out = silu(gate) * up, one pass, and its
torch reference.

The kernel's numerics follow `silu_and_mul_reference`: silu is computed in float32 and rounded to
the input dtype, then the product is rounded again, as the two torch ops do. Triton is imported
at the kernel's first launch, never for the reference (see `triton_lazy`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .triton_lazy import cdiv, jit, next_power_of_2

tl = None  # triton.language, bound at the first launch (see triton_lazy)

SILU_BLOCK = 1024


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
}


def activation_reference(x: torch.Tensor, act: str) -> torch.Tensor:
    """act(x), the plain (ungated) MLP's activation."""
    return ACTIVATIONS[act](x)


def act_and_mul_reference(x: torch.Tensor, act: str) -> torch.Tensor:
    """x: [..., gate | up] -> act(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return ACTIVATIONS[act](gate) * up


@jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    n_cols,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    y = silu * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] -> [..., I]."""
    two_i = x.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {two_i}")
    n = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows and n:
        block = min(SILU_BLOCK, next_power_of_2(n))
        grid = (rows, cdiv(n, block))
        _silu_and_mul_kernel[grid](
            x2, out, x2.stride(0), out.stride(0), n, BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], n)

"""The Triton pieces more than one kernel module uses, written once: jit helpers (bound as
`triton_lazy` describes: at the first launch of a kernel calling one, in this module, and the
kernel's module gets that same JIT function) and what the launchers of row-wise kernels share.

Helpers that serve one family of kernels stay beside it: the split-K GEMM pieces and the packed
integer weight tile in kernels/w4a16.py, the expert-block pieces in kernels/fused_moe.py, the
e4m3 codec in kernels/e4m3.py.
"""

from __future__ import annotations

import torch

from .triton_lazy import jit, next_power_of_2

tl = None  # triton.language, bound at the first launch (see triton_lazy)


@jit
def tanh(x):
    """tanh from exp (not every Triton has one in tl): exp(-2|x|) never overflows."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


# -- GEMM tiles (kernels/w4a16.py, fp8.py, fused_moe.py, fused_moe_w4a16.py) ----------------------


@jit
def x_tile(x_ptr, stride_xm, offs_m, mask_m, offs_k, mask_k):
    """The activations' [BLOCK_M, BLOCK_K] tile: rows `offs_m` (any row indices) and columns
    `offs_k` of row-major x, zeros outside."""
    return tl.load(
        x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
        mask=mask_m[:, None] & mask_k[None, :],
        other=0.0,
    )


@jit
def w_tile(w_ptr, stride_wn, offs_k, mask_k, offs_n, mask_n):
    """The [BLOCK_K, BLOCK_N] tile of a weight stored [N, K] with K contiguous (nn.Linear's
    layout), as loaded (the caller converts or decodes it), zeros outside."""
    return tl.load(
        w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
        mask=mask_k[:, None] & mask_n[None, :],
        other=0,
    )


@jit
def dot_acc(acc, x, w):
    """acc + x @ w, w the float32 weight tile: IEEE float32 dots for float32 activations, else
    w rounded to the activations' 16-bit type."""
    if x.dtype == tl.float32:
        return acc + tl.dot(x, w, input_precision="ieee")
    return acc + tl.dot(x, w.to(x.dtype))


# -- row-wise norms (kernels/rms_norm.py, layer_norm.py): one program per row ---------------------


@jit
def norm_input_row(
    x_ptr, res_ptr, res_out_ptr, row, stride_x, stride_res, stride_res_out, cols, mask,
    HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """Row `row` of x, or with HAS_RESIDUAL of x + residual, rounded to x's dtype (as the torch
    add is) and stored as the new residual: what the norm normalises, in x's dtype."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    return x


def rows_of(t: torch.Tensor, n: int) -> torch.Tensor:
    """t as [rows, n] with unit stride along n (a copy only where the view lacks it)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def norm_rows(
    x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A norm kernel's row operands: (x as rows, the residual as rows, the new residual's
    buffer); without a residual the last two are x's rows, which the kernel does not read."""
    x2 = rows_of(x, x.shape[-1])
    if residual is None:
        return x2, x2, x2
    return x2, rows_of(residual, x2.shape[1]), torch.empty_like(x2)


def row_launch_shape(n_cols: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of a one-program-per-row kernel over `n_cols` columns."""
    block = next_power_of_2(n_cols)
    # About 8-16 elements per thread: wide rows get more warps instead of more registers.
    num_warps = max(1, min(16, block // 512))
    return block, num_warps

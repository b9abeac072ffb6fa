"""RMSNorm, optionally fused with the residual add before it: one read of x (and the residual),
one write of the output (and the new residual); and its torch reference.

The kernel's numerics follow `rms_norm_reference`: the sum x + residual is rounded to the input
dtype (as the torch add is), the statistics are taken in float32, the normalised row is rounded to
the input dtype before the weight multiplies it. Triton is imported at the kernel's first launch,
never for the reference (see `triton_lazy`).
"""

from __future__ import annotations

import torch

from .triton_common import norm_input_row, norm_rows, row_launch_shape
from .triton_lazy import jit

tl = None  # triton.language, bound at the first launch (see triton_lazy)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The torch reference, with the kernel's contract: norm(x) or, with `residual`,
    (norm(x + residual), x + residual). The norm as Llama computes it: statistics in float32,
    the weight applied after casting back."""
    if residual is not None:
        x = residual = x + residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


@jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = norm_input_row(
        x_ptr, res_ptr, res_out_ptr, row, stride_x, stride_res, stride_res_out, cols, mask,
        HAS_RESIDUAL,
    )  # fmt: skip
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = normed * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) or, with `residual`, (norm(x + residual), x + residual); x: [..., hidden]."""
    shape = x.shape
    x2, res2, res_out = norm_rows(x, residual)
    rows, n = x2.shape
    out_dtype = torch.result_type(weight, x)
    out = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    block, num_warps = row_launch_shape(n)
    if rows:
        _rms_norm_kernel[(rows,)](
            x2,
            res2,
            weight,
            out,
            res_out,
            x2.stride(0),
            res2.stride(0),
            out.stride(0),
            res_out.stride(0),
            n,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=num_warps,
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)

"""LayerNorm (with or without weight and bias), optionally fused with the residual add before
it: one read of x (and the residual), one write of the output (and the new residual); and its
torch reference.

The statistics and the affine step run in float32 and the result is rounded once to the input
dtype, as transformers' LayerNorms do in half precision (nn.LayerNorm's CPU and CUDA kernels,
Cohere's and OLMo's own); the kernel does the same, with the residual sum rounded to the input
dtype first (as the torch add is). Triton is imported at the kernel's first launch, never for the
reference (see `triton_lazy`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .triton_common import norm_input_row, norm_rows, row_launch_shape
from .triton_lazy import jit

tl = None  # triton.language, bound at the first launch (see triton_lazy)


def layer_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) or, with `residual`, (norm(x + residual), x + residual), as `rms_norm_reference`."""
    if residual is not None:
        x = residual = x + residual
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    out = F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)
    return out if residual is None else (out, residual)


@jit
def _layer_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
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
    mean = tl.sum(h, axis=0) / n_cols
    centered = tl.where(mask, h - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
    y = centered * rstd
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) or, with `residual`, (norm(x + residual), x + residual); x: [..., hidden]. The
    output has the input's dtype, as `layer_norm_reference`."""
    shape = x.shape
    x2, res2, res_out = norm_rows(x, residual)
    rows, n = x2.shape
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block, num_warps = row_launch_shape(n)
    if rows:
        _layer_norm_kernel[(rows,)](
            x2,
            res2,
            x2 if weight is None else weight,  # unused when None
            x2 if bias is None else bias,
            out,
            res_out,
            x2.stride(0),
            res2.stride(0),
            out.stride(0),
            res_out.stride(0),
            n,
            eps,
            HAS_RESIDUAL=residual is not None,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=num_warps,
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)

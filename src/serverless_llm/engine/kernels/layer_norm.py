"""LayerNorm (with or without weight and bias), optionally fused with the residual add before
it; and its torch reference.

The statistics and the affine step run in float32 and the result is rounded once to the input
dtype, as transformers' LayerNorms do in half precision (nn.LayerNorm's CPU and CUDA kernels,
Cohere's and OLMo's own). Triton is imported at the kernel's first launch, never for the
reference (see `triton_lazy`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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

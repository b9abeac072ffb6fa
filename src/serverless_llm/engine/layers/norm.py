"""RMSNorm and LayerNorm, each optionally fused with the residual add that precedes it: the
Triton kernel or its torch reference, as the model was built (see kernels/rms_norm.py and
kernels/layer_norm.py). Both share one contract: norm(x), or with `residual` the pair
(norm(x + residual), x + residual) a pre-norm decoder layer needs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu_native import NativeKernels
from ..kernels.layer_norm import layer_norm, layer_norm_reference
from ..kernels.rms_norm import rms_norm, rms_norm_reference


def native_add_norm(native: NativeKernels | None, x, residual, weight, bias, eps, kind):
    """The native CPU kernel's norm when it applies (float32 rows, contiguous), else None."""
    if (
        native is None
        or x.dtype != torch.float32
        or not x.is_contiguous()
        or (residual is not None and not residual.is_contiguous())
        or (weight is not None and weight.dtype != torch.float32)
        or (bias is not None and bias.dtype != torch.float32)
    ):
        return None
    out, res = native.add_norm(x, residual, weight, bias, eps, kind)
    return out if residual is None else (out, res)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, use_kernels: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_kernels = use_kernels
        self.native: NativeKernels | None = None  # set on CPU by DecoderModel.optimize_for_cpu

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.native is not None:
            got = native_add_norm(self.native, x, residual, self.weight, None, self.eps, 0)
            if got is not None:
                return got
        norm = rms_norm if self.use_kernels else rms_norm_reference
        return norm(x, self.weight, self.eps, residual)


class LayerNorm(nn.Module):
    """LayerNorm with a weight and bias (GPT-2, Falcon, ...), a weight only (Cohere, OLMo 1.7's
    configs) or neither (OLMo's non-parametric norm)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        weight: bool = True,
        bias: bool = True,
        use_kernels: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size)) if weight else None
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None
        self.eps = eps
        self.use_kernels = use_kernels
        self.native: NativeKernels | None = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.native is not None:
            got = native_add_norm(self.native, x, residual, self.weight, self.bias, self.eps, 1)
            if got is not None:
                return got
        norm = layer_norm if self.use_kernels else layer_norm_reference
        return norm(x, self.weight, self.bias, self.eps, residual)


class HeadLayerNorm(nn.Module):
    """LayerNorm over each head's dims with a weight per head, [heads, head_dim] (Cohere's and
    StableLM's q/k norms); statistics and weight in float32."""

    def __init__(self, num_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads, head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H, D]
        h = F.layer_norm(x.float(), (x.shape[-1],), None, None, self.eps)
        return (h * self.weight.float()).to(x.dtype)

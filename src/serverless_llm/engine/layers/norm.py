"""RMSNorm, optionally fused with the residual add that precedes it: the Triton kernel or its
torch reference, as the model was built (see kernels/rms_norm.py)."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.rms_norm import rms_norm, rms_norm_reference


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, use_kernels: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_kernels = use_kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), the pair a
        pre-norm decoder layer needs, so the add and the norm can be one kernel."""
        norm = rms_norm if self.use_kernels else rms_norm_reference
        return norm(x, self.weight, self.eps, residual)

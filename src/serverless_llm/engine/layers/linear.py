"""Linear layers on CPU through oneDNN with pre-packed weights.

ATen's float32 matmul on CPU goes to MKL, which on AMD processors runs a slow generic path and
re-packs the weight on every call; for the small-M matmuls of decoding that costs 3-4x. oneDNN
with the weight packed once at load time does not. The packed op is an internal one of torch
(the one Inductor's CPU freezing uses), so it is probed at start-up and any failure, or any
difference from F.linear beyond float32 rounding, falls back to F.linear.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

_PACK_BATCH_HINT = 32  # oneDNN chooses a layout for this M; any M works with it


def _packed_ops_work() -> bool:
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 40, generator=g)
        b = torch.randn(48, generator=g)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
        for m in (1, 5, 64):
            x = torch.randn(m, 40, generator=g)
            out = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
            if not torch.allclose(out, F.linear(x, w, b), rtol=1e-4, atol=1e-4):
                return False
        return True
    except Exception:  # op missing in this torch build, or no oneDNN
        return False


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """A float32 [out, in] weight in oneDNN's packed layout, for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), _PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear(x, w, bias) for w packed by `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_ops_work() -> bool:
    """Whether this torch build has oneDNN's packed linear and it agrees with F.linear (probed
    once per process)."""
    global _PACKED_OK
    if _PACKED_OK is None:
        _PACKED_OK = _packed_ops_work()
        if not _PACKED_OK:
            logger.info("oneDNN packed linear unavailable; using F.linear")
    return _PACKED_OK


_PACKED_OK: bool | None = None


class PackedLinear(nn.Module):
    """Inference-only replacement for nn.Linear holding a oneDNN-packed weight."""

    def __init__(self, linear: nn.Linear | None, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        w = (linear.weight if linear is not None else weight).detach()
        self.out_features, self.in_features = w.shape
        self.packed = pack_weight(w)
        self.bias = None if linear is None or linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def pack_linears_for_cpu(model: nn.Module) -> bool:
    """Swaps every float32 nn.Linear of `model` for a PackedLinear; True if it did."""
    if not packed_ops_work():
        return False
    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype == torch.float32
    ]
    # One layer at a time, dropping each plain weight as soon as its packed copy exists: the
    # freed memory is reused by the next packed weight instead of faulting in fresh pages, and
    # the peak stays near one copy of the weights rather than two.
    for parent, name in targets:
        setattr(parent, name, PackedLinear(getattr(parent, name)))
    return True

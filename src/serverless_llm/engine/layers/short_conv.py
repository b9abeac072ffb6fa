"""LFM2's short convolution: a gated depthwise causal convolution of a few taps, the recurrent
layer of Liquid's LFM2 and LFM3 models (`Lfm2ShortConv` in transformers).

    B, C, x = in_proj(h).chunk(3);  y = out_proj(C * conv(B * x))

Its state per request is the convolution's last K - 1 inputs (B * x). The convolution runs the
Triton kernel on CUDA and its torch reference elsewhere (kernels/causal_conv1d.py).

Tensor parallelism: each rank holds 1/N of the channels (its rows of each of in_proj's B, C and
x thirds, its convolution channels; the whole computation is per channel) and out_proj's matching
input columns, whose partial outputs are all-reduced.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.causal_conv1d import causal_conv1d, causal_conv1d_ref
from ..parallel.group import SINGLE, TensorParallel
from .recurrent import (
    RecurrentMixer,
    RecurrentMixerSpec,
    Split,
    StateShapes,
    conv_and_state,
    indivisible,
    share,
    step_slots,
)


class ConvWeights(nn.Module):
    """A depthwise convolution's taps [channels, K] (a checkpoint's [channels, 1, K] fills them)
    and its bias."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None


def run_conv(use_kernels: bool, x, conv: ConvWeights, state, meta, activation: str | None):
    """The causal convolution of the step's tokens x [T, C] through the requests' state slots."""
    slots, init = step_slots(meta)
    fn = causal_conv1d if use_kernels else causal_conv1d_ref
    return fn(
        x,
        conv.weight,
        conv.bias,
        state,
        meta.query_start_loc,
        slots,
        init,
        activation,
        num_decodes=meta.num_decodes,
        max_query_len=meta.max_query_len,
    )


@dataclass(frozen=True)
class ShortConvSpec(RecurrentMixerSpec):
    kernel: int  # taps (conv_L_cache)
    bias: bool = False
    channels: int | None = None  # None: the hidden size; a tensor-parallel rank's share of it

    def build(self, spec, backend, tp) -> ShortConv:
        return ShortConv(spec.hidden_size, self, backend.use_kernels, tp)

    def describe(self) -> str:
        return f"short convolution of {self.kernel} taps"

    def tp_refusal(self, hidden: int, size: int) -> str | None:
        return indivisible(size, hidden, "short-convolution channels (its hidden size)")

    def shard(self, hidden: int, size: int) -> ShortConvSpec:
        return dataclasses.replace(self, channels=hidden // size)

    def tp_split(self, name: str, hidden: int, rank: int, size: int) -> Split:
        lo, n = share(hidden, rank, size)
        if name == "in_proj":  # this rank's channels of B, of C and of x
            return "out", [(part * hidden + lo, n) for part in range(3)]
        if name == "conv1d":
            return "out", [(lo, n)]
        if name == "out_proj":
            return "in", [(lo, n)]
        raise ValueError(f"short convolution: no parameter {name!r}")


class ShortConv(RecurrentMixer):
    def __init__(
        self, hidden: int, spec: ShortConvSpec, use_kernels: bool, tp: TensorParallel = SINGLE
    ):
        super().__init__()
        self.tp = tp
        self.channels = c = spec.channels or hidden
        self.spec = spec
        self.use_kernels = use_kernels
        self.in_proj = nn.Linear(hidden, 3 * c, bias=spec.bias)
        self.conv1d = ConvWeights(c, spec.kernel, spec.bias)
        self.out_proj = nn.Linear(c, hidden, bias=spec.bias)

    def state_shapes(self, dtype: torch.dtype) -> StateShapes:
        return conv_and_state(self.channels, self.spec.kernel, None, dtype)

    def forward(self, x, state, meta):
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        y = run_conv(self.use_kernels, b * h, self.conv1d, state[0], meta, None)
        return self.tp.all_reduce(self.out_proj(c * y))

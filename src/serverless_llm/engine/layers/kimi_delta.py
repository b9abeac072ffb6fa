"""Kimi Delta Attention (KDA), the recurrent layer of Moonshot's Kimi Linear
(`KimiLinearDeltaAttention` in transformers): the gated delta rule with a forget gate per head
and key channel.

    q, k, v = silu(causal_conv(x W_qkv))                    (one depthwise conv over q | k | v)
    g       = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)  (per head and channel, float32)
    beta    = sigmoid(b(x))                                 (per head)
    o       = delta_rule(l2norm(q), l2norm(k), v, g, beta)  (kernels/gated_delta.py)
    out     = o_proj(rmsnorm(o) * o_norm.weight * sigmoid(g_b(g_a(x))))   (per head)

q, k, v, f_a, g_a and b all read the layer's input: they are one fused `in_proj`. Its state per
request: the convolution's last K-1 inputs ([3 * H * D, K-1], the model dtype) and the delta
rule's matrix ([H, D, D], float32). The convolution and the delta rule run their Triton kernels
on CUDA and their torch references elsewhere.

The output norm is not kernels/causal_conv1d.py's `gated_rms_norm`: KDA gates by sigmoid (not
silu) and multiplies the weight on the float32 row (transformers' `KimiLinearRMSNormGated`),
so it is written here in torch (a few elementwise ops on [T, H, D]).

Tensor parallelism: each rank holds 1/N of the heads: its rows of q, k, v and b in in_proj (f_a
and g_a, the gates' low-rank inputs, whole on every rank), its convolution channels, its heads'
rows of f_b and g_b, dt_bias and A_log (the norm is per head: no communication), and o_proj's
input columns of its heads, whose partial outputs are all-reduced.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.gated_delta import gated_delta_rule, gated_delta_rule_ref
from ..parallel.group import SINGLE, TensorParallel
from .recurrent import (
    ParamHolder,
    RecurrentMixer,
    RecurrentMixerSpec,
    Split,
    StateShapes,
    conv_and_state,
    indivisible,
    share,
    step_slots,
)
from .short_conv import ConvWeights, run_conv


@dataclass(frozen=True)
class KimiDeltaSpec(RecurrentMixerSpec):
    num_heads: int  # linear_num_heads
    head_dim: int  # linear_head_dim (keys and values alike)
    conv_kernel: int  # linear_conv_kernel_dim
    eps: float  # the output norm's (rms_norm_eps)

    def build(self, spec, backend, tp) -> KimiDeltaAttention:
        return KimiDeltaAttention(spec.hidden_size, self, backend.use_kernels, tp)

    def describe(self) -> str:
        return (
            f"Kimi Delta Attention, {self.num_heads} heads of {self.head_dim}, "
            f"convolution of {self.conv_kernel} taps"
        )

    def tp_refusal(self, hidden: int, size: int) -> str | None:
        return indivisible(size, self.num_heads, "Kimi Delta Attention heads")

    def shard(self, hidden: int, size: int) -> KimiDeltaSpec:
        return dataclasses.replace(self, num_heads=self.num_heads // size)

    def tp_split(self, name: str, hidden: int, rank: int, size: int) -> Split:
        H, D = self.num_heads, self.head_dim
        h0, hn = share(H, rank, size)
        heads = (h0 * D, hn * D)  # this rank's heads' channels of a [H * D] width
        qkv = [(part * H * D + heads[0], heads[1]) for part in range(3)]
        if name == "in_proj":  # [q | k | v | f_a | g_a | b]: f_a and g_a whole
            return "out", [*qkv, (3 * H * D, 2 * D), (3 * H * D + 2 * D + h0, hn)]
        if name == "conv1d":
            return "out", qkv
        if name in ("f_b_proj", "g_b_proj", "dt_bias"):
            return "out", [heads]
        if name == "A_log":
            return "out", [(h0, hn)]
        if name == "o_norm":  # one weight [D] shared by the heads
            return None
        if name == "o_proj":
            return "in", [heads]
        raise ValueError(f"Kimi Delta Attention: no parameter {name!r}")

    def in_proj_parts(self) -> tuple[int, ...]:
        """The widths of the fused input projection's pieces: q, k, v, f_a, g_a, b."""
        width = self.num_heads * self.head_dim
        return (width, width, width, self.head_dim, self.head_dim, self.num_heads)


def kda_forget_gate(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor) -> torch.Tensor:
    """KDA's log decay [T, H, D] float32 from f_b's output f [T, H * D]: transformers'
    `KimiLinearForgetGate`, -exp(A_log) * softplus(f + dt_bias), softplus taken as x above 20."""
    T, H = f.shape[0], a_log.shape[0]
    g = (f.float() + dt_bias.float()).view(T, H, -1)
    softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
    return -torch.exp(a_log.float()).view(H, 1) * softplus


def kda_gated_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float):
    """RMSNorm of each head's row of o [T, H, D], times weight [D] and sigmoid(gate), all in
    float32 and rounded once to o's dtype (`KimiLinearRMSNormGated`)."""
    h = o.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h * torch.sigmoid(gate.float())).to(o.dtype)


class KimiDeltaAttention(RecurrentMixer):
    def __init__(
        self, hidden: int, spec: KimiDeltaSpec, use_kernels: bool, tp: TensorParallel = SINGLE
    ):
        super().__init__()
        self.tp = tp
        self.spec = spec
        self.use_kernels = use_kernels
        H, D = spec.num_heads, spec.head_dim
        self.in_proj = nn.Linear(hidden, sum(spec.in_proj_parts()), bias=False)
        self.conv1d = ConvWeights(3 * H * D, spec.conv_kernel, bias=False)
        self.f_b_proj = nn.Linear(D, H * D, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(H * D))
        self.A_log = nn.Parameter(torch.empty(H))
        self.g_b_proj = nn.Linear(D, H * D, bias=False)
        self.o_norm = ParamHolder(D)  # applied by kda_gated_norm
        self.o_proj = nn.Linear(H * D, hidden, bias=False)

    def state_shapes(self, dtype: torch.dtype) -> StateShapes:
        H, D, K = self.spec.num_heads, self.spec.head_dim, self.spec.conv_kernel
        return conv_and_state(3 * H * D, K, (H, D, D), dtype)

    def forward(self, x, state, meta):
        conv_state, delta_state = state
        T = x.shape[0]
        H, D = self.spec.num_heads, self.spec.head_dim
        qkv, f_a, g_a, b = self.in_proj(x).split([3 * H * D, D, D, H], dim=-1)
        qkv = run_conv(self.use_kernels, qkv, self.conv1d, conv_state, meta, "silu")
        q, k, v = qkv.view(T, 3, H, D).unbind(1)
        g = kda_forget_gate(self.f_b_proj(f_a), self.dt_bias, self.A_log)
        beta = torch.sigmoid(b)  # in the model dtype, as transformers rounds it
        slots, init = step_slots(meta)
        rule = gated_delta_rule if self.use_kernels else gated_delta_rule_ref
        o = rule(
            q,
            k,
            v,
            g,
            beta,
            delta_state,
            meta.query_start_loc,
            slots,
            init,
            use_qk_l2norm=True,
            num_decodes=meta.num_decodes,
        )
        o = kda_gated_norm(o, self.g_b_proj(g_a).view(T, H, D), self.o_norm.weight, self.spec.eps)
        return self.tp.all_reduce(self.o_proj(o.reshape(T, H * D)))

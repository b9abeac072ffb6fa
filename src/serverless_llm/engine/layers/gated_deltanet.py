"""Gated DeltaNet: the linear-attention layer of Qwen3-Next, Qwen3.5 and OLMo Hybrid
(`Qwen3NextGatedDeltaNet`, `Qwen3_5GatedDeltaNet`, `OlmoHybridGatedDeltaNet` in transformers).

    q, k, v, z, b, a = in_proj(h)                           one fused projection
    q, k, v = silu(conv(q | k | v))                         depthwise causal, K taps
    beta = sigmoid(b)  (times 2 with OLMo's allow_neg_eigval)
    g = -exp(A_log) * softplus(a + dt_bias)                 float32 log decay per value head
    o = gated delta rule(l2norm(q), l2norm(k), v, g, beta)  Hv value heads over Hk q/k heads
    y = out_proj(weight * rmsnorm(o) * silu(z))             per value head, norm before gate

A request's state: the convolution's last K-1 inputs [conv_dim, K-1] in the model dtype, and the
recurrence's matrix [Hv, Dk, Dv] in float32. The convolution, the delta rule and the gated norm
run their Triton kernels on CUDA and their torch references elsewhere (kernels/causal_conv1d.py,
kernels/gated_delta.py).

The fused in_proj's rows are [q | k | v | z | b | a] (q, k: Hk heads of Dk; v, z: Hv heads of Dv;
b, a: one row per value head), so the forward splits them as views. The checkpoints' layouts
(Qwen3-Next's in_proj_qkvz and in_proj_ba interleaved per key head, Qwen3.5's in_proj_qkv / z /
b / a, OLMo Hybrid's separate q/k/v/g/b/a projections and its split convolution) are put into
that order at load (`GatedDeltaNetSpec.checkpoint_rows`, the "mixer:<part>" placement).

Tensor parallelism: each rank holds 1/N of the q/k heads and the value heads they serve (GQA
groups whole on a rank: value head h reads q/k head h // (Hv / Hk)), i.e. its rows of q, k, v,
z, b and a in in_proj, its convolution channels of q, k and v, its heads' A_log and dt_bias (the
gated norm is per head: no communication), and out_proj's input columns of its value heads,
whose partial outputs are all-reduced.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.causal_conv1d import gated_rms_norm, gated_rms_norm_ref
from ..kernels.gated_delta import gated_delta_rule, gated_delta_rule_ref
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
from .short_conv import ConvWeights, run_conv


@dataclass(frozen=True)
class GatedDeltaNetSpec(RecurrentMixerSpec):
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    norm_eps: float  # the gated RMSNorm's
    beta_scale: float = 1.0  # OLMo Hybrid's allow_neg_eigval: beta in [0, 2]

    def __post_init__(self):
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"Gated DeltaNet: {self.num_v_heads} value heads are not a multiple of "
                f"{self.num_k_heads} key heads"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"Gated DeltaNet: a convolution of {self.conv_kernel} taps")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def proj_parts(self) -> tuple[int, int, int, int]:
        """The fused in_proj's widths: (q | k | v, z, b, a)."""
        return (self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads)

    def build(self, spec, backend, tp) -> GatedDeltaNet:
        return GatedDeltaNet(spec.hidden_size, self, backend.use_kernels, tp)

    def describe(self) -> str:
        return (
            f"Gated DeltaNet ({self.num_k_heads} q/k heads of {self.head_k_dim}, "
            f"{self.num_v_heads} value heads of {self.head_v_dim}, convolution of "
            f"{self.conv_kernel} taps)"
        )

    def tp_refusal(self, hidden: int, size: int) -> str | None:
        # the value heads are a multiple of the q/k heads: they divide too
        return indivisible(size, self.num_k_heads, "Gated DeltaNet q/k heads")

    def shard(self, hidden: int, size: int) -> GatedDeltaNetSpec:
        return dataclasses.replace(
            self, num_k_heads=self.num_k_heads // size, num_v_heads=self.num_v_heads // size
        )

    def tp_split(self, name: str, hidden: int, rank: int, size: int) -> Split:
        kd, vd, dk, dv = self.key_dim, self.value_dim, self.head_k_dim, self.head_v_dim
        k0, kn = share(self.num_k_heads, rank, size)
        v0, vn = share(self.num_v_heads, rank, size)
        qkv = [(k0 * dk, kn * dk), (kd + k0 * dk, kn * dk), (2 * kd + v0 * dv, vn * dv)]
        if name == "in_proj":  # [q | k | v | z | b | a]
            ba = 2 * kd + 2 * vd
            z_b_a = [
                (2 * kd + vd + v0 * dv, vn * dv),
                (ba + v0, vn),
                (ba + self.num_v_heads + v0, vn),
            ]
            return "out", qkv + z_b_a
        if name == "conv1d":
            return "out", qkv
        if name in ("A_log", "dt_bias"):
            return "out", [(v0, vn)]
        if name == "norm":  # one weight [Dv] shared by the heads
            return None
        if name == "out_proj":
            return "in", [(v0 * dv, vn * dv)]
        raise ValueError(f"Gated DeltaNet: no parameter {name!r}")

    def checkpoint_segments(self, part: str, rows: int) -> list[tuple[int, int, int]]:
        """Where checkpoint tensor `part`'s rows go in the fused in_proj (parts "qkvz", "ba",
        "qkv", "z", "b", "a", "q", "k", "v") or the convolution's channels ("conv_q", "conv_k",
        "conv_v"): runs of (first checkpoint row, first fused row, length)."""
        kd, vd, hk = self.key_dim, self.value_dim, self.num_k_heads
        dk, dv, hv = self.head_k_dim, self.head_v_dim, self.num_v_heads
        r = hv // hk
        if part == "qkvz":  # per key head h: [q_h | k_h | v of its r heads | z of its r heads]
            w = 2 * dk + 2 * r * dv
            runs = []
            for h in range(hk):
                base = h * w
                runs += [
                    (base, h * dk, dk),
                    (base + dk, kd + h * dk, dk),
                    (base + 2 * dk, 2 * kd + h * r * dv, r * dv),
                    (base + 2 * dk + r * dv, 2 * kd + vd + h * r * dv, r * dv),
                ]
            return runs
        if part == "ba":  # per key head h: [b of its r heads | a of its r heads]
            ba = 2 * kd + 2 * vd
            return [
                run
                for h in range(hk)
                for run in ((2 * r * h, ba + h * r, r), (2 * r * h + r, ba + hv + h * r, r))
            ]
        starts = {
            "qkv": 0,
            "q": 0,
            "k": kd,
            "v": 2 * kd,
            "z": 2 * kd + vd,
            "b": 2 * kd + 2 * vd,
            "a": 2 * kd + 2 * vd + hv,
            "conv_q": 0,
            # OLMo Hybrid's q/k/v convolutions: from OLMo-core they are [key_dim, key_dim,
            # value_dim] channels; transformers' save_pretrained splits its fused convolution
            # into three near-equal parts instead. Either way q and k have as many channels and
            # the three cover the whole in order, so k starts where its own size says and v
            # ends at the end.
            "conv_k": rows,
            "conv_v": self.conv_dim - rows,
        }
        if part not in starts:
            raise ValueError(f"unknown Gated DeltaNet checkpoint part {part!r}")
        return [(0, starts[part], rows)]

    def checkpoint_rows(self, part: str, tensor: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Where a checkpoint tensor's rows go: (first row, the rows in the fused order) in the
        fused in_proj or the convolution's channels (`checkpoint_segments`)."""
        runs = sorted(self.checkpoint_segments(part, tensor.shape[0]), key=lambda run: run[1])
        rows = [tensor.narrow(0, src, n) for src, _, n in runs]
        return runs[0][1], rows[0] if len(rows) == 1 else torch.cat(rows)


class GatedRMSNorm(nn.Module):
    """weight * rmsnorm(x) * silu(z) over each value head's Dv channels (the norm before the
    gate: Qwen3NextRMSNormGated)."""

    def __init__(self, size: int, eps: float, use_kernels: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.use_kernels = use_kernels

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        fn = gated_rms_norm if self.use_kernels else gated_rms_norm_ref
        d = self.weight.shape[0]
        return fn(x, z, self.weight, self.eps, d, True)


class GatedDeltaNet(RecurrentMixer):
    def __init__(
        self, hidden: int, spec: GatedDeltaNetSpec, use_kernels: bool, tp: TensorParallel = SINGLE
    ):
        super().__init__()
        self.tp = tp
        self.spec = spec
        self.use_kernels = use_kernels
        self.in_proj = nn.Linear(hidden, sum(spec.proj_parts), bias=False)
        self.conv1d = ConvWeights(spec.conv_dim, spec.conv_kernel, bias=False)
        self.A_log = nn.Parameter(torch.empty(spec.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(spec.num_v_heads))
        self.norm = GatedRMSNorm(spec.head_v_dim, spec.norm_eps, use_kernels)
        self.out_proj = nn.Linear(spec.value_dim, hidden, bias=False)

    def state_shapes(self, dtype: torch.dtype) -> StateShapes:
        s = self.spec
        return conv_and_state(
            s.conv_dim, s.conv_kernel, (s.num_v_heads, s.head_k_dim, s.head_v_dim), dtype
        )

    def forward(self, x, state, meta):
        s = self.spec
        T = x.shape[0]
        qkv, z, b, a = self.in_proj(x).split(s.proj_parts, dim=-1)
        qkv = run_conv(self.use_kernels, qkv, self.conv1d, state[0], meta, "silu")
        q, k, v = qkv.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = q.view(T, s.num_k_heads, s.head_k_dim)
        k = k.view(T, s.num_k_heads, s.head_k_dim)
        v = v.view(T, s.num_v_heads, s.head_v_dim)
        # As transformers: beta in the model dtype, the log decay in float32.
        beta = torch.sigmoid(b)
        if s.beta_scale != 1.0:
            beta = beta * s.beta_scale
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        slots, init = step_slots(meta)
        rule = gated_delta_rule if self.use_kernels else gated_delta_rule_ref
        o = rule(
            q,
            k,
            v,
            g,
            beta,
            state[1],
            meta.query_start_loc,
            slots,
            init,
            scale=None,
            use_qk_l2norm=True,
            num_decodes=meta.num_decodes,
        )
        o = self.norm(o, z.view(T, s.num_v_heads, s.head_v_dim))
        return self.tp.all_reduce(self.out_proj(o.reshape(T, s.value_dim)))

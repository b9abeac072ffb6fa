"""Mamba's selective state-space mixer (Mamba-1): the recurrent layer of Mamba
(`MambaMixer` in transformers) and of Jamba's Mamba layers (`JambaMambaMixer`, which adds
RMSNorms on dt, B and C).

    x, z = in_proj(h).split(2)                  x, z: [T, d_inner]
    u = silu(conv(x) + conv_bias)               causal depthwise convolution of K taps
    dt, B, C = x_proj(u).split(R, N, N)         (Jamba: each through its RMSNorm)
    delta = dt_proj(dt)                         [T, d_inner], dt_proj's bias left to the scan
    y = scan(u, delta, A = -exp(A_log), B, C, D, z, dt_bias)   kernels/selective_scan.py
    out = out_proj(y)

State per request: the convolution's last K - 1 inputs [d_inner, K - 1] in the model dtype and
the SSM state [d_inner, N] in float32. The convolution and the scan run their Triton kernels on
CUDA and their torch references elsewhere; both compute in float32 and round once, which in a
float32 model is what transformers computes (its casts are then the identity).

Tensor parallelism: each rank holds 1/N of the d_inner channels (its rows of in_proj's x and z,
its convolution channels, dt_proj's output rows, A_log, D and the delta bias; the scan is per
channel) and out_proj's matching input columns, whose partial outputs are all-reduced. x_proj
reads every channel: each rank multiplies its columns and the partial [dt | B | C] are
all-reduced (R + 2N values per token, before Jamba's norms and dt_proj). That is exact and
cheaper than the alternative, x_proj whole on every rank, which would need u gathered from all
ranks (d_inner values per token) and N times the x_proj work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.selective_scan import selective_scan, selective_scan_ref
from ..parallel.group import SINGLE, TensorParallel
from .norm import RMSNorm
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
class MambaSpec(RecurrentMixerSpec):
    d_inner: int  # channels of the convolution and the scan (expand * hidden)
    d_state: int  # N: the SSM state per channel
    d_conv: int  # K: the convolution's taps
    dt_rank: int  # R: the width of dt before dt_proj
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj's and out_proj's
    # Jamba: RMSNorms (with weights) on dt, B and C after x_proj, of this eps; None: none.
    inner_norm_eps: float | None = None

    def build(self, spec, backend, tp) -> MambaMixer:
        return MambaMixer(spec.hidden_size, self, backend.use_kernels, tp)

    def describe(self) -> str:
        norms = ", RMSNorm on dt, B, C" if self.inner_norm_eps is not None else ""
        return (
            f"Mamba selective scan (d_inner {self.d_inner}, state {self.d_state}, conv "
            f"{self.d_conv} taps, dt rank {self.dt_rank}{norms})"
        )

    def tp_refusal(self, hidden: int, size: int) -> str | None:
        return indivisible(size, self.d_inner, "Mamba inner channels (d_inner)")

    def shard(self, hidden: int, size: int) -> MambaSpec:
        return dataclasses.replace(self, d_inner=self.d_inner // size)

    def tp_split(self, name: str, hidden: int, rank: int, size: int) -> Split:
        lo, n = share(self.d_inner, rank, size)
        if name == "in_proj":  # [x | z]
            return "out", [(lo, n), (self.d_inner + lo, n)]
        if name in ("conv1d", "dt_proj", "dt_bias", "A_log", "D"):
            return "out", [(lo, n)]
        if name in ("x_proj", "out_proj"):
            return "in", [(lo, n)]
        if name in ("dt_norm", "b_norm", "c_norm"):  # after x_proj's all-reduce: whole
            return None
        raise ValueError(f"Mamba: no parameter {name!r}")


class MambaMixer(RecurrentMixer):
    def __init__(
        self, hidden: int, spec: MambaSpec, use_kernels: bool, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        self.spec = spec
        self.use_kernels = use_kernels
        d, n, r = spec.d_inner, spec.d_state, spec.dt_rank
        self.in_proj = nn.Linear(hidden, 2 * d, bias=spec.proj_bias)  # [x | z]
        self.conv1d = ConvWeights(d, spec.d_conv, spec.conv_bias)
        self.x_proj = nn.Linear(d, r + 2 * n, bias=False)  # [dt | B | C]
        self.dt_proj = nn.Linear(r, d, bias=False)
        self.dt_bias = ParamHolder(d)  # dt_proj's bias, added inside the scan in float32
        self.A_log = ParamHolder(d, n)
        self.D = ParamHolder(d)
        self.out_proj = nn.Linear(d, hidden, bias=spec.proj_bias)
        eps = spec.inner_norm_eps
        if eps is not None:
            self.dt_norm = RMSNorm(r, eps, use_kernels)
            self.b_norm = RMSNorm(n, eps, use_kernels)
            self.c_norm = RMSNorm(n, eps, use_kernels)
        else:
            self.dt_norm = self.b_norm = self.c_norm = None

    def state_shapes(self, dtype: torch.dtype) -> StateShapes:
        s = self.spec
        return conv_and_state(s.d_inner, s.d_conv, (s.d_inner, s.d_state), dtype)

    def forward(self, h, state, meta):
        s = self.spec
        conv_state, ssm_state = state[0], state[1]
        x, z = self.in_proj(h).split([s.d_inner, s.d_inner], dim=-1)
        u = run_conv(self.use_kernels, x, self.conv1d, conv_state, meta, "silu")
        # x_proj's partial sums over this rank's channels (see the module docstring)
        dbc = self.tp.all_reduce(self.x_proj(u))
        dt, B, C = dbc.split([s.dt_rank, s.d_state, s.d_state], dim=-1)
        if self.dt_norm is not None:
            dt, B, C = self.dt_norm(dt), self.b_norm(B), self.c_norm(C)
        delta = self.dt_proj(dt)
        A = -torch.exp(self.A_log.weight.float())
        slots, init = step_slots(meta)
        scan = selective_scan if self.use_kernels else selective_scan_ref
        y = scan(
            u,
            delta,
            A,
            B,
            C,
            self.D.weight,
            z,
            self.dt_bias.weight,
            True,
            ssm_state,
            meta.query_start_loc,
            slots,
            init,
            num_decodes=meta.num_decodes,
        )
        return self.tp.all_reduce(self.out_proj(y))

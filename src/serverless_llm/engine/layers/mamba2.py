"""The Mamba-2 mixer: the recurrent layer of Mamba2, Bamba, Granite 4.0-H (GraniteMoeHybrid),
Nemotron-H and Falcon-H1 (`Mamba2Mixer`, `BambaMixer`, `GraniteMoeHybridMambaLayer` in
transformers, which compute the same thing).

    z | xBC | dt = in_proj(h)                   z [d_inner], xBC [conv_dim], dt [H]
    xBC = silu(conv1d(xBC) + conv_bias)          causal, through the conv state
    x | B | C = xBC                              x [H, P], B and C [G, N]
    y = ssd(x, dt, A = -exp(A_log), B, C, D, dt_bias, softplus, time_step_limit)
    y = norm(y, z)                               gated RMSNorm in groups (or y * silu(z))
    out = out_proj(y)

with d_inner = H * P and conv_dim = d_inner + 2 G N. Its state per request: the convolution's last
K - 1 inputs [conv_dim, K-1] in the model dtype, and the SSM state [H, P, N] in float32. The
convolution and the scan run the Triton kernels on CUDA and their torch references elsewhere
(kernels/causal_conv1d.py, kernels/ssd.py).

Precision: transformers' torch path computes the in/out projections and the convolution in the
model dtype and the scan in float32; here the convolution, the scan and the gated norm compute
in float32 and round once to the model dtype (the kernels' rule). In float32 the two compute the
same formula. Mamba2's `residual_in_fp32` (a float32 residual stream in 16-bit models) is not
reproduced: the residual stream is in the model dtype, as for every family.

Tensor parallelism: each rank holds 1/N of the heads (its rows of z, x and dt in in_proj, its x
channels of the convolution, its heads' dt_bias, A_log and D, its channels of the norm weight,
and out_proj's matching input columns, whose partial outputs are all-reduced) and the B and C
groups its heads read: 1/N of them, or, with fewer groups than ranks, the one group of its
heads (held by N / G ranks alike). The gated norm needs nothing from the other ranks when each
norm group lies on one rank; with fewer norm groups than ranks a group spans N / groups ranks,
whose sums of squares are all-reduced (`norm_span`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.causal_conv1d import gated_rms_norm, gated_rms_norm_ref
from ..kernels.ssd import ssd_scan, ssd_scan_ref
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

ACTIVATIONS = ("silu",)  # the convolution's activation (transformers' hidden_act)


@dataclass(frozen=True)
class Mamba2Spec(RecurrentMixerSpec):
    """A model's Mamba-2 layers. `norm`: the gated RMSNorm over groups of d_inner / norm_groups
    channels (`norm_groups` None: n_groups), the silu gate applied before the norm unless
    `norm_before_gate`; without it the output is y * silu(z) (Falcon-H1's mamba_rms_norm=False).
    `time_step_limit` clamps dt after its softplus (Nemotron-H: (time_step_min, inf)); with
    `clamp_decodes` False it clamps the prompt rows only, as transformers does (its one-token
    path, `mamba2_selective_state_update`, applies no limit)."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    conv_bias: bool = True
    in_bias: bool = False  # in_proj's bias
    out_bias: bool = False  # out_proj's bias
    activation: str = "silu"
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    clamp_decodes: bool = True
    norm: bool = True
    norm_before_gate: bool = False
    norm_groups: int | None = None
    norm_eps: float = 1e-5
    # Tensor parallelism with fewer norm groups than ranks: how many ranks hold one norm group
    # between them (a rank's part of the description: its norm group is then partial).
    norm_span: int = 1

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"Mamba-2 layers with activation {self.activation!r} (only silu)")
        if self.num_heads % self.n_groups:
            raise ValueError(f"Mamba-2: {self.num_heads} heads in {self.n_groups} groups")
        if self.d_inner % self.groups_of_norm:
            raise ValueError(f"Mamba-2: d_inner {self.d_inner} in {self.groups_of_norm} groups")

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.state_size

    @property
    def groups_of_norm(self) -> int:
        return self.norm_groups or self.n_groups

    def build(self, spec, backend, tp) -> Mamba2Mixer:
        return Mamba2Mixer(spec.hidden_size, self, backend.use_kernels, tp)

    def tp_refusal(self, hidden: int, size: int) -> str | None:
        heads = indivisible(size, self.num_heads, "Mamba-2 heads")
        if heads is not None:
            return heads
        counts = [(self.n_groups, "Mamba-2 B/C groups (n_groups)")]
        if self.norm:
            counts.append((self.groups_of_norm, "Mamba-2 gated norm groups"))
        for count, what in counts:
            if count % size and size % count:
                return (
                    f"tensor_parallel_size={size} and the model's {count} {what}: one must "
                    "divide the other (the groups are split across ranks, or each serves "
                    "size/groups ranks)"
                )
        return None

    def shard(self, hidden: int, size: int) -> Mamba2Spec:
        g, ng = self.n_groups, self.groups_of_norm
        return dataclasses.replace(
            self,
            num_heads=self.num_heads // size,
            n_groups=g // size if g % size == 0 else 1,
            norm_groups=ng // size if ng % size == 0 else 1,
            norm_span=1 if ng % size == 0 else size // ng,
        )

    def tp_split(self, name: str, hidden: int, rank: int, size: int) -> Split:
        d, p, n, g = self.d_inner, self.head_dim, self.state_size, self.n_groups
        h0, hn = share(self.num_heads, rank, size)
        if g % size == 0:
            g0, gn = share(g, rank, size)
        else:  # fewer groups than ranks: the one group this rank's heads read
            g0, gn = h0 // (self.num_heads // g), 1
        x = (h0 * p, hn * p)  # this rank's channels of a [d_inner] width
        bc = [(d + g0 * n, gn * n), (d + g * n + g0 * n, gn * n)]  # of x | B | C
        if name == "in_proj":  # [z | x | B | C | dt]
            xbc = [(d + lo, ln) for lo, ln in [x, *bc]]
            return "out", [x, *xbc, (d + self.conv_dim + h0, hn)]
        if name == "conv1d":  # [x | B | C]
            return "out", [x, *bc]
        if name in ("dt_bias", "A_log", "D"):
            return "out", [(h0, hn)]
        if name == "norm":
            return "out", [x]
        if name == "out_proj":
            return "in", [x]
        raise ValueError(f"Mamba-2: no parameter {name!r}")

    def describe(self) -> str:
        return (
            f"Mamba-2: {self.num_heads} heads of {self.head_dim}, state {self.state_size}, "
            f"{self.n_groups} groups, conv {self.conv_kernel}"
        )


class Mamba2Mixer(RecurrentMixer):
    def __init__(
        self, hidden: int, spec: Mamba2Spec, use_kernels: bool, tp: TensorParallel = SINGLE
    ):
        super().__init__()
        self.tp = tp
        self.spec = spec
        self.use_kernels = use_kernels
        H, d_inner, conv_dim = spec.num_heads, spec.d_inner, spec.conv_dim
        self.in_proj = nn.Linear(hidden, d_inner + conv_dim + H, bias=spec.in_bias)
        self.conv1d = ConvWeights(conv_dim, spec.conv_kernel, spec.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.A_log = nn.Parameter(torch.empty(H))
        self.D = nn.Parameter(torch.empty(H))
        self.norm = ParamHolder(d_inner) if spec.norm else None  # the gated norm's weight
        self.out_proj = nn.Linear(d_inner, hidden, bias=spec.out_bias)
        self.splits = (d_inner, conv_dim, H)
        self.xbc_splits = (
            d_inner,
            spec.n_groups * spec.state_size,
            spec.n_groups * spec.state_size,
        )

    def state_shapes(self, dtype: torch.dtype) -> StateShapes:
        s = self.spec
        return conv_and_state(
            s.conv_dim, s.conv_kernel, (s.num_heads, s.head_dim, s.state_size), dtype
        )

    def forward(self, x, state, meta):
        s = self.spec
        T = x.shape[0]
        z, xbc, dt = self.in_proj(x).split(self.splits, dim=-1)
        xbc = run_conv(self.use_kernels, xbc, self.conv1d, state[0], meta, s.activation)
        h, B, C = xbc.split(self.xbc_splits, dim=-1)
        slots, init = step_slots(meta)
        dt_bias, softplus, limit = self.dt_bias, True, s.time_step_limit
        nd = meta.num_decodes
        if not s.clamp_decodes and limit != (0.0, math.inf):
            # The time steps computed here, so that generated tokens skip the limit prompt tokens
            # take (per token: a preempted request recomputes its generated tokens in a prompt
            # chunk, a one-token prompt chunk is a "decode"); the scan gets them processed (a
            # (0, inf) clamp is a no-op).
            d = F.softplus(dt.float() + self.dt_bias.float())
            rows = meta.prompt_rows
            if rows is None:  # no per-token flags: the step's decodes are the generated tokens
                rows = torch.arange(T, device=d.device) >= nd
            dt = torch.where(rows[:, None], d.clamp(*limit), d)
            dt_bias, softplus, limit = None, False, (0.0, math.inf)
        scan = ssd_scan if self.use_kernels else ssd_scan_ref
        y = scan(
            h.view(T, s.num_heads, s.head_dim),
            dt,
            -torch.exp(self.A_log.float()),
            B.view(T, s.n_groups, s.state_size),
            C.view(T, s.n_groups, s.state_size),
            self.D,
            dt_bias,
            softplus,
            limit,
            state[1],
            meta.query_start_loc,
            slots,
            init,
            num_decodes=meta.num_decodes,
        ).view(T, s.d_inner)
        if self.norm is not None and s.norm_span > 1:
            y = self._norm_across_ranks(y, z)
        elif self.norm is not None:
            norm = gated_rms_norm if self.use_kernels else gated_rms_norm_ref
            group = s.d_inner // s.groups_of_norm
            y = norm(y, z, self.norm.weight, s.norm_eps, group, s.norm_before_gate)
        else:
            y = (y.float() * F.silu(z.float())).to(y.dtype)
        return self.tp.all_reduce(self.out_proj(y))

    def _norm_across_ranks(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated RMSNorm of this rank's channels y, z [T, d_inner / N], part of a norm group
        that `norm_span` ranks hold: the group's sum of squares all-reduced (each group's in its
        own column, so the ranks of other groups add nothing to it), then `gated_rms_norm_ref`'s
        casts."""
        s, tp = self.spec, self.tp
        gate = F.silu(z.float())
        h = y.float()
        if not s.norm_before_gate:
            h = h * gate
        sums = h.new_zeros(h.shape[0], tp.size // s.norm_span)
        group = tp.rank // s.norm_span
        sums[:, group] = h.pow(2).sum(-1)
        sq = tp.all_reduce(sums)[:, group : group + 1]
        h = h * torch.rsqrt(sq / (h.shape[-1] * s.norm_span) + s.norm_eps)
        out = self.norm.weight * h.to(y.dtype)
        if s.norm_before_gate:
            out = out * gate
        return out.to(y.dtype)

"""Mixture-of-experts: the router's choice and the experts' stacked weights.

A sparse MLP block sends each token to `top_k` of `num_experts` gated MLPs and sums their outputs
weighted by the router. The experts' weights are stacked, one tensor for all experts' [gate | up]
rows (`w13`, [E, 2 * I, H]) and one for their down projections (`w2`, [E, H, I]), so the loader
fills each expert's slice in place and a kernel reads any expert by index.

`route` turns router logits into (weights, expert ids) the way each family's transformers code
does; `experts_forward` runs the experts by the Triton grouped GEMM or its torch reference
(tokens grouped by expert, one matmul pair per expert that received any: the CPU path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.activation import ACT_CODES
from ..kernels.cpu_native import PanelPointers, pack_panels_in_place
from ..kernels.fused_moe import (
    Fp8BlockExperts,
    Fp8Experts,
    fused_moe,
    fused_moe_fp8,
    fused_moe_fp8_block,
    fused_moe_fp8_block_reference,
    fused_moe_fp8_reference,
    fused_moe_reference,
)
from ..kernels.fused_moe_mxfp4 import Mxfp4Experts, fused_moe_mxfp4, fused_moe_mxfp4_reference
from ..kernels.fused_moe_w4a16 import (
    PackedExperts,
    fused_moe_w4a16,
    fused_moe_w4a16_reference,
    pack_experts,
)
from .activation import check_activation
from .linear import pack_weight, packed_linear
from .quant_linear import WHOLE, QuantLinear, QuantLoadError, apply_keeping_dtype

ROUTINGS = (
    "softmax_topk",
    "topk_softmax",
    "sparsemixer",
    "sigmoid_grouped",
    "topk_sigmoid",
    "softmax_grouped",
    "softmax_biased",
)


def route(
    logits: torch.Tensor,
    top_k: int,
    routing: str,
    renormalize: bool | float,
    jitter_eps: float = 0.0,
    *,
    score_bias: torch.Tensor | None = None,
    groups: tuple[int, int] = (1, 1),
    scale: float = 1.0,
    norm_floor: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k] int64) from router logits [T, E].

    - "softmax_topk" (Mixtral, Qwen-MoE, OLMoE, DBRX): softmax over all experts in float32, the
      top k probabilities, divided by their sum when `renormalize` is True (Mixtral always;
      Qwen/OLMoE by `norm_topk_prob`), or by their p-norm when it is a number p (DBRX's
      `moe_normalize_expert_weights`; p = 1 is the sum).
    - "topk_softmax" (Granite-MoE): the top k logits, softmax over those k.
    - "topk_sigmoid" (Llama 4): the top k logits, each through a sigmoid (no normalisation).
    - "sparsemixer" (PhiMoE), at inference, always two experts (top_k must be 2): the best
      expert, weighted by its share of a softmax over the experts whose logit is within a
      relative `2 * jitter_eps` of the best, (best - logit) / max(|logit|, best) <= 2 * eps;
      then the best of the rest, weighted the same way against the second-best logit, with the
      first expert left out of its softmax. transformers' training-time Gumbel sampling and
      gradient estimate do not change these inference values.
    - "sigmoid_grouped" (Kimi Linear; DeepSeek-V3's and Nemotron-H's router too): sigmoid
      scores in float32; the experts are chosen by score + `score_bias` (the checkpoint's
      e_score_correction_bias) among the best `groups[1]` of `groups[0]` equal groups of experts
      (a group ranked by the sum of its two best biased scores); weighted by their unbiased
      scores, divided by their sum (+1e-20) when `renormalize`, times `scale` (the routed
      scaling factor). GLM-4.5, dots.llm1 and MiniMax-M2 (one group) route so too.
    - "softmax_grouped" (DeepSeek-V2, topk_method "greedy" with one group or
      "group_limited_greedy"): softmax probabilities in float32; the experts outside the best
      `groups[1]` of `groups[0]` groups (a group ranked by its best probability) count as 0;
      the top k weighted by their probability (divided by their sum (+1e-20) when
      `renormalize`; DeepSeek-V2 in transformers never does), times `scale`.
    - "softmax_biased" (ERNIE 4.5): softmax probabilities in float32; the experts chosen by
      probability + `score_bias`; weighted by their probabilities divided by their sum, the sum
      no less than `norm_floor` (moe_norm_min), when `renormalize`."""
    if routing == "softmax_topk":
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            p = float(renormalize)  # True: 1, the sum
            if p == 1:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            else:
                weights = weights / torch.norm(weights, p=p, dim=-1, keepdim=True)
        return weights, ids
    if routing == "topk_softmax":
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    if routing == "topk_sigmoid":
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.sigmoid(top.float()), ids
    if routing in ("sigmoid_grouped", "softmax_grouped", "softmax_biased"):
        return _scored(
            logits.float(), top_k, routing, renormalize, score_bias, groups, scale, norm_floor
        )
    if routing == "sparsemixer":
        if top_k != 2:
            raise ValueError(f"sparsemixer routing picks 2 experts, not {top_k}")
        return _sparsemixer(logits.float(), jitter_eps)
    raise ValueError(f"unknown MoE routing {routing!r}; known: {', '.join(ROUTINGS)}")


def _scored(
    logits: torch.Tensor,
    top_k: int,
    routing: str,
    renormalize: bool | float,
    score_bias: torch.Tensor | None,
    groups: tuple[int, int],
    scale: float,
    norm_floor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route`'s "sigmoid_grouped", "softmax_grouped" and "softmax_biased" on float32 logits
    [T, E]: scores, a choice among the best groups by (biased) score, weights from the scores."""
    sigmoid = routing == "sigmoid_grouped"
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    choice = scores if score_bias is None else scores + score_bias.float().reshape(-1)
    num_groups, best_groups = groups
    if best_groups < num_groups:  # keep only the experts of the best groups
        T, E = choice.shape
        by_group = choice.view(T, num_groups, E // num_groups)
        if sigmoid:  # DeepSeek-V3: a group's two best scores
            ranks = by_group.topk(min(2, E // num_groups), dim=-1)[0].sum(-1)
        else:  # DeepSeek-V2: its best one
            ranks = by_group.amax(dim=-1)
        keep = torch.zeros_like(ranks, dtype=torch.bool)
        keep.scatter_(1, ranks.topk(best_groups, dim=-1)[1], True)
        # DeepSeek-V2 zeroes the others' probabilities, which are then its weights too
        dropped = ~keep.repeat_interleave(E // num_groups, dim=1)
        choice = choice.masked_fill(dropped, float("-inf") if sigmoid else 0.0)
        if not sigmoid:
            scores = choice
    ids = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        if routing == "softmax_biased":
            weights = weights / total.clamp(min=norm_floor)
        else:
            weights = weights / (total + 1e-20)
    return weights * scale, ids


def experts_on_weighted_inputs(experts, x: torch.Tensor, weights, ids) -> torch.Tensor:
    """Llama 4's way of weighting: each chosen expert reads the token already multiplied by its
    router weight (rounded to the model dtype, as transformers does), and the experts' outputs
    are summed as they are. With top_k > 1 each (token, choice) pair is a row of its own."""
    T, k = ids.shape
    w = weights.to(x.dtype)
    ones = torch.ones(T * k, 1, dtype=weights.dtype, device=weights.device)
    if k == 1:
        return experts(x * w, ones, ids)
    rows = (x.unsqueeze(1) * w.unsqueeze(-1)).reshape(T * k, x.shape[-1])
    return experts(rows, ones, ids.reshape(T * k, 1)).view(T, k, -1).sum(dim=1)


class BiasedRouter(nn.Module):
    """The router of "sigmoid_grouped", "softmax_grouped" and "softmax_biased" routing:
    `weight` [E, H] and (`bias`) the score correction bias [E] (`e_score_correction_bias`, as
    checkpoints name it); its logits are computed in float32 (as transformers' routers of those
    kinds do), so quantizers and the CPU packing leave it be. The bias stays float32 whatever
    the model's dtype (transformers keeps it so: rounded to bfloat16 it would change choices),
    and so does the weight when `float32_weight` (ERNIE 4.5's)."""

    def __init__(
        self, hidden: int, num_experts: int, bias: bool = True, float32_weight: bool = False
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        if bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts))
        self.float32 = ("e_score_correction_bias",) + (("weight",) if float32_weight else ())

    def _apply(self, fn, recurse=True):
        # model.to(dtype) moves these, never rounds them: each keeps its float32 values (or,
        # from the meta device, float32 storage) on the device the others went to
        kept = {n: self._parameters[n].data for n in self.float32 if n in self._parameters}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            p = self._parameters[name]
            if p.dtype == torch.float32:
                continue
            if old.is_meta and not p.is_meta:
                t = torch.empty(p.shape, dtype=torch.float32, device=p.device)
            else:
                t = old.to(device=p.device, dtype=torch.float32)
            self._parameters[name] = nn.Parameter(t, p.requires_grad)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


def _sparsemixer(scores: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's `sparsemixer` with training=False: two rounds of (best expert, its weight)."""
    weights, ids = [], []
    masked = scores
    for _ in range(2):
        top, idx = masked.max(dim=-1, keepdim=True)
        factor = scores.abs().clamp(min=top)
        gates = masked.masked_fill((top - scores) / factor > 2 * eps, float("-inf"))
        weights.append(torch.softmax(gates, dim=-1).gather(-1, idx))
        ids.append(idx)
        masked = scores.scatter(-1, idx, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)


class StackedWeight(nn.Module):
    """One parameter `weight` [num_experts, out, in]: every expert's matrix of one projection."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))


class StackedBias(nn.Module):
    """Every expert's bias of one projection, [num_experts, out] (gpt-oss); a module whose
    parameter is `weight`, as the loader fills a checkpoint's bare parameters."""

    def __init__(self, num_experts: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features))


def experts_forward(
    x, w13, w2, weights, ids, act, use_kernels: bool, linear=F.linear, gated: bool = True,
    b13=None, b2=None,
) -> torch.Tensor:  # fmt: skip
    """The experts' weighted sum for each token: the Triton grouped GEMM when `use_kernels`,
    else its torch reference (kernels/fused_moe.py), whose matmuls are `linear` (per-expert
    packed weights on CPU); `gated`: w13 holds gate and up rows, else up rows alone; `b13`,
    `b2`: the experts' biases or None."""
    if use_kernels:
        return fused_moe(x, w13, w2, weights, ids, act, gated, b13, b2)
    return fused_moe_reference(x, w13, w2, weights, ids, act, linear, gated, b13, b2)


class _PanelWeight:
    """An expert's weight in the native GEMM's panels (`Experts.pack_for_cpu`)."""

    def __init__(self, panels: torch.Tensor, out_features: int, native) -> None:
        self.panels, self.out_features, self.native = panels, out_features, native


def _expert_linear(rows: torch.Tensor, w) -> torch.Tensor:
    """One expert's projection of its rows (`fused_moe_reference`'s `linear`): a oneDNN-packed
    weight, or one in panels for the native GEMM."""
    if isinstance(w, _PanelWeight):
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return w.native.linear(rows, w.panels, None, w.out_features)
    return packed_linear(rows, w)


class Experts(nn.Module):
    """The experts of a sparse block and their activation. Float checkpoints: the stacked
    weights `w13` [E, 2I, H] and `w2` [E, H, I] (oneDNN-packed per expert on CPU,
    `pack_for_cpu`). Quantized checkpoints (`quantize`): each expert's tensors go to a
    QuantLinear that unpacks them as they arrive; then either

    - "dequantize": the expert's float weight is copied into its slice of the stacked weights
      at once (one expert in flight, never a second copy of the model), or
    - "packed" (CUDA's default): GPTQ/AWQ/pack-quantized integer experts are packed into
      `PackedExperts` (kernels/fused_moe_w4a16.py) and stay at their bit width, run by the
      packed MoE kernel; FP8 experts stay as their e4m3 bytes and channel scales
      (`Fp8Experts`, kernels/fused_moe.py), run by the grouped GEMM decoding them (each with
      its torch reference elsewhere); block-FP8 experts (DeepSeek-V3's) as their bytes and
      block scales (`Fp8BlockExperts`), the same GEMM scaling each K tile's sums. MXFP4 experts (gpt-oss) stay as their E2M1 bytes and
      E8M0 block scales (`Mxfp4Experts`, kernels/fused_moe_mxfp4.py; `keep_mxfp4`,
      `take_mxfp4`), run by the MXFP4 MoE kernel.

    Non-gated experts (`gated=False`, Nemotron-H's): `w13` [E, I, H] holds the up rows alone and
    the activation applies to them; float checkpoints only for now. `bias` (gpt-oss): each
    expert has a bias per projection, `w13_bias` [E, 2I] and `w2_bias` [E, H]; `act` may be
    a `ClampedSwiGLU` (kernels/activation.py)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        act,
        use_kernels: bool,
        gated: bool = True,
        bias: bool = False,
    ):
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.gated = gated
        self.w13 = StackedWeight(num_experts, (2 if gated else 1) * inter, hidden)
        self.w2 = StackedWeight(num_experts, hidden, inter)
        self.w13_bias = StackedBias(num_experts, (2 if gated else 1) * inter) if bias else None
        self.w2_bias = StackedBias(num_experts, hidden) if bias else None
        self.act = check_activation(act)
        self.use_kernels = use_kernels
        self.packed: tuple[list, list] | None = None  # `pack_for_cpu`
        self.native_call: tuple | None = None  # `pack_for_cpu`: the experts in one native call
        self.scheme = None  # a quantized checkpoint's scheme (`quantize`)
        self.mode = "float"
        self.receivers: dict[tuple[str, int], QuantLinear] = {}
        self.forms: dict[str, dict[int, tuple]] = {"w13": {}, "w2": {}}
        self.quantized: set[str] = set()  # "packed": projections held as `<which>_*` buffers
        self.w2_groups: int | None = None  # see `quantize`

    def _shape(self, which: str) -> tuple[int, int]:
        rows = (2 if self.gated else 1) * self.inter
        return (rows, self.hidden) if which == "w13" else (self.hidden, self.inter)

    def quantize(self, scheme, mode: str, w2_groups: int | None = None) -> None:
        """Before materializing: the checkpoint's experts are quantized; `mode` as the model's
        other quantized linears ("packed": integer experts packed, FP8 experts kept as bytes).
        `w2_groups`: the down projections' group count when it exceeds their inputs' (a
        tensor-parallel rank of an act-order checkpoint keeps every group)."""
        if not self.gated:
            raise ValueError("quantized checkpoints of non-gated experts are not supported yet")
        if self.w13_bias is not None:
            raise ValueError("quantized checkpoints of experts with biases are not supported yet")
        self.scheme = scheme
        self.w2_groups = w2_groups
        self.mode = "packed" if mode == "packed" else "dequantize"
        if self.mode == "packed":  # no float storage for the experts at all
            del self.w13, self.w2

    def keep_mxfp4(self, scheme) -> None:
        """Before materializing: the checkpoint's experts are MXFP4 (gpt-oss) and stay so,
        `Mxfp4Experts` run by the MXFP4 MoE kernel (`take_mxfp4`); no float storage for them."""
        self.scheme, self.mode = scheme, "packed"
        del self.w13, self.w2

    def take_mxfp4(self, which: str, blocks, scales, place: str, device) -> None:
        """One projection's checkpoint `*_blocks` [E, N, K / 32, 16] and `*_scales` [E, N, K / 32]
        onto `device`; `place` "experts:interleaved": gate and up rows alternate in the
        checkpoint, ours are [gate | up] (rows are output channels: whole rows move)."""
        if place == "experts:interleaved":
            blocks = torch.cat([blocks[:, 0::2], blocks[:, 1::2]], dim=1)
            scales = torch.cat([scales[:, 0::2], scales[:, 1::2]], dim=1)
        elif place:
            raise QuantLoadError(f"MXFP4 experts stored as {place!r} are not supported")
        packed = Mxfp4Experts.from_checkpoint(blocks, scales)
        shape = (self.num_experts, *self._shape(which))
        have = (packed.num_experts, packed.out_features, packed.in_features)
        if have != shape:
            raise QuantLoadError(f"MXFP4 experts ({which}) are {have}, expected {shape}")
        self._hold(which, Mxfp4Experts(packed.blocks.to(device), packed.scales.to(device)))

    def take_quantized(self, which: str, how: str, kind: str, name: str, tensor) -> list[str]:
        """A quantized checkpoint tensor of an expert (`how`: "expert:<e>[:gate|up]");
        returns the load markers (as the loader records placements) once the expert is whole."""
        _, e, half = (how.split(":") + [""])[:3]
        e = int(e)
        rec = self.receivers.get((which, e))
        if rec is None:
            out, k = self._shape(which)
            parts = (out // 2, out // 2) if which == "w13" else (out,)
            mode = "forms" if self.mode == "packed" else "dequantize"
            groups = self.w2_groups if which == "w2" else None
            rec = QuantLinear(k, out, False, self.scheme, parts, mode, num_groups=groups)
            self.receivers[(which, e)] = rec
        rec.take(kind, {"gate": 0, "up": 1}.get(half, WHOLE), name, tensor)
        return self._flush(which, e)

    def _flush(self, which: str, e: int) -> list[str]:
        rec = self.receivers[(which, e)]
        if not rec.settled:
            return []
        del self.receivers[(which, e)]
        if self.mode == "packed":
            self.forms[which][e] = self._one_form(which, e, rec.forms)
            if len(self.forms[which]) == self.num_experts:
                forms = [self.forms[which].pop(i) for i in range(self.num_experts)]
                if self.scheme.method == "fp8" and self.scheme.block is not None:
                    weight = torch.stack([f[0] for f in forms]).view(torch.uint8)
                    scale = torch.stack([f[1] for f in forms])
                    block_k = self.scheme.block[1]
                    self._hold(which, Fp8BlockExperts(weight, scale, forms[0][2], block_k))
                elif self.scheme.method == "fp8":
                    weight = torch.stack([w for w, _ in forms]).view(torch.uint8)
                    self._hold(which, Fp8Experts(weight, torch.stack([s for _, s in forms])))
                else:
                    self._hold(which, pack_experts(forms, self.scheme.bits))
        else:
            stacked = getattr(self, which).weight
            stacked.data[e].copy_(rec.weight.reshape(stacked.shape[1:]))
        pname = f"{which}.weight"
        if which == "w13":
            return [f"{pname}#expert:{e}:gate", f"{pname}#expert:{e}:up"]
        return [f"{pname}#expert:{e}"]

    def _one_form(self, which: str, e: int, forms: list[tuple]) -> tuple:
        """An expert's parts (gate, up) as one form: FP8 (e4m3 weight, float32 channel scales)
        or integers, which must share their act-order."""
        kind = "fp8" if self.scheme.method == "fp8" else "int"
        if kind == "fp8" and all(f[0] == "fp8" for f in forms):
            return tuple(torch.cat([f[i] for f in forms]) for i in (1, 2))
        if kind == "fp8" and all(f[0] == "fp8_block" for f in forms):
            # (e4m3 weight, stacked block grids, grid row of each output row): gate and up
            # each keep their own blocks, as a fused QuantLinear's parts do
            rows = [forms[0][3]]
            if len(forms) > 1:
                rows.append(forms[1][3] + forms[0][2].shape[0])
            w, scale = (torch.cat([f[i] for f in forms]) for i in (1, 2))
            return w, scale, torch.cat(rows).to(torch.int32)
        if any(f[0] != kind for f in forms):
            raise QuantLoadError(
                f"expert {e} ({which}) is not stored as integers like the others: serve this "
                "checkpoint with QUANTIZED_WEIGHTS=dequantize (quantized_weights)"
            )
        if len(forms) > 1 and not torch.equal(forms[0][4], forms[1][4]):
            raise QuantLoadError(
                f"expert {e}: gate and up have different act-order (g_idx): serve this "
                "checkpoint with QUANTIZED_WEIGHTS=dequantize (quantized_weights)"
            )
        q, zeros, scales = (torch.cat([f[i] for f in forms]) for i in (1, 2, 3))
        return q, zeros, scales, forms[0][4]

    def settle_pending(self) -> tuple[list[str], list[str]]:
        """After the last tensor: (load markers of the experts that settle only now - GPTQ
        parts wait for their optional g_idx until the end -, what the experts still lack)."""
        marks, out = [], []
        for (which, e), rec in list(self.receivers.items()):
            out += rec.missing()
            if rec.settled:
                marks += self._flush(which, e)
        if self.mode == "packed":
            for which in ("w13", "w2"):
                if which not in self.quantized:
                    have = set(self.forms[which])
                    out += [f"expert {i} {which}" for i in range(self.num_experts) if i not in have]
        return marks, out

    def init_dummy(self, g: torch.Generator) -> None:
        """Random packed experts (LOAD_FORMAT=dummy) in the scheme's shape."""
        if self.mode != "packed":
            return
        if self.scheme.method == "mxfp4":  # any codes, block scales of 2^-6
            for which in ("w13", "w2"):
                out, k = self._shape(which)
                shape = (self.num_experts, out, k // 32, 16)
                blocks = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
                scales = torch.full(shape[:-1], 127 - 6, dtype=torch.uint8)
                device = self.w13_bias.weight.device if self.w13_bias is not None else None
                self.take_mxfp4(which, blocks, scales, "", device)
            return
        if self.scheme.method == "fp8":  # codes of magnitude up to ~1 (no NaN), small scales
            for which in ("w13", "w2"):
                out, k = self._shape(which)
                shape = (self.num_experts, out, k)
                codes = torch.randint(0, 0x3F, shape, generator=g, dtype=torch.uint8)
                codes |= torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7
                scale = torch.full((self.num_experts, out), 0.04, dtype=torch.float32)
                if self.scheme.block is not None:
                    bn, bk = self.scheme.block
                    grid = (self.num_experts, -(-out // bn), -(-k // bk))
                    rows = (torch.arange(out) // bn).to(torch.int32)
                    packed = Fp8BlockExperts(codes, torch.full(grid, 0.04), rows, bk)
                    self._hold(which, packed)
                    continue
                self._hold(which, Fp8Experts(codes, scale))
            return
        bits = self.scheme.bits
        group = self.scheme.group_size if self.scheme.group_size > 0 else None
        for which in ("w13", "w2"):
            out, k = self._shape(which)
            groups = -(-k // (group or k))
            forms = []
            for _ in range(self.num_experts):
                q = torch.randint(0, 1 << bits, (out, k), generator=g, dtype=torch.uint8)
                zeros = torch.full((out, groups), 1 << (bits - 1), dtype=torch.int32)
                scales = torch.full((out, groups), 0.04 / (1 << bits), dtype=torch.float16)
                forms.append((q, zeros, scales, torch.arange(k) // (group or k)))
            self._hold(which, pack_experts(forms, bits))

    _PACKED_FIELDS = ("qweight", "scales", "zeros", "g_idx", "perm")
    _FP8_FIELDS = ("weight", "scale")
    _FP8_BLOCK_FIELDS = ("weight", "scale", "row_block")
    _MXFP4_FIELDS = ("blocks", "scales")

    def _fields(self) -> tuple[str, ...]:
        if self.scheme.method == "mxfp4":
            return self._MXFP4_FIELDS
        if self.scheme.method == "fp8" and self.scheme.block is not None:
            return self._FP8_BLOCK_FIELDS
        return self._FP8_FIELDS if self.scheme.method == "fp8" else self._PACKED_FIELDS

    def _hold(
        self, which: str, packed: PackedExperts | Fp8Experts | Fp8BlockExperts | Mxfp4Experts
    ) -> None:
        """Keeps a projection's packed experts as buffers (model.to moves them; the memory
        counts see them)."""
        for field in self._fields():
            self.register_buffer(f"{which}_{field}", getattr(packed, field))
        self.quantized.add(which)

    def packed_experts(
        self, which: str
    ) -> PackedExperts | Fp8Experts | Fp8BlockExperts | Mxfp4Experts:
        fields = [getattr(self, f"{which}_{f}") for f in self._fields()]
        if self.scheme.method == "mxfp4":
            return Mxfp4Experts(*fields)
        if self.scheme.method == "fp8" and self.scheme.block is not None:
            return Fp8BlockExperts(*fields, self.scheme.block[1])
        if self.scheme.method == "fp8":
            return Fp8Experts(*fields)
        return PackedExperts(*fields, self.scheme.bits)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) must not round the packed experts' scales and zero points (float16
        # GPTQ scales in a bfloat16 model, FP8's float32 channel scales): they follow the
        # device only, as QuantLinear's do.
        keep = tuple(n for n in self._buffers if n.endswith(("_scales", "_zeros", "_scale")))
        return apply_keeping_dtype(self, fn, recurse, keep)

    def biases(self) -> tuple:
        """(b13, b2): the experts' bias tensors, or (None, None)."""
        if self.w13_bias is None:
            return None, None
        return self.w13_bias.weight, self.w2_bias.weight

    def forward(self, x, weights, ids):
        if self.quantized:
            w13, w2 = self.packed_experts("w13"), self.packed_experts("w2")
            if self.scheme.method == "mxfp4":
                fn = fused_moe_mxfp4 if self.use_kernels else fused_moe_mxfp4_reference
                return fn(x, w13, w2, weights, ids, self.act, *self.biases())
            if self.scheme.method == "fp8" and self.scheme.block is not None:
                # the grouped GEMM's K tile (64; 32 for float32) must divide the blocks
                kernel = self.use_kernels and self.scheme.block[1] % 64 == 0
                fn = fused_moe_fp8_block if kernel else fused_moe_fp8_block_reference
            elif self.scheme.method == "fp8":
                fn = fused_moe_fp8 if self.use_kernels else fused_moe_fp8_reference
            else:
                fn = fused_moe_w4a16 if self.use_kernels else fused_moe_w4a16_reference
            return fn(x, w13, w2, weights, ids, self.act)
        if self.native_call is not None and x.dtype == torch.float32 and x.dim() == 2:
            native, w13, w2, code = self.native_call
            if x.stride(-1) != 1:
                x = x.contiguous()
            return native.moe_experts(x, ids, weights, w13, w2, code, self.gated)
        if self.packed is not None:
            w13, w2 = self.packed
            return experts_forward(
                x, w13, w2, weights, ids, self.act, False, _expert_linear, self.gated,
                *self.biases(),
            )  # fmt: skip
        w13, w2 = self.w13.weight, self.w2.weight
        return experts_forward(
            x, w13, w2, weights, ids, self.act, self.use_kernels, F.linear, self.gated,
            *self.biases(),
        )  # fmt: skip

    def pack_for_cpu(self, native=None) -> None:
        """Each expert's matrices packed in place of the stacked float32 weights (the CPU path;
        the Triton path keeps the stacked tensors), one projection at a time, so the peak holds
        one projection twice, not the layer: for oneDNN (measured 10x faster than F.linear on
        expert slices at 4 rows per expert), or, with the native kernels (`native`, float32),
        in the native GEMM's panels instead, written over the stacked weights' own memory
        (`pack_panels_in_place`: one expert's projection held twice at a time).
        An expert's rows of a decode step are few (32 requests, top 2 of 8: ~8), where the
        AVX-512 panels took ~0.7-0.8x oneDNN's time with the weights streamed from memory,
        and as much at 128-1,000 rows (a prefill's share); at one row (one request) ~1.2x."""
        if self.quantized or not hasattr(self, "w13"):
            return
        native = native if native is not None and self.w13.weight.dtype == torch.float32 else None
        packed = []
        for name in ("w13", "w2"):
            ws = getattr(self, name).weight
            if native is not None:
                packed.append(
                    [_PanelWeight(pack_panels_in_place(w), w.shape[0], native) for w in ws]
                )
            else:
                packed.append([pack_weight(w) for w in ws])
            delattr(self, name)
        self.packed = (packed[0], packed[1])
        # In panels, with no biases and an activation of the native kernel's: the whole
        # block's experts in one native call (grouping, GEMMs, activation, weighted sum).
        code = ACT_CODES.get(self.act) if isinstance(self.act, str) else None
        if native is not None and self.w13_bias is None and code is not None and code <= 3:
            self.native_call = (
                native,
                PanelPointers([w.panels for w in packed[0]]),
                PanelPointers([w.panels for w in packed[1]]),
                code,
            )

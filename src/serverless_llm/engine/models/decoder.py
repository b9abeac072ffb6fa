"""One decoder for every dense family, built from a `DecoderSpec`.

A family (families.py) is a function from its transformers config to a `DecoderSpec`: the
norm kind, the positions (rope full or partial in either layout, learned, ALiBi, none on some
layers), the attention options (q/k norm, biases, soft-cap, windows, scale), the MLP kind, the
residual shape and the multipliers, plus the names its checkpoint gives each weight
(`WeightNames`). This module turns that description into modules and runs them on the step's
flat ragged batch: `input_ids` and `positions` are [T], and attention reads the paged cache
through `meta`.

Inside, every family has the same parameter names: Q/K/V are one fused `qkv_proj` ([q | k | v]
rows) and a gated MLP's gate and up one `gate_up_proj` ([gate | up]), so one matmul serves each;
the loader puts each checkpoint tensor into its place (`load_weights`).

The residual stream travels as the pair (x, residual): the last sublayer's output, not yet
added, and the stream before it. A norm with `residual` adds the two and normalises in one
kernel; `residual is None` means the stream is x itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.activation import Activation, check_activation, gated_activation
from ..layers.attention import AttentionBackend, AttentionMetadata, AttentionSpec
from ..layers.linear import PackedLinear, pack_linears_for_cpu
from ..layers.lora import LoRALinear, LoRAStep
from ..layers.moe import ROUTINGS, Experts, route
from ..layers.norm import LayerNorm, RMSNorm
from ..layers.quant_linear import WHOLE, QuantLinear, QuantLoadError
from ..layers.rotary import RotaryStep, apply_rotary, rope_table, rotary_step, rotate_gathered

# -- the description ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NormSpec:
    kind: str = "rms"  # "rms" | "layer"
    eps: float = 1e-6
    weight: bool = True
    bias: bool = False  # LayerNorm only


@dataclass(frozen=True)
class RopeSpec:
    """One rope table: its settings (rope_parameters as transformers normalises them), how many
    of a head's dims it rotates, and the layout (neox: halves; gpt-j: interleaved pairs)."""

    params: tuple  # sorted (key, value) items, lists as tuples, so specs compare and hash
    rot_dim: int
    is_neox: bool = True

    @staticmethod
    def of(params: dict, rot_dim: int, is_neox: bool = True) -> RopeSpec:
        items = tuple(
            sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items())
        )
        return RopeSpec(items, rot_dim, is_neox)

    def params_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.params}


@dataclass(frozen=True)
class MoESpec:
    """A sparse MLP block: `top_k` of `num_experts` gated MLPs of width `intermediate_size` per
    token, chosen by a bias-free router (`route` in layers/moe.py says what `routing`,
    `renormalize` (True, or the p of a p-norm) and `jitter_eps` (sparsemixer's threshold) mean),
    plus an optional shared expert of width `shared_size` that every token goes through, scaled
    by sigmoid(a one-output gate) when `shared_gate` (Qwen2-MoE)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    routing: str = "softmax_topk"
    renormalize: bool | float = False
    jitter_eps: float = 0.0
    shared_size: int = 0
    shared_gate: bool = False

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown MoE routing {self.routing!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} with {self.num_experts} experts")


def expert_names(prefix: str, num_experts: int, gate: str, up: str, down: str) -> dict:
    """WeightNames.layer entries for per-expert checkpoint tensors (`prefix`.e.`gate` ...): each
    expert's gate and up fill its rows of the stacked [gate | up] weight, its down its slice of
    the stacked down weight."""
    names = {}
    for e in range(num_experts):
        names[f"{prefix}.{e}.{gate}"] = ("mlp.experts.w13", f"expert:{e}:gate")
        names[f"{prefix}.{e}.{up}"] = ("mlp.experts.w13", f"expert:{e}:up")
        names[f"{prefix}.{e}.{down}"] = ("mlp.experts.w2", f"expert:{e}")
    return names


@dataclass
class WeightNames:
    """Where each checkpoint tensor goes. `layer` maps a module path inside decoder layer i
    (under `layers_prefix`.i.) to an internal module path, or to (internal path, how); `top`
    does the same for modules outside the layers. `how` is one of:

    - "q", "k", "v": that part of the fused qkv_proj; "gate", "up": that half of gate_up_proj;
    - "qkv_heads": a fused qkv stored per head as [heads, 3, head_dim] rows (GPT-NeoX, Bloom);
    - "qkv_grouped": [kv_heads, group + 2, head_dim] rows (Falcon's new decoder);
    - "t": a GPT-2 Conv1D weight, stored [in, out];
    - "head:<h>": the row h of a per-head norm weight [heads, head_dim] (StableLM);
    - "expert:<e>", "expert:<e>:gate", "expert:<e>:up": expert e's matrix of a stacked MoE
      weight [experts, out, in], or the gate or up half of its rows (`expert_names`);
    - "experts:gate", "experts:up": every expert's gate (or up) matrix in one 2-D tensor
      [experts * out, in], into that half of each expert's rows of the stacked w13 (DBRX);
    - "experts:t": every expert's down matrix stored transposed in one 2-D tensor
      [experts * in, out], into the stacked w2 [experts, out, in] (DBRX).

    A checkpoint tensor that is a bare parameter rather than a module's weight or bias (DBRX's
    `ffn.experts.mlp.w1`) is looked up in `layer` by its full path and fills the target
    module's weight.

    Tensors whose name contains one of `ignore` are buffers a checkpoint may carry (rotary
    tables, causal masks) and are skipped. A checkpoint saved from the bare base model (GPT-2's
    and OPT's own) names its tensors without the head model's prefix: a name that starts
    neither with `base_prefix` nor with one of `top`'s is read with `base_prefix` before it."""

    layers_prefix: str
    layer: dict
    top: dict
    ignore: tuple[str, ...] = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
    base_prefix: str = ""


@dataclass
class DecoderSpec:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    names: WeightNames
    norm: NormSpec = field(default_factory=NormSpec)
    # Which norms a layer has: "in" (before attention), "post_attn" (on the attention output),
    # "mlp" (before the MLP), "post_mlp" (on the MLP output).
    layer_norms: tuple[str, ...] = ("in", "mlp")
    final_norm: bool = True
    norm_weight_offset: float = 0.0  # Gemma stores norm weights as w - 1
    parallel: bool = False  # attention and MLP both read the layer's input stream
    post_ln: bool = False  # norms after each residual add (OPT-350m), not before the sublayer
    # attention
    qkv_bias: bool = False
    o_bias: bool = False
    # "rms_head" (RMSNorm over head_dim, shared by the heads) | "rms_full" (over all heads) |
    # "layer_head" (LayerNorm, a weight per head) | "layer_head_shared" (LayerNorm with weight
    # and bias over head_dim, shared by the heads: Phi)
    qk_norm: str | None = None
    qk_norm_eps: float | None = None  # default: norm.eps
    scale: float | None = None  # default: head_dim ** -0.5
    attn_softcap: float | None = None
    windows: tuple[int | None, ...] | None = None  # per layer; None: no sliding window
    clip_qkv: float | None = None
    clip_after_norm: bool = False  # OLMoE clips q and k after their norms, not before
    alibi_scale: float | None = None  # ALiBi, slopes times this (Falcon scales them by `scale`)
    alibi_bias_max: float = 8.0  # the slopes' geometric sequence ends at 2 ** -this (MPT's)
    # positions
    rope: tuple[RopeSpec | None, ...] | None = None  # per layer; None everywhere: no rope
    learned_positions: int = 0  # table size of learned absolute positions (GPT-2, OPT)
    position_offset: int = 0  # OPT's table starts at 2
    # MLP
    moe: MoESpec | None = None
    moe_layers: tuple[bool, ...] | None = None  # per layer, with `moe`: sparse (else dense MLP)
    gated: bool = True
    act: str = "silu"
    mlp_bias: bool = False
    # embeddings and head
    embed_scale: float | None = None  # Gemma: sqrt(hidden), rounded to the model dtype
    embed_norm: bool = False  # Bloom: a LayerNorm right after the embedding
    project_dim: int | None = None  # OPT: embeddings narrower than the model
    residual_scale: float = 1.0  # Granite: each sublayer's output scaled before the add
    logit_scale: float = 1.0  # Cohere multiplies the logits; Granite divides
    final_softcap: float | None = None
    tied: bool = False
    lm_head_bias: bool = False

    def __post_init__(self):
        check_activation(self.act)
        n = self.num_layers
        if self.windows is None:
            self.windows = (None,) * n
        if self.rope is None:
            self.rope = (None,) * n
        if self.moe_layers is None:
            self.moe_layers = (self.moe is not None,) * n
        if len(self.moe_layers) != n:
            raise ValueError(f"{self.arch}: per-layer settings for {n} layers expected")
        if len(self.windows) != n or len(self.rope) != n:
            raise ValueError(f"{self.arch}: per-layer settings for {n} layers expected")


# -- modules -----------------------------------------------------------------------------------


def make_norm(spec: NormSpec, size: int, use_kernels: bool) -> nn.Module:
    if spec.kind == "rms":
        return RMSNorm(size, spec.eps, use_kernels)
    return LayerNorm(size, spec.eps, spec.weight, spec.bias, use_kernels)


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


def alibi_slopes(num_heads: int, bias_max: float = 8.0) -> torch.Tensor:
    """The ALiBi slopes of Press et al., in MPT's general form: over n2, the power of two at or
    above num_heads, 2 ** (-bias_max * i / n2) for i = 1..n2; past a power of two the even i
    first, then the odd ones, the first num_heads of them. With bias_max 8 these are Bloom's and
    Falcon's slopes (a sequence from the power of two below, interleaved past it)."""
    n2 = 2 ** math.ceil(math.log2(num_heads))
    slopes = [2.0 ** (-bias_max * (i + 1) / n2) for i in range(n2)]
    if n2 != num_heads:
        slopes = (slopes[1::2] + slopes[::2])[:num_heads]
    return torch.tensor(slopes, dtype=torch.float32)


class Attention(nn.Module):
    def __init__(self, s: DecoderSpec, attn: AttentionSpec, backend: AttentionBackend, rope):
        super().__init__()
        self.spec = attn
        self.backend = backend
        self.rope = rope  # the RopeSpec of this layer, or None
        h, kvh, d = s.num_heads, s.num_kv_heads, s.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.q_size, self.kv_size = h * d, kvh * d
        self.qkv_proj = nn.Linear(s.hidden_size, self.q_size + 2 * self.kv_size, bias=s.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, s.hidden_size, bias=s.o_bias)
        self.clip_qkv = s.clip_qkv
        self.clip_after_norm = s.clip_after_norm and s.clip_qkv is not None
        self.qk_norm = s.qk_norm
        eps = s.qk_norm_eps if s.qk_norm_eps is not None else s.norm.eps
        if s.qk_norm == "rms_head":
            self.q_norm = RMSNorm(d, eps, backend.use_kernels)
            self.k_norm = RMSNorm(d, eps, backend.use_kernels)
        elif s.qk_norm == "rms_full":
            self.q_norm = RMSNorm(self.q_size, eps, backend.use_kernels)
            self.k_norm = RMSNorm(self.kv_size, eps, backend.use_kernels)
        elif s.qk_norm == "layer_head":
            self.q_norm = HeadLayerNorm(h, d, eps)
            self.k_norm = HeadLayerNorm(kvh, d, eps)
        elif s.qk_norm == "layer_head_shared":
            self.q_norm = LayerNorm(d, eps, use_kernels=backend.use_kernels)
            self.k_norm = LayerNorm(d, eps, use_kernels=backend.use_kernels)
        elif s.qk_norm is not None:
            raise ValueError(f"unknown q/k norm {s.qk_norm!r}")

    def forward(self, x, rope: RotaryStep | None, kv_cache, meta: AttentionMetadata):
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.clip_qkv is not None and not self.clip_after_norm:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        if rope is not None and rope.cos is not None and self.qk_norm is None:
            # The torch path of a full-width neox rotation: q and k are neighbours in the fused
            # projection, so one rotation covers both heads' sets (half the ops of two).
            qk = qkv[:, : self.q_size + self.kv_size].view(T, -1, self.head_dim)
            q, k = rotate_gathered(qk, rope).split([self.num_heads, self.num_kv_heads], dim=1)
            v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
            return self.o_proj(self.backend.forward(q, k, v, kv_cache, meta, self.spec))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "rms_full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_after_norm:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm in ("rms_head", "layer_head_shared"):
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        elif self.qk_norm == "layer_head":
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, k, rope, self.rope.is_neox)
        return self.o_proj(self.backend.forward(q, k, v, kv_cache, meta, self.spec))


class MLP(nn.Module):
    def __init__(self, s: DecoderSpec, use_kernels: bool, intermediate_size: int | None = None):
        super().__init__()
        self.gated = s.gated
        inter = intermediate_size or s.intermediate_size
        if s.gated:
            self.gate_up_proj = nn.Linear(s.hidden_size, 2 * inter, bias=s.mlp_bias)
            self.act_fn = gated_activation(s.act, use_kernels)
        else:
            self.up_proj = nn.Linear(s.hidden_size, inter, bias=s.mlp_bias)
            self.act_fn = Activation(s.act, use_kernels)
        self.down_proj = nn.Linear(inter, s.hidden_size, bias=s.mlp_bias)

    def forward(self, x):
        up = self.gate_up_proj(x) if self.gated else self.up_proj(x)
        return self.down_proj(self.act_fn(up))


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP: router, experts, and the shared expert when the family has one."""

    def __init__(self, s: DecoderSpec, use_kernels: bool):
        super().__init__()
        m = self.moe = s.moe
        self.gate = nn.Linear(s.hidden_size, m.num_experts, bias=False)
        self.experts = Experts(
            m.num_experts, s.hidden_size, m.intermediate_size, s.act, use_kernels
        )
        self.shared_expert = MLP(s, use_kernels, m.shared_size) if m.shared_size else None
        self.shared_expert_gate = nn.Linear(s.hidden_size, 1, bias=False) if m.shared_gate else None

    def forward(self, x):
        m = self.moe
        weights, ids = route(self.gate(x), m.top_k, m.routing, m.renormalize, m.jitter_eps)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


def _add_norm(norm, x, residual):
    """(norm(stream), stream) where stream = x + residual (or x when residual is None)."""
    if residual is None:
        return (norm(x) if norm is not None else x), x
    if norm is not None:
        return norm(x, residual)
    stream = x + residual
    return stream, stream


class DecoderLayer(nn.Module):
    def __init__(
        self, s: DecoderSpec, attn: AttentionSpec, backend: AttentionBackend, rope, sparse=False
    ):
        super().__init__()
        uk = backend.use_kernels
        self.self_attn = Attention(s, attn, backend, rope)
        self.mlp = SparseMoE(s, uk) if sparse else MLP(s, uk)
        for slot in ("in", "post_attn", "mlp", "post_mlp"):
            norm = make_norm(s.norm, s.hidden_size, uk) if slot in s.layer_norms else None
            setattr(self, f"{slot}_norm", norm)
        self.parallel = s.parallel
        self.post_ln = s.post_ln
        self.residual_scale = s.residual_scale

    def forward(self, x, residual, rope, kv_cache, meta):
        if self.post_ln:  # OPT-350m: stream = norm(stream + sublayer(stream))
            stream = x if residual is None else x + residual
            h = self.self_attn(stream, rope, kv_cache, meta)
            stream, _ = self.in_norm(h, stream)
            stream, _ = self.mlp_norm(self.mlp(stream), stream)
            return stream, None
        h, residual = _add_norm(self.in_norm, x, residual)
        if self.parallel:
            # GPT-J, Phi, Cohere: one norm feeds both; GPT-NeoX, Falcon's new decoder: two.
            m = self.mlp(self.mlp_norm(residual) if self.mlp_norm is not None else h)
            return self.self_attn(h, rope, kv_cache, meta) + m, residual
        h = self.self_attn(h, rope, kv_cache, meta)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        if self.residual_scale != 1.0:
            h = h * self.residual_scale
        h, residual = _add_norm(self.mlp_norm, h, residual)
        h = self.mlp(h)
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        if self.residual_scale != 1.0:
            h = h * self.residual_scale
        return h, residual


class DecoderModel(nn.Module):
    """A causal LM of any described family. Built on the meta device by the model builder,
    then `materialize`d and loaded."""

    def __init__(self, spec: DecoderSpec, config, backend: AttentionBackend, max_position: int):
        super().__init__()
        self.spec = spec
        self.config = config
        self.max_position = max_position
        self.use_kernels = backend.use_kernels
        s = spec
        self.num_layers = s.num_layers
        self.num_kv_heads = s.num_kv_heads
        self.head_dim = s.head_dim
        embed_dim = s.project_dim or s.hidden_size
        self.embed_tokens = nn.Embedding(s.vocab_size, embed_dim)
        self.project_in = nn.Linear(embed_dim, s.hidden_size, bias=False) if s.project_dim else None
        self.embed_positions = (
            nn.Embedding(s.learned_positions, s.hidden_size) if s.learned_positions else None
        )
        uk = backend.use_kernels
        self.embed_norm = make_norm(s.norm, s.hidden_size, uk) if s.embed_norm else None
        # The rope tables: one per distinct RopeSpec (Gemma 3: local and global), computed by
        # `materialize` from the config, never read from the checkpoint.
        self.rope_specs: list[RopeSpec] = sorted(
            {r for r in s.rope if r is not None}, key=lambda r: repr(r)
        )
        self.rope_of_layer = [None if r is None else self.rope_specs.index(r) for r in s.rope]
        self.rope_caches: list[torch.Tensor] = []
        self.layers = nn.ModuleList(
            DecoderLayer(s, self._attention_spec(i), backend, s.rope[i], s.moe_layers[i])
            for i in range(s.num_layers)
        )
        self.norm = make_norm(s.norm, s.hidden_size, uk) if s.final_norm else None
        self.project_out = (
            nn.Linear(s.hidden_size, embed_dim, bias=False) if s.project_dim else None
        )
        self.tied = s.tied
        if not self.tied:
            self.lm_head = nn.Linear(embed_dim, s.vocab_size, bias=s.lm_head_bias)
        elif s.lm_head_bias:
            self.lm_head_bias = nn.Parameter(torch.zeros(s.vocab_size))
        self.packed_lm_head = None
        self.quantization = "none"  # for the start-up line; `quantize` says which

    def _attention_spec(self, i: int, slopes: torch.Tensor | None = None) -> AttentionSpec:
        s = self.spec
        return AttentionSpec(
            num_heads=s.num_heads,
            num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            scale=s.scale if s.scale is not None else s.head_dim**-0.5,
            sliding_window=s.windows[i],
            logit_softcap=s.attn_softcap,
            alibi_slopes=slopes,
        )

    def materialize(self, device: torch.device) -> DecoderModel:
        """Storage on `device` for a model built on the meta device: the weights uninitialised
        (`load_weights` or `init_dummy_weights` fills them), the rope tables and ALiBi slopes
        computed."""
        self.to_empty(device=device)
        orig_max = getattr(self.config, "max_position_embeddings", None) or self.max_position
        self.rope_caches = [
            rope_table(r.params_dict(), r.rot_dim, self.max_position, orig_max).to(device)
            for r in self.rope_specs
        ]
        if self.spec.alibi_scale is not None:
            slopes = alibi_slopes(self.spec.num_heads, self.spec.alibi_bias_max)
            slopes = (slopes * self.spec.alibi_scale).to(device)
            for i, layer in enumerate(self.layers):
                layer.self_attn.spec = self._attention_spec(i, slopes)
        return self

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tied else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states of every token, after the final norm: [T, hidden]."""
        s = self.spec
        x = self.embed_tokens(input_ids)
        if s.embed_scale is not None:
            x = x * torch.tensor(s.embed_scale, dtype=x.dtype)
        if self.project_in is not None:
            x = self.project_in(x)
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions + s.position_offset)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        steps = [
            rotary_step(
                cache,
                positions,
                x.dtype,
                self.use_kernels,
                gather=r.is_neox and r.rot_dim == s.head_dim,
            )
            for cache, r in zip(self.rope_caches, self.rope_specs)
        ]
        residual = None
        for layer, cache, r in zip(self.layers, kv_caches, self.rope_of_layer):
            x, residual = layer(x, residual, None if r is None else steps[r], cache, meta)
        x, _ = _add_norm(self.norm, x, residual)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if self.packed_lm_head is not None:
            logits = self.packed_lm_head(hidden)
        elif self.tied:
            logits = F.linear(hidden, self.embed_tokens.weight, getattr(self, "lm_head_bias", None))
        else:
            logits = self.lm_head(hidden)
        if s.logit_scale != 1.0:
            logits = logits * s.logit_scale
        if s.final_softcap is not None:
            logits = torch.tanh(logits / s.final_softcap) * s.final_softcap
        return logits

    def optimize_for_cpu(self) -> None:
        """Packs the linear layers for oneDNN (after weights are loaded, float32 only)."""
        if self.embed_tokens.weight.dtype != torch.float32 or not pack_linears_for_cpu(self):
            return
        for m in self.modules():
            if isinstance(m, Experts) and not m.use_kernels:
                m.pack_for_cpu()
        if self.tied:  # the embedding itself stays plain for the lookup
            bias = getattr(self, "lm_head_bias", None)
            self.packed_lm_head = PackedLinear(None, self.embed_tokens.weight)
            self.packed_lm_head.bias = None if bias is None else bias.detach()
        else:
            self.packed_lm_head = self.lm_head

    # -- LoRA ----------------------------------------------------------------------------------

    LORA_TARGETS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.up_proj",
                    "mlp.down_proj")  # fmt: skip

    def enable_lora(
        self, max_loras: int, max_rank: int, dtype: torch.dtype
    ) -> tuple[LoRAStep, dict[str, LoRALinear]]:
        """Wraps every attention and dense-MLP projection of the decoder layers in a LoRALinear
        with `max_loras` empty slots (after loading; the CPU packing may come before or after).
        Returns the step object the runner fills and the wrapped layers by internal path."""
        s = self.spec
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        device = self.embed_tokens.weight.device
        step = LoRAStep(
            num_slots=max_loras, masked=device.type == "cpu", use_kernels=self.use_kernels
        )
        layers: dict[str, LoRALinear] = {}
        for i, layer in enumerate(self.layers):
            for path in self.LORA_TARGETS:
                parent_name, _, name = path.rpartition(".")
                parent = layer.get_submodule(parent_name)
                child = getattr(parent, name, None)
                if child is None or isinstance(parent, SparseMoE):
                    continue
                out = child.out_features
                if name == "qkv_proj":
                    parts = [(0, q), (q, kv), (q + kv, kv)]
                elif name == "gate_up_proj":
                    parts = [(0, out // 2), (out // 2, out // 2)]
                else:
                    parts = [(0, out)]
                wrapped = LoRALinear(
                    child, child.in_features, parts, max_loras, max_rank, dtype, device, step
                )
                setattr(parent, name, wrapped)
                layers[f"layers.{i}.{path}"] = wrapped
        self.lora_layers = layers
        return step, layers

    def lora_target(self, module: str) -> tuple[str, int | None, int, int]:
        """Where an adapter's module (the checkpoint's name, e.g. model.layers.3.self_attn.q_proj)
        lands: (internal layer path, part index or None for the whole output, in features, out
        rows); KeyError saying why for a module adapters cannot target."""
        names = self.spec.names
        prefix = names.layers_prefix + "."
        if not module.startswith(prefix):
            raise KeyError("only the decoder layers' attention and MLP projections take adapters")
        idx, _, local = module[len(prefix) :].partition(".")
        target = names.layer.get(local)
        if target is None or not idx.isdigit():
            raise KeyError(f"no such module in {self.spec.arch}")
        internal, how = (target, None) if isinstance(target, str) else target
        layer = getattr(self, "lora_layers", {}).get(f"layers.{idx}.{internal}")
        if layer is None:
            raise KeyError(
                "not a layer adapters can target here (attention and dense MLP projections)"
            )
        if how in self._SHARDS:
            part = self._SHARDS[how]
            out_rows = layer.parts[part][1]
        elif how is None:
            part, out_rows = None, layer.lora_b.shape[0]
        else:
            raise KeyError(f"its weight is stored as {how!r}, which adapters cannot target")
        return f"layers.{idx}.{internal}", part, layer.lora_a.shape[2], out_rows

    # -- weights -------------------------------------------------------------------------------

    def quantize(self, scheme, mode: str) -> None:
        """Swaps every linear of the decoder layers for a QuantLinear of `scheme` (before
        `materialize`): a fused qkv_proj or gate_up_proj knows its parts' sizes, so the
        checkpoint's separate q/k/v or gate/up tensors each fill theirs."""
        s = self.spec
        group = "" if scheme.group_size == -1 else f" group {scheme.group_size}"
        act = " act-order" if scheme.desc_act else ""
        self.quantization = f"{scheme.method} {scheme.bits}-bit{group}{act}, {mode}"
        if s.moe is not None and (mode != "packed" or scheme.method == "fp8"):
            self.quantization += " (experts dequantized)"
        kv = s.num_kv_heads * s.head_dim
        parts_of = {"qkv_proj": (s.num_heads * s.head_dim, kv, kv), "gate_up_proj": None}
        for layer in self.layers:
            for parent in layer.modules():
                if isinstance(parent, Experts):
                    parent.quantize(scheme, mode)
                for name, child in list(parent.named_children()):
                    if type(child) is not nn.Linear:
                        continue
                    if isinstance(parent, SparseMoE) and name in ("gate", "shared_expert_gate"):
                        continue  # routers: quantizers leave them in float
                    parts = parts_of.get(name, (child.out_features,))
                    if parts is None:
                        parts = (child.out_features // 2,) * 2
                    quant = QuantLinear(
                        child.in_features,
                        child.out_features,
                        child.bias is not None,
                        scheme,
                        parts,
                        mode,
                        self.use_kernels,
                    )
                    setattr(parent, name, quant)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies each checkpoint tensor into its place (see `WeightNames`); raises KeyError for
        a tensor with no place and for parameters the checkpoint leaves unset."""
        names = self.spec.names
        params = dict(self.named_parameters())
        quant = {n: m for n, m in self.named_modules() if isinstance(m, QuantLinear)}
        quant_experts = {
            f"{n}.{which}": (m, which)
            for n, m in self.named_modules()
            if isinstance(m, Experts) and m.scheme is not None
            for which in ("w13", "w2")
        }
        loaded: set[str] = set()
        layer_prefix = names.layers_prefix + "."
        kv_scales: dict[int, dict[str, float]] = {}
        for name, tensor in weights:
            if any(part in name for part in names.ignore):
                continue
            module, _, kind = name.rpartition(".")
            if kind in ("k_scale", "v_scale", "kv_scale") and module.startswith(layer_prefix):
                self._take_kv_scale(kv_scales, module[len(layer_prefix) :], kind, name, tensor)
                continue
            if module == "lm_head" and self.tied:  # a tied checkpoint may still save the head
                if kind == "bias" and "lm_head_bias" in params:
                    self._place(params["lm_head_bias"], "lm_head_bias", None, tensor, loaded)
                continue
            if names.base_prefix and not module.startswith(names.base_prefix):
                if not any(module == t or module.startswith(t + ".") for t in names.top):
                    module = names.base_prefix + module
            if module.startswith(layer_prefix):
                idx, _, local = module[len(layer_prefix) :].partition(".")
                target = names.layer.get(local)
                if target is None and f"{local}.{kind}" in names.layer:  # a bare parameter
                    target, kind = names.layer[f"{local}.{kind}"], "weight"
                prefix = f"layers.{idx}."
            else:
                target = names.top.get(module)
                prefix = ""
            if target is None:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {self.spec.arch}")
            internal, how = (target, None) if isinstance(target, str) else target
            pname = f"{prefix}{internal}.{kind}"
            experts = quant_experts.get(f"{prefix}{internal}")
            if experts is not None and (kind != "weight" or tensor.dtype == torch.float8_e4m3fn):
                if kind == "bias":  # GPTQ's zero bias for every quantized linear
                    if not bool((tensor == 0).all()):
                        raise QuantLoadError(f"checkpoint tensor {name!r}: an expert has no bias")
                    continue
                module, which = experts
                marks = module.take_quantized(which, how, kind, name, tensor)
                loaded.update(f"{prefix}{internal.rpartition('.')[0]}.{m}" for m in marks)
                continue
            if f"{prefix}{internal}" in quant and kind != "bias":
                self._take_quantized(quant[f"{prefix}{internal}"], name, kind, how, tensor)
                continue
            if pname not in params:
                if kind == "bias" and f"{prefix}{internal}" in quant:
                    # GPTQ writers save a bias for every quantized linear, zeros where the
                    # model has none.
                    if not bool((tensor == 0).all()):
                        raise QuantLoadError(
                            f"checkpoint tensor {name!r} is a non-zero bias for a linear that "
                            f"has none in {self.spec.arch}"
                        )
                    continue
                raise KeyError(f"checkpoint tensor {name!r} maps to unknown parameter {pname!r}")
            self._place(params[pname], pname, how, tensor, loaded)
        late: list[str] = []
        for path in sorted({p.rpartition(".")[0] for p in quant_experts}):
            marks, lack = quant_experts[f"{path}.w13"][0].settle_pending()
            loaded.update(f"{path}.{m}" for m in marks)
            late += lack
        missing = [p for p, t in params.items() if not self._complete(p, t, loaded)]
        for mname, m in quant.items():
            missing += [f"{mname}: {what}" for what in m.missing()]
        missing += late
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        for i, scales in kv_scales.items():
            attn = self.layers[i].self_attn
            attn.spec = dataclasses.replace(attn.spec, **scales)
        if quant and not any(m.packed is not None or m.took_quantized for m in quant.values()):
            scheme = next(iter(quant.values())).scheme
            raise QuantLoadError(
                f"the config says {scheme.method}, but no linear of the checkpoint is quantized "
                "(no qweight tensors): a config from the quantized repo with unquantized weights?"
            )
        self._settle_quantized()

    def _take_kv_scale(self, scales: dict, local: str, kind: str, name: str, tensor) -> None:
        """A layer's KV cache scale (FP8 checkpoints made with a quantized KV cache write
        `self_attn.k_scale` and `v_scale`, older ones one `kv_scale`): what an 8-bit float cache
        divides K or V by. Read whatever the cache dtype; used only by an 8-bit cache."""
        idx = local.partition(".")[0]
        if not idx.isdigit() or int(idx) >= len(self.layers) or tensor.numel() != 1:
            raise KeyError(f"checkpoint tensor {name!r} has no place in {self.spec.arch}")
        value = float(tensor.float().reshape(()))
        if not math.isfinite(value) or value <= 0:
            raise KeyError(f"checkpoint tensor {name!r} is {value}: a KV scale must be > 0")
        names = ("k_scale", "v_scale") if kind == "kv_scale" else (kind,)
        scales.setdefault(int(idx), {}).update(dict.fromkeys(names, value))

    def _take_quantized(self, module: QuantLinear, name, kind, how, tensor) -> None:
        if how in self._SHARDS:
            module.take(kind, self._SHARDS[how], name, tensor)
        elif how in ("qkv_heads", "qkv_grouped"):
            module.take(kind, WHOLE, name, tensor, rows=lambda t: self._reorder_rows(how, t))
        elif how is None:
            module.take(kind, WHOLE, name, tensor)
        else:
            raise QuantLoadError(
                f"checkpoint tensor {name!r}: quantized {self.spec.arch} checkpoints are not "
                f"supported (its weights are stored as {how!r})"
            )

    def _settle_quantized(self) -> None:
        """QuantLinears settle on the CPU, where the checkpoint is read: each moves to the
        model's device, and a "dequantize" one becomes a plain nn.Linear (which the CPU packing
        then serves)."""
        device = self.embed_tokens.weight.device
        for parent in list(self.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, QuantLinear):
                    child.to(device)
                    if child.weight is not None:
                        setattr(parent, name, child.to_linear())

    @staticmethod
    def _complete(pname: str, param: torch.Tensor, loaded: set[str]) -> bool:
        """Whether the checkpoint filled `pname`: whole, or every one of its parts (the three
        of a qkv_proj, the two of a gate_up_proj, each head of a per-head norm)."""
        if pname in loaded:
            return True
        parts = sum(1 for name in loaded if name.startswith(pname + "#"))
        target = pname.rsplit(".", 2)[-2]
        # per-head norms: a part per row; stacked experts: one per expert (two with gate | up)
        need = {"qkv_proj": 3, "gate_up_proj": 2, "w13": 2 * param.shape[0]}.get(
            target, param.shape[0]
        )
        return parts > 0 and parts == need

    _SHARDS = {"q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}

    def _place(self, param, pname, how, tensor, loaded: set[str]) -> None:
        s = self.spec
        data = param.data
        if how in self._SHARDS:
            i = self._SHARDS[how]
            if how in ("q", "k", "v"):
                sizes = [s.num_heads * s.head_dim] + [s.num_kv_heads * s.head_dim] * 2
            else:
                sizes = [data.shape[0] // 2] * 2
            data.narrow(0, sum(sizes[:i]), sizes[i]).copy_(tensor)
            loaded.add(f"{pname}#{i}")
            return
        if how == "t":
            tensor = tensor.t()
        elif how in ("qkv_heads", "qkv_grouped"):
            tensor = self._reorder_rows(how, tensor)
        elif how is not None and how.startswith("head:"):
            data[int(how[5:])].copy_(tensor)
            loaded.add(f"{pname}#{how}")
            return
        elif how in ("experts:gate", "experts:up", "experts:t"):
            e, rows, cols = data.shape  # w13: [E, 2I, H]; w2: [E, H, I]
            if how == "experts:t":
                dest, stored = data, (e, cols, rows)
            else:
                half = rows // 2
                dest = data.narrow(1, 0 if how == "experts:gate" else half, half)
                stored = (e, half, cols)
            if tensor.numel() != math.prod(stored) or tensor.shape[-1] != stored[-1]:
                raise KeyError(
                    f"checkpoint tensor for {pname} ({how}) is {tuple(tensor.shape)}, expected "
                    f"({stored[0] * stored[1]}, {stored[2]})"
                )
            tensor = tensor.reshape(stored)
            dest.copy_(tensor.transpose(1, 2) if how == "experts:t" else tensor)
            if how == "experts:t":
                loaded.add(pname)
            else:  # each expert's half, as the per-expert placements count them
                loaded.update(f"{pname}#expert:{i}:{how[8:]}" for i in range(e))
            return
        elif how is not None and how.startswith("expert:"):
            _, e, half = (how.split(":") + [""])[:3]
            dest = data[int(e)]
            if half:
                rows = dest.shape[0] // 2
                dest = dest.narrow(0, 0 if half == "gate" else rows, rows)
            if tuple(tensor.shape) != tuple(dest.shape):
                raise KeyError(
                    f"checkpoint tensor for {pname} ({how}) is {tuple(tensor.shape)}, expected "
                    f"{tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(f"{pname}#{how}")
            return
        elif how is not None:
            raise ValueError(f"unknown weight placement {how!r}")
        if s.norm_weight_offset and pname.endswith("norm.weight"):
            tensor = tensor.float() + s.norm_weight_offset
        data.copy_(tensor.reshape(data.shape))
        loaded.add(pname)

    def _reorder_rows(self, how: str, tensor: torch.Tensor) -> torch.Tensor:
        """A fused qkv tensor's output rows (dim 0) in the order of qkv_proj: [q | k | v]."""
        s = self.spec
        if how == "qkv_heads":  # [H, 3, D, ...] -> [3, H, D, ...]
            h, d = s.num_heads, s.head_dim
            return tensor.reshape(h, 3, d, *tensor.shape[1:]).transpose(0, 1)
        # qkv_grouped: [KVH, G + 2, D, ...] -> q rows, then k, then v
        kvh, d = s.num_kv_heads, s.head_dim
        g = s.num_heads // kvh
        t = tensor.reshape(kvh, g + 2, d, *tensor.shape[1:])
        return torch.cat([t[:, :g].flatten(0, 2), t[:, g].flatten(0, 1), t[:, g + 1].flatten(0, 1)])

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights from the config alone (LOAD_FORMAT=dummy), for benchmarks."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.data.fill_(1.0)
            elif name.endswith("norm.bias") or name.endswith(".bias"):
                p.data.zero_()
            else:
                p.data.copy_(torch.randn(p.shape, generator=g) * 0.02)
        for m in self.modules():
            if isinstance(m, QuantLinear | Experts):
                m.init_dummy(g)
        self._settle_quantized()

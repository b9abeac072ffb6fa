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
import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

from ..kernels.activation import ACT_CODES, ClampedSwiGLU
from ..kernels.cpu_native import (
    NATIVE_ACT_CODES,
    ConvLayerWeights,
    DecoderLayerWeights,
    LayerPrep,
    native_cache_ok,
    prepare_reference,
    ptr_or_null,
)
from ..kv_cache import layer_view
from ..layers.activation import (
    ActAndMul,
    Activation,
    SiluAndMul,
    check_activation,
    gated_activation,
)
from ..layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    NativeCpuBackend,
    alibi_slopes,
)
from ..layers.linear import PackedLinear, pack_linears_for_cpu, use_native_linears
from ..layers.moe import ROUTINGS, BiasedRouter, Experts, experts_on_weighted_inputs, route
from ..layers.norm import HeadLayerNorm, LayerNorm, RMSNorm
from ..layers.recurrent import RecurrentMixerSpec, step_slots
from ..layers.rotary import (
    RotaryStep,
    apply_rotary,
    mrope_table,
    rope_table,
    rotary_step,
    rotate_gathered,
)
from ..layers.short_conv import ShortConv
from ..parallel.group import SINGLE, TensorParallel
from .lora_targets import DecoderLoRA
from .mla import LatentAttention, MLASpec
from .weights import DecoderWeights

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
    by sigmoid(a one-output gate) when `shared_gate` (Qwen2-MoE). "sigmoid_grouped" routing
    (Kimi Linear, DeepSeek-V3, GLM-4.5) has a router with a score correction bias
    (`BiasedRouter`), picks among the best `groups[1]` of `groups[0]` expert groups and scales
    the weights by `routed_scale`; "softmax_grouped" (DeepSeek-V2) the same without the bias;
    "softmax_biased" (ERNIE 4.5) divides by a sum no less than `norm_floor`.
    The experts are gated MLPs when the model's MLP is (`DecoderSpec.gated`), else plain ones
    (Nemotron-H); `latent_size`: they run in a narrower width, between the block's projections
    `fc1_latent_proj` (hidden -> latent) and `fc2_latent_proj` (latent -> hidden) (Nemotron-H's
    latent MoE; the router and the shared expert read the hidden width). `weighted_inputs`: the
    router weight scales each expert's input instead of its output (Llama 4,
    `experts_on_weighted_inputs`)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    routing: str = "softmax_topk"
    renormalize: bool | float = False
    jitter_eps: float = 0.0
    shared_size: int = 0
    shared_gate: bool = False
    groups: tuple[int, int] = (1, 1)
    routed_scale: float = 1.0
    latent_size: int | None = None
    # gpt-oss: a router with a bias, experts with a bias per projection, and the experts'
    # activation `ClampedSwiGLU(alpha, limit)` given as (alpha, limit) instead of the model's.
    router_bias: bool = False
    expert_bias: bool = False
    swiglu: tuple[float, float] | None = None
    weighted_inputs: bool = False
    norm_floor: float = 0.0  # "softmax_biased": the least sum the weights are divided by
    float32_router: bool = False  # the router's weight kept in float32 (ERNIE 4.5)

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown MoE routing {self.routing!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} with {self.num_experts} experts")
        n, best = self.groups
        if n < 1 or self.num_experts % n or not 1 <= best <= n:
            raise ValueError(f"the best {best} of {n} groups of {self.num_experts} experts")


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
      [experts * in, out], into the stacked w2 [experts, out, in] (DBRX);
    - "rows:<start>:<n>": the target's rows from `start` on, one of the n pieces a fused
      module's weight is stored as (Kimi Linear's q/k/v projections and convolutions).

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
    # Tensors whose name starts with one of these belong to parts the engine does not run
    # (Qwen3-Next's multi-token-prediction layers, "mtp.") and are skipped.
    skip_prefixes: tuple[str, ...] = ()
    # Per token-mixer kind ("attention", "recurrent"), entries overriding `layer` in layers of
    # that kind (OLMo Hybrid names a norm alike in both kinds of layers and places it apart).
    mixer_layer: dict = field(default_factory=dict)
    # Multipliers folded into checkpoint tensors as they load (Falcon-H1's muP multipliers on
    # projection inputs and outputs): a module path inside a layer (as in `layer`) -> (weight
    # scale, bias scale), each a float or a 1-D tensor over the output rows. Float tensors only;
    # adapters cannot target these modules (their delta would miss the scale).
    scales: dict = field(default_factory=dict)


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
    # Per token-mixer kind, its layers' norms instead of `layer_norms` (OLMo Hybrid: norms after
    # attention and MLP in its attention layers, before them in its recurrent layers).
    mixer_norms: dict | None = None
    final_norm: bool = True
    norm_weight_offset: float = 0.0  # Gemma stores norm weights as w - 1
    parallel: bool = False  # attention and MLP both read the layer's input stream
    post_ln: bool = False  # norms after each residual add (OPT-350m), not before the sublayer
    # attention
    qkv_bias: bool = False
    o_bias: bool = False
    # "rms_head" (RMSNorm over head_dim, shared by the heads) | "rms_full" (over all heads) |
    # "layer_head" (LayerNorm, a weight per head) | "layer_head_shared" (LayerNorm with weight
    # and bias over head_dim, shared by the heads: Phi) | "l2_head" (RMS over head_dim with no
    # weight, after the rotary: Llama 4's L2 norm)
    qk_norm: str | None = None
    qk_norm_layers: tuple[bool, ...] | None = None  # per layer, whether it has it (default all)
    qk_norm_eps: float | None = None  # default: norm.eps
    scale: float | None = None  # default: head_dim ** -0.5
    attn_softcap: float | None = None
    windows: tuple[int | None, ...] | None = None  # per layer; None: no sliding window
    # per layer, its local attention chunk (Llama 4: a query sees only its own chunk's keys)
    chunks: tuple[int | None, ...] | None = None
    # Attention temperature tuning on the layers without rotary (Llama 4's NoPE layers): the
    # query at position p is multiplied by 1 + attn_scale * log1p(floor((p + 1) / floor_scale)),
    # given as (floor_scale, attn_scale).
    attn_temperature: tuple[float, float] | None = None
    # Gemma 4's pieces. Per layer, (num_kv_heads, head_dim) where the layer's differ from the
    # model's (its global layers' wider heads); None: the model's.
    layer_heads: tuple[tuple[int, int] | None, ...] | None = None
    # Per layer, whether its values are its keys' projection (`attention_k_eq_v`: no v rows;
    # v is the raw k projection, taken before the k norm).
    k_eq_v: tuple[bool, ...] | None = None
    v_norm: bool = False  # values RMS-normalised over head_dim, without a weight
    # Per layer, the earlier layer whose keys and values it attends to (KV shared across
    # layers: such a layer has no K/V projection and keeps no cache of its own), or None.
    kv_source: tuple[int | None, ...] | None = None
    mlp_sizes: tuple[int | None, ...] | None = None  # per layer, its dense MLP width if not ours
    # Per-layer input embeddings (vocab, width): an embedding of every layer's own, mixed with
    # a projection of the token embedding, fed into each layer after its MLP.
    per_layer_input: tuple[int, int] | None = None
    # The token whose per-layer embedding the rows taking image features look up (Gemma 4:
    # transformers replaces the image tokens by the pad token before that lookup); None: the
    # rows' own token ids.
    per_layer_image_id: int | None = None
    layer_scalar: bool = False  # each layer's output stream times its `layer_scalar`
    # Gemma 4's MoE block: routed experts beside the dense MLP in every layer (`ExpertsBeside`;
    # `routing` and `renormalize` as for `moe`).
    moe_beside: MoESpec | None = None
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
    # A `...ForSequenceClassification` checkpoint (registry.py): its `score` linear [labels,
    # hidden] on the last token's final hidden state replaces the LM head (pooling.py's
    # classifier head); None: a causal LM.
    num_labels: int | None = None
    # Token mixers (hybrid models). Per layer: "attention"; "recurrent" (the layer keeps a state
    # instead of KV: `recurrent` describes it, layers/recurrent.py); "parallel" (attention and the
    # recurrent mixer both read the normed input and their outputs are summed: Falcon-H1; the
    # layer keeps KV and a state); or "none" (no mixer: the layer is its norm and its MLP,
    # Nemotron-H's MLP blocks). None: attention everywhere.
    mixers: tuple[str, ...] | None = None
    recurrent: RecurrentMixerSpec | None = None
    mlp_layers: tuple[bool, ...] | None = None  # per layer, whether it has an MLP (default all)
    # Qwen3-Next's gated attention: q_proj gives each head's query and a gate of the same width
    # ([q_h | gate_h] per head); the attention output is multiplied by sigmoid(gate).
    attn_output_gate: bool = False
    # LFM3's gate per head: the attention output of head h is multiplied by
    # sigmoid(g_proj(x))[h], g_proj a [heads, hidden] linear of the layer's input.
    attn_head_gate: bool = False
    # gpt-oss: a learned sink logit per head inside the softmax (`AttentionSpec.sinks`), the
    # checkpoint's `self_attn.sinks`.
    attn_sinks: bool = False
    # Multi-head latent attention (DeepSeek V2/V3, Mistral 4; models/mla.py) on every attending
    # layer: head_dim is then the query/key head width (nope + rope), and the cache holds one
    # latent row a token instead of K and V.
    mla: MLASpec | None = None

    def __post_init__(self):
        check_activation(self.act)
        n = self.num_layers
        if self.windows is None:
            self.windows = (None,) * n
        if self.chunks is None:
            self.chunks = (None,) * n
        if self.qk_norm_layers is None:
            self.qk_norm_layers = (True,) * n
        if len(self.chunks) != n or len(self.qk_norm_layers) != n:
            raise ValueError(f"{self.arch}: per-layer settings for {n} layers expected")
        self.layer_heads = self.layer_heads or (None,) * n
        self.k_eq_v = self.k_eq_v or (False,) * n
        self.kv_source = self.kv_source or (None,) * n
        self.mlp_sizes = self.mlp_sizes or (None,) * n
        per_layer = (self.layer_heads, self.k_eq_v, self.kv_source, self.mlp_sizes)
        if any(len(t) != n for t in per_layer):
            raise ValueError(f"{self.arch}: per-layer settings for {n} layers expected")
        for i, src in enumerate(self.kv_source):
            if src is not None and not (0 <= src < i and self.kv_source[src] is None):
                raise ValueError(f"{self.arch}: layer {i} reads the KV of layer {src}")
        if self.rope is None:
            self.rope = (None,) * n
        if self.moe_layers is None:
            self.moe_layers = (self.moe is not None,) * n
        if self.mixers is None:
            self.mixers = ("attention",) * n
        if self.mlp_layers is None:
            self.mlp_layers = (True,) * n
        if len(self.moe_layers) != n:
            raise ValueError(f"{self.arch}: per-layer settings for {n} layers expected")
        if len(self.windows) != n or len(self.rope) != n:
            raise ValueError(f"{self.arch}: per-layer settings for {n} layers expected")
        if len(self.mixers) != n or len(self.mlp_layers) != n:
            raise ValueError(f"{self.arch}: per-layer settings for {n} layers expected")
        unknown = set(self.mixers) - set(MIXER_KINDS)
        if unknown:
            raise ValueError(f"{self.arch}: unknown token mixers {sorted(unknown)}")
        if {"recurrent", "parallel"} & set(self.mixers) and self.recurrent is None:
            raise ValueError(f"{self.arch}: recurrent layers without a recurrent description")

    @property
    def attention_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends and keeps KV in the paged cache (a layer reading
        another layer's KV keeps none)."""
        return tuple(
            m in ("attention", "parallel") and src is None
            for m, src in zip(self.mixers, self.kv_source)
        )

    @property
    def latent_widths(self) -> tuple[int | None, ...] | None:
        """Per layer, the width of its latent cache row (MLA layers), else None; None for a
        model without latent attention."""
        if self.mla is None:
            return None
        return tuple(self.mla.width if a else None for a in self.attention_layers)

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers that keep a recurrent state (the state group)."""
        return tuple(i for i, m in enumerate(self.mixers) if m in ("recurrent", "parallel"))


MIXER_KINDS = ("attention", "recurrent", "parallel", "none")


# -- modules -----------------------------------------------------------------------------------


def make_norm(spec: NormSpec, size: int, use_kernels: bool) -> nn.Module:
    if spec.kind == "rms":
        return RMSNorm(size, spec.eps, use_kernels)
    return LayerNorm(size, spec.eps, spec.weight, spec.bias, use_kernels)


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them without tensor parallelism); the
    output projection's partial sums are all-reduced."""

    def __init__(
        self,
        s: DecoderSpec,
        attn: AttentionSpec,
        backend: AttentionBackend,
        rope,
        tp: TensorParallel = SINGLE,
        index: int = 0,
    ):
        super().__init__()
        self.tp = tp
        self.spec = attn
        self.backend = backend
        self.rope = rope  # the RopeSpec of this layer, or None
        h, kvh, d = s.num_heads, s.num_kv_heads, s.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.q_size, self.kv_size = h * d, kvh * d
        # The fused projection's parts: q, k, v; q and k when the values are the keys'
        # projection; q alone when the layer reads another layer's K/V (`link_kv_source`).
        self.reads_kv_of = s.kv_source[index]
        self.qkv_parts = 1 if self.reads_kv_of is not None else 2 if s.k_eq_v[index] else 3
        self.v_norm = s.v_norm
        self._kv_source: list = []  # [the Attention whose K/V this layer reads]
        self.kv_out = None  # this step's (k, v), kept when a later layer reads them
        self.keep_kv_out = False
        # With an output gate the fused projection is [q | k | v | gate].
        self.gate_size = self.q_size if s.attn_output_gate else 0
        self.qkv_proj = nn.Linear(
            s.hidden_size,
            self.q_size + (self.qkv_parts - 1) * self.kv_size + self.gate_size,
            bias=s.qkv_bias,
        )
        self.o_proj = nn.Linear(self.q_size, s.hidden_size, bias=s.o_bias)
        self.g_proj = nn.Linear(s.hidden_size, h, bias=False) if s.attn_head_gate else None
        # The sinks (their `weight`, as the loader fills a checkpoint's bare parameter); the
        # spec points at it once materialized (`DecoderModel.materialize`).
        self.sinks = HeadSinks(h) if s.attn_sinks else None
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
        elif s.qk_norm == "l2_head":
            self.qk_eps = eps
        elif s.qk_norm is not None:
            raise ValueError(f"unknown q/k norm {s.qk_norm!r}")
        if self.qkv_parts == 1 and s.qk_norm is not None:
            self.k_norm = None  # a layer reading another's K/V has no k norm
        self.v_eps = eps
        # Temperature tuning (`DecoderSpec.attn_temperature`) on a layer without rotary.
        self.temperature = s.attn_temperature if rope is None else None
        # Whether the native CPU step can prepare q and k itself (its clip comes before the
        # norms; a norm over every head only without tensor parallelism, where its statistics
        # would span the ranks).
        self.native_prep = isinstance(backend, NativeCpuBackend) and (
            self.qkv_parts == 3
            and not self.v_norm
            and not self.clip_after_norm
            and not (s.qk_norm == "rms_full" and tp.enabled)
            and not self.gate_size
            and s.qk_norm != "l2_head"
            and self.temperature is None
        )
        self._native_layer: tuple | None = None  # (key, struct, prep), rebuilt on a new key

    def forward(self, x, rope: RotaryStep | None, kv_cache, meta: AttentionMetadata, q_scale=None):
        """`q_scale`: [T, 1, 1] float32 factors for the queries (temperature tuning), or None."""
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.g_proj is not None:
            attn = self._attend(qkv, T, rope, kv_cache, meta, q_scale)
            gate = torch.sigmoid(self.g_proj(x)).unsqueeze(-1)
            return self._out((attn.reshape(T, self.num_heads, -1) * gate).reshape(T, -1))
        if not self.gate_size:
            return self._out(self._attend(qkv, T, rope, kv_cache, meta, q_scale))
        qkv, gate = qkv.split([qkv.shape[-1] - self.gate_size, self.gate_size], dim=-1)
        attn = self._attend(qkv, T, rope, kv_cache, meta, q_scale)
        return self._out(attn * torch.sigmoid(gate))

    def link_kv_source(self, source: Attention) -> None:
        """This layer attends to `source`'s keys and values (written by it earlier in the
        step): `source` keeps them for this layer (a plain list: not a submodule)."""
        self._kv_source = [source]
        source.keep_kv_out = True

    def _attend(
        self, qkv, T: int, rope: RotaryStep | None, kv_cache, meta: AttentionMetadata, q_scale=None
    ):
        if self.qkv_parts != 3 or self.v_norm:
            return self._attend_own_kv(qkv, T, rope, kv_cache, meta)
        if self.native_prep and qkv.dtype == torch.float32:
            return self._forward_native(qkv, rope, kv_cache, meta)
        if self.clip_qkv is not None and not self.clip_after_norm:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        plain = self.qk_norm is None and q_scale is None
        if rope is not None and rope.cos is not None and plain:
            # The torch path of a full-width neox rotation: q and k are neighbours in the fused
            # projection, so one rotation covers both heads' sets (half the ops of two).
            qk = qkv[:, : self.q_size + self.kv_size].view(T, -1, self.head_dim)
            q, k = rotate_gathered(qk, rope).split([self.num_heads, self.num_kv_heads], dim=1)
            v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
            return self.backend.forward(q, k, v, kv_cache, meta, self.spec)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "rms_full":
            if self.tp.enabled:  # the norm spans every head: its statistics span the ranks
                q, k = (
                    self._rms_across_ranks(q, self.q_norm),
                    self._rms_across_ranks(k, self.k_norm),
                )
            else:
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
        if self.qk_norm == "l2_head":
            q, k = _rms_plain(q, self.qk_eps), _rms_plain(k, self.qk_eps)
        if q_scale is not None:
            q = (q.float() * q_scale).to(q.dtype)
        return self.backend.forward(q, k, v, kv_cache, meta, self.spec)

    def _attend_own_kv(self, qkv, T: int, rope: RotaryStep | None, kv_cache, meta):
        """Gemma 4's attention: per-head q/k norms, values RMS-normed without a weight (`v_norm`),
        values that are the keys' projection (`k_eq_v`), or no K/V at all: the source layer's
        of this step, written into its cache already (`kv_cache` and `meta` are the source's;
        the write is repeated, the same values into the same slots, so every backend path
        serves it unchanged)."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = qkv[:, : self.q_size].reshape(T, h, d)
        q_norm, k_norm = getattr(self, "q_norm", None), getattr(self, "k_norm", None)
        if q_norm is not None:
            q = q_norm(q.reshape(-1, d)).view(T, h, d)
        if self.qkv_parts == 1:  # the source's keys and values
            if rope is not None:  # rotate q alone (a copy of one head stands in for k)
                q, _ = apply_rotary(q, q[:, :1].clone(), rope, self.rope.is_neox)
            k, v = self._kv_source[0].kv_out
            return self.backend.forward(q, k, v, kv_cache, meta, self.spec)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].reshape(T, kvh, d)
        v = k if self.qkv_parts == 2 else qkv[:, self.q_size + self.kv_size :].reshape(T, kvh, d)
        if k_norm is not None:
            k = k_norm(k.reshape(-1, d)).view(T, kvh, d)
        if self.v_norm:
            v = _rms_plain(v, self.v_eps)
        if rope is not None:
            q, k = apply_rotary(q, k, rope, self.rope.is_neox)
        if self.keep_kv_out:
            self.kv_out = (k, v)
        return self.backend.forward(q, k, v, kv_cache, meta, self.spec)

    def _forward_native(self, qkv, rope, kv_cache, meta):
        """The native CPU step from the fused projection: q, k, v prepared in place (clip, q/k
        norm, rotary), written and attended in one call."""
        q, k, v = qkv.view(qkv.shape[0], -1, self.head_dim).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1
        )
        backend: NativeCpuBackend = self.backend
        layer, prep = self.native_layer(rope, kv_cache)
        positions = None if rope is None else rope.positions
        if layer is None:  # an 8-bit cache: prepared in torch, the torch backend's path
            q, k, v = prepare_reference(q, k, v, positions, prep)
            return backend.forward(q, k, v, kv_cache, meta, self.spec)
        return backend.forward_native(q, k, v, kv_cache, meta, self.spec, layer, positions)

    def native_layer(self, rope: RotaryStep | None, kv_cache: torch.Tensor):
        """(this layer's struct for the native step, or None for a cache it cannot read; its
        LayerPrep). The struct points into the cache, the rope table and the q/k norm weights
        (loading copies into those in place): rebuilt when the cache, table or spec is another
        object."""
        table = None if rope is None else rope.cache
        cached = self._native_layer
        if cached is not None:  # (unpacked: this runs for every layer of every step)
            cache0, table0, spec0 = cached[0]
            if cache0 is kv_cache and table0 is table and spec0 is self.spec:
                return cached[1], cached[2]
        prep = self._prep(rope)
        layer = self.backend.layer(self.spec, kv_cache, prep) if native_cache_ok(kv_cache) else None
        self._native_layer = ((kv_cache, table, self.spec), layer, prep)
        return layer, prep

    def _prep(self, rope: RotaryStep | None) -> LayerPrep:
        norms = biases = (None, None)
        if self.qk_norm:
            norms = (self.q_norm.weight, self.k_norm.weight)
            biases = (getattr(self.q_norm, "bias", None), getattr(self.k_norm, "bias", None))
        return LayerPrep(
            rope=None if rope is None else rope.cache,
            is_neox=self.rope.is_neox if self.rope is not None else True,
            clip=self.clip_qkv,
            qk_norm=self.qk_norm,
            q_norm=norms[0],
            k_norm=norms[1],
            qk_eps=self.q_norm.eps if self.qk_norm else 1e-6,
            q_norm_bias=biases[0],
            k_norm_bias=biases[1],
        )

    def _out(self, attn: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.o_proj(attn))

    def _rms_across_ranks(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """RMSNorm over a width split across the ranks (this rank holds x's part and the
        weight's): the squares' sum all-reduced, as rms_norm_reference computes it."""
        h = x.float()
        sq = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True))
        h = h * torch.rsqrt(sq / (x.shape[-1] * self.tp.size) + norm.eps)
        return norm.weight * h.to(x.dtype)


def _rms_plain(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation over the last dim with no weight, in float32 (Llama 4's L2 norm)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def attention_temperature(positions: torch.Tensor, floor_scale: float, attn_scale: float):
    """Llama 4's temperature tuning: [T, 1, 1] float32 factors for the queries at `positions`."""
    p = positions.float()
    return (torch.log1p(torch.floor((p + 1.0) / floor_scale)) * attn_scale + 1.0).view(-1, 1, 1)


class HeadSinks(nn.Module):
    """gpt-oss's sink logits, one per attention head of this rank: `weight` [heads]."""

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads))


class MLP(nn.Module):
    """A dense MLP over this rank's part of the width; `tp` all-reduces the partial outputs
    (None: the caller does, as a MoE block does once for its experts and shared expert)."""

    def __init__(
        self,
        s: DecoderSpec,
        use_kernels: bool,
        intermediate_size: int | None = None,
        tp: TensorParallel | None = SINGLE,
    ):
        super().__init__()
        self.tp = tp
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
        out = self.down_proj(self.act_fn(up))
        return out if self.tp is None else self.tp.all_reduce(out)


class ScaledRouter(nn.Module):
    """Gemma 4's router: the stream RMS-normed without a weight, times `scale` [hidden] and
    hidden ** -0.5, projected to the experts' logits (`proj`); the routed weights (softmax top-k,
    renormalised) times `per_expert_scale` [experts] of the chosen experts."""

    FLOAT_CHILDREN = ("proj",)  # quantizers leave it in float

    def __init__(self, hidden: int, num_experts: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.proj = nn.Linear(hidden, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))

    def forward(self, x: torch.Tensor, m: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
        h = _rms_plain(x, self.eps) * self.scale * x.shape[-1] ** -0.5
        weights, ids = route(self.proj(h), m.top_k, m.routing, m.renormalize)
        return weights * self.per_expert_scale[ids].float(), ids


class ExpertsBeside(nn.Module):
    """Gemma 4's MoE block beside the dense MLP: the experts read the stream before the MLP
    norm, routed by `ScaledRouter` and normed on the way in (`in_norm`); the dense MLP's output
    and the experts' are each normed (`dense_norm`, `out_norm`), then summed. Under tensor
    parallelism each rank holds every expert at 1/N of its width (as `SparseMoE`): the experts'
    partial sums are all-reduced before their norm (the dense MLP has all-reduced its own)."""

    def __init__(self, s: DecoderSpec, use_kernels: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        m = self.moe = s.moe_beside
        h = s.hidden_size
        self.router = ScaledRouter(h, m.num_experts, s.norm.eps)
        self.experts = Experts(m.num_experts, h, m.intermediate_size, s.act, use_kernels)
        self.dense_norm = make_norm(s.norm, h, use_kernels)
        self.in_norm = make_norm(s.norm, h, use_kernels)
        self.out_norm = make_norm(s.norm, h, use_kernels)

    def forward(self, dense: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(stream, self.moe)
        routed = self.tp.all_reduce(self.experts(self.in_norm(stream), weights, ids))
        return self.dense_norm(dense) + self.out_norm(routed)


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP: router, experts, and the shared expert when the family has one."""

    FLOAT_CHILDREN = ("gate", "shared_expert_gate")  # the routers stay float in quantized models

    def __init__(self, s: DecoderSpec, use_kernels: bool, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        m = self.moe = s.moe
        if m.routing in ("sigmoid_grouped", "softmax_biased", "softmax_grouped"):
            # float32 logits; DeepSeek-V2's router has no correction bias
            bias = m.routing != "softmax_grouped"
            self.gate = BiasedRouter(s.hidden_size, m.num_experts, bias, m.float32_router)
        else:
            self.gate = nn.Linear(s.hidden_size, m.num_experts, bias=m.router_bias)
        if tp.enabled and (m.latent_size or not s.gated):
            raise ValueError("tensor parallelism of latent or non-gated experts is not supported")
        width = m.latent_size or s.hidden_size
        self.experts = Experts(
            m.num_experts,
            width,
            m.intermediate_size,
            ClampedSwiGLU(*m.swiglu) if m.swiglu else s.act,
            use_kernels,
            gated=s.gated,
            bias=m.expert_bias,
        )
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if m.latent_size:
            self.fc1_latent_proj = nn.Linear(s.hidden_size, width, bias=s.mlp_bias)
            self.fc2_latent_proj = nn.Linear(width, s.hidden_size, bias=s.mlp_bias)
        self.shared_expert = MLP(s, use_kernels, m.shared_size, tp=None) if m.shared_size else None
        self.shared_expert_gate = nn.Linear(s.hidden_size, 1, bias=False) if m.shared_gate else None

    def forward(self, x):
        m = self.moe
        weights, ids = route(
            self.gate(x),
            m.top_k,
            m.routing,
            m.renormalize,
            m.jitter_eps,
            score_bias=getattr(self.gate, "e_score_correction_bias", None),
            groups=m.groups,
            scale=m.routed_scale,
            norm_floor=m.norm_floor,
        )
        if m.weighted_inputs:
            out = experts_on_weighted_inputs(self.experts, x, weights, ids)
        elif self.fc1_latent_proj is None:
            out = self.experts(x, weights, ids)
        else:
            out = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), weights, ids))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.tp.all_reduce(out)


def _global_hooks() -> bool:
    """Whether any forward hook is registered for every module (torch's global hooks)."""
    return bool(
        torch_module._global_forward_pre_hooks
        or torch_module._global_forward_hooks
        or torch_module._global_forward_hooks_always_called
    )


def _add_norm(norm, x, residual):
    """(norm(stream), stream) where stream = x + residual (or x when residual is None)."""
    if residual is None:
        return (norm(x) if norm is not None else x), x
    if norm is not None:
        return norm(x, residual)
    stream = x + residual
    return stream, stream


class LayerScalar(nn.Module):
    """A layer's output multiplier (Gemma 4's `layer_scalar`): `weight` [1]."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        s: DecoderSpec,
        attn: AttentionSpec,
        backend: AttentionBackend,
        rope,
        sparse=False,
        tp: TensorParallel = SINGLE,
        mixer: str = "attention",
        has_mlp: bool = True,
        index: int = 0,
    ):
        super().__init__()
        uk = backend.use_kernels
        # The token mixer: attention, a recurrent layer (`mixer`, keeping a state), both side by
        # side ("parallel"), or none.
        attends, recurs = mixer in ("attention", "parallel"), mixer in ("recurrent", "parallel")
        if not attends:
            self.self_attn = None
        elif s.mla is not None:
            self.self_attn = LatentAttention(s, attn, backend, rope, tp)
        else:
            self.self_attn = Attention(s, attn, backend, rope, tp, index)
        self.mixer = s.recurrent.build(s, backend, tp) if recurs else None
        if has_mlp:
            self.mlp = SparseMoE(s, uk, tp) if sparse else MLP(s, uk, tp=tp)
        else:
            self.mlp = None
        norms = (s.mixer_norms or {}).get(mixer, s.layer_norms)
        for slot in ("in", "post_attn", "mlp", "post_mlp"):
            norm = make_norm(s.norm, s.hidden_size, uk) if slot in norms else None
            setattr(self, f"{slot}_norm", norm)
        self.parallel = s.parallel
        self.post_ln = s.post_ln
        self.residual_scale = s.residual_scale
        # Gemma 4: the per-layer input's gate, projection and norm after the MLP; the scalar.
        self.ple_gate = self.ple_proj = self.ple_norm = None
        if s.per_layer_input is not None:
            width = s.per_layer_input[1]
            self.ple_gate = nn.Linear(s.hidden_size, width, bias=False)
            self.ple_act = Activation(s.act, uk)
            self.ple_proj = nn.Linear(width, s.hidden_size, bias=False)
            self.ple_norm = make_norm(s.norm, s.hidden_size, uk)
        self.layer_scalar = LayerScalar() if s.layer_scalar else None
        self.experts_beside = ExpertsBeside(s, uk, tp) if s.moe_beside is not None else None
        self.native_decode: NativeDecodeLayer | None = None  # `NativeDecodeLayer.attach`

    def _mix(self, h, rope, cache, meta, q_scale=None):
        """The token mixer's output for the normed stream `h` (None for a layer without one)."""
        if self.self_attn is not None and self.mixer is not None:  # its cache: a RecurrentState
            return self.mixer(h, cache, meta) + self.self_attn(h, rope, cache.kv, meta, q_scale)
        if self.self_attn is not None:
            return self.self_attn(h, rope, cache, meta, q_scale)
        if self.mixer is not None:
            return self.mixer(h, cache, meta)
        return None

    def forward(self, x, residual, rope, kv_cache, meta, q_scale=None, per_layer_input=None):
        """`q_scale`: the queries' temperature factors (`attention_temperature`), or None;
        `per_layer_input`: this layer's [T, width] per-layer input (Gemma 4), or None."""
        if self.ple_gate is not None or self.layer_scalar is not None:
            x, residual = self._forward(x, residual, rope, kv_cache, meta, q_scale)
            stream = x if residual is None else x + residual
            if self.ple_gate is not None:
                g = self.ple_act(self.ple_gate(stream)) * per_layer_input
                stream = stream + self.ple_norm(self.ple_proj(g))
            if self.layer_scalar is not None:
                stream = stream * self.layer_scalar.weight
            return stream, None
        return self._forward(x, residual, rope, kv_cache, meta, q_scale)

    def _forward(self, x, residual, rope, kv_cache, meta, q_scale=None):
        nd = self.native_decode
        if nd is not None and nd.takes(self, x, residual, meta):
            return nd(self, x, residual, rope, kv_cache, meta)
        if self.post_ln:  # OPT-350m: stream = norm(stream + sublayer(stream))
            stream = x if residual is None else x + residual
            h = self.self_attn(stream, rope, kv_cache, meta, q_scale)
            stream, _ = self.in_norm(h, stream)
            stream, _ = self.mlp_norm(self.mlp(stream), stream)
            return stream, None
        h, residual = _add_norm(self.in_norm, x, residual)
        if self.parallel:
            # GPT-J, Phi, Cohere: one norm feeds both; GPT-NeoX, Falcon's new decoder: two.
            m = self.mlp(self.mlp_norm(residual) if self.mlp_norm is not None else h)
            return self._mix(h, rope, kv_cache, meta, q_scale) + m, residual
        if self.self_attn is None and self.mixer is None:  # an MLP block alone (its one norm: in)
            return self._scaled(self._mlp_out(h)), residual
        h = self._mix(h, rope, kv_cache, meta, q_scale)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        h = self._scaled(h)
        if self.mlp is None:  # a mixer block alone (Nemotron-H's Mamba and attention blocks)
            return h, residual
        h, residual = _add_norm(self.mlp_norm, h, residual)
        return self._scaled(self._mlp_out(h, residual)), residual

    def _mlp_out(self, h, stream=None):
        h = self.mlp(h)
        if self.experts_beside is not None:  # Gemma 4: experts beside, from the stream
            h = self.experts_beside(h, stream)
        return self.post_mlp_norm(h) if self.post_mlp_norm is not None else h

    def _scaled(self, h):
        return h * self.residual_scale if self.residual_scale != 1.0 else h


class _WholeLayerCall:
    """What the whole-layer native calls share: the steps they take (decode rows only, between
    the fewest rows every linear takes the native kernel at, `min_rows`, and the most it was
    chosen for, `rows`; float32, contiguous) while the layer's linears are still those the
    call was built on (`same_linears`)."""

    MIXER: str  # the layer's mixer module: "self_attn" or "mixer"
    MIXER_LINEARS: tuple[str, str]  # the mixer's two linears the call reads, in order
    rows: int
    min_rows: int
    linears: tuple  # the mixer's two linears, up (gate-up when gated) and down
    extra: tuple = ()  # (name, linear) of other mixer linears the call reads (LFM3's gate)

    @classmethod
    def linears_of(cls, layer: DecoderLayer) -> tuple:
        """The layer's mixer linears (MIXER_LINEARS), up (gate-up when gated) and down linears,
        as they are now (None for those it lacks: a recurrent layer has no QKV or O)."""
        mix, mlp = getattr(layer, cls.MIXER, None), layer.mlp
        up = getattr(mlp, "gate_up_proj" if getattr(mlp, "gated", True) else "up_proj", None)
        first, second = (getattr(mix, name, None) for name in cls.MIXER_LINEARS)
        return first, second, up, getattr(mlp, "down_proj", None)

    def same_linears(self, layer: DecoderLayer) -> bool:
        """`linears_of(layer) == self.linears` (and the extra linears the same), read from the
        modules' own tables (a linear replaced since, by a LoRA wrapper or anything else, is
        another entry there); each step asks it of every layer, and nn.Module's attribute
        fallback is the slow part."""
        first, second, up, down = self.linears
        mix, mlp = layer._modules.get(self.MIXER), layer._modules.get("mlp")
        if mix is None or mlp is None:
            return False
        a, m = mix._modules, mlp._modules
        name1, name2 = self.MIXER_LINEARS
        up_name = "gate_up_proj" if getattr(mlp, "gated", True) else "up_proj"
        if not (
            a.get(name1) is first
            and a.get(name2) is second
            and m.get(up_name) is up
            and m.get("down_proj") is down
        ):
            return False
        for name, lin in self.extra:
            if a.get(name) is not lin:
                return False
        return True

    def takes(self, layer: DecoderLayer, x, residual, meta) -> bool:
        return (
            self.min_rows <= x.shape[0] <= self.rows
            and meta.num_decodes == x.shape[0]
            and x.dtype == torch.float32
            and x.is_contiguous()
            and (residual is None or residual.is_contiguous())
            and self.same_linears(layer)
        )


class NativeDecodeLayer(_WholeLayerCall):
    """A decode step of a few rows through a whole layer in one native call
    (`decoder_layer_f32`): for the common layer shapes only (pre-norm "in" and "mlp" norms of
    one kind, sequential or parallel (the "mlp" norm optional), sandwich RMSNorms on a
    sequential layer (Gemma 2/3, LFM3), LFM3's sigmoid gate a head, no multipliers, a gated or
    plain MLP of a native activation, every linear packed with its panels kept for the native
    rows, q/k prepared by the native step), and only while the layer's linears are those it was
    built on (a LoRA wrapper or anything else put in their place afterwards turns it off)."""

    MIXER, MIXER_LINEARS = "self_attn", ("qkv_proj", "o_proj")

    def __init__(self, layer: DecoderLayer, native, rows: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.native, self.rows = native, rows
        self.linears = self.linears_of(layer)
        self.gate = attn.g_proj  # LFM3's per-head gate, or None
        self.extra = (("g_proj", self.gate),)
        # the fewest rows every linear takes the native kernel at (one row: oneDNN's, on some)
        self.min_rows = max(lin.native_min_rows for lin in self.all_linears)
        norm, mlp_norm = layer.in_norm, layer.mlp_norm
        qkv, o, up, down = self.linears
        self.weights = DecoderLayerWeights(
            hidden=o.out_features,
            q_size=attn.q_size,
            kv_size=attn.kv_size,
            inter=down.in_features,
            norm_kind=0 if isinstance(norm, RMSNorm) else 1,
            act=ACT_CODES[mlp.act_fn.act],
            gated=int(mlp.gated),
            parallel=int(layer.parallel),
            mlp_norm=int(mlp_norm is not None),
            eps=norm.eps,
            in_w=ptr_or_null(norm.weight),
            in_b=ptr_or_null(getattr(norm, "bias", None)),
            mlp_w=ptr_or_null(getattr(mlp_norm, "weight", None)),
            mlp_b=ptr_or_null(getattr(mlp_norm, "bias", None)),
            qkv_w=ptr_or_null(qkv.panels),
            qkv_b=ptr_or_null(qkv.bias),
            o_w=ptr_or_null(o.panels),
            o_b=ptr_or_null(o.bias),
            up_w=ptr_or_null(up.panels),
            up_b=ptr_or_null(up.bias),
            down_w=ptr_or_null(down.panels),
            down_b=ptr_or_null(down.bias),
            gate_w=ptr_or_null(None if self.gate is None else self.gate.panels),
            gate_heads=0 if self.gate is None else self.gate.out_features,
            post_w=ptr_or_null(getattr(layer.post_attn_norm, "weight", None)),
            post_mlp_w=ptr_or_null(getattr(layer.post_mlp_norm, "weight", None)),
        )

    @property
    def all_linears(self) -> tuple:
        return self.linears if self.gate is None else (*self.linears, self.gate)

    @staticmethod
    def attach(layer: DecoderLayer, native, tp_enabled: bool) -> bool:
        """Gives `layer` the whole-layer path where its shape allows; True if it did."""
        if isinstance(layer.mixer, ShortConv) and layer.self_attn is None:
            return NativeConvLayer.attach(layer, native, tp_enabled)
        if (
            not isinstance(layer.self_attn, Attention)
            or layer.mlp is None
            or layer.mixer is not None
        ):
            # recurrent, MLP-only, mixer-only, attention beside a recurrent mixer, latent
            layer.native_decode = None
            return False
        attn, mlp = layer.self_attn, layer.mlp
        norm, mlp_norm = layer.in_norm, layer.mlp_norm
        linears = NativeDecodeLayer.linears_of(layer)
        if attn.g_proj is not None:  # LFM3's per-head gate: a linear of the same kind
            linears = (*linears, attn.g_proj)
        posts = [n for n in (layer.post_attn_norm, layer.post_mlp_norm) if n is not None]
        fits = (
            not tp_enabled
            and not layer.post_ln
            and layer.residual_scale == 1.0
            and layer.experts_beside is None
            # sandwich norms (LFM3, Gemma 2/3): RMSNorms of the sublayers' outputs before
            # their adds, in a sequential layer of RMSNorms of one eps
            and (
                not posts
                or isinstance(norm, RMSNorm)
                and not layer.parallel
                and all(isinstance(n, RMSNorm) and n.eps == norm.eps for n in posts)
            )
            and isinstance(norm, (RMSNorm, LayerNorm))
            # sequential: an "mlp" norm of the same kind; parallel: that, or none
            and (type(mlp_norm) is type(norm) or (layer.parallel and mlp_norm is None))
            and isinstance(mlp, MLP)
            and ACT_CODES[mlp.act_fn.act] in NATIVE_ACT_CODES
            and attn.native_prep
            and all(isinstance(lin, PackedLinear) and lin.panels is not None for lin in linears)
        )
        rows = min((lin.native_rows for lin in linears), default=0) if fits else 0
        layer.native_decode = NativeDecodeLayer(layer, native, rows) if rows else None
        return layer.native_decode is not None

    def __call__(self, layer: DecoderLayer, x, residual, rope, kv_cache, meta):
        attn = layer.self_attn
        struct, _ = attn.native_layer(rope, kv_cache)
        if struct is None:  # a cache the native step cannot read
            layer.native_decode = None
            return layer.forward(x, residual, rope, kv_cache, meta)
        step = attn.backend.step(meta, None if rope is None else rope.positions)
        return self.native.decoder_layer(self.weights, struct, step, x, residual)


class NativeConvLayer(_WholeLayerCall):
    """A decode step of a few rows through a whole short-convolution layer (LFM2's and LFM3's
    recurrent layers) in one native call (`conv_layer_f32`): the in norm, in_proj, the gated
    convolution's one-token update of each request's window in its state slot, out_proj, LFM3's
    post norm, the add and MLP norm, a gated or plain MLP of a native activation, LFM3's post-MLP
    norm. Taken where `NativeDecodeLayer` is (float32 decode rows, every linear packed with its
    panels and taking the native kernel at the step's rows, no tensor parallelism, RMSNorms only)
    and only while the layer's linears are those it was built on (LoRA turns it off). The same
    kernels in the same order as the module path, so the two agree bit for bit."""

    MIXER, MIXER_LINEARS = "mixer", ("in_proj", "out_proj")

    def __init__(self, layer: DecoderLayer, native, rows: int) -> None:
        mix, mlp = layer.mixer, layer.mlp
        self.native, self.rows = native, rows
        self.linears = self.linears_of(layer)
        self.min_rows = max(lin.native_min_rows for lin in self.linears)
        in_proj, out_proj, up, down = self.linears
        conv = mix.conv1d
        self._keep = conv.weight.detach().contiguous()  # [C, K]: the checkpoint's, float32
        self.weights = ConvLayerWeights(
            hidden=out_proj.out_features,
            channels=mix.channels,
            kernel=conv.weight.shape[1],
            inter=down.in_features,
            act=ACT_CODES[mlp.act_fn.act],
            gated=int(mlp.gated),
            eps=layer.in_norm.eps,
            in_w=ptr_or_null(layer.in_norm.weight),
            post_w=ptr_or_null(getattr(layer.post_attn_norm, "weight", None)),
            mlp_w=ptr_or_null(layer.mlp_norm.weight),
            post_mlp_w=ptr_or_null(getattr(layer.post_mlp_norm, "weight", None)),
            in_proj_w=ptr_or_null(in_proj.panels),
            in_proj_b=ptr_or_null(in_proj.bias),
            conv_w=ptr_or_null(self._keep),
            conv_b=ptr_or_null(conv.bias),
            out_w=ptr_or_null(out_proj.panels),
            out_b=ptr_or_null(out_proj.bias),
            up_w=ptr_or_null(up.panels),
            up_b=ptr_or_null(up.bias),
            down_w=ptr_or_null(down.panels),
            down_b=ptr_or_null(down.bias),
        )

    @staticmethod
    def attach(layer: DecoderLayer, native, tp_enabled: bool) -> bool:
        """Gives the short-convolution `layer` the whole-layer path where its shape allows;
        True if it did."""
        mix, mlp = layer.mixer, layer.mlp
        norms = (layer.in_norm, layer.mlp_norm, layer.post_attn_norm, layer.post_mlp_norm)
        linears = NativeConvLayer.linears_of(layer)
        f32 = (mix.conv1d.weight, *(n.weight for n in norms if n is not None))
        fits = (
            not tp_enabled
            and isinstance(mix, ShortConv)
            and layer.self_attn is None
            and isinstance(mlp, MLP)
            and not layer.post_ln
            and not layer.parallel
            and layer.residual_scale == 1.0
            and layer.ple_gate is None
            and layer.layer_scalar is None
            and layer.experts_beside is None
            and isinstance(layer.in_norm, RMSNorm)
            and isinstance(layer.mlp_norm, RMSNorm)
            and all(n is None or isinstance(n, RMSNorm) for n in norms[2:])
            and len({n.eps for n in norms if n is not None}) == 1
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in f32)
            and (mix.conv1d.bias is None or mix.conv1d.bias.dtype == torch.float32)
            and ACT_CODES[mlp.act_fn.act] in NATIVE_ACT_CODES
            and all(isinstance(lin, PackedLinear) and lin.panels is not None for lin in linears)
        )
        rows = min((lin.native_rows for lin in linears), default=0) if fits else 0
        layer.native_decode = NativeConvLayer(layer, native, rows) if rows else None
        return layer.native_decode is not None

    def __call__(self, layer: DecoderLayer, x, residual, rope, state, meta):
        conv_state = state[0]
        if conv_state.dtype != torch.float32 or not conv_state.is_contiguous():
            layer.native_decode = None  # a state the native call cannot read: modules from now
            return layer.forward(x, residual, rope, state, meta)
        slots, has_init = self.step_slots(meta)
        return self.native.conv_layer(self.weights, conv_state, slots, has_init, x, residual)

    @staticmethod
    def step_slots(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's decode rows' state slots (int32) and continue flags (bool), contiguous:
        made once a step (its metadata's backend state) for every layer of the step."""
        st = meta.backend_state
        got = st.get("conv_slots")
        if got is None:
            n = meta.num_decodes
            slots, init = step_slots(meta)
            slots, init = slots[:n], init[:n]
            got = st["conv_slots"] = (
                slots.to(torch.int32).contiguous(),
                init.to(torch.bool).contiguous(),
            )
        return got


class DecoderModel(DecoderWeights, DecoderLoRA, nn.Module):
    """A causal LM of any described family. Built on the meta device by the model builder,
    then `materialize`d and loaded. With tensor parallelism (`tp`) it is this rank's shard:
    `spec` is the shard's (sharding.py), `full_spec` the model's."""

    def __init__(
        self,
        spec: DecoderSpec,
        config,
        backend: AttentionBackend,
        max_position: int,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        self.tp = tp
        self.full_spec = spec
        if tp.enabled:
            from .sharding import Sharder, local_spec

            self.sharder = Sharder(spec, tp)
            spec = local_spec(spec, tp)
        else:
            self.sharder = None
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
            DecoderLayer(
                self._layer_spec(i),
                self._attention_spec(i),
                backend,
                s.rope[i],
                s.moe_layers[i],
                tp,
                mixer=s.mixers[i],
                has_mlp=s.mlp_layers[i],
                index=i,
            )
            for i in range(s.num_layers)
        )
        for i, src in enumerate(s.kv_source):
            if src is not None:
                self.layers[i].self_attn.link_kv_source(self.layers[src].self_attn)
        # Gemma 4's per-layer inputs: an embedding of every layer's [width] at once, and the
        # projection of the token embedding mixed into it (`_per_layer_inputs`).
        if s.per_layer_input is not None:
            vocab, width = s.per_layer_input
            self.embed_tokens_per_layer = nn.Embedding(vocab, s.num_layers * width)
            self.per_layer_model_projection = nn.Linear(
                s.hidden_size, s.num_layers * width, bias=False
            )
            self.per_layer_projection_norm = make_norm(s.norm, width, uk)
        self.norm = make_norm(s.norm, s.hidden_size, uk) if s.final_norm else None
        # The native CPU kernels (handed to the norms by `optimize_for_cpu`), and whether every
        # layer's rotary runs inside them (then the step gathers no cos/sin for the torch path).
        self.native = backend.kernels if isinstance(backend, NativeCpuBackend) else None
        self.native_rotary = False
        self._plain_layers: bool | None = None  # DecoderModel._whole_native_step
        self.project_out = (
            nn.Linear(s.hidden_size, embed_dim, bias=False) if s.project_dim else None
        )
        self.tied = s.tied
        self.num_labels = s.num_labels
        if s.num_labels is not None:  # a classifier: its score head instead of the LM head
            self.score = nn.Linear(embed_dim, s.num_labels, bias=False)
            self.tied = True  # no lm_head parameter to load (generation is refused)
        elif not self.tied:
            self.lm_head = nn.Linear(embed_dim, s.vocab_size, bias=s.lm_head_bias)
        elif s.lm_head_bias:
            self.lm_head_bias = nn.Parameter(torch.zeros(s.vocab_size))
        self.packed_lm_head = None
        self.quantization = "none"  # for the start-up line; `quantize` says which

    def _layer_spec(self, i: int) -> DecoderSpec:
        """The description as layer i reads it: its q/k norm, head shape and MLP width."""
        s, changes = self.spec, {}
        if not s.qk_norm_layers[i]:
            changes["qk_norm"] = None
        if s.layer_heads[i] is not None:
            changes["num_kv_heads"], changes["head_dim"] = s.layer_heads[i]
        if s.mlp_sizes[i] is not None:
            changes["intermediate_size"] = s.mlp_sizes[i]
        return dataclasses.replace(s, **changes) if changes else s

    def _heads_of(self, i: int) -> tuple[int, int]:
        """Layer i's (num_kv_heads, head_dim)."""
        return self.spec.layer_heads[i] or (self.spec.num_kv_heads, self.spec.head_dim)

    def _attention_spec(self, i: int, slopes: torch.Tensor | None = None) -> AttentionSpec:
        s = self.spec
        kvh, d = self._heads_of(i)
        return AttentionSpec(
            num_heads=s.num_heads,
            num_kv_heads=kvh,
            head_dim=d,
            scale=s.scale if s.scale is not None else d**-0.5,
            sliding_window=s.windows[i],
            chunk_size=s.chunks[i],
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
            slopes = alibi_slopes(self.full_spec.num_heads, self.spec.alibi_bias_max)
            if self.sharder is not None:  # this rank's heads' slopes
                slopes = slopes.narrow(0, *self.sharder.q_heads)
            slopes = (slopes * self.spec.alibi_scale).to(device)
            for i, layer in enumerate(self.layers):
                if layer.self_attn is not None:
                    layer.self_attn.spec = self._attention_spec(i, slopes)
        for layer in self.layers:
            attn = layer.self_attn
            if attn is not None and getattr(attn, "sinks", None) is not None:
                # The parameter itself: loading and dtype changes keep the object.
                attn.spec = dataclasses.replace(attn.spec, sinks=attn.sinks.weight)
        return self

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(parts, heads, width) of a token's cache entry in one layer: K and V of this rank's
        KV heads, or a latent attention layer's one row (`kv_cache.allocate_kv_cache`)."""
        if self.spec.mla is not None:
            return 1, 1, self.spec.mla.width
        # Layers of other head shapes (Gemma 4's global layers): the widest entry, the others
        # views into it (`layer_cache_views`).
        shapes = [self._heads_of(i) for i, a in enumerate(self.spec.attention_layers) if a]
        kvh, d = max(shapes, key=lambda hd: hd[0] * hd[1], default=(self.num_kv_heads, 0))
        return 2, kvh, d or self.head_dim

    def layer_cache_views(self, caches: list) -> list:
        """Each layer's cache in the tensors `kv_cache_shape` sized: a layer whose entries are
        narrower sees its own (heads, dim) view of them (`kv_cache.layer_view`); a layer that
        reads another layer's K/V gets None (the forward hands it the source's)."""
        if self.spec.mla is not None:  # latent attention: one row a token, no per-head views
            return list(caches)
        _, kvh, d = self.kv_cache_shape()
        out = list(caches)
        for i, cache in enumerate(caches):
            if isinstance(cache, torch.Tensor) and self._heads_of(i) != (kvh, d):
                out[i] = layer_view(cache, *self._heads_of(i))
        return out

    def state_shapes(self) -> dict[int, list]:
        """Per recurrent layer, one request's state tensors (shape, dtype) (`state_shapes`)."""
        dtype = self.embed_tokens.weight.dtype
        return {
            i: layer.mixer.state_shapes(dtype)
            for i, layer in enumerate(self.layers)
            if layer.mixer is not None
        }

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tied else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        meta: AttentionMetadata | list[AttentionMetadata],
        images: tuple | None = None,
    ) -> torch.Tensor:
        """Hidden states of every token, after the final norm: [T, hidden]. `kv_caches`: per
        layer its KV tensor, its `RecurrentState` (a recurrent layer), or None (no mixer).
        `positions`: [T], or [3, T] multimodal rotary positions (M-RoPE). `images`: (rows,
        embeddings, deepstack or None) of a vision-language model's step: the embeddings
        replace those rows' token embeddings (after the embedding scale, as transformers
        scatters them), and deepstack level i is added to the rows after layer i."""
        s = self.spec
        x = self._embed(input_ids)
        if s.embed_scale is not None:
            x = x * torch.tensor(s.embed_scale, dtype=x.dtype)
        deepstack = None
        if images is not None:
            rows, embeds, deepstack = images
            x = x.index_copy(0, rows, embeds.to(x.dtype))
        if self.project_in is not None:
            x = self.project_in(x)
        if positions.dim() == 2:
            steps = [self._mrope_step(cache, r, positions, x.dtype) for cache, r in self._ropes()]
            positions = positions[0]
        else:
            steps = [
                rotary_step(
                    cache,
                    positions,
                    x.dtype,
                    self.use_kernels,
                    gather=r.is_neox and r.rot_dim == s.head_dim and not self.native_rotary,
                )
                for cache, r in self._ropes()
            ]
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions + s.position_offset)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        per_layer = None
        if s.per_layer_input is not None:
            ids = input_ids
            if images is not None and s.per_layer_image_id is not None:
                ids = ids.index_fill(0, images[0], s.per_layer_image_id)
            per_layer = self._per_layer_inputs(ids, x)
        residual = None
        temps = None
        if s.attn_temperature is not None:  # for the layers without rotary
            temps = attention_temperature(positions, *s.attn_temperature)
        # One metadata for every layer, or (cache groups) a list: each layer's group's.
        metas = meta if isinstance(meta, list) else itertools.repeat(meta)
        if self._whole_native_step(x, meta, per_layer, temps, images):
            # Every layer in one native call each: no module call or per-layer branches.
            native = True
            layers = zip(self.layers, kv_caches, self.rope_of_layer, metas)
            for layer, cache, r, m in layers:
                rope = None if r is None else steps[r]
                native = native and layer.native_decode.same_linears(layer)
                if native:
                    x, residual = layer.native_decode(layer, x, residual, rope, cache, m)
                else:  # a linear replaced since (LoRA): this and later layers as modules
                    x, residual = layer(x, residual, rope, cache, m)
            x, _ = _add_norm(self.norm, x, residual)
            if self.project_out is not None:
                x = self.project_out(x)
            return x
        layers = zip(self.layers, kv_caches, self.rope_of_layer, metas)
        for i, (layer, cache, r, m) in enumerate(layers):
            src = s.kv_source[i]
            if src is not None:  # the source layer's cache and its group's metadata
                cache, m = kv_caches[src], meta[src] if isinstance(meta, list) else meta
            extra = {}
            if per_layer is not None:
                extra["per_layer_input"] = per_layer[:, i]
            if r is None:
                x, residual = layer(x, residual, None, cache, m, q_scale=temps, **extra)
            else:
                x, residual = layer(x, residual, steps[r], cache, m, **extra)
            if deepstack is not None and i < len(deepstack):
                x = x.index_add(0, images[0], deepstack[i].to(x.dtype))
        for src in {src for src in s.kv_source if src is not None}:
            self.layers[src].self_attn.kv_out = None  # this step's only: let them go
        x, _ = _add_norm(self.norm, x, residual)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def _ropes(self):
        return zip(self.rope_caches, self.rope_specs)

    def _whole_native_step(self, x, meta, per_layer, temps, images) -> bool:
        """Whether every layer takes this step in its whole-layer native call (a decode step of
        plain layers, NativeDecodeLayer.takes): the layer loop then calls them directly. What
        `takes` asks of x and the residual holds for every layer once it holds for the first
        (each layer's outputs are new contiguous float32 rows of the same shape)."""
        if per_layer is not None or temps is not None or images is not None:
            return False
        if self._plain_layers is None:  # what the model's shape allows, once
            self._plain_layers = all(src is None for src in self.spec.kv_source) and all(
                lay.ple_gate is None and lay.layer_scalar is None for lay in self.layers
            )
        if not self._plain_layers:
            return False
        T = x.shape[0]
        first = meta[0] if isinstance(meta, list) else meta
        if first.num_decodes != T or x.dtype != torch.float32 or not x.is_contiguous():
            return False
        if _global_hooks():
            return False
        for layer in self.layers:
            nd = layer.native_decode
            if nd is None or not nd.min_rows <= T <= nd.rows:
                return False
            if layer._forward_pre_hooks or layer._forward_hooks:  # (eagle.py's taps) as modules
                return False
        return True

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Gemma 4's per-layer inputs [T, layers, width]: the per-layer embedding (times
        sqrt(width), rounded to the dtype) and the RMS-normed projection of the token embedding
        `x` (times hidden ** -0.5), averaged by 2 ** -0.5, as transformers mixes them."""
        s = self.spec
        width = s.per_layer_input[1]
        shape = (x.shape[0], s.num_layers, width)
        own = self._vocab_lookup(
            self.embed_tokens_per_layer, input_ids, self.full_spec.per_layer_input[0]
        )
        own = (own * torch.tensor(width**0.5, dtype=own.dtype)).view(shape)
        mixed = self.per_layer_model_projection(x) * s.hidden_size**-0.5
        mixed = self.per_layer_projection_norm(mixed.view(shape))
        return (mixed + own) * 2.0**-0.5

    def _mrope_step(self, cache, r: RopeSpec, positions: torch.Tensor, dtype) -> RotaryStep:
        """A step's rotary for [3, T] positions: the rows of this step's table mix the three
        streams per frequency (`mrope_table`), looked up by row index."""
        params = r.params_dict()
        section = params.get("mrope_section")
        if section is None:  # a table without sections rotates by the first stream
            table = cache.index_select(0, positions[0])
        else:
            table = mrope_table(cache, positions, section, bool(params.get("mrope_interleaved")))
        index = torch.arange(positions.shape[1], device=positions.device)
        gather = r.is_neox and r.rot_dim == self.spec.head_dim and not self.native_rotary
        return rotary_step(table, index, dtype, self.use_kernels, gather=gather)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._vocab_lookup(self.embed_tokens, input_ids, self.full_spec.vocab_size)

    def _vocab_lookup(self, table: nn.Embedding, input_ids: torch.Tensor, vocab: int):
        """`table`'s rows of `input_ids`, of a vocabulary of `vocab` rows. Vocab-parallel: each
        rank looks up the ids in its rows (`table` holds them), zeros for the others, summed
        (exactly the one rank's row: every other term is zero)."""
        if not self.tp.enabled:
            return table(input_ids)
        first, rows = self.tp.vocab_range(vocab)
        local = input_ids - first
        mine = (local >= 0) & (local < rows)
        x = table(torch.where(mine, local, 0))
        return self.tp.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))

    classifier_pooling = "last"  # transformers' ...ForSequenceClassification reads the last token

    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        """A classifier checkpoint's logits [N, num_labels] for pooled final hidden states
        (pooling.py's classifier head)."""
        return self.score(rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [N, vocab]. With tensor parallelism every rank computes its vocab rows and
        rank 0 gets them all (the other ranks get None)."""
        s = self.spec
        if self.packed_lm_head is not None:
            logits = self.packed_lm_head(hidden)
        elif self.tied:
            logits = F.linear(hidden, self.embed_tokens.weight, getattr(self, "lm_head_bias", None))
        else:
            logits = self.lm_head(hidden)
        if self.tp.enabled:
            logits = self.tp.gather_last_dim(logits)
            if logits is None:
                return None
            logits = logits[:, : self.full_spec.vocab_size]
        if s.logit_scale != 1.0:
            logits = logits * s.logit_scale
        if s.final_softcap is not None:
            logits = torch.tanh(logits / s.final_softcap) * s.final_softcap
        return logits

    def optimize_for_cpu(self) -> str | None:
        """Packs the linear layers for oneDNN (after weights are loaded; float32, and bfloat16
        where the CPU has bfloat16 arithmetic: `packable_dtype`), and
        hands the norms and linears the native CPU kernels when the backend has them (norms
        check their input's dtype at every call; linears take the native kernel for the step
        sizes where it measures faster, `use_native_linears`). Returns the linears' choice for
        the start-up line, or None."""
        float32 = self.embed_tokens.weight.dtype == torch.float32
        if self.native is not None:
            for m in self.modules():
                if isinstance(m, (RMSNorm, LayerNorm)):
                    m.native = self.native
                elif isinstance(m, (SiluAndMul, ActAndMul, Activation)):
                    m.native = self.native if ACT_CODES[m.act] in NATIVE_ACT_CODES else None
            self.native_rotary = float32 and all(
                layer.self_attn.native_prep for layer in self.layers if layer.self_attn is not None
            )
        native = self.native is not None and float32
        dtype = self.embed_tokens.weight.dtype
        if not pack_linears_for_cpu(self, keep_panels=native, dtype=dtype):
            return None
        for m in self.modules():
            if isinstance(m, Experts) and not m.use_kernels:
                m.pack_for_cpu(self.native if native else None)
        if self.num_labels is not None:
            pass  # a classifier has no LM head to pack
        elif self.packed_lm_head is not None:
            pass  # given at load: the GGUF file's blocks (layers/gguf_linear.py)
        elif self.tied:  # the embedding itself stays plain for the lookup
            bias = getattr(self, "lm_head_bias", None)
            self.packed_lm_head = PackedLinear(None, self.embed_tokens.weight, keep_panels=native)
            self.packed_lm_head.bias = None if bias is None else bias.detach().contiguous()
        else:
            self.packed_lm_head = self.lm_head
        if not native:
            return None
        choice = use_native_linears(self, self.native)
        whole = sum(
            NativeDecodeLayer.attach(layer, self.native, self.tp.enabled) for layer in self.layers
        )
        return f"{choice}; whole decode layers in one native call: {whole} of {len(self.layers)}"

"""Hybrids of attention and Gated DeltaNet (linear attention with the gated delta rule,
layers/gated_deltanet.py): Qwen3-Next, Qwen3.5 (dense and MoE, and the text part of their
multimodal checkpoints, loader/multimodal.py) and OLMo Hybrid. Their kinds of layers come from
`layer_types`: "linear_attention" (Gated DeltaNet) or "full_attention".

What differs from Llama:

- Qwen3-Next: gated attention (q_proj gives each head [q_h | gate_h]; the output is multiplied by
  sigmoid(gate)); partial rotary (`partial_rotary_factor`, 0.25 by default); q/k RMSNorm per head;
  zero-centred RMSNorms, (1 + w), everywhere but the Gated DeltaNet's own gated norm; a MoE on
  the sparse layers (`mlp_only_layers`, `decoder_sparse_step`) with a shared expert behind a
  sigmoid gate, a dense MLP on the others. Its Gated DeltaNet's in_proj_qkvz and in_proj_ba are
  interleaved per key head. Its multi-token-prediction tensors (`mtp.*`) are skipped here and
  read by speculative decoding's `mtp` method (engine/eagle.py).
- Qwen3.5: Qwen3-Next's shape with the Gated DeltaNet projections apart (in_proj_qkv, in_proj_z,
  in_proj_b, in_proj_a); a dense MLP on every layer (Qwen3.5) or a MoE with a shared expert on
  every layer (Qwen3.5-MoE, top-k always renormalised). Its multimodal rope (M-RoPE, Qwen3-VL's
  interleaved layout over the partial rotary part, sections [11, 11, 10] by default) is kept in
  the rope settings for images (models/vision/qwen_vl.py); on text its three position streams
  are equal and it is the plain rotation.
- OLMo Hybrid: OLMo 3's attention layers (norms after attention and after the MLP, q/k RMSNorm
  over all heads; rope, or none (NoPE) when rope_theta is None) beside Gated DeltaNet layers with
  Llama's norms before; separate q/k/v/g(ate)/b/a projections and convolutions, a gated norm of
  eps 1e-5, beta doubled with `linear_allow_neg_eigval`.
"""

from __future__ import annotations

from ..layers.gated_deltanet import GatedDeltaNetSpec
from ..layers.rotary import rope_parameters
from .decoder import DecoderSpec, MoESpec, expert_names
from .families import family, head_dim_of, llama_like, llama_names, rope_of
from .families_moe import QK_NORMS, QWEN_EXPERTS, _qwen_sparse_layers

LAYER_KINDS = {"linear_attention": "recurrent", "full_attention": "attention"}

# The Qwen Gated DeltaNet's tensors (either checkpoint layout) and its gated attention's q_proj.
QWEN_LINEAR = {
    "linear_attn": "mixer",  # A_log, dt_bias
    "linear_attn.in_proj_qkvz": ("mixer.in_proj", "mixer:qkvz:2"),
    "linear_attn.in_proj_ba": ("mixer.in_proj", "mixer:ba:2"),
    "linear_attn.in_proj_qkv": ("mixer.in_proj", "mixer:qkv:4"),
    "linear_attn.in_proj_z": ("mixer.in_proj", "mixer:z:4"),
    "linear_attn.in_proj_b": ("mixer.in_proj", "mixer:b:4"),
    "linear_attn.in_proj_a": ("mixer.in_proj", "mixer:a:4"),
    "linear_attn.conv1d": "mixer.conv1d",
    "linear_attn.norm": "mixer.norm",
    "linear_attn.out_proj": "mixer.out_proj",
    "self_attn.q_proj": ("self_attn.qkv_proj", "q_gated"),
    **QK_NORMS,
}

# The Qwen MoE block: per-expert tensors, or (newer checkpoints) every expert's in one 3-D tensor
# ([E, 2I, H] gate | up, [E, H, I] down: the stacked weights' own layout).
QWEN_MOE = {
    "mlp.gate": "mlp.gate",
    "mlp.experts.gate_up_proj": "mlp.experts.w13",
    "mlp.experts.down_proj": "mlp.experts.w2",
    "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", "gate"),
    "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", "up"),
    "mlp.shared_expert.down_proj": "mlp.shared_expert.down_proj",
    "mlp.shared_expert_gate": "mlp.shared_expert_gate",
}


def layer_mixers(config) -> tuple[str, ...]:
    """Per layer, "recurrent" (linear_attention) or "attention" (full_attention)."""
    unknown = sorted(set(config.layer_types) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(f"unknown layer types {unknown}")
    return tuple(LAYER_KINDS[k] for k in config.layer_types)


def gated_deltanet(config, norm_eps: float, beta_scale: float = 1.0) -> GatedDeltaNetSpec:
    if config.hidden_act != "silu":  # the convolution's activation is hidden_act
        raise ValueError(
            f"hidden_act {config.hidden_act!r}: the Gated DeltaNet convolution takes silu only"
        )
    return GatedDeltaNetSpec(
        num_k_heads=config.linear_num_key_heads,
        num_v_heads=config.linear_num_value_heads,
        head_k_dim=config.linear_key_head_dim,
        head_v_dim=config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
        norm_eps=norm_eps,
        beta_scale=beta_scale,
    )


def attention_rope(config, mixers, params: dict | None = None) -> tuple:
    """The config's rope on the attention layers only (params: rope settings, else the config's;
    NoPE when its rope_theta is None)."""
    params = dict(params if params is not None else rope_parameters(config))
    if params.get("rope_theta") is None:
        return (None,) * len(mixers)
    rope = rope_of(config, head_dim_of(config), params=params)
    return tuple(r if m == "attention" else None for r, m in zip(rope, mixers))


# transformers' Qwen3.5 text rotary: these sections when the config names none, interleaved
QWEN3_5_MROPE_SECTION = [11, 11, 10]


def qwen3_5_rope(config) -> dict:
    """Qwen3.5's rope settings with its M-RoPE kept for images: the sections (over the rot_dim / 2
    frequencies of the partial rotary part) and the interleaved layout, which transformers uses
    whatever the config says (as Qwen3-VL's). On text the three streams are equal and the
    rotation is the plain one."""
    params = rope_parameters(config)
    params["mrope_section"] = list(params.get("mrope_section") or QWEN3_5_MROPE_SECTION)
    params["mrope_interleaved"] = True
    return params


def qwen_hybrid(
    config, moe: MoESpec | None, moe_layers, names=None, params=None, **overrides
) -> DecoderSpec:
    """Qwen3-Next's shape (Qwen3.5's too): see the module docstring. `params`: the rope
    settings, else the config's."""
    mixers = layer_mixers(config)
    names = names or llama_names(**QWEN_LINEAR)
    names.skip_prefixes = ("mtp.",)
    return llama_like(
        config,
        names=names,
        norm_weight_offset=1.0,
        qk_norm="rms_head",
        attn_output_gate=True,
        rope=attention_rope(config, mixers, params),
        mixers=mixers,
        recurrent=gated_deltanet(config, config.rms_norm_eps),
        moe=moe,
        moe_layers=moe_layers,
        **overrides,
    )


def qwen_moe_names(num_experts: int):
    return llama_names(
        **QWEN_LINEAR, **QWEN_MOE, **expert_names(QWEN_EXPERTS[0], num_experts, *QWEN_EXPERTS[1:])
    )


@family("Qwen3NextForCausalLM")
def qwen3_next(config) -> DecoderSpec:
    e = config.num_experts
    if not e:
        return qwen_hybrid(config, None, None)
    shared = config.shared_expert_intermediate_size or 0
    moe = MoESpec(
        num_experts=e,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        shared_size=shared,
        shared_gate=shared > 0,
    )
    return qwen_hybrid(config, moe, _qwen_sparse_layers(config), qwen_moe_names(e))


@family("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
def qwen3_5(config) -> DecoderSpec:
    return qwen_hybrid(config, None, None, params=qwen3_5_rope(config))


@family("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
def qwen3_5_moe(config) -> DecoderSpec:
    e = config.num_experts
    shared = config.shared_expert_intermediate_size or 0
    moe = MoESpec(
        num_experts=e,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        renormalize=True,
        shared_size=shared,
        shared_gate=shared > 0,
    )
    n = config.num_hidden_layers
    # every layer is sparse: the config has no dense MLP width (none is built)
    names = qwen_moe_names(e)
    return qwen_hybrid(
        config,
        moe,
        (True,) * n,
        names,
        params=qwen3_5_rope(config),
        intermediate_size=config.moe_intermediate_size,
    )


OLMO_LINEAR = {
    "linear_attn": "mixer",  # A_log, dt_bias
    "linear_attn.q_proj": ("mixer.in_proj", "mixer:q:6"),
    "linear_attn.k_proj": ("mixer.in_proj", "mixer:k:6"),
    "linear_attn.v_proj": ("mixer.in_proj", "mixer:v:6"),
    "linear_attn.g_proj": ("mixer.in_proj", "mixer:z:6"),
    "linear_attn.b_proj": ("mixer.in_proj", "mixer:b:6"),
    "linear_attn.a_proj": ("mixer.in_proj", "mixer:a:6"),
    "linear_attn.conv1d": "mixer.conv1d",
    "linear_attn.q_conv1d": ("mixer.conv1d", "mixer:conv_q:3"),
    "linear_attn.k_conv1d": ("mixer.conv1d", "mixer:conv_k:3"),
    "linear_attn.v_conv1d": ("mixer.conv1d", "mixer:conv_v:3"),
    "linear_attn.o_norm": "mixer.norm",
    "linear_attn.o_proj": "mixer.out_proj",
    **QK_NORMS,
}

# OLMo-core's checkpoints (and transformers' save_pretrained, which writes them back) name the
# norm after attention and the one before the MLP alike; which is which depends on the layer.
OLMO_NORMS = {
    "recurrent": {
        "attention_layer_norm": "in_norm",
        "input_layernorm": "in_norm",
        "feedforward_layer_norm": "mlp_norm",
        "post_attention_layernorm": "mlp_norm",
    },
    "attention": {
        "feedforward_layer_norm": "post_attn_norm",
        "post_attention_layernorm": "post_attn_norm",
        "post_feedforward_layernorm": "post_mlp_norm",
    },
}


@family("OlmoHybridForCausalLM")
def olmo_hybrid(config) -> DecoderSpec:
    mixers = layer_mixers(config)
    names = llama_names(**OLMO_LINEAR)
    names.mixer_layer = OLMO_NORMS
    beta_scale = 2.0 if config.linear_allow_neg_eigval else 1.0
    return llama_like(
        config,
        names=names,
        qk_norm="rms_full",
        mixer_norms={"attention": ("post_attn", "post_mlp"), "recurrent": ("in", "mlp")},
        rope=attention_rope(config, mixers),
        mixers=mixers,
        # FLA's fused gated norm, which OLMo Hybrid was trained with, has eps 1e-5
        recurrent=gated_deltanet(config, 1e-5, beta_scale),
    )

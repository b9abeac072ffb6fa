"""Hybrids of attention and short convolutions: Liquid's LFM2 (`Lfm2ForCausalLM`) and LFM3
(`Lfm3ForCausalLM`), whose non-attention layers are gated short convolutions
(layers/short_conv.py).

What LFM2 changes from Llama: per-layer kinds from `layer_types` ("conv" or "full_attention");
q/k RMSNorm per head ("q_layernorm"); a SwiGLU MLP named w1/w3/w2 whose width may be
auto-adjusted from the config's (2/3, a multiplier, rounded up to a multiple); the final norm is
named `embedding_norm` although it comes last.

What LFM3 changes from LFM2: sliding-window attention layers beside the full ones, each kind
with its own rope (the full layers' "proportional": half the frequency pairs rotate); a sigmoid
gate per attention head from the layer's input (`attn_head_gate`); norms on the mixer's and the
MLP's outputs before the residual add ("sandwich" norms); Qwen 3's attention names; the MLP
width as configured.
"""

from __future__ import annotations

from ..layers.short_conv import ShortConvSpec
from .decoder import DecoderSpec, NormSpec, RopeSpec
from .families import family, head_dim_of, llama_like, llama_names


def lfm2_mlp_width(config) -> int:
    """Lfm2MLP's width: intermediate_size, or with block_auto_adjust_ff_dim 2/3 of it, times the
    multiplier, rounded up to block_multiple_of."""
    width = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):
        width = int(2 * width / 3)
        multiplier = getattr(config, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            width = int(multiplier * width)
            step = config.block_multiple_of
            width = step * ((width + step - 1) // step)
    return width


# The names LFM2 and LFM3 share: the convolution, the MLP (w1/w3/w2) and the two norms.
LFM_LAYER = {
    "conv.in_proj": "mixer.in_proj",
    "conv.conv": "mixer.conv1d",
    "conv.out_proj": "mixer.out_proj",
    "feed_forward.w1": ("mlp.gate_up_proj", "gate"),
    "feed_forward.w3": ("mlp.gate_up_proj", "up"),
    "feed_forward.w2": "mlp.down_proj",
    "operator_norm": "in_norm",
    "ffn_norm": "mlp_norm",
}
LFM2_LAYER = {
    **LFM_LAYER,
    "self_attn.q_layernorm": "self_attn.q_norm",
    "self_attn.k_layernorm": "self_attn.k_norm",
    "self_attn.out_proj": "self_attn.o_proj",
}


@family("Lfm2ForCausalLM")
def lfm2(config) -> DecoderSpec:
    names = llama_names(**LFM2_LAYER)
    names.top["model.embedding_norm"] = "norm"
    kinds = config.layer_types
    return llama_like(
        config,
        names=names,
        intermediate_size=lfm2_mlp_width(config),
        qk_norm="rms_head",
        norm=NormSpec("rms", config.norm_eps),
        act="silu",
        mixers=tuple("recurrent" if k == "conv" else "attention" for k in kinds),
        recurrent=ShortConvSpec(config.conv_L_cache, bool(config.conv_bias)),
        tied=bool(getattr(config, "tie_word_embeddings", True)),
    )


LFM3_LAYER = {
    **LFM_LAYER,
    "self_attn.q_norm": "self_attn.q_norm",
    "self_attn.k_norm": "self_attn.k_norm",
    "self_attn.gate_proj": "self_attn.g_proj",  # the checkpoints' name (transformers renames it)
    "self_attn.g_proj": "self_attn.g_proj",
    "post_operator_norm": "post_attn_norm",
    "post_ffn_norm": "post_mlp_norm",
}


def layer_rope(params: dict, head_dim: int) -> RopeSpec:
    """One layer kind's rope: "proportional" spans the whole head (its partial factor picks
    which frequency pairs rotate); any other type rotates the first partial_rotary_factor of
    the head."""
    params = dict(params)
    if params.get("rope_type") == "proportional":
        return RopeSpec.of(params, head_dim)
    partial = params.pop("partial_rotary_factor", None) or 1.0
    return RopeSpec.of(params, int(head_dim * partial))


@family("Lfm3ForCausalLM")
def lfm3(config) -> DecoderSpec:
    d = head_dim_of(config)
    kinds = config.layer_types
    unknown = set(kinds) - {"conv", "full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"unknown LFM3 layer types {sorted(unknown)}")
    rope = tuple(None if k == "conv" else layer_rope(config.rope_parameters[k], d) for k in kinds)
    window = getattr(config, "sliding_window", None)
    sandwich = bool(getattr(config, "use_sandwich_norm", True))
    names = llama_names(**LFM3_LAYER)
    names.top["model.embedding_norm"] = "norm"
    return llama_like(
        config,
        names=names,
        qk_norm="rms_head",
        norm=NormSpec("rms", config.norm_eps),
        act="silu",
        layer_norms=("in", "post_attn", "mlp", "post_mlp") if sandwich else ("in", "mlp"),
        windows=tuple(window if k == "sliding_attention" else None for k in kinds),
        rope=rope,
        attn_head_gate=bool(getattr(config, "use_attention_gate", True)),
        mixers=tuple("recurrent" if k == "conv" else "attention" for k in kinds),
        recurrent=ShortConvSpec(config.conv_L_cache, bool(config.conv_bias)),
        tied=bool(getattr(config, "tie_word_embeddings", True)),
    )

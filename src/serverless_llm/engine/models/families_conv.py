"""Hybrids of attention and short convolutions: Liquid's LFM2 (`Lfm2ForCausalLM`), whose
non-attention layers are gated short convolutions (layers/short_conv.py).

What differs from Llama: per-layer kinds from `layer_types` ("conv" or "full_attention"); q/k
RMSNorm per head ("q_layernorm"); a SwiGLU MLP named w1/w3/w2 whose width may be auto-adjusted
from the config's (2/3, a multiplier, rounded up to a multiple); the final norm is named
`embedding_norm` although it comes last.
"""

from __future__ import annotations

from ..layers.short_conv import ShortConvSpec
from .decoder import DecoderSpec
from .families import family, llama_like, llama_names


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


LFM2_LAYER = {
    "self_attn.q_layernorm": "self_attn.q_norm",
    "self_attn.k_layernorm": "self_attn.k_norm",
    "self_attn.out_proj": "self_attn.o_proj",
    "conv.in_proj": "mixer.in_proj",
    "conv.conv": "mixer.conv1d",
    "conv.out_proj": "mixer.out_proj",
    "feed_forward.w1": ("mlp.gate_up_proj", "gate"),
    "feed_forward.w3": ("mlp.gate_up_proj", "up"),
    "feed_forward.w2": "mlp.down_proj",
    "operator_norm": "in_norm",
    "ffn_norm": "mlp_norm",
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
        norm=llama_like(config).norm.__class__("rms", config.norm_eps),
        act="silu",
        mixers=tuple("recurrent" if k == "conv" else "attention" for k in kinds),
        recurrent=ShortConvSpec(config.conv_L_cache, bool(config.conv_bias)),
        tied=bool(getattr(config, "tie_word_embeddings", True)),
    )

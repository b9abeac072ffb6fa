"""The ALiBi families and Falcon as descriptions (see families.py): Bloom, MPT, and Falcon's
old and new decoders, with rotary or ALiBi.

How each scales its ALiBi bias against the softmax scale, from transformers' modeling files:
Bloom adds it unscaled (`alibi.baddbmm(q, k, beta=1, alpha=1/sqrt(d))`), MPT too (scores times
`softmax_scale`, then + bias), Falcon scales it with the scores (`(q.k + alibi) / sqrt(d)`), so
its slopes are multiplied by the softmax scale.
"""

from __future__ import annotations

import math

from .decoder import DecoderSpec, NormSpec, WeightNames
from .families import _get, base_shape, family, rope_of


class UnsupportedConfigError(ValueError):
    """A checkpoint of a served architecture whose config asks for something the engine does
    not do."""


def _refuse(arch: str, what: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"{arch}: {what} is not supported")


def _common(config, **kw) -> dict:
    """What every family here reads the same way."""
    return dict(
        **base_shape(config),
        tied=bool(getattr(config, "tie_word_embeddings", True)),
        gated=False,
        **kw,
    )


# -- Bloom -------------------------------------------------------------------------------------

BLOOM_NAMES = WeightNames(
    "transformer.h",
    {
        "self_attention.query_key_value": ("self_attn.qkv_proj", "qkv_heads"),
        "self_attention.dense": "self_attn.o_proj",
        "mlp.dense_h_to_4h": "mlp.up_proj",
        "mlp.dense_4h_to_h": "mlp.down_proj",
        "input_layernorm": "in_norm",
        "post_attention_layernorm": "mlp_norm",
    },
    {
        "transformer.word_embeddings": "embed_tokens",
        "transformer.word_embeddings_layernorm": "embed_norm",
        "transformer.ln_f": "norm",
        "lm_head": "lm_head",
    },
    base_prefix="transformer.",  # bigscience's checkpoints are saved from BloomModel
)


@family("BloomForCausalLM")
def bloom(config) -> DecoderSpec:
    if getattr(config, "apply_residual_connection_post_layernorm", False):
        raise _refuse(
            "BloomForCausalLM",
            "apply_residual_connection_post_layernorm=True (the normalised stream as residual)",
        )
    return DecoderSpec(
        **_common(config),
        num_kv_heads=config.num_attention_heads,
        intermediate_size=4 * config.hidden_size,
        names=BLOOM_NAMES,
        norm=NormSpec("layer", config.layer_norm_epsilon, bias=True),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        act="gelu_pytorch_tanh",  # bloom_gelu_forward: the tanh approximation
        embed_norm=True,
        alibi_scale=1.0,
    )


# -- MPT ---------------------------------------------------------------------------------------

MPT_NAMES = WeightNames(
    "transformer.blocks",
    {
        "attn.Wqkv": "self_attn.qkv_proj",  # [q | k | v] rows, the engine's own order
        "attn.out_proj": "self_attn.o_proj",
        "ffn.up_proj": "mlp.up_proj",
        "ffn.down_proj": "mlp.down_proj",
        "norm_1": "in_norm",
        "norm_2": "mlp_norm",
    },
    {"transformer.wte": "embed_tokens", "transformer.norm_f": "norm", "lm_head": "lm_head"},
    base_prefix="transformer.",
)


@family("MptForCausalLM", "MPTForCausalLM")  # the second: mosaicml's own (remote code) name
def mpt(config) -> DecoderSpec:
    arch = "MptForCausalLM"
    ac = config.attn_config
    attn = ac if isinstance(ac, dict) else ac.to_dict()
    if not attn.get("alibi", True):
        raise _refuse(arch, "attn_config.alibi=False (learned or rotary positions)")
    if attn.get("rope", False):
        raise _refuse(arch, "attn_config.rope=True")
    if attn.get("qk_ln", False):
        raise _refuse(arch, "attn_config.qk_ln=True (LayerNorm on queries and keys)")
    if attn.get("prefix_lm", False):
        raise _refuse(arch, "attn_config.prefix_lm=True (bidirectional attention on the prompt)")
    kind = attn.get("attn_type", "multihead_attention")
    if kind != "multihead_attention":
        raise _refuse(arch, f"attn_config.attn_type={kind!r} (transformers' MPT has neither)")
    if not getattr(config, "no_bias", True):
        raise _refuse(arch, "no_bias=False (biases; transformers' MPT has none either)")
    logit_scale = getattr(config, "logit_scale", None)
    if logit_scale == "inv_sqrt_d_model":
        logit_scale = 1.0 / math.sqrt(config.hidden_size)
    return DecoderSpec(
        **_common(config),
        num_kv_heads=config.num_attention_heads,
        intermediate_size=int(_get(config, "expansion_ratio", default=4) * config.hidden_size),
        names=MPT_NAMES,
        norm=NormSpec("layer", config.layer_norm_epsilon, bias=False),
        scale=attn.get("softmax_scale"),
        clip_qkv=attn.get("clip_qkv") or None,
        act="gelu",
        alibi_scale=1.0,
        alibi_bias_max=float(attn.get("alibi_bias_max", 8)),
        # transformers leaves logit_scale out; MPT's own code multiplies the logits by it.
        logit_scale=float(logit_scale) if logit_scale is not None else 1.0,
    )


# -- Falcon ------------------------------------------------------------------------------------

FALCON_TOP = {
    "transformer.word_embeddings": "embed_tokens",
    "transformer.ln_f": "norm",
    "lm_head": "lm_head",
}


@family("FalconForCausalLM")
def falcon(config) -> DecoderSpec:
    """Falcon's new decoder (40B, 180B, Falcon 2/3-style: grouped [kv_heads, group + 2, d]
    q/k/v, the attention and the MLP in parallel, each with its norm or both with one) and the
    old one (7B: multi-query, parallel, one norm; RW: a q/k/v per head, ALiBi, sequential)."""
    arch = "FalconForCausalLM"
    h = config.num_attention_heads
    d = config.hidden_size // h
    new = bool(config.new_decoder_architecture)
    parallel = bool(config.parallel_attn)
    layer = {
        "self_attention.dense": "self_attn.o_proj",
        "mlp.dense_h_to_4h": "mlp.up_proj",
        "mlp.dense_4h_to_h": "mlp.down_proj",
    }
    if new:
        if not parallel:
            raise _refuse(arch, "new_decoder_architecture with parallel_attn=False")
        kvh = config.num_kv_heads
        layer["self_attention.query_key_value"] = ("self_attn.qkv_proj", "qkv_grouped")
        two = (getattr(config, "num_ln_in_parallel_attn", None) or 2) == 2
    else:
        kvh = 1 if config.multi_query else h
        # multi-query: [q | k | v] rows already; otherwise [heads, 3, d].
        qkv = "self_attn.qkv_proj" if config.multi_query else ("self_attn.qkv_proj", "qkv_heads")
        layer["self_attention.query_key_value"] = qkv
        two = False
    if two:
        layer.update(ln_attn="in_norm", ln_mlp="mlp_norm")
        norms = ("in", "mlp")
    elif parallel:
        layer.update(input_layernorm="in_norm")
        norms = ("in",)
    else:
        layer.update(input_layernorm="in_norm", post_attention_layernorm="mlp_norm")
        norms = ("in", "mlp")
    bias = bool(config.bias)
    alibi = bool(config.alibi)
    return DecoderSpec(
        **_common(config),
        num_kv_heads=kvh,
        intermediate_size=_get(config, "ffn_hidden_size", default=4 * config.hidden_size),
        names=WeightNames("transformer.h", layer, dict(FALCON_TOP), base_prefix="transformer."),
        norm=NormSpec("layer", config.layer_norm_epsilon, bias=True),
        layer_norms=norms,
        parallel=parallel,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        act=_get(config, "activation", default="gelu"),
        rope=None if alibi else rope_of(config, d),
        alibi_scale=d**-0.5 if alibi else None,
    )

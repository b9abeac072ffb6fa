"""The GPT-shaped families as descriptions (see families.py): LayerNorm with bias, a plain
two-matrix MLP, and positions learned (GPT-2, GPT-BigCode, OPT) or rotary over part of each
head (GPT-J, GPT-NeoX, Phi), some with attention and MLP side by side (GPT-J, GPT-NeoX, Phi).

What each option computes comes from transformers' modeling file of the family; options this
engine does not implement are refused with a ValueError naming them, never run approximately.
"""

from __future__ import annotations

from ..layers.rotary import rope_parameters
from .decoder import DecoderSpec, NormSpec, RopeSpec, WeightNames
from .families import _get, base_shape, family, num_kv_heads_of, rope_of


def _arch(config) -> str:
    return (config.architectures or ["?"])[0]


def _refuse(config, *options: str) -> None:
    """ValueError for the first of `options` the config switches on."""
    on = [name for name in options if getattr(config, name, False)]
    if on:
        raise ValueError(f"{_arch(config)}: {', '.join(on)} is not supported by this engine")


def _learned_positions(config) -> int:
    return int(_get(config, "n_positions", "max_position_embeddings"))


# -- GPT-2 and GPT-BigCode: learned positions, ln_1 / ln_2, c_attn fused [q | k | v] -------------


def _gpt2_names(how_attn, how: str | None) -> WeightNames:
    """GPT-2 (Conv1D weights, `how` "t") and GPT-BigCode (nn.Linear, `how` None)."""

    def place(internal, placement):
        return internal if placement is None else (internal, placement)

    layer = {
        "ln_1": "in_norm",
        "ln_2": "mlp_norm",
        "attn.c_attn": place("self_attn.qkv_proj", how_attn),
        "attn.c_proj": place("self_attn.o_proj", how),
        "mlp.c_fc": place("mlp.up_proj", how),
        "mlp.c_proj": place("mlp.down_proj", how),
    }
    top = {
        "transformer.wte": "embed_tokens",
        "transformer.wpe": "embed_positions",
        "transformer.ln_f": "norm",
        "lm_head": "lm_head",
    }
    return WeightNames("transformer.h", layer, top, base_prefix="transformer.")


def _gpt2_common(config, num_kv_heads: int, names: WeightNames) -> DecoderSpec:
    hidden, heads = config.hidden_size, config.num_attention_heads
    d = hidden // heads
    return DecoderSpec(
        **base_shape(config, d),
        num_kv_heads=num_kv_heads,
        intermediate_size=config.n_inner or 4 * hidden,
        names=names,
        norm=NormSpec("layer", config.layer_norm_epsilon, bias=True),
        qkv_bias=True,
        o_bias=True,
        scale=d**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0,
        learned_positions=_learned_positions(config),
        gated=False,
        act=config.activation_function,
        mlp_bias=True,
        tied=bool(getattr(config, "tie_word_embeddings", True)),
    )


@family("GPT2LMHeadModel")
def gpt2(config) -> DecoderSpec:
    # A scale per layer is refused. reorder_and_upcast_attn only asks for the scores in float32,
    # which the attention kernel keeps anyway; transformers itself heeds it only in its eager
    # attention, not in the SDPA one it runs by default.
    _refuse(config, "scale_attn_by_inverse_layer_idx")
    names = _gpt2_names("t", "t")
    return _gpt2_common(config, config.num_attention_heads, names)


@family("GPTBigCodeForCausalLM")
def gpt_bigcode(config) -> DecoderSpec:
    # Multi-query: c_attn's rows are [q | k | v] with one K and one V head, this engine's own
    # order; otherwise they are [heads, 3, head_dim].
    mq = bool(getattr(config, "multi_query", True))
    names = _gpt2_names(None if mq else "qkv_heads", None)
    return _gpt2_common(config, 1 if mq else config.num_attention_heads, names)


# -- GPT-J: one norm feeding attention and MLP side by side, interleaved rotary ------------------


@family("GPTJForCausalLM")
def gptj(config) -> DecoderSpec:
    hidden, heads = config.hidden_size, config.num_attention_heads
    d = hidden // heads
    rot_dim = config.rotary_dim or d
    # The table is GPT-J's own: base 10000 over the rotated dims (create_sinusoidal_positions).
    rope = RopeSpec.of({"rope_type": "default", "rope_theta": 10000.0}, rot_dim, is_neox=False)
    layer = {
        "ln_1": "in_norm",
        "attn.q_proj": ("self_attn.qkv_proj", "q"),
        "attn.k_proj": ("self_attn.qkv_proj", "k"),
        "attn.v_proj": ("self_attn.qkv_proj", "v"),
        "attn.out_proj": "self_attn.o_proj",
        "mlp.fc_in": "mlp.up_proj",
        "mlp.fc_out": "mlp.down_proj",
    }
    top = {"transformer.wte": "embed_tokens", "transformer.ln_f": "norm", "lm_head": "lm_head"}
    return DecoderSpec(
        **base_shape(config, d),
        num_kv_heads=heads,
        intermediate_size=config.n_inner or 4 * hidden,
        names=WeightNames("transformer.h", layer, top, base_prefix="transformer."),
        norm=NormSpec("layer", config.layer_norm_epsilon, bias=True),
        layer_norms=("in",),
        parallel=True,
        rope=(rope,) * config.num_hidden_layers,
        gated=False,
        act=config.activation_function,
        mlp_bias=True,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        lm_head_bias=True,
    )


# -- GPT-NeoX: fused per-head QKV, partial neox rotary, parallel residual with two norms ---------


@family("GPTNeoXForCausalLM")
def gpt_neox(config) -> DecoderSpec:
    hidden, heads = config.hidden_size, config.num_attention_heads
    d = hidden // heads
    params = rope_parameters(config)
    # transformers 5 moves rotary_pct / rotary_emb_base into rope_parameters; older configs not.
    partial = params.pop("partial_rotary_factor", None) or _get(config, "rotary_pct", default=1.0)
    if not getattr(config, "rope_parameters", None) and getattr(config, "rotary_emb_base", None):
        params["rope_theta"] = config.rotary_emb_base
    parallel = bool(getattr(config, "use_parallel_residual", True))
    bias = bool(getattr(config, "attention_bias", True))
    layer = {
        "input_layernorm": "in_norm",
        "post_attention_layernorm": "mlp_norm",
        "attention.query_key_value": ("self_attn.qkv_proj", "qkv_heads"),
        "attention.dense": "self_attn.o_proj",
        "mlp.dense_h_to_4h": "mlp.up_proj",
        "mlp.dense_4h_to_h": "mlp.down_proj",
    }
    top = {
        "gpt_neox.embed_in": "embed_tokens",
        "gpt_neox.final_layer_norm": "norm",
        "embed_out": "lm_head",  # the name in the hub's checkpoints
        "lm_head": "lm_head",  # the name transformers 5 saves
    }
    ignore = WeightNames.ignore + (".attention.bias", ".attention.masked_bias")
    return DecoderSpec(
        **base_shape(config, d),
        num_kv_heads=heads,
        intermediate_size=config.intermediate_size,
        names=WeightNames("gpt_neox.layers", layer, top, ignore, base_prefix="gpt_neox."),
        norm=NormSpec("layer", config.layer_norm_eps, bias=True),
        # Parallel: attention reads input_layernorm(x), the MLP post_attention_layernorm(x).
        layer_norms=("in", "mlp"),
        parallel=parallel,
        qkv_bias=bias,
        o_bias=bias,
        rope=rope_of(config, d, partial=partial, params=params),
        gated=False,
        act=config.hidden_act,
        mlp_bias=True,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
    )


# -- OPT: learned positions from 2, pre- or post-LN, embeddings projected in and out -------------


@family("OPTForCausalLM")
def opt(config) -> DecoderSpec:
    hidden, heads = config.hidden_size, config.num_attention_heads
    d = hidden // heads
    pre_ln = bool(getattr(config, "do_layer_norm_before", True))
    final_norm = pre_ln and not getattr(config, "_remove_final_layer_norm", False)
    embed_dim = getattr(config, "word_embed_proj_dim", None) or hidden
    bias = bool(getattr(config, "enable_bias", True))
    affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
    layer = {
        "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
        "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
        "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
        "self_attn.out_proj": "self_attn.o_proj",
        "self_attn_layer_norm": "in_norm",
        "fc1": "mlp.up_proj",
        "fc2": "mlp.down_proj",
        "final_layer_norm": "mlp_norm",
    }
    top = {
        "model.decoder.embed_tokens": "embed_tokens",
        "model.decoder.embed_positions": "embed_positions",
        "model.decoder.final_layer_norm": "norm",
        "model.decoder.project_in": "project_in",
        "model.decoder.project_out": "project_out",
        "lm_head": "lm_head",
    }
    return DecoderSpec(
        **base_shape(config, d),
        num_kv_heads=heads,
        intermediate_size=config.ffn_dim,
        names=WeightNames("model.decoder.layers", layer, top, base_prefix="model."),
        # nn.LayerNorm's default eps; without elementwise_affine neither weight nor bias.
        norm=NormSpec("layer", 1e-5, weight=affine, bias=affine),
        post_ln=not pre_ln,
        final_norm=final_norm,
        qkv_bias=bias,
        o_bias=bias,
        # OPT multiplies q by head_dim ** -0.5 before the product: the same scale.
        scale=d**-0.5,
        learned_positions=config.max_position_embeddings + 2,
        position_offset=2,
        gated=False,
        act=config.activation_function,
        mlp_bias=bias,
        project_dim=embed_dim if embed_dim != hidden else None,
        tied=bool(getattr(config, "tie_word_embeddings", True)),
    )


# -- Phi: one norm feeding attention and MLP side by side, partial neox rotary -------------------


@family("PhiForCausalLM")
def phi(config) -> DecoderSpec:
    hidden, heads = config.hidden_size, config.num_attention_heads
    d = _get(config, "head_dim") or hidden // heads
    qk = bool(getattr(config, "qk_layernorm", False))
    layer = {
        "input_layernorm": "in_norm",
        "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
        "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
        "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
        "self_attn.dense": "self_attn.o_proj",
        "self_attn.q_layernorm": "self_attn.q_norm",
        "self_attn.k_layernorm": "self_attn.k_norm",
        "mlp.fc1": "mlp.up_proj",
        "mlp.fc2": "mlp.down_proj",
    }
    top = {
        "model.embed_tokens": "embed_tokens",
        "model.final_layernorm": "norm",
        "lm_head": "lm_head",
    }
    return DecoderSpec(
        **base_shape(config, d),
        num_kv_heads=num_kv_heads_of(config),
        intermediate_size=config.intermediate_size,
        names=WeightNames("model.layers", layer, top),
        norm=NormSpec("layer", config.layer_norm_eps, bias=True),
        layer_norms=("in",),
        parallel=True,
        qkv_bias=True,
        o_bias=True,
        qk_norm="layer_head_shared" if qk else None,
        rope=rope_of(config, d),
        gated=False,
        act=config.hidden_act,
        mlp_bias=True,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        lm_head_bias=True,
    )

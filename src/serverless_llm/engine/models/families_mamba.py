"""Mamba-2 models and hybrids of attention and Mamba-2 layers: Mamba2, Bamba, Granite 4.0-H
(GraniteMoeHybrid), Nemotron-H and Falcon-H1. Their recurrent layers are Mamba-2 mixers
(layers/mamba2.py, `Mamba2Spec`).

- Mamba2 (`Mamba2ForCausalLM`): recurrent layers alone, each a norm and a mixer (no attention,
  no MLP, no KV cache); names under `backbone.`.
- Bamba (`BambaForCausalLM`): Llama with Mamba-2 mixers in place of attention except at
  `attn_layer_indices`; rotary over half of each head (partial_rotary_factor 0.5, hard-coded by
  its config); a SwiGLU `feed_forward`; the final norm `final_layernorm`.
- Granite 4.0-H (`GraniteMoeHybridForCausalLM`): Granite's multipliers (embedding, residual,
  attention scale, logits), layer kinds from `layer_types`, rope or no position embedding, a
  top-k MoE (softmax of the top-k logits) plus a shared MLP on every layer, or the shared MLP
  alone when num_local_experts is 0.
"""

from __future__ import annotations

import math

from ..layers.mamba2 import Mamba2Spec
from .decoder import DecoderSpec, MoESpec, NormSpec, WeightNames
from .families import family, granite, head_dim_of, llama_like, llama_names, rope_of

# A Mamba-2 mixer's checkpoint names under its module (`mamba` or `mixer`): A_log, D and dt_bias
# are the module's own parameters, so the module itself maps to the internal mixer.
MIXER_PARTS = ("in_proj", "conv1d", "norm", "out_proj")


def mixer_names(module: str) -> dict:
    return {module: "mixer", **{f"{module}.{p}": f"mixer.{p}" for p in MIXER_PARTS}}


def time_step_limit(config) -> tuple[float, float]:
    """The config's (min, max) dt clamp; None (which transformers cannot run) is no clamp."""
    limit = getattr(config, "time_step_limit", None)
    if limit is None:
        return (0.0, math.inf)
    lo, hi = (float(v) for v in limit)
    return (lo, hi)


def hybrid_mamba_spec(config) -> Mamba2Spec:
    """The Mamba-2 layers of Bamba's and Granite 4.0-H's configs (`mamba_*` fields)."""
    d_inner = int(config.mamba_expand * config.hidden_size)
    if config.mamba_n_heads * config.mamba_d_head != d_inner:
        raise ValueError(
            f"mamba_n_heads {config.mamba_n_heads} x mamba_d_head {config.mamba_d_head} is not "
            f"mamba_expand x hidden_size ({d_inner})"
        )
    return Mamba2Spec(
        num_heads=config.mamba_n_heads,
        head_dim=config.mamba_d_head,
        state_size=config.mamba_d_state,
        n_groups=config.mamba_n_groups,
        conv_kernel=config.mamba_d_conv,
        conv_bias=bool(config.mamba_conv_bias),
        in_bias=bool(config.mamba_proj_bias),
        out_bias=bool(config.mamba_proj_bias),
        activation=config.hidden_act,
        time_step_limit=time_step_limit(config),
        norm_eps=config.rms_norm_eps,
    )


def layer_mixers(kinds) -> tuple[str, ...]:
    """Per layer "recurrent" or "attention" from transformers' layer kinds (the legacy names
    "mamba" and "attention" too)."""
    table = {
        "linear_attention": "recurrent",
        "mamba": "recurrent",
        "full_attention": "attention",
        "attention": "attention",
    }
    unknown = sorted(set(kinds) - set(table))
    if unknown:
        raise ValueError(f"layer kinds {unknown} are not supported")
    return tuple(table[k] for k in kinds)


def attention_only(rope, mixers) -> tuple:
    """The rope of the attention layers; None on the others (they read no positions)."""
    return tuple(r if m == "attention" else None for r, m in zip(rope, mixers))


# -- Mamba2 ------------------------------------------------------------------------------------


@family("Mamba2ForCausalLM")
def mamba2(config) -> DecoderSpec:
    # mamba_ssm's d_ssm (a d_inner wider than the heads, the rest of in_proj a gated MLP) has no
    # field in transformers' config; a config naming it is refused rather than misloaded.
    for key in ("d_ssm", "d_mlp"):
        if getattr(config, key, None):
            raise ValueError(f"Mamba-2 layers with {key} (an MLP part in in_proj) are unsupported")
    d_inner = int(config.expand * config.hidden_size)
    if config.num_heads * config.head_dim != d_inner:
        raise ValueError(
            f"num_heads {config.num_heads} x head_dim {config.head_dim} is not expand x "
            f"hidden_size ({d_inner})"
        )
    n = config.num_hidden_layers
    layer = {"norm": "in_norm", **mixer_names("mixer")}
    top = {
        "backbone.embeddings": "embed_tokens",
        "backbone.embedding": "embed_tokens",  # older checkpoints (transformers' load hook)
        "backbone.norm_f": "norm",
        "lm_head": "lm_head",
    }
    recurrent = Mamba2Spec(
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        state_size=config.state_size,
        n_groups=config.n_groups,
        conv_kernel=config.conv_kernel,
        conv_bias=bool(config.use_conv_bias),
        in_bias=bool(config.use_bias),
        out_bias=bool(config.use_bias),
        activation=config.hidden_act,
        time_step_limit=time_step_limit(config),
        norm_eps=config.layer_norm_epsilon,
    )
    return DecoderSpec(
        arch="Mamba2ForCausalLM",
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=n,
        # no attention layer: the attention sizes only fill the description
        num_heads=config.num_heads,
        num_kv_heads=config.num_heads,
        head_dim=config.head_dim,
        intermediate_size=0,
        names=WeightNames("backbone.layers", layer, top),
        norm=NormSpec("rms", config.layer_norm_epsilon),
        layer_norms=("in",),
        mixers=("recurrent",) * n,
        mlp_layers=(False,) * n,
        recurrent=recurrent,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
    )


# -- Bamba -------------------------------------------------------------------------------------

BAMBA_LAYER = {
    "feed_forward.gate_proj": ("mlp.gate_up_proj", "gate"),
    "feed_forward.up_proj": ("mlp.gate_up_proj", "up"),
    "feed_forward.down_proj": "mlp.down_proj",
    "pre_ff_layernorm": "mlp_norm",
    **mixer_names("mamba"),
}


@family("BambaForCausalLM")
def bamba(config) -> DecoderSpec:
    names = llama_names(**BAMBA_LAYER)
    del names.top["model.norm"]
    names.top["model.final_layernorm"] = "norm"
    mixers = layer_mixers(config.layers_block_type)
    return llama_like(
        config,
        names=names,
        rope=attention_only(rope_of(config, head_dim_of(config)), mixers),
        mixers=mixers,
        recurrent=hybrid_mamba_spec(config),
    )


# -- Granite 4.0-H -----------------------------------------------------------------------------

GRANITE_HYBRID_LAYER = {
    "post_attention_layernorm": "mlp_norm",
    "block_sparse_moe.router.layer": "mlp.gate",
    "block_sparse_moe.input_linear": "mlp.experts.w13",
    "block_sparse_moe.output_linear": "mlp.experts.w2",
    # transformers 5's own names for the same tensors
    "block_sparse_moe.router": "mlp.gate",
    "block_sparse_moe.experts.gate_up_proj": "mlp.experts.w13",
    "block_sparse_moe.experts.down_proj": "mlp.experts.w2",
    **mixer_names("mamba"),
}


@family("GraniteMoeHybridForCausalLM")
def granite_moe_hybrid(config) -> DecoderSpec:
    mixers = layer_mixers(config.layer_types)
    position = getattr(config, "position_embedding_type", None)
    if position not in (None, "nope", "rope"):
        raise ValueError(f"position_embedding_type {position!r} is not supported")
    rope = (None,) * config.num_hidden_layers
    if position == "rope":
        # transformers' default rope here rotates whole heads whatever partial_rotary_factor says;
        # a scaled rope would read the factor
        params = config.rope_parameters or {}
        partial = params.get("partial_rotary_factor") or 1.0
        if params.get("rope_type", "default") != "default" and partial != 1.0:
            raise ValueError("partial_rotary_factor with a scaled rope is not supported")
        rope = attention_only(rope_of(config, head_dim_of(config), partial=1.0), mixers)
    experts = config.num_local_experts or 0
    shared = config.shared_intermediate_size
    moe = None
    names = dict(GRANITE_HYBRID_LAYER)
    if experts > 0:
        # routed experts plus the shared MLP ([gate | up] in one input_linear) on every token
        moe = MoESpec(
            num_experts=experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            routing="topk_softmax",
            shared_size=shared,
        )
        names["shared_mlp.input_linear"] = "mlp.shared_expert.gate_up_proj"
        names["shared_mlp.output_linear"] = "mlp.shared_expert.down_proj"
    else:
        names["shared_mlp.input_linear"] = "mlp.gate_up_proj"
        names["shared_mlp.output_linear"] = "mlp.down_proj"
    scales = granite(config)  # Granite's multipliers, read as the dense Granite reads them
    return llama_like(
        config,
        names=llama_names(**names),
        intermediate_size=shared,
        rope=rope,
        embed_scale=scales.embed_scale,
        residual_scale=scales.residual_scale,
        scale=scales.scale,
        logit_scale=scales.logit_scale,
        moe=moe,
        mlp_bias=False,
        mixers=mixers,
        recurrent=hybrid_mamba_spec(config),
    )

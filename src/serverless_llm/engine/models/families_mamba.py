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
- Nemotron-H (`NemotronHForCausalLM`): blocks of one kind each, from `layers_block_type` (older
  configs' `hybrid_override_pattern`, M = Mamba-2, * = attention, - = MLP, E = MoE, which
  transformers turns into that list): norm -> the block's mixer or MLP -> residual. Attention
  without positions or biases; a non-gated relu^2 MLP; the Mamba-2 dt limited below by
  time_step_min on prompt rows only (as transformers); names under `backbone.`.
- Falcon-H1 (`FalconH1ForCausalLM`): every layer runs attention and a Mamba-2 mixer side by side
  on the same normed input (the decoder's "parallel" layer, keeping KV and a state), their sum
  into the residual, then a SwiGLU MLP. Its muP multipliers are folded into the projections'
  weights at load (`WeightNames.scales`): attention input, key, attention output, the SSM input
  and the per-channel `mup_vector` of in_proj (from `ssm_multipliers`), SSM output, MLP gate
  and down; the embedding and lm_head multipliers are the decoder's embed_scale and
  logit_scale.
"""

from __future__ import annotations

import math

import torch

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


# -- Nemotron-H --------------------------------------------------------------------------------


def expert_names_plain(prefix: str, num_experts: int) -> dict:
    """WeightNames.layer entries for non-gated experts stored one by one (`prefix`.e.up_proj,
    `prefix`.e.down_proj): each expert's up rows fill its slice of the stacked w13."""
    names = {}
    for e in range(num_experts):
        names[f"{prefix}.{e}.up_proj"] = ("mlp.experts.w13", f"expert:{e}")
        names[f"{prefix}.{e}.down_proj"] = ("mlp.experts.w2", f"expert:{e}")
    return names


# Block kind -> its token mixer in the decoder (an MLP or MoE block is mixer "none", its MLP
# reading the block's one norm).
NEMOTRON_H_MIXERS = {
    "linear_attention": "recurrent",
    "full_attention": "attention",
    "mlp": "none",
    "moe": "none",
}
NEMOTRON_H_LAYER = {
    "norm": "in_norm",
    **mixer_names("mixer"),
    "mixer.q_proj": ("self_attn.qkv_proj", "q"),
    "mixer.k_proj": ("self_attn.qkv_proj", "k"),
    "mixer.v_proj": ("self_attn.qkv_proj", "v"),
    "mixer.o_proj": "self_attn.o_proj",
    "mixer.up_proj": "mlp.up_proj",
    "mixer.down_proj": "mlp.down_proj",
    # MoE blocks: the router with its score correction bias, the latent projections, the shared
    # expert, and the experts (transformers 5's stacked names; per-expert names are added)
    "mixer.gate": "mlp.gate",
    "mixer.fc1_latent_proj": "mlp.fc1_latent_proj",
    "mixer.fc2_latent_proj": "mlp.fc2_latent_proj",
    "mixer.shared_experts.up_proj": "mlp.shared_expert.up_proj",
    "mixer.shared_experts.down_proj": "mlp.shared_expert.down_proj",
    "mixer.experts.up_proj": "mlp.experts.w13",
    "mixer.experts.down_proj": "mlp.experts.w2",
}


def nemotron_h_moe(config) -> MoESpec:
    """Nemotron-H's MoE blocks: DeepSeek-V3's router (sigmoid scores, the best `topk_group` of
    `n_group` groups, renormalised by norm_topk_prob, times routed_scaling_factor), non-gated
    experts of moe_intermediate_size (the model's MLP kind), in moe_latent_size when set, and
    one shared expert of moe_shared_expert_intermediate_size (n_shared_experts is not read:
    transformers builds one)."""
    return MoESpec(
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        routing="sigmoid_grouped",
        renormalize=bool(config.norm_topk_prob),
        shared_size=config.moe_shared_expert_intermediate_size,
        groups=(config.n_group, config.topk_group),
        routed_scale=float(config.routed_scaling_factor),
        latent_size=config.moe_latent_size,
    )


@family("NemotronHForCausalLM")
def nemotron_h(config) -> DecoderSpec:
    kinds = list(config.layers_block_type)
    unknown = sorted(set(kinds) - set(NEMOTRON_H_MIXERS))
    if unknown:
        raise ValueError(f"Nemotron-H block kinds {unknown} are not supported")
    # transformers' NemotronH attention has no biases and no window whatever the config says: a
    # config asking for them is refused rather than run as transformers runs it
    if getattr(config, "attention_bias", False):
        raise ValueError("attention_bias (transformers' Nemotron-H attention has no biases)")
    if getattr(config, "sliding_window", None):
        raise ValueError("sliding_window (transformers' Nemotron-H attends to every token)")
    n = len(kinds)
    mixers = tuple(NEMOTRON_H_MIXERS[k] for k in kinds)
    recurrent = Mamba2Spec(
        num_heads=config.mamba_num_heads,
        head_dim=config.mamba_head_dim,
        state_size=config.ssm_state_size,
        n_groups=config.n_groups,
        conv_kernel=config.conv_kernel,
        conv_bias=bool(config.use_conv_bias),
        in_bias=bool(config.use_bias),
        out_bias=bool(config.use_bias),
        activation=config.mamba_hidden_act,
        # the mixer's own limit (transformers ignores config.time_step_limit here)
        time_step_limit=(float(config.time_step_min), math.inf),
        clamp_decodes=False,
        norm_eps=config.layer_norm_epsilon,
    )
    top = {"backbone.embeddings": "embed_tokens", "backbone.norm_f": "norm", "lm_head": "lm_head"}
    layer = dict(NEMOTRON_H_LAYER)
    moe = None
    if "moe" in kinds:
        moe = nemotron_h_moe(config)
        layer.update(expert_names_plain("mixer.experts", moe.num_experts))
    names = WeightNames(
        "backbone.layers",
        layer,
        top,
        skip_prefixes=("mtp.", "backbone.mtp."),  # multi-token-prediction layers, not run
    )
    return DecoderSpec(
        arch="NemotronHForCausalLM",
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=n,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        names=names,
        norm=NormSpec("rms", config.layer_norm_epsilon),
        layer_norms=("in",),
        gated=False,
        act=config.mlp_hidden_act,
        mlp_bias=bool(config.mlp_bias),
        mixers=mixers,
        mlp_layers=tuple(k in ("mlp", "moe") for k in kinds),
        moe=moe,
        moe_layers=tuple(k == "moe" for k in kinds),
        recurrent=recurrent,
        # transformers' NemotronH never ties lm_head to the embeddings (no tied keys), whatever
        # tie_word_embeddings says: the checkpoint's lm_head is read
        tied=False,
    )


# -- Falcon-H1 ---------------------------------------------------------------------------------

FALCON_H1_LAYER = {
    "feed_forward.gate_proj": ("mlp.gate_up_proj", "gate"),
    "feed_forward.up_proj": ("mlp.gate_up_proj", "up"),
    "feed_forward.down_proj": "mlp.down_proj",
    "pre_ff_layernorm": "mlp_norm",
    **mixer_names("mamba"),
}


def falcon_h1_scales(config, d_ssm: int) -> dict:
    """Falcon-H1's multipliers as `WeightNames.scales` (those that are not 1): a multiplier of a
    projection's input scales its weight, one of its output its weight and bias. in_proj's
    output rows [z | x | B | C | dt] each take their `ssm_multipliers` entry (transformers'
    mup_vector), its input `ssm_in_multiplier`."""
    a, km = config.attention_in_multiplier, config.key_multiplier
    ao, so = config.attention_out_multiplier, config.ssm_out_multiplier
    gate, down = config.mlp_multipliers
    gn = config.mamba_n_groups * config.mamba_d_state
    sizes = (d_ssm, d_ssm, gn, gn, config.mamba_n_heads)
    mup = torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, config.ssm_multipliers)])
    si = config.ssm_in_multiplier
    scales = {
        "self_attn.q_proj": (a, 1.0),
        "self_attn.k_proj": (a * km, km),
        "self_attn.v_proj": (a, 1.0),
        "self_attn.o_proj": (ao, ao),
        "feed_forward.gate_proj": (gate, gate),
        "feed_forward.down_proj": (down, down),
        "mamba.out_proj": (so, so),
    }
    scales = {k: v for k, v in scales.items() if v != (1.0, 1.0)}
    if si != 1.0 or bool((mup != 1.0).any()):
        scales["mamba.in_proj"] = (mup * si, mup)
    return scales


@family("FalconH1ForCausalLM")
def falcon_h1(config) -> DecoderSpec:
    if len(config.ssm_multipliers) != 5 or len(config.mlp_multipliers) != 2:
        raise ValueError("ssm_multipliers needs 5 entries and mlp_multipliers 2")
    d_ssm = config.mamba_d_ssm or int(config.mamba_expand * config.hidden_size)
    heads, head_dim = config.mamba_n_heads, config.mamba_d_head
    if heads * head_dim != d_ssm:
        raise ValueError(f"mamba_n_heads {heads} x mamba_d_head {head_dim} is not d_ssm {d_ssm}")
    recurrent = Mamba2Spec(
        num_heads=heads,
        head_dim=head_dim,
        state_size=config.mamba_d_state,
        n_groups=config.mamba_n_groups,
        conv_kernel=config.mamba_d_conv,
        conv_bias=bool(config.mamba_conv_bias),
        in_bias=bool(config.mamba_proj_bias),
        out_bias=bool(config.projectors_bias),
        activation=config.hidden_act,
        time_step_limit=time_step_limit(config),
        clamp_decodes=False,
        norm=bool(config.mamba_rms_norm),
        norm_before_gate=bool(config.mamba_norm_before_gate),
        norm_eps=config.rms_norm_eps,
    )
    n = config.num_hidden_layers
    names = llama_names(**FALCON_H1_LAYER)
    del names.top["model.norm"]
    names.top["model.final_layernorm"] = "norm"
    names.scales = falcon_h1_scales(config, d_ssm)
    embed = config.embedding_multiplier
    return llama_like(
        config,
        names=names,
        mixers=("parallel",) * n,
        recurrent=recurrent,
        embed_scale=None if embed == 1.0 else embed,
        logit_scale=config.lm_head_multiplier,
    )

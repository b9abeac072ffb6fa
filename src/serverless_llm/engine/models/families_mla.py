"""The families built on multi-head latent attention (models/mla.py): DeepSeek V2 (and
V2-Lite), DeepSeek V3 (and the checkpoints that reuse its architecture: Kimi K2, Moonlight),
Mistral 4; DeepSeek V3.2 and V4 refused by name.

Each is Llama's layer around an MLA block: RMSNorm before attention and MLP, a gated SiLU MLP
on the first `first_k_dense_replace` layers and DeepSeek's MoE block after them (routing,
shared experts and the MoE's weight names come from families_moe2.py's `deepseek_moe`).
What differs between them is in the attention:

- the query: straight from q_proj (V2-Lite: no q_lora_rank) or through the query LoRA
  (q_a_proj, RMSNorm, q_b_proj);
- the rotary layout: V2 rotates interleaved pairs (transformers' complex form), V3 and
  Mistral 4 too unless `rope_interleave` is off (then halves);
- YaRN (rope_type "yarn"): the table with its attention factor, and the softmax scale
  multiplied by mscale(factor, mscale_all_dim) squared, as transformers does;
- Mistral 4: each query scaled by Llama 4's 1 + beta * log(1 + floor(p / original)), and its
  MoE routes by softmax (one group) with renormalised weights.
"""

from __future__ import annotations

import dataclasses

from ..layers.rotary import rope_parameters
from .decoder import DecoderSpec, NormSpec, RopeSpec, WeightNames
from .families import LLAMA_LAYER, LLAMA_TOP, base_shape, family
from .mla import MLASpec, deepseek_softmax_scale

MLA_LAYER = {
    name: name
    for name in (
        "self_attn.q_proj",
        "self_attn.q_a_proj",
        "self_attn.q_a_layernorm",
        "self_attn.q_b_proj",
        "self_attn.kv_a_proj_with_mqa",
        "self_attn.kv_a_layernorm",
        "self_attn.kv_b_proj",
        "self_attn.o_proj",
    )
}
LLAMA_MLP = {k: v for k, v in LLAMA_LAYER.items() if not k.startswith("self_attn.")}


def _mtp_prefixes(config) -> tuple[str, ...]:
    """The multi-token-prediction layers DeepSeek-V3 checkpoints store after the last decoder
    layer (`model.layers.<L>.`, num_nextn_predict_layers of them), which the engine does not
    run (transformers does not load them either)."""
    n = config.num_hidden_layers
    count = getattr(config, "num_nextn_predict_layers", None)
    if count is None:
        count = getattr(config, "num_mtp_layers", None) or 0
    return tuple(f"model.layers.{i}." for i in range(n, n + count))


def _moe_parts(config):
    """(MoESpec or None, per-layer MoE flags, the MoE's weight names): DeepSeek's MoE block
    (families_moe2.py) when the config has routed experts after its dense layers."""
    n = config.num_hidden_layers
    first = getattr(config, "first_k_dense_replace", None) or 0
    if not getattr(config, "n_routed_experts", None) or first >= n:
        return None, (False,) * n, {}
    from .families_moe2 import deepseek_moe, deepseek_moe_layers, deepseek_moe_names

    moe = deepseek_moe(config)
    return moe, deepseek_moe_layers(config), deepseek_moe_names(moe.num_experts)


def mla_decoder(config, *, interleaved: bool, query_scale=None, moe=None) -> DecoderSpec:
    """The decoder of a DeepSeek-style MLA config. `interleaved`: the rotary pairs' layout;
    `query_scale`: Mistral 4's (beta, original length); `moe`: a MoESpec in place of the one
    `deepseek_moe` describes (Mistral 4's routing)."""
    n = config.num_hidden_layers
    heads = config.num_attention_heads
    mla = MLASpec(
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        q_lora_rank=getattr(config, "q_lora_rank", None) or None,
        bias=bool(getattr(config, "attention_bias", False)),
        query_scale=query_scale,
    )
    params = rope_parameters(config)
    # The table spans the rotary part alone (transformers: head_dim = qk_rope_head_dim, or
    # Mistral 4's partial_rotary_factor of the whole query head).
    params.pop("partial_rotary_factor", None)
    if "original_max_position_embeddings" not in params and params["rope_type"] == "yarn":
        params["original_max_position_embeddings"] = config.max_position_embeddings
    rope = RopeSpec.of(params, mla.qk_rope_head_dim, is_neox=not interleaved)
    spec_moe, moe_layers, moe_names = _moe_parts(config)
    if moe is not None and spec_moe is not None:
        spec_moe = moe
    names = WeightNames("model.layers", {**MLA_LAYER, **LLAMA_MLP, **moe_names}, dict(LLAMA_TOP))
    names.skip_prefixes = _mtp_prefixes(config)
    return DecoderSpec(
        **base_shape(config, head_dim=mla.qk_head_dim),
        num_kv_heads=heads,
        intermediate_size=config.intermediate_size,
        names=names,
        norm=NormSpec("rms", config.rms_norm_eps),
        scale=deepseek_softmax_scale(mla.qk_head_dim, params),
        rope=(rope,) * n,
        act=config.hidden_act,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        moe=spec_moe,
        moe_layers=moe_layers,
        mla=mla,
    )


@family("DeepseekV2ForCausalLM")
def deepseek_v2(config) -> DecoderSpec:
    # DeepSeek-V2 and V2-Lite (no query LoRA): transformers rotates V2's pairs in complex form.
    return mla_decoder(config, interleaved=True)


@family("DeepseekV3ForCausalLM")
def deepseek_v3(config) -> DecoderSpec:
    # DeepSeek-V3/R1, Kimi K2, Moonlight: the query LoRA, interleaved pairs unless
    # rope_interleave is off, YaRN with mscale on the long-context checkpoints.
    return mla_decoder(config, interleaved=bool(getattr(config, "rope_interleave", True)))


@family("Mistral4ForCausalLM")
def mistral4(config) -> DecoderSpec:
    # Mistral Small 4: DeepSeek-V3's attention (query LoRA, YaRN), every query scaled by Llama
    # 4's attention scaling, and a MoE routed by softmax (no correction bias), renormalised.
    params = rope_parameters(config)
    beta = params.get("llama_4_scaling_beta")
    orig = params.get("original_max_position_embeddings")
    scale = None
    if beta is not None:
        if orig is None:
            raise ValueError("llama_4_scaling_beta without original_max_position_embeddings")
        scale = (float(beta), int(orig))
    moe = None
    first = getattr(config, "first_k_dense_replace", None) or 0
    if getattr(config, "n_routed_experts", None) and first < config.num_hidden_layers:
        groups, best = getattr(config, "n_group", None) or 1, getattr(config, "topk_group", None)
        if best is not None and best < groups:
            raise ValueError(
                f"n_group {groups} with topk_group {best}: Mistral 4's group-limited routing "
                "(groups ranked by their two best probabilities) is not supported"
            )
        from .families_moe2 import deepseek_moe

        moe = dataclasses.replace(
            deepseek_moe(config),  # read as DeepSeek-V3's: experts, shared experts, scaling
            routing="softmax_grouped",
            renormalize=bool(getattr(config, "norm_topk_prob", True)),
            groups=(1, 1),
        )
    return mla_decoder(
        config,
        interleaved=bool(getattr(config, "rope_interleave", True)),
        query_scale=scale,
        moe=moe,
    )


@family("DeepseekV32ForCausalLM")
def deepseek_v32(config) -> DecoderSpec:
    raise ValueError(
        "DeepSeek V3.2's sparse attention (its lightning indexer choosing the top "
        f"{getattr(config, 'index_topk', '?')} keys of each query) is not supported; "
        "DeepSeek V3/R1 checkpoints (DeepseekV3ForCausalLM) are"
    )


@family("DeepseekV4ForCausalLM")
def deepseek_v4(config) -> DecoderSpec:
    raise ValueError(
        f"DeepSeek V4's hyper-connections ({getattr(config, 'hc_mult', '?')} residual streams "
        "mixed around each sublayer) and its compressed sparse attention (a lightning indexer "
        "over compressed keys) are not supported"
    )

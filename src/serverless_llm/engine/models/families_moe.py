"""Mixture-of-experts families: a dense family's description with a `MoESpec` (decoder.py) on its
sparse layers, and the names its checkpoint gives the router and each expert's tensors.

Each router is read from transformers' own code of the family: Mixtral renormalises its top-k
softmax probabilities, Qwen2/3-MoE and OLMoE only with `norm_topk_prob`, DBRX by their p-norm
(`moe_normalize_expert_weights`), Granite-MoE takes the softmax of its top-k logits, PhiMoE routes
by `sparsemixer`. Qwen2-MoE adds a shared expert behind a sigmoid gate and may keep some layers
dense (`mlp_only_layers`, `decoder_sparse_step`).
"""

from __future__ import annotations

from .decoder import DecoderSpec, MoESpec, NormSpec, WeightNames, expert_names
from .families import base_shape, family, granite, head_dim_of, llama_like, llama_names, rope_of

QK_NORMS = {"self_attn.q_norm": "self_attn.q_norm", "self_attn.k_norm": "self_attn.k_norm"}


def _moe(config, num_experts: int, inter: int, **kw) -> MoESpec:
    return MoESpec(
        num_experts=num_experts, top_k=config.num_experts_per_tok, intermediate_size=inter, **kw
    )


def _qwen_sparse_layers(config) -> tuple[bool, ...]:
    """Which layers are sparse in Qwen2/3-MoE: not in mlp_only_layers, and every
    decoder_sparse_step-th one."""
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return tuple(
        i not in dense and config.num_experts > 0 and (i + 1) % step == 0
        for i in range(config.num_hidden_layers)
    )


QWEN_EXPERTS = ("mlp.experts", "gate_proj", "up_proj", "down_proj")


@family("MixtralForCausalLM")
def mixtral(config) -> DecoderSpec:
    e = config.num_local_experts
    names = llama_names(
        **{"block_sparse_moe.gate": "mlp.gate"},
        **expert_names("block_sparse_moe.experts", e, "w1", "w3", "w2"),
    )
    moe = _moe(config, e, config.intermediate_size, renormalize=True)
    return llama_like(config, names=names, moe=moe)


@family("Qwen2MoeForCausalLM")
def qwen2_moe(config) -> DecoderSpec:
    e = config.num_experts
    shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
    names = llama_names(
        **{"mlp.gate": "mlp.gate"},
        **expert_names(QWEN_EXPERTS[0], e, *QWEN_EXPERTS[1:]),
        **{
            "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", "gate"),
            "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", "up"),
            "mlp.shared_expert.down_proj": "mlp.shared_expert.down_proj",
            "mlp.shared_expert_gate": "mlp.shared_expert_gate",
        },
    )
    moe = _moe(
        config,
        e,
        config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        shared_size=shared,
        shared_gate=shared > 0,
    )
    return llama_like(
        config,
        names=names,
        qkv_bias=True,
        o_bias=False,
        moe=moe,
        moe_layers=_qwen_sparse_layers(config),
    )


@family("Qwen3MoeForCausalLM")
def qwen3_moe(config) -> DecoderSpec:
    e = config.num_experts
    names = llama_names(
        **{"mlp.gate": "mlp.gate"},
        **QK_NORMS,
        **expert_names(QWEN_EXPERTS[0], e, *QWEN_EXPERTS[1:]),
    )
    moe = _moe(config, e, config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob))
    return llama_like(
        config, names=names, qk_norm="rms_head", moe=moe, moe_layers=_qwen_sparse_layers(config)
    )


@family("OlmoeForCausalLM")
def olmoe(config) -> DecoderSpec:
    # q and k normalised over all heads, then clipped with v (clip_qkv)
    e = config.num_experts
    names = llama_names(
        **{"mlp.gate": "mlp.gate"},
        **QK_NORMS,
        **expert_names(QWEN_EXPERTS[0], e, *QWEN_EXPERTS[1:]),
    )
    moe = _moe(config, e, config.intermediate_size, renormalize=bool(config.norm_topk_prob))
    return llama_like(
        config,
        names=names,
        qk_norm="rms_full",
        clip_qkv=getattr(config, "clip_qkv", None),
        clip_after_norm=True,
        moe=moe,
    )


@family("GraniteMoeForCausalLM")
def granite_moe(config) -> DecoderSpec:
    # Granite's multipliers; the experts stored stacked ([E, 2I, H] gate | up, [E, H, I] down)
    names = llama_names(
        **{
            "block_sparse_moe.router.layer": "mlp.gate",
            "block_sparse_moe.input_linear": "mlp.experts.w13",
            "block_sparse_moe.output_linear": "mlp.experts.w2",
        }
    )
    dense = granite(config)
    moe = _moe(config, config.num_local_experts, config.intermediate_size, routing="topk_softmax")
    return llama_like(
        config,
        names=names,
        embed_scale=dense.embed_scale,
        residual_scale=dense.residual_scale,
        scale=dense.scale,
        logit_scale=dense.logit_scale,
        moe=moe,
    )


@family("PhimoeForCausalLM")
def phimoe(config) -> DecoderSpec:
    # Mixtral's names and window with LayerNorms (weight and bias), q/k/v/o and LM-head biases by
    # the config, routed by sparsemixer: always two experts (transformers ignores
    # num_experts_per_tok). Its LongRoPE scales cos and sin by short_mscale within the original
    # context and long_mscale past it, one factor for both tables here. Past the original
    # context the engine takes the long factors per position, as for Phi-3; transformers 5's
    # PhiMoE keeps the short ones (its rotary recomputes them without the sequence length).
    e = config.num_local_experts
    names = llama_names(
        **{"block_sparse_moe.gate": "mlp.gate"},
        **expert_names("block_sparse_moe.experts", e, "w1", "w3", "w2"),
    )
    moe = MoESpec(
        num_experts=e,
        top_k=2,
        intermediate_size=config.intermediate_size,
        routing="sparsemixer",
        jitter_eps=float(config.router_jitter_noise),
    )
    d = head_dim_of(config)
    rope = rope_of(config, d)
    params = rope[0].params_dict()
    if params["rope_type"] != "default":
        # transformers scales any non-default rope by the mscales; only LongRoPE is served
        if params["rope_type"] not in ("longrope", "su"):
            raise ValueError(f"rope_type {params['rope_type']!r} is not supported")
        short, long = params.get("short_mscale"), params.get("long_mscale")
        if short != long:
            raise ValueError(f"short_mscale {short} != long_mscale {long} is not supported")
        rope = rope_of(config, d, params={**params, "attention_factor": short})
    return llama_like(
        config,
        names=names,
        norm=NormSpec("layer", config.rms_norm_eps, bias=True),
        rope=rope,
        moe=moe,
        lm_head_bias=bool(getattr(config, "lm_head_bias", False)),
    )


DBRX_LAYER = {
    "norm_attn_norm.norm_1": "in_norm",
    "norm_attn_norm.norm_2": "mlp_norm",
    "norm_attn_norm.attn.Wqkv": "self_attn.qkv_proj",
    "norm_attn_norm.attn.out_proj": "self_attn.o_proj",
    "ffn.router.layer": "mlp.gate",
    # every expert's matrices in one 2-D tensor each: w1 (gate) and v1 (up) [E * I, H], w2 the
    # down projections transposed, [E * I, H]
    "ffn.experts.mlp.w1": ("mlp.experts.w13", "experts:gate"),
    "ffn.experts.mlp.v1": ("mlp.experts.w13", "experts:up"),
    "ffn.experts.mlp.w2": ("mlp.experts.w2", "experts:t"),
}
DBRX_TOP = {"transformer.wte": "embed_tokens", "transformer.norm_f": "norm", "lm_head": "lm_head"}


@family("DbrxForCausalLM")
def dbrx(config) -> DecoderSpec:
    # Bias-free LayerNorms and linears, fused Wqkv clipped by clip_qkv, softmax top-k routing
    # renormalised by the p-norm of moe_normalize_expert_weights (None: not at all). The rope
    # base is the one DBRX checkpoints write in attn_config (transformers 4 read it there);
    # transformers 5 reads rope_parameters, which such a config leaves at its default.
    attn, ffn = config.attn_config, config.ffn_config
    d = config.hidden_size // config.num_attention_heads
    theta = getattr(attn, "rope_theta", None)
    params = rope_of(config, d)[0].params_dict()
    if theta is not None:
        params["rope_theta"] = theta
    p = ffn.moe_normalize_expert_weights
    moe = MoESpec(
        num_experts=ffn.moe_num_experts,
        top_k=ffn.moe_top_k,
        intermediate_size=ffn.ffn_hidden_size,
        renormalize=False if p is None else float(p),
    )
    return DecoderSpec(
        **base_shape(config, d),
        num_kv_heads=attn.kv_n_heads,
        intermediate_size=ffn.ffn_hidden_size,
        names=WeightNames("transformer.blocks", dict(DBRX_LAYER), dict(DBRX_TOP)),
        norm=NormSpec("layer", 1e-5, bias=False),
        clip_qkv=attn.clip_qkv,
        rope=rope_of(config, d, params=params),
        act=(ffn.ffn_act_fn or {}).get("name", "silu"),
        moe=moe,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
    )

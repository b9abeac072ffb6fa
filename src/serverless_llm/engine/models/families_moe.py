"""Mixture-of-experts families: a dense family's description with a `MoESpec` (decoder.py) on its
sparse layers, and the names its checkpoint gives the router and each expert's tensors.

Each router is read from transformers' own code of the family: Mixtral renormalises its top-k
softmax probabilities, Qwen2/3-MoE and OLMoE only with `norm_topk_prob`, Granite-MoE takes the
softmax of its top-k logits. Qwen2-MoE adds a shared expert behind a sigmoid gate and may keep
some layers dense (`mlp_only_layers`, `decoder_sparse_step`).
"""

from __future__ import annotations

from .decoder import DecoderSpec, MoESpec, expert_names
from .families import family, granite, llama_like, llama_names

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

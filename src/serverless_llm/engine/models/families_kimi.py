"""Kimi Linear: Kimi Delta Attention (the delta rule with a per-channel forget gate) beside
multi-head latent attention.

What differs from Llama (transformers' `KimiLinearForCausalLM`): per-layer kinds from
`layer_types` ("linear_attention": KDA, layers/kimi_delta.py; "full_attention": multi-head latent
attention, models/mla.py, under the checkpoint's DeepSeek names, its latents in their own cache
group); no positions at all (its MLA is NoPE: the rope part of each key is cached and attended
to unrotated); per-layer MLPs from `mlp_layer_types` ("dense": a SwiGLU of intermediate_size;
"sparse": a MoE of moe_intermediate_size with sigmoid-scored grouped top-k routing, a score
correction bias, routed scaling and `n_shared_experts` shared experts, layers/moe.py's
"sigmoid_grouped"). Checkpoints name the MoE `block_sparse_moe` (transformers saves its dense
MLPs under that name too) and store KDA's q/k/v projections and convolutions apart, which the
engine fuses.
"""

from __future__ import annotations

from itertools import accumulate

from ..layers.kimi_delta import KimiDeltaSpec
from .decoder import DecoderSpec, MoESpec, expert_names
from .families import family, llama_like, llama_names
from .families_mla import MLA_LAYER
from .mla import MLASpec

# The keys of a checkpoint's `linear_attn_config` that transformers reads (the layer lists, the
# KDA sizes); any other (a gate lower bound, a full-rank gate: later Kimi variants) is refused.
KNOWN_LINEAR_KEYS = {
    "kda_layers",
    "full_attn_layers",
    "num_heads",
    "head_dim",
    "short_conv_kernel_size",
}


def _refuse_unsupported(config) -> None:
    """ValueError for what this engine (or transformers' reference) does not compute."""
    kinds = list(config.layer_types)
    unknown = sorted({k for k in kinds if k not in ("linear_attention", "full_attention")})
    if unknown:
        raise ValueError(f"unknown layer types {unknown}")
    mlps = sorted({k for k in config.mlp_layer_types if k not in ("dense", "sparse")})
    if mlps:
        raise ValueError(f"unknown mlp_layer_types {mlps}")
    if config.hidden_act != "silu":
        raise ValueError(
            f"hidden_act {config.hidden_act!r}: Kimi Delta Attention's convolution takes silu only"
        )
    extra = sorted(set(getattr(config, "linear_attn_config", None) or {}) - KNOWN_LINEAR_KEYS)
    if extra:
        raise ValueError(f"linear_attn_config options {extra} are not supported")
    # Options of the original checkpoints that transformers does not read: refused unless they
    # say what transformers computes.
    act = getattr(config, "moe_router_activation_func", None)
    if act not in (None, "sigmoid"):
        raise ValueError(f"moe_router_activation_func {act!r} is not supported (sigmoid only)")
    freq = getattr(config, "moe_layer_freq", None)
    if freq not in (None, 1):
        raise ValueError(f"moe_layer_freq {freq} is not supported (1 only)")
    method = getattr(config, "topk_method", None)
    if method not in (None, "noaux_tc"):
        raise ValueError(f"topk_method {method!r} is not supported (noaux_tc only)")
    if getattr(config, "use_grouped_topk", True) is False and config.n_group > 1:
        raise ValueError("use_grouped_topk false with several expert groups is not supported")


def kimi_names(kda: KimiDeltaSpec, num_experts: int):
    """The checkpoint's names: KDA's separate q/k/v/f_a/g_a/b projections into the fused
    in_proj's rows, its three convolutions into one, its bare A_log and dt_bias onto the
    mixer's own parameters; MoE and dense MLPs under `block_sparse_moe` (dense also `mlp`)."""
    parts = kda.in_proj_parts()
    starts = [0, *accumulate(parts)]
    width = parts[0]
    layer = {"self_attn": "mixer"}  # A_log, dt_bias
    for i, name in enumerate(("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj")):
        layer[f"self_attn.{name}"] = ("mixer.in_proj", f"rows:{starts[i]}:{len(parts)}")
    for i, name in enumerate(("q_conv1d", "k_conv1d", "v_conv1d")):
        layer[f"self_attn.{name}"] = ("mixer.conv1d", f"rows:{i * width}:3")
    for name in ("f_b_proj", "g_b_proj", "o_norm", "o_proj"):
        layer[f"self_attn.{name}"] = f"mixer.{name}"
    for prefix in ("mlp", "block_sparse_moe"):  # dense layers, either name
        layer[f"{prefix}.gate_proj"] = ("mlp.gate_up_proj", "gate")
        layer[f"{prefix}.up_proj"] = ("mlp.gate_up_proj", "up")
        layer[f"{prefix}.down_proj"] = "mlp.down_proj"
    shared = "block_sparse_moe.shared_experts"
    layer.update(
        {
            "block_sparse_moe.gate": "mlp.gate",  # weight and e_score_correction_bias
            f"{shared}.gate_proj": ("mlp.shared_expert.gate_up_proj", "gate"),
            f"{shared}.up_proj": ("mlp.shared_expert.gate_up_proj", "up"),
            f"{shared}.down_proj": "mlp.shared_expert.down_proj",
            **expert_names("block_sparse_moe.experts", num_experts, "w1", "w3", "w2"),
        }
    )
    return llama_names(**layer)


@family("KimiLinearForCausalLM")
def kimi_linear(config) -> DecoderSpec:
    _refuse_unsupported(config)
    n = config.num_hidden_layers
    kda = KimiDeltaSpec(
        num_heads=config.linear_num_heads,
        head_dim=config.linear_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
        eps=config.rms_norm_eps,
    )
    e = config.num_local_experts
    moe = MoESpec(
        num_experts=e,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        routing="sigmoid_grouped",
        renormalize=bool(config.norm_topk_prob),
        shared_size=config.moe_intermediate_size * config.n_shared_experts,
        groups=(config.n_group, config.topk_group or config.n_group),
        routed_scale=float(config.routed_scaling_factor),
    )
    mixers = tuple(
        "attention" if k == "full_attention" else "recurrent" for k in config.layer_types
    )
    names = kimi_names(kda, e)
    mla = None
    extra = {}
    if "attention" in mixers:
        # MLA under DeepSeek's names (`self_attn.q_proj` ... in those layers, not KDA's rows)
        names.mixer_layer = {"attention": dict(MLA_LAYER)}
        mla = MLASpec(
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            q_lora_rank=getattr(config, "q_lora_rank", None) or None,
            bias=bool(getattr(config, "attention_bias", False)),
        )
        qk = mla.qk_head_dim
        extra = dict(head_dim=qk, num_kv_heads=config.num_attention_heads, scale=qk**-0.5)
    return llama_like(
        config,
        names=names,
        rope=(None,) * n,
        mixers=mixers,
        recurrent=kda,
        moe=moe,
        moe_layers=tuple(k == "sparse" for k in config.mlp_layer_types),
        mla=mla,
        **extra,
    )

"""Jamba: attention beside Mamba (Mamba-1) layers, with mixture-of-experts MLPs; and Mamba
itself, a model of Mamba layers alone.

Jamba (`JambaForCausalLM`), what differs from Llama: layer i attends when
i % attn_layer_period == attn_layer_offset and is a Mamba layer otherwise (layers/mamba.py, with
RMSNorms on dt, B and C); its MLP is sparse when i % expert_layer_period == expert_layer_offset
(and num_experts > 1): top-k of a softmax router, the weights not renormalised; attention has
no positional encoding at all (the Mamba layers carry position); the final norm is
`final_layernorm`, the MLP's norm `pre_ff_layernorm`.

Mamba (`MambaForCausalLM`): every layer is an RMSNorm and a Mamba mixer (no inner norms), with
no MLP and no attention; names under `backbone.`. transformers keeps the residual stream in
float32 when `residual_in_fp32` (the default); here it is in the model dtype, which is the same
in a float32 model and a rounding of the stream in float16/bfloat16.

Both refuse a `hidden_act` other than silu: it is also the activation of the Mamba layers'
convolution, whose kernels apply silu only.
"""

from __future__ import annotations

from ..layers.mamba import MambaSpec
from .decoder import DecoderSpec, MoESpec, NormSpec, WeightNames, expert_names
from .families import family, llama_like, llama_names


def _mixer_names(src: str) -> dict:
    """WeightNames.layer entries for a Mamba mixer stored under `src` (dt_proj's weight and its
    bias go to different places: the bias is the scan's delta bias)."""
    return {
        f"{src}.in_proj": "mixer.in_proj",
        f"{src}.conv1d": "mixer.conv1d",
        f"{src}.x_proj": "mixer.x_proj",
        f"{src}.dt_proj.weight": "mixer.dt_proj",
        f"{src}.dt_proj.bias": "mixer.dt_bias",
        f"{src}.A_log": "mixer.A_log",
        f"{src}.D": "mixer.D",
        f"{src}.out_proj": "mixer.out_proj",
    }


def _check_silu(config) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(
            f"hidden_act {act!r}: the Mamba layers' convolution applies it, and only silu is "
            "implemented"
        )


@family("JambaForCausalLM")
def jamba(config) -> DecoderSpec:
    _check_silu(config)
    n = config.num_hidden_layers
    attends = tuple(i % config.attn_layer_period == config.attn_layer_offset for i in range(n))
    e = config.num_experts
    sparse = tuple(
        e > 1 and i % config.expert_layer_period == config.expert_layer_offset for i in range(n)
    )
    names = llama_names(
        **_mixer_names("mamba"),
        **{
            "mamba.dt_layernorm": "mixer.dt_norm",
            "mamba.b_layernorm": "mixer.b_norm",
            "mamba.c_layernorm": "mixer.c_norm",
            "feed_forward.gate_proj": ("mlp.gate_up_proj", "gate"),
            "feed_forward.up_proj": ("mlp.gate_up_proj", "up"),
            "feed_forward.down_proj": "mlp.down_proj",
            "feed_forward.router": "mlp.gate",
            "pre_ff_layernorm": "mlp_norm",
        },
        **expert_names("feed_forward.experts", e, "gate_proj", "up_proj", "down_proj"),
    )
    names.top["model.final_layernorm"] = "norm"
    moe = None
    if any(sparse):
        moe = MoESpec(e, config.num_experts_per_tok, config.intermediate_size)
    return llama_like(
        config,
        names=names,
        rope=(None,) * n,
        windows=(None,) * n,  # Jamba's attention has no window, whatever the config says
        moe=moe,
        moe_layers=sparse,
        mixers=tuple("attention" if a else "recurrent" for a in attends),
        recurrent=MambaSpec(
            d_inner=config.mamba_expand * config.hidden_size,
            d_state=config.mamba_d_state,
            d_conv=config.mamba_d_conv,
            dt_rank=config.mamba_dt_rank,
            conv_bias=bool(config.mamba_conv_bias),
            proj_bias=bool(config.mamba_proj_bias),
            inner_norm_eps=config.rms_norm_eps,
        ),
    )


@family("MambaForCausalLM")
def mamba(config) -> DecoderSpec:
    _check_silu(config)
    n = config.num_hidden_layers
    names = WeightNames(
        "backbone.layers",
        {**_mixer_names("mixer"), "norm": "in_norm"},
        {"backbone.embeddings": "embed_tokens", "backbone.norm_f": "norm", "lm_head": "lm_head"},
    )
    return DecoderSpec(
        arch=(config.architectures or ["MambaForCausalLM"])[0],
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=n,
        # no attention layer: the head counts only give the unused attention shape a size
        num_heads=1,
        num_kv_heads=1,
        head_dim=config.hidden_size,
        intermediate_size=config.intermediate_size,
        names=names,
        norm=NormSpec("rms", config.layer_norm_epsilon),
        layer_norms=("in",),
        mixers=("recurrent",) * n,
        mlp_layers=(False,) * n,
        recurrent=MambaSpec(
            d_inner=config.intermediate_size,
            d_state=config.state_size,
            d_conv=config.conv_kernel,
            dt_rank=int(config.time_step_rank),
            conv_bias=bool(config.use_conv_bias),
            proj_bias=bool(config.use_bias),
        ),
        tied=bool(getattr(config, "tie_word_embeddings", True)),
    )

"""Every supported family as a description: a function from its transformers config to a
`DecoderSpec` (decoder.py), registered under the `config.architectures` names it serves.

Each description says only how its family differs from the shape it starts from, the way
transformers' modular files do; `docs/models.md` lists them with an example repo each. The
exact behaviour of each option comes from transformers' own modeling file of that family.
"""

from __future__ import annotations

from collections.abc import Callable

from ..layers.rotary import rope_parameters
from .decoder import DecoderSpec, NormSpec, RopeSpec, WeightNames

FAMILIES: dict[str, Callable[[object], DecoderSpec]] = {}


def family(*archs: str):
    def register(fn):
        for arch in archs:
            FAMILIES[arch] = fn
        return fn

    return register


# -- config readers ----------------------------------------------------------------------------


def _get(config, *keys, default=None):
    for key in keys:
        value = getattr(config, key, None)
        if value is not None:
            return value
    return default


def head_dim_of(config) -> int:
    return _get(config, "head_dim") or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config) -> int:
    return _get(config, "num_key_value_heads") or config.num_attention_heads


def base_shape(config, head_dim: int | None = None) -> dict:
    """The DecoderSpec fields every family reads the same way (the KV heads, MLP width and
    everything else are the family's own)."""
    heads = config.num_attention_heads
    return dict(
        arch=(config.architectures or ["?"])[0],
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        head_dim=head_dim or config.hidden_size // heads,
    )


QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def sliding_windows(config) -> tuple[int | None, ...]:
    """The window of each layer: transformers 5 names layer kinds in `layer_types`; older
    configs put one `sliding_window` on every layer (Qwen2/3 only with use_sliding_window)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if getattr(config, "model_type", "") in QWEN_TYPES and not getattr(
        config, "use_sliding_window", False
    ):
        window = None
    if not window:
        return (None,) * n
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return tuple(window if kind == "sliding_attention" else None for kind in kinds)
    return (window,) * n


def rope_of(config, head_dim: int, partial: float | None = None, is_neox=True, params=None):
    """The same rope on every layer: over `partial` of each head (or the config's
    partial_rotary_factor)."""
    params = dict(params if params is not None else rope_parameters(config))
    if partial is None:
        partial = params.pop("partial_rotary_factor", None) or _get(
            config, "partial_rotary_factor", default=1.0
        )
    params.pop("partial_rotary_factor", None)
    for key in ("original_max_position_embeddings",):
        if key not in params and getattr(config, key, None) is not None:
            params[key] = getattr(config, key)
    rot_dim = int(head_dim * partial)
    return (RopeSpec.of(params, rot_dim, is_neox),) * config.num_hidden_layers


# -- Llama and the families shaped like it -----------------------------------------------------

LLAMA_LAYER = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "self_attn.o_proj": "self_attn.o_proj",
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
    "mlp.down_proj": "mlp.down_proj",
    "input_layernorm": "in_norm",
    "post_attention_layernorm": "mlp_norm",
}
LLAMA_TOP = {"model.embed_tokens": "embed_tokens", "model.norm": "norm", "lm_head": "lm_head"}


def llama_names(**layer) -> WeightNames:
    return WeightNames("model.layers", {**LLAMA_LAYER, **layer}, dict(LLAMA_TOP))


def llama_like(config, **overrides) -> DecoderSpec:
    """Llama's shape read from a config; `overrides` are a family's differences."""
    d = head_dim_of(config)
    bias = bool(getattr(config, "attention_bias", False))
    kw = dict(
        **base_shape(config, d),
        num_kv_heads=num_kv_heads_of(config),
        intermediate_size=config.intermediate_size,
        names=llama_names(),
        norm=NormSpec("rms", _get(config, "rms_norm_eps", default=1e-6)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        windows=sliding_windows(config),
        rope=rope_of(config, d),
        act=_get(config, "hidden_act", default="silu"),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
    )
    kw.update(overrides)
    return DecoderSpec(**kw)


@family("LlamaForCausalLM", "MistralForCausalLM")
def llama(config) -> DecoderSpec:
    return llama_like(config)


@family("Qwen2ForCausalLM")
def qwen2(config) -> DecoderSpec:
    return llama_like(config, qkv_bias=True, o_bias=False)


@family("Qwen3ForCausalLM")
def qwen3(config) -> DecoderSpec:
    names = llama_names(
        **{"self_attn.q_norm": "self_attn.q_norm", "self_attn.k_norm": "self_attn.k_norm"}
    )
    return llama_like(config, qk_norm="rms_head", names=names)


def _gemma_common(config) -> dict:
    return dict(
        embed_scale=config.hidden_size**0.5,
        norm_weight_offset=1.0,
        # Gemma checkpoints tie the LM head to the embedding; transformers honours the config
        # when one does not (a fine-tune saved untied).
        tied=getattr(config, "tie_word_embeddings", True) is not False,
        act=_get(config, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh"),
    )


@family("GemmaForCausalLM")
def gemma(config) -> DecoderSpec:
    return llama_like(config, **_gemma_common(config))


GEMMA2_NORMS = {
    "post_attention_layernorm": "post_attn_norm",
    "pre_feedforward_layernorm": "mlp_norm",
    "post_feedforward_layernorm": "post_mlp_norm",
}


@family("Gemma2ForCausalLM")
def gemma2(config) -> DecoderSpec:
    return llama_like(
        config,
        **_gemma_common(config),
        names=llama_names(**GEMMA2_NORMS),
        layer_norms=("in", "post_attn", "mlp", "post_mlp"),
        scale=config.query_pre_attn_scalar**-0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None),
    )


@family("Gemma3ForCausalLM")
def gemma3(config) -> DecoderSpec:
    d = head_dim_of(config)
    params = config.rope_parameters  # one set per layer kind
    kinds = config.layer_types
    rope = tuple(RopeSpec.of(dict(params[kind]), d) for kind in kinds)
    names = llama_names(
        **GEMMA2_NORMS,
        **{"self_attn.q_norm": "self_attn.q_norm", "self_attn.k_norm": "self_attn.k_norm"},
    )
    return llama_like(
        config,
        **_gemma_common(config),
        names=names,
        layer_norms=("in", "post_attn", "mlp", "post_mlp"),
        qk_norm="rms_head",
        scale=config.query_pre_attn_scalar**-0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None),
        rope=rope,
    )


@family("Phi3ForCausalLM")
def phi3(config) -> DecoderSpec:
    # The checkpoint stores q/k/v and gate/up fused, in this engine's order.
    names = llama_names(
        **{"self_attn.qkv_proj": "self_attn.qkv_proj", "mlp.gate_up_proj": "mlp.gate_up_proj"}
    )
    return llama_like(config, names=names)


@family("OlmoForCausalLM")
def olmo(config) -> DecoderSpec:
    # OLMo's LayerNorm has neither weight nor bias.
    return llama_like(
        config,
        norm=NormSpec("layer", 1e-5, weight=False, bias=False),
        clip_qkv=getattr(config, "clip_qkv", None),
    )


@family("Olmo2ForCausalLM", "Olmo3ForCausalLM")
def olmo2(config) -> DecoderSpec:
    names = llama_names(
        post_attention_layernorm="post_attn_norm",
        post_feedforward_layernorm="post_mlp_norm",
        **{"self_attn.q_norm": "self_attn.q_norm", "self_attn.k_norm": "self_attn.k_norm"},
    )
    return llama_like(
        config, names=names, layer_norms=("post_attn", "post_mlp"), qk_norm="rms_full"
    )


@family("GraniteForCausalLM")
def granite(config) -> DecoderSpec:
    return llama_like(
        config,
        embed_scale=float(config.embedding_multiplier),
        residual_scale=float(config.residual_multiplier),
        scale=float(config.attention_multiplier),
        logit_scale=1.0 / float(config.logits_scaling),
    )


@family("CohereForCausalLM")
def cohere(config) -> DecoderSpec:
    d = head_dim_of(config)
    qk = bool(getattr(config, "use_qk_norm", False))
    names = llama_names(
        **{"self_attn.q_norm": "self_attn.q_norm", "self_attn.k_norm": "self_attn.k_norm"}
    )
    return llama_like(
        config,
        names=names,
        norm=NormSpec("layer", config.layer_norm_eps, weight=True, bias=False),
        layer_norms=("in",),
        parallel=True,
        qk_norm="layer_head" if qk else None,
        rope=rope_of(config, d, is_neox=False),
        logit_scale=float(config.logit_scale),
        tied=bool(getattr(config, "tie_word_embeddings", True)),
    )


@family("StableLmForCausalLM")
def stablelm(config) -> DecoderSpec:
    h, kvh = config.num_attention_heads, num_kv_heads_of(config)
    parallel = bool(getattr(config, "use_parallel_residual", False))
    layer = {}
    if getattr(config, "qk_layernorm", False):
        layer.update(
            {
                f"self_attn.q_layernorm.norms.{i}": ("self_attn.q_norm", f"head:{i}")
                for i in range(h)
            }
        )
        layer.update(
            {
                f"self_attn.k_layernorm.norms.{i}": ("self_attn.k_norm", f"head:{i}")
                for i in range(kvh)
            }
        )
    bias = bool(getattr(config, "use_qkv_bias", False))
    return llama_like(
        config,
        names=llama_names(**layer),
        norm=NormSpec("layer", config.layer_norm_eps, bias=True),
        layer_norms=("in",) if parallel else ("in", "mlp"),
        parallel=parallel,
        qk_norm="layer_head" if layer else None,
        qkv_bias=bias,
        o_bias=False,
    )


@family("Starcoder2ForCausalLM")
def starcoder2(config) -> DecoderSpec:
    bias = bool(getattr(config, "use_bias", True))
    names = llama_names(**{"mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"})
    return llama_like(
        config,
        names=names,
        norm=NormSpec("layer", config.norm_epsilon, bias=True),
        qkv_bias=bias,
        o_bias=bias,
        gated=False,
        mlp_bias=bias,
    )


# -- plain variants of the above (transformers' modular files derive them in a few lines) -------


@family("SmolLM3ForCausalLM")
def smollm3(config) -> DecoderSpec:
    # Every n-th layer has no rotary at all (no_rope_layers[i] == 0).
    rope = rope_of(config, head_dim_of(config))
    use = getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers
    return llama_like(config, rope=tuple(r if u else None for r, u in zip(rope, use)))


GLM_FUSED = {"mlp.gate_up_proj": "mlp.gate_up_proj"}


@family("GlmForCausalLM")
def glm(config) -> DecoderSpec:
    # Phi-3's fused gate_up_proj, q/k/v bias without o bias, partial rotary in the gpt-j layout.
    d = head_dim_of(config)
    return llama_like(
        config,
        names=llama_names(**GLM_FUSED),
        o_bias=False,
        rope=rope_of(config, d, is_neox=False),
    )


@family("Glm4ForCausalLM")
def glm4(config) -> DecoderSpec:
    names = llama_names(
        **GLM_FUSED,
        post_self_attn_layernorm="post_attn_norm",
        post_attention_layernorm="mlp_norm",
        post_mlp_layernorm="post_mlp_norm",
    )
    return llama_like(
        config,
        names=names,
        layer_norms=("in", "post_attn", "mlp", "post_mlp"),
        o_bias=False,
        rope=rope_of(config, head_dim_of(config), is_neox=False),
    )


@family("Exaone4ForCausalLM")
def exaone4(config) -> DecoderSpec:
    # OLMo 2's post-norms and Qwen 3's per-head q/k norms; with sliding layers, the global
    # layers have no rotary.
    windows = sliding_windows(config)
    rope = rope_of(config, head_dim_of(config))
    if any(w is not None for w in windows):
        rope = tuple(r if w is not None else None for r, w in zip(rope, windows))
    names = llama_names(
        post_attention_layernorm="post_attn_norm",
        post_feedforward_layernorm="post_mlp_norm",
        **{"self_attn.q_norm": "self_attn.q_norm", "self_attn.k_norm": "self_attn.k_norm"},
    )
    return llama_like(
        config,
        names=names,
        layer_norms=("post_attn", "post_mlp"),
        qk_norm="rms_head",
        windows=windows,
        rope=rope,
    )

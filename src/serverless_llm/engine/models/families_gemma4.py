"""Gemma 4 (`Gemma4ForCausalLM`, and the text part of `Gemma4ForConditionalGeneration`), as
transformers' modeling_gemma4.py computes it. Its text decoder is Gemma 3's layer (norms before
and after attention and MLP, per-head q/k RMSNorm, sliding and global layers each with their
rope, the embedding times sqrt(hidden), a final soft-cap) with:

- RMSNorm weights used as they are (no `1 + w`), attention scale 1 (the q/k norms scale);
- values RMS-normed over the head without a weight (`v_norm`);
- **per-layer head shapes**: the global ("full_attention") layers' `global_head_dim` and, with
  `attention_k_eq_v`, `num_global_key_value_heads` (`per_layer_config`); their cache entries are
  views into the widest layer's (`DecoderModel.layer_cache_views`);
- **`attention_k_eq_v`** on global layers: no v_proj, the values are the raw key projection;
- rope per layer kind: the sliding layers' default rope over their head, the global layers'
  `proportional` rope (the first `partial_rotary_factor` of the frequency pairs rotating at the
  whole head's frequencies) over theirs;
- **KV shared across layers** (`num_kv_shared_layers`): the last layers have no K/V projection
  and no cache; each attends to the K/V of the last earlier layer of its kind (its cache group,
  `DecoderSpec.kv_source`), and their MLPs may be twice as wide (`use_double_wide_mlp`);
- **per-layer input embeddings** (`hidden_size_per_layer_input`): an embedding of every
  layer's own (times sqrt(width)), mixed with the normed projection of the token embedding,
  fed into each layer after its MLP through a gate, a projection and a norm; at the rows that
  take image features, the pad token's embedding mixed with the features' projection;
- each layer's output times its `layer_scalar`;
- the **MoE block** (`enable_moe_block`, the 26B-A4B model): routed experts beside the dense MLP
  in every layer (`DecoderSpec.moe_beside`, decoder.ExpertsBeside): routed from the stream before
  the MLP norm (RMS-normed without a weight, times a learned scale and hidden^-0.5; softmax
  top-k renormalised, times the chosen experts' `per_expert_scale`), their input and output and
  the dense MLP's output each normed, the two summed before the post-MLP norm.

Refused at start, by name: bidirectional attention over text
(`use_bidirectional_attention: "all"`).
"""

from __future__ import annotations

from .decoder import DecoderSpec, MoESpec, NormSpec, RopeSpec
from .families import GEMMA2_NORMS, _get, base_shape, family, llama_names

GEMMA4_LAYER = {
    **GEMMA2_NORMS,
    "self_attn.q_norm": "self_attn.q_norm",
    "self_attn.k_norm": "self_attn.k_norm",
    "per_layer_input_gate": "ple_gate",
    "per_layer_projection": "ple_proj",
    "post_per_layer_input_norm": "ple_norm",
    ".layer_scalar": "layer_scalar",  # a bare tensor of the layer itself
}
# The MoE block beside the dense MLP (`enable_moe_block`): the router's bare `scale` and
# `per_expert_scale`, the experts stored stacked ([E, 2I, H] gate | up, [E, H, I] down).
GEMMA4_MOE = {
    "router": "experts_beside.router",
    "router.proj": "experts_beside.router.proj",
    "experts.gate_up_proj": "experts_beside.experts.w13",
    "experts.down_proj": "experts_beside.experts.w2",
    "post_feedforward_layernorm_1": "experts_beside.dense_norm",
    "pre_feedforward_layernorm_2": "experts_beside.in_norm",
    "post_feedforward_layernorm_2": "experts_beside.out_norm",
}
GEMMA4_TOP = {
    "model.embed_tokens_per_layer": "embed_tokens_per_layer",
    "model.per_layer_model_projection": "per_layer_model_projection",
    "model.per_layer_projection_norm": "per_layer_projection_norm",
}
LAYER_KINDS = ("sliding_attention", "full_attention")


def kv_sources(config) -> tuple[int | None, ...]:
    """Per layer, the layer whose K/V it reads: from `num_hidden_layers - num_kv_shared_layers`
    on, the last earlier layer of the same kind (transformers' "store" layers); else None."""
    n = config.num_hidden_layers
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    first = n - shared
    kinds = list(config.layer_types)
    sources: list[int | None] = [None] * n
    for i in range(first, n):
        earlier = [j for j in range(first) if kinds[j] == kinds[i]]
        if not earlier:
            raise ValueError(
                f"layer {i} shares the KV of a {kinds[i]} layer, and none comes before"
            )
        sources[i] = earlier[-1]
    return tuple(sources)


@family("Gemma4ForCausalLM")
def gemma4(config) -> DecoderSpec:
    moe = None
    if getattr(config, "enable_moe_block", False):
        moe = MoESpec(
            num_experts=config.num_experts,
            top_k=config.top_k_experts,
            intermediate_size=config.moe_intermediate_size,
            routing="softmax_topk",
            renormalize=True,
        )
    if getattr(config, "use_bidirectional_attention", None) == "all":
        raise ValueError("use_bidirectional_attention='all' (every token attending both ways)")
    n = config.num_hidden_layers
    kinds = list(config.layer_types)
    unknown = set(kinds) - set(LAYER_KINDS)
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} (Gemma 4 has {', '.join(LAYER_KINDS)})")
    # Head shapes are per layer (`per_layer_config`; transformers refuses to read the global
    # ones of such a config): the model's are the first layer's, the others' where they differ.
    per_layer = getattr(config, "per_layer_config", None)
    shapes = []
    for i in range(n):
        own = per_layer[i] if per_layer is not None else config
        shapes.append((own.num_key_value_heads, own.head_dim))
    kvh, d = shapes[0]
    heads = [None if shape == (kvh, d) else shape for shape in shapes]
    params = config.rope_parameters  # one set per layer kind
    rope = tuple(
        None
        if params.get(kind) is None
        else RopeSpec.of(dict(params[kind]), (heads[i] or (kvh, d))[1])
        for i, kind in enumerate(kinds)
    )
    sources = kv_sources(config)
    double = bool(getattr(config, "use_double_wide_mlp", False))
    mlp_sizes = tuple(
        2 * config.intermediate_size if double and src is not None else None for src in sources
    )
    width = getattr(config, "hidden_size_per_layer_input", 0) or 0
    per_layer_input = per_layer_image_id = None
    if width:
        per_layer_input = (config.vocab_size_per_layer_input, width)
        # the image rows' per-layer embedding is the pad token's (Gemma4Model.forward)
        per_layer_image_id = getattr(config, "pad_token_id", None)
    window = config.sliding_window
    names = llama_names(**GEMMA4_LAYER, **(GEMMA4_MOE if moe is not None else {}))
    names.top.update(GEMMA4_TOP)
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderSpec(
        **base_shape(config, d),
        num_kv_heads=kvh,
        intermediate_size=config.intermediate_size,
        qkv_bias=bias,
        o_bias=bias,
        names=names,
        norm=NormSpec("rms", config.rms_norm_eps),
        layer_norms=("in", "post_attn", "mlp", "post_mlp"),
        qk_norm="rms_head",
        scale=1.0,
        windows=tuple(window if kind == "sliding_attention" else None for kind in kinds),
        rope=rope,
        embed_scale=config.hidden_size**0.5,
        tied=getattr(config, "tie_word_embeddings", True) is not False,
        act=_get(config, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh"),
        final_softcap=getattr(config, "final_logit_softcapping", None),
        v_norm=True,
        layer_heads=tuple(heads),
        k_eq_v=tuple(
            bool(config.attention_k_eq_v) and kind != "sliding_attention" for kind in kinds
        ),
        kv_source=sources,
        mlp_sizes=mlp_sizes,
        per_layer_input=per_layer_input,
        per_layer_image_id=per_layer_image_id,
        layer_scalar=True,
        moe_beside=moe,
    )

"""Llama 4 (`Llama4ForCausalLM`, and the text part of `Llama4ForConditionalGeneration`), as
transformers' modeling_llama4.py computes it: Llama's layers with

- chunked local attention on the layers with rotary ("chunked_attention" in `layer_types`): a
  query sees only the keys of its own `attention_chunk_size` chunk, so their cache group holds
  the current chunk only (kv_cache_manager.ChunkedLocalSpec);
- no rotary on every `no_rope_layer_interval`-th layer (`no_rope_layers[i] == 0`), which attend
  to everything and scale their queries by the attention temperature (`attn_temperature_tuning`:
  1 + attn_scale * log1p(floor((p + 1) / floor_scale)) at position p);
- rotary in the interleaved-pairs layout (transformers multiplies complex pairs), then the L2
  norm (RMS with no weight) of q and k, on the rotary layers only (`use_qk_norm`);
- mixture-of-experts layers every `interleave_moe_layer_step`-th layer (`moe_layers`): top-k
  logits through a sigmoid, each chosen expert reading the token scaled by its weight
  (MoESpec.weighted_inputs), plus a shared expert of the experts' width; the dense layers' MLP
  is `intermediate_size_mlp` wide. The experts are stored stacked and transposed
  (gate_up_proj [E, H, 2I], down_proj [E, I, H]) by transformers, or one tensor per expert and
  projection (`experts.<e>.gate_proj` ...), as some quantized checkpoints store them.
"""

from __future__ import annotations

from .decoder import DecoderSpec, MoESpec, expert_names
from .families import family, head_dim_of, llama_like, llama_names, rope_of

LLAMA4_FFN = {
    "feed_forward.gate_proj": ("mlp.gate_up_proj", "gate"),
    "feed_forward.up_proj": ("mlp.gate_up_proj", "up"),
    "feed_forward.down_proj": "mlp.down_proj",
    "feed_forward.router": "mlp.gate",
    "feed_forward.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", "gate"),
    "feed_forward.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", "up"),
    "feed_forward.shared_expert.down_proj": "mlp.shared_expert.down_proj",
    "feed_forward.experts.gate_up_proj": ("mlp.experts.w13", "experts:t"),
    "feed_forward.experts.down_proj": ("mlp.experts.w2", "experts:t"),
}


@family("Llama4ForCausalLM")
def llama4(config) -> DecoderSpec:
    n = config.num_hidden_layers
    d = head_dim_of(config)
    uses_rope = tuple(bool(u) for u in config.no_rope_layers)
    rope = tuple(r if u else None for r, u in zip(rope_of(config, d, is_neox=False), uses_rope))
    kinds = list(config.layer_types)
    unknown = set(kinds) - {"chunked_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} (Llama 4 has chunked and full layers)")
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is None and "chunked_attention" in kinds:
        raise ValueError("chunked_attention layers without an attention_chunk_size")
    chunks = tuple(chunk if k == "chunked_attention" else None for k in kinds)
    sparse = set(config.moe_layers or ())
    moe = None
    if sparse:
        moe = MoESpec(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            routing="topk_sigmoid",
            shared_size=config.intermediate_size,
            weighted_inputs=True,
        )
    temperature = None
    if getattr(config, "attn_temperature_tuning", False):
        temperature = (float(config.floor_scale), float(config.attn_scale))
    per_expert = {}
    if moe is not None:
        e = config.num_local_experts
        per_expert = expert_names("feed_forward.experts", e, "gate_proj", "up_proj", "down_proj")
    return llama_like(
        config,
        names=llama_names(**LLAMA4_FFN, **per_expert),
        intermediate_size=config.intermediate_size_mlp,
        rope=rope,
        windows=(None,) * n,
        chunks=chunks,
        qk_norm="l2_head" if getattr(config, "use_qk_norm", False) else None,
        qk_norm_layers=uses_rope,
        attn_temperature=temperature,
        moe=moe,
        moe_layers=tuple(i in sparse for i in range(n)),
    )

"""gpt-oss (`GptOssForCausalLM`, openai/gpt-oss-20b and -120b): Llama's layer with what
transformers' gpt_oss model adds to it.

- Attention: q/k/v/o biases, a learned sink logit per head inside the softmax
  (`self_attn.sinks`: `DecoderSpec.attn_sinks`), layers alternating between a sliding window
  (`sliding_window`, 128 tokens in the released models) and full attention by `layer_types`,
  which the cache groups keep apart; YaRN rotary over whole heads in halves.
- Every layer's MLP is sparse: a router with a bias (`mlp.router`), top-k of its logits with a
  softmax over those k ("topk_softmax"), experts with a bias per projection and the clamped
  SwiGLU (`swiglu_alpha`, `swiglu_limit`: `ClampedSwiGLU`).
- Checkpoint layout of the experts: `gate_up_proj` [E, H, 2I] with gate and up columns
  alternating, its bias [E, 2I] alike, `down_proj` [E, I, H] (both stored input-major), or in
  the released checkpoints MXFP4 `*_blocks` and `*_scales` ([E, out, in / 32, 16] and
  [E, out, in / 32]: kernels/mxfp4.py), dequantized at load.
"""

from __future__ import annotations

from .decoder import DecoderSpec, MoESpec
from .families import family, llama_like, llama_names

GPT_OSS_LAYER = {
    "self_attn.sinks": "self_attn.sinks",
    "mlp.router": "mlp.gate",
    "mlp.experts.gate_up_proj": ("mlp.experts.w13", "experts:interleaved_t"),
    "mlp.experts.gate_up_proj_bias": ("mlp.experts.w13_bias", "experts:interleaved"),
    "mlp.experts.down_proj": ("mlp.experts.w2", "experts:stacked_t"),
    "mlp.experts.down_proj_bias": "mlp.experts.w2_bias",
    # MXFP4: [E, out, in / 32, 16] blocks, decoded with their scales into our [E, out, in]
    "mlp.experts.gate_up_proj_blocks": ("mlp.experts.w13", "mxfp4_blocks:experts:interleaved"),
    "mlp.experts.gate_up_proj_scales": ("mlp.experts.w13", "mxfp4_scales:experts:interleaved"),
    "mlp.experts.down_proj_blocks": ("mlp.experts.w2", "mxfp4_blocks"),
    "mlp.experts.down_proj_scales": ("mlp.experts.w2", "mxfp4_scales"),
}


@family("GptOssForCausalLM")
def gpt_oss(config) -> DecoderSpec:
    moe = MoESpec(
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.intermediate_size,
        routing="topk_softmax",
        router_bias=True,
        expert_bias=True,
        swiglu=(float(config.swiglu_alpha), float(config.swiglu_limit)),
    )
    return llama_like(config, names=llama_names(**GPT_OSS_LAYER), attn_sinks=True, moe=moe)

"""Families whose code lives only in their hub repositories (TRUST_REMOTE_CODE), served where
one is exactly a described shape under other weight names. Their configs come from the
repository's own configuration file, so each description reads the fields that file defines.

- InternLM2 (`InternLM2ForCausalLM`): Llama with q/k/v fused per KV group ([kv_heads,
  group + 2, head_dim] rows, as Falcon's new decoder stores them) and its own names.
- InternLM (`InternLMForCausalLM`), Aquila (`AquilaForCausalLM`, `AquilaModel`), Xverse
  (`XverseForCausalLM`): Llama under Llama's names (InternLM with `bias` on q/k/v/o).
- Qwen (v1, `QWenLMHeadModel`): Llama with a fused, biased c_attn and GPT-style names; its MLP
  computes w1(x) * silu(w2(x)), so w2 is the gate; `intermediate_size` counts both halves.
  Its long-context tricks (dynamic NTK, log-n attention scaling) act only past `seq_length`,
  which the engine's context limit keeps it within.
- MiMo (`MiMoForCausalLM`, XiaomiMiMo/MiMo-7B-Base, -RL; model_type "mimo"): Qwen2 (q/k/v
  bias) under Qwen2's names; its config is read by Qwen2's config class without the
  repository's code (loader/weights.CONFIG_STANDINS). Its multi-token-prediction layers
  (`model.mtp_layers.<i>.`, num_nextn_predict_layers of them) are skipped here; speculative
  decoding's `mtp` method runs the first (engine/eagle.py).

Families of worker-vllm's list that are not served: Baichuan (ALiBi for 13B chosen by model size
in its code, and a normalised head), ChatGLM (its own 2D rotary), Jais (muP scalings with
ALiBi and SwiGLU), MiniCPM and Orion; docs/models.md says so.
"""

from __future__ import annotations

from .decoder import DecoderSpec, NormSpec, WeightNames
from .families import _get, family, llama_like, qwen2, rope_of


@family("InternLM2ForCausalLM")
def internlm2(config) -> DecoderSpec:
    bias = bool(getattr(config, "bias", False))
    names = WeightNames(
        "model.layers",
        {
            "attention.wqkv": ("self_attn.qkv_proj", "qkv_grouped"),
            "attention.wo": "self_attn.o_proj",
            "feed_forward.w1": ("mlp.gate_up_proj", "gate"),
            "feed_forward.w3": ("mlp.gate_up_proj", "up"),
            "feed_forward.w2": "mlp.down_proj",
            "attention_norm": "in_norm",
            "ffn_norm": "mlp_norm",
        },
        {"model.tok_embeddings": "embed_tokens", "model.norm": "norm", "output": "lm_head"},
    )
    return llama_like(config, names=names, qkv_bias=bias, o_bias=bias)


@family("InternLMForCausalLM")
def internlm(config) -> DecoderSpec:
    bias = bool(getattr(config, "bias", True))
    return llama_like(config, qkv_bias=bias, o_bias=bias)


@family("AquilaForCausalLM", "AquilaModel", "XverseForCausalLM")
def llama_named(config) -> DecoderSpec:
    return llama_like(config)


@family("QWenLMHeadModel")
def qwen_v1(config) -> DecoderSpec:
    h = config.hidden_size
    heads = config.num_attention_heads
    d = _get(config, "kv_channels") or h // heads
    names = WeightNames(
        "transformer.h",
        {
            "attn.c_attn": "self_attn.qkv_proj",
            "attn.c_proj": "self_attn.o_proj",
            "mlp.w2": ("mlp.gate_up_proj", "gate"),
            "mlp.w1": ("mlp.gate_up_proj", "up"),
            "mlp.c_proj": "mlp.down_proj",
            "ln_1": "in_norm",
            "ln_2": "mlp_norm",
        },
        {"transformer.wte": "embed_tokens", "transformer.ln_f": "norm", "lm_head": "lm_head"},
    )
    params = {
        "rope_type": "default",
        "rope_theta": float(_get(config, "rotary_emb_base", default=10000.0)),
    }
    return llama_like(
        config,
        names=names,
        num_kv_heads=heads,
        head_dim=d,
        intermediate_size=config.intermediate_size // 2,
        norm=NormSpec("rms", _get(config, "layer_norm_epsilon", default=1e-6)),
        qkv_bias=True,
        o_bias=not getattr(config, "no_bias", True),
        rope=rope_of(
            config, d, partial=float(_get(config, "rotary_pct", default=1.0)), params=params
        ),
        windows=(None,) * config.num_hidden_layers,
    )


@family("MiMoForCausalLM")
def mimo(config) -> DecoderSpec:
    spec = qwen2(config)
    spec.names.skip_prefixes = ("model.mtp_layers.",)
    # Its repository's config class (trust_remote_code) keeps sliding_window without
    # use_sliding_window; Qwen2's rule: no window unless use_sliding_window.
    if not getattr(config, "use_sliding_window", False):
        spec.windows = (None,) * config.num_hidden_layers
    return spec

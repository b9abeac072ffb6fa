"""Every Llama-shaped family against transformers: a tiny random model from the family's own
config class with its characteristic options on (sliding windows shorter than the prompts,
soft-caps, partial rotary, parallel residual, multipliers, q/k norms), 8 prompts of different
lengths batched together, 48 greedy tokens each."""

from __future__ import annotations

import pytest
import transformers

from tests.engine.family_check import (
    family_models_fixture,
    greedy_family_test,
    save_family_model,
    tiny_dims,
)
from tests.tiny_models import build_tokenizer

# The family's config with its twists switched on.
CONFIGS = {
    "qwen3": lambda tok: transformers.Qwen3Config(
        **tiny_dims(tok, head_dim=24), attention_bias=True, tie_word_embeddings=False
    ),
    "qwen3_window": lambda tok: transformers.Qwen3Config(
        **tiny_dims(tok, num_hidden_layers=3),
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=1,
    ),
    "gemma": lambda tok: transformers.GemmaConfig(**tiny_dims(tok, head_dim=16)),
    "gemma2": lambda tok: transformers.Gemma2Config(
        **tiny_dims(tok, head_dim=16, num_hidden_layers=3),
        sliding_window=16,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    ),
    "gemma3": lambda tok: transformers.Gemma3TextConfig(
        **tiny_dims(tok, head_dim=16, num_hidden_layers=3),
        sliding_window=16,
        sliding_window_pattern=2,
        query_pre_attn_scalar=24,
        final_logit_softcapping=3.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0},
        },
        architectures=["Gemma3ForCausalLM"],
    ),
    "phi3": lambda tok: transformers.Phi3Config(
        **tiny_dims(tok, max_position_embeddings=4096),
        original_max_position_embeddings=1024,
        partial_rotary_factor=0.5,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(4)],
            "long_factor": [2.0 + 0.2 * i for i in range(4)],
        },
        sliding_window=20,
    ),
    "olmo": lambda tok: transformers.OlmoConfig(**tiny_dims(tok), clip_qkv=0.5),
    "olmo2": lambda tok: transformers.Olmo2Config(**tiny_dims(tok)),
    "granite": lambda tok: transformers.GraniteConfig(
        **tiny_dims(tok),
        embedding_multiplier=3.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=2.0,
    ),
    "cohere": lambda tok: transformers.CohereConfig(
        **tiny_dims(tok), use_qk_norm=True, logit_scale=0.5
    ),
    "stablelm": lambda tok: transformers.StableLmConfig(
        **tiny_dims(tok), qk_layernorm=True, use_qkv_bias=True, partial_rotary_factor=0.25
    ),
    "stablelm_parallel": lambda tok: transformers.StableLmConfig(
        **tiny_dims(tok), use_parallel_residual=True
    ),
    "starcoder2": lambda tok: transformers.Starcoder2Config(**tiny_dims(tok), sliding_window=16),
    "smollm3": lambda tok: transformers.SmolLM3Config(
        **tiny_dims(tok, num_hidden_layers=4), no_rope_layer_interval=2
    ),
    "glm": lambda tok: transformers.GlmConfig(**tiny_dims(tok, head_dim=16), attention_bias=True),
    "glm4": lambda tok: transformers.Glm4Config(**tiny_dims(tok, head_dim=16), attention_bias=True),
    "exaone4": lambda tok: transformers.Exaone4Config(
        **tiny_dims(tok, num_hidden_layers=4), sliding_window=16, sliding_window_pattern=2
    ),
}

family_models = family_models_fixture(CONFIGS)
test_family_greedy_equals_transformers = greedy_family_test(CONFIGS)


def test_unsupported_architecture_names_every_family(tmp_path):
    from serverless_llm import LLM
    from serverless_llm.engine import UnsupportedModelError

    config = transformers.LlamaConfig(**tiny_dims(build_tokenizer()))
    path = save_family_model(str(tmp_path / "fancy"), config)
    import json

    cfg_path = tmp_path / "fancy" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        LLM(path, num_kv_blocks=16, max_model_len=64)
    for arch in ("FancyNewForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "docs/models.md"):
        assert arch in str(e.value)

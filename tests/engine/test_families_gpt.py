"""The GPT-shaped families against transformers (families_gpt.py): a tiny random model from the
family's own config class with its characteristic options on (learned positions, Conv1D weights,
multi-query, partial and interleaved rotary, parallel residual with one norm and with two, OPT
before and after the norm and with its embeddings projected, Phi's shared q/k LayerNorm, a
biased lm_head), 8 prompts of different lengths batched together, 48 greedy tokens each."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from serverless_llm.engine.models import describe_model
from tests.engine.family_check import (
    assert_matches_transformers,
    family_models_fixture,
    greedy_family_test,
    save_family_model,
    tiny_dims,
)
from tests.tiny_models import build_tokenizer

# The family's config with its twists switched on.
CONFIGS = {
    "gpt2": lambda tok: transformers.GPT2Config(
        **tiny_dims(tok, "gpt2"), reorder_and_upcast_attn=True
    ),
    "gpt2_unscaled": lambda tok: transformers.GPT2Config(
        **tiny_dims(tok, "gpt2"), scale_attn_weights=False, activation_function="relu"
    ),
    "gpt_bigcode": lambda tok: transformers.GPTBigCodeConfig(
        **tiny_dims(tok, "gpt2"), multi_query=True
    ),
    "gpt_bigcode_mha": lambda tok: transformers.GPTBigCodeConfig(
        **tiny_dims(tok, "gpt2"), multi_query=False
    ),
    "gptj": lambda tok: transformers.GPTJConfig(**tiny_dims(tok, "gpt2"), rotary_dim=8),
    # rotary over the whole head
    "gptj_full_rotary": lambda tok: transformers.GPTJConfig(
        **tiny_dims(tok, "gpt2"), rotary_dim=16
    ),
    "gpt_neox": lambda tok: transformers.GPTNeoXConfig(
        **tiny_dims(tok, "neox"), rotary_pct=0.25, rotary_emb_base=1000, use_parallel_residual=True
    ),
    "gpt_neox_sequential": lambda tok: transformers.GPTNeoXConfig(
        **tiny_dims(tok, "neox"), rotary_pct=0.5, use_parallel_residual=False, attention_bias=False
    ),
    "opt": lambda tok: transformers.OPTConfig(
        **tiny_dims(tok, "neox"), ffn_dim=128, do_layer_norm_before=True, word_embed_proj_dim=32
    ),
    # opt-350m's shape: norms after the adds, embeddings projected
    "opt_post_ln": lambda tok: transformers.OPTConfig(
        **tiny_dims(tok, "neox"), ffn_dim=128, do_layer_norm_before=False, word_embed_proj_dim=32
    ),
    "opt_no_bias": lambda tok: transformers.OPTConfig(
        **tiny_dims(tok, "neox"),
        ffn_dim=128,
        enable_bias=False,
        layer_norm_elementwise_affine=False,
        tie_word_embeddings=False,
    ),
    "phi": lambda tok: transformers.PhiConfig(
        **tiny_dims(tok), qk_layernorm=True, partial_rotary_factor=0.5
    ),
}

family_models = family_models_fixture(CONFIGS)
test_family_greedy_equals_transformers = greedy_family_test(CONFIGS)


@pytest.mark.parametrize(("name", "prefix"), [("gpt2", "transformer."), ("opt", "model.")])
def test_checkpoint_of_the_bare_base_model_loads(tmp_path, name, prefix):
    """GPT-2's and OPT's own checkpoints name their tensors without the head model's prefix
    ("h.0.attn.c_attn.weight", "decoder.layers.0.fc1.weight") and carry buffers (the causal
    mask "h.0.attn.bias") and the tied head."""
    config = CONFIGS[name](build_tokenizer())
    path = save_family_model(str(tmp_path / name), config)
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    bare = {k.removeprefix(prefix): v for k, v in state.items()}
    assert bare.keys() != state.keys()
    bare["lm_head.weight"] = state[
        f"{prefix}{'wte' if name == 'gpt2' else 'decoder.embed_tokens'}.weight"
    ].clone()
    if name == "gpt2":
        bare["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 8, 8))
    save_file(bare, file, metadata={"format": "pt"})
    assert_matches_transformers(path, new_tokens=8, lengths=(3, 20))


def test_gpt2_per_layer_scale_is_refused(tmp_path):
    config = CONFIGS["gpt2"](build_tokenizer())
    config.scale_attn_by_inverse_layer_idx = True
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        describe_model(config)


def test_neox_checkpoint_names_from_the_hub(tmp_path):
    """GPT-NeoX checkpoints on the hub name the head `embed_out` (as transformers saves it, the
    other tests) or `lm_head` (its module's name) and carry the attention's mask and rotary
    buffers."""
    config = CONFIGS["gpt_neox"](build_tokenizer())
    path = save_family_model(str(tmp_path / "neox"), config)
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    state["lm_head.weight"] = state.pop("embed_out.weight")
    state["gpt_neox.layers.0.attention.bias"] = torch.tril(torch.ones(1, 1, 8, 8))
    state["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
    state["gpt_neox.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(2)
    save_file(state, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["GPTNeoXForCausalLM"]
    assert_matches_transformers(path, new_tokens=8, lengths=(3, 20))

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
from tests.engine.family_check import assert_matches_transformers, save_family_model
from tests.tiny_models import build_tokenizer


def _ids(tok) -> dict:
    return dict(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def _gpt2_dims(tok, **kw) -> dict:
    """GPT-2's own names for the tiny sizes (GPT-2, GPT-BigCode, GPT-J)."""
    return dict(n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=512, **_ids(tok), **kw)


def _dims(tok, **kw) -> dict:
    """The tiny sizes under the usual names (GPT-NeoX, Phi)."""
    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
    )
    return {**base, **_ids(tok), **kw}


def _config(name: str, tok):
    """The family's config with its twists switched on."""
    if name == "gpt2":
        return transformers.GPT2Config(**_gpt2_dims(tok), reorder_and_upcast_attn=True)
    if name == "gpt2_unscaled":
        return transformers.GPT2Config(
            **_gpt2_dims(tok), scale_attn_weights=False, activation_function="relu"
        )
    if name == "gpt_bigcode":
        return transformers.GPTBigCodeConfig(**_gpt2_dims(tok), multi_query=True)
    if name == "gpt_bigcode_mha":
        return transformers.GPTBigCodeConfig(**_gpt2_dims(tok), multi_query=False)
    if name == "gptj":
        return transformers.GPTJConfig(**_gpt2_dims(tok), rotary_dim=8)
    if name == "gptj_full_rotary":
        return transformers.GPTJConfig(**_gpt2_dims(tok), rotary_dim=16)  # the whole head
    if name == "gpt_neox":
        return transformers.GPTNeoXConfig(
            **_dims(tok), rotary_pct=0.25, rotary_emb_base=1000, use_parallel_residual=True
        )
    if name == "gpt_neox_sequential":
        return transformers.GPTNeoXConfig(
            **_dims(tok), rotary_pct=0.5, use_parallel_residual=False, attention_bias=False
        )
    if name == "opt":
        return transformers.OPTConfig(
            **_dims(tok), ffn_dim=128, do_layer_norm_before=True, word_embed_proj_dim=32
        )
    if name == "opt_post_ln":  # opt-350m's shape: norms after the adds, embeddings projected
        return transformers.OPTConfig(
            **_dims(tok), ffn_dim=128, do_layer_norm_before=False, word_embed_proj_dim=32
        )
    if name == "opt_no_bias":
        return transformers.OPTConfig(
            **_dims(tok),
            ffn_dim=128,
            enable_bias=False,
            layer_norm_elementwise_affine=False,
            tie_word_embeddings=False,
        )
    if name == "phi":
        return transformers.PhiConfig(
            **_dims(tok, num_key_value_heads=2), qk_layernorm=True, partial_rotary_factor=0.5
        )
    raise ValueError(name)


FAMILIES = [
    "gpt2",
    "gpt2_unscaled",
    "gpt_bigcode",
    "gpt_bigcode_mha",
    "gptj",
    "gptj_full_rotary",
    "gpt_neox",
    "gpt_neox_sequential",
    "opt",
    "opt_post_ln",
    "opt_no_bias",
    "phi",
]


@pytest.mark.parametrize("name", FAMILIES)
def test_family_greedy_equals_transformers(tmp_path, name):
    config = _config(name, build_tokenizer())
    path = save_family_model(str(tmp_path / name), config)
    assert_matches_transformers(path)


@pytest.mark.parametrize(("name", "prefix"), [("gpt2", "transformer."), ("opt", "model.")])
def test_checkpoint_of_the_bare_base_model_loads(tmp_path, name, prefix):
    """GPT-2's and OPT's own checkpoints name their tensors without the head model's prefix
    ("h.0.attn.c_attn.weight", "decoder.layers.0.fc1.weight") and carry buffers (the causal
    mask "h.0.attn.bias") and the tied head."""
    config = _config(name, build_tokenizer())
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
    config = _config("gpt2", build_tokenizer())
    config.scale_attn_by_inverse_layer_idx = True
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        describe_model(config)


def test_neox_checkpoint_names_from_the_hub(tmp_path):
    """GPT-NeoX checkpoints on the hub name the head `embed_out` (as transformers saves it, the
    other tests) or `lm_head` (its module's name) and carry the attention's mask and rotary
    buffers."""
    config = _config("gpt_neox", build_tokenizer())
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

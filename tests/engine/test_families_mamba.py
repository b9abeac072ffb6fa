"""Mamba-2 models and hybrids of attention and Mamba-2 layers (issue 35) against transformers: tiny
random models, 8 prompts of different lengths batched together, 48 greedy tokens each."""

from __future__ import annotations

import pytest
import transformers

from serverless_llm.engine.models.registry import UnsupportedModelError, describe_model
from tests.engine.family_check import family_models_fixture, greedy_family_test, tiny_dims


def token_ids(tok) -> dict:
    return dict(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


# The Mamba-2 layer of the hybrids: 8 heads of 16 (d_inner 128 = 2 x 64), 2 groups of B and C,
# a state of 16, 3 taps, conv and projection biases on.
MAMBA = dict(
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=3,
    mamba_conv_bias=True,
    mamba_proj_bias=True,
)


def granite_hybrid(tok, **kw):
    # mamba, attention, mamba, mamba; Granite's four multipliers away from 1
    return transformers.GraniteMoeHybridConfig(
        **tiny_dims(tok, num_hidden_layers=4),
        layer_types=["mamba", "attention", "mamba", "mamba"],
        **MAMBA,
        shared_intermediate_size=96,
        embedding_multiplier=3.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
        logits_scaling=2.0,
        rms_norm_eps=1e-5,
        **kw,
    )


CONFIGS = {
    # recurrent layers alone (no attention, no KV cache), n_groups 2, in/out proj biases
    "mamba2": lambda tok: transformers.Mamba2Config(
        **token_ids(tok),
        hidden_size=64,
        num_hidden_layers=3,
        num_heads=8,
        head_dim=16,
        state_size=16,
        n_groups=2,
        conv_kernel=4,
        use_bias=True,
        use_conv_bias=True,
    ),
    # attention at layers 1 and 3 of 4, partial rotary (half of each head)
    "bamba": lambda tok: transformers.BambaConfig(
        **tiny_dims(tok, num_hidden_layers=4),
        attn_layer_indices=[1, 3],
        **MAMBA,
        attention_bias=True,
    ),
    # top-2 of 4 experts plus the shared MLP, rope
    "granitemoehybrid": lambda tok: granite_hybrid(
        tok, num_local_experts=4, num_experts_per_tok=2, position_embedding_type="rope"
    ),
    # no experts: the shared MLP alone, no position embedding
    "granitemoehybrid_dense": lambda tok: granite_hybrid(
        tok, num_local_experts=0, position_embedding_type="nope"
    ),
}

family_models = family_models_fixture(CONFIGS)
test_family_greedy_equals_transformers = greedy_family_test(CONFIGS)


def test_mamba2_keeps_no_kv_cache(family_models):
    from serverless_llm import LLM

    llm = LLM(family_models("mamba2"), max_model_len=64, dtype="float32", max_num_seqs=3)
    layout = llm.engine.cache_layout
    assert layout.num_groups == 0 and len(layout.state_layers) == 3
    assert llm.engine.state_pool.num_slots == 4


@pytest.mark.parametrize(
    "arch, change, named",
    [
        ("Mamba2ForCausalLM", dict(hidden_act="gelu"), "gelu"),
        ("Mamba2ForCausalLM", dict(d_ssm=64), "d_ssm"),
        ("GraniteMoeHybridForCausalLM", dict(position_embedding_type="alibi"), "alibi"),
        ("GraniteMoeHybridForCausalLM", dict(layer_types=["mamba", "sliding"]), "sliding"),
    ],
)
def test_unsupported_options_are_refused_by_name(arch, change, named):
    from tests.tiny_models import build_tokenizer

    name = {"Mamba2ForCausalLM": "mamba2", "GraniteMoeHybridForCausalLM": "granitemoehybrid"}
    config = CONFIGS[name[arch]](build_tokenizer())
    config.architectures = [arch]
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(UnsupportedModelError, match=named):
        describe_model(config)

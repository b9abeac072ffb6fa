"""Jamba (attention beside Mamba layers, with MoE MLPs, issue 35) and Mamba (Mamba layers
alone) against transformers: tiny random models, 8 prompts of different lengths batched
together, 48 greedy tokens each."""

from __future__ import annotations

import pytest
import transformers

from serverless_llm.engine.models.registry import UnsupportedModelError, describe_model
from tests.engine.family_check import family_models_fixture, greedy_family_test, tiny_dims
from tests.tiny_models import TINY_SIZES, build_tokenizer


def _mamba_dims(tok) -> dict:
    """A tiny MambaConfig's sizes (it has no attention heads nor an MLP width of its own)."""
    return dict(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        hidden_size=TINY_SIZES["hidden"],
        num_hidden_layers=3,
    )


CONFIGS = {
    # mamba, attention, mamba, mamba: the states and the KV cache side by side; experts on
    # layers 1 and 3 (an attention layer and a Mamba layer), dense MLPs on 0 and 2; in/out
    # projection biases and the conv bias on
    "jamba": lambda tok: transformers.JambaConfig(
        **tiny_dims(tok, num_hidden_layers=4),
        attn_layer_period=3,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_d_conv=3,
        mamba_proj_bias=True,
        rms_norm_eps=1e-5,
    ),
    # Mamba layers alone: no attention layer, no MLP; tied embeddings, a dt rank of its own
    "mamba": lambda tok: transformers.MambaConfig(
        **_mamba_dims(tok),
        state_size=8,
        conv_kernel=4,
        time_step_rank=6,
    ),
}

family_models = family_models_fixture(CONFIGS)
test_family_greedy_equals_transformers = greedy_family_test(CONFIGS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_activation_other_than_silu_is_refused(name):
    """hidden_act is also the Mamba layers' convolution activation, which is silu only: any
    other is a load error naming it, not a silently different model."""
    config = CONFIGS[name](build_tokenizer())
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    assert describe_model(config).recurrent is not None
    config.hidden_act = "gelu"
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        describe_model(config)

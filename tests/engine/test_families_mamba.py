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


def nemotron_h(tok, **kw):
    # Mamba-2 (n_groups 2, in/out and conv biases), attention (no positions), relu^2 MLPs; a
    # time_step_min of 0.5 puts many time steps below the limit, which transformers applies to
    # prompt tokens and not to decoded ones
    return transformers.NemotronHConfig(
        **tiny_dims(tok, num_hidden_layers=None, head_dim=16),
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=16,
        conv_kernel=3,
        use_conv_bias=True,
        use_bias=True,
        mlp_bias=True,
        mlp_hidden_act="relu2",
        time_step_min=0.5,
        **kw,
    )


def falcon_h1(tok, **kw):
    # every layer attention beside Mamba-2 (d_ssm 96 narrower than expand x hidden, 2 groups),
    # every multiplier away from 1, a per-channel mup_vector, head_dim 24 (not hidden / heads)
    return transformers.FalconH1Config(
        **tiny_dims(tok, num_hidden_layers=3, head_dim=24),
        mamba_d_ssm=96,
        mamba_n_heads=6,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=3,
        embedding_multiplier=2.0,
        lm_head_multiplier=0.6,
        key_multiplier=0.7,
        attention_in_multiplier=1.3,
        attention_out_multiplier=0.8,
        ssm_in_multiplier=1.25,
        ssm_out_multiplier=0.6,
        ssm_multipliers=[0.35, 0.25, 0.5, 0.7, 1.5],
        mlp_multipliers=[0.9, 0.6],
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
    # every block kind, from the legacy pattern string: Mamba-2, MoE (latent experts, the best
    # group of 2 chosen, weights renormalised and scaled), attention, Mamba-2, MLP
    "nemotron_h": lambda tok: nemotron_h(
        tok,
        hybrid_override_pattern="ME*M-",
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        moe_shared_expert_intermediate_size=80,
        moe_latent_size=32,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
    # MoE experts in the hidden width, weights not renormalised, one group
    "nemotron_h_moe_plain": lambda tok: nemotron_h(
        tok,
        layers_block_type=["linear_attention", "mlp", "moe", "full_attention"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        moe_shared_expert_intermediate_size=64,
        norm_topk_prob=False,
    ),
    # the gated RMSNorm (in 2 groups) with the gate after the norm, every projection bias on
    "falcon_h1": lambda tok: falcon_h1(
        tok,
        mamba_rms_norm=True,
        mamba_norm_before_gate=True,
        mamba_proj_bias=True,
        mamba_conv_bias=True,
        projectors_bias=True,
        attention_bias=True,
        mlp_bias=True,
    ),
    # no gated RMSNorm (y * silu(z)), no biases, tied embeddings
    "falcon_h1_plain": lambda tok: falcon_h1(
        tok, mamba_rms_norm=False, mamba_conv_bias=False, tie_word_embeddings=True
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
        ("NemotronHForCausalLM", dict(mamba_hidden_act="gelu"), "gelu"),
        ("NemotronHForCausalLM", dict(mlp_hidden_act="relu6"), "relu6"),
        ("NemotronHForCausalLM", dict(attention_bias=True), "attention_bias"),
        ("NemotronHForCausalLM", dict(sliding_window=16), "sliding_window"),
        ("NemotronHForCausalLM", dict(layers_block_type=["mamba", "mlp"]), "mamba"),
        ("FalconH1ForCausalLM", dict(hidden_act="gelu"), "gelu"),
        ("FalconH1ForCausalLM", dict(ssm_multipliers=[1.0, 1.0]), "ssm_multipliers"),
    ],
)
def test_unsupported_options_are_refused_by_name(arch, change, named):
    from tests.tiny_models import build_tokenizer

    name = {
        "Mamba2ForCausalLM": "mamba2",
        "GraniteMoeHybridForCausalLM": "granitemoehybrid",
        "NemotronHForCausalLM": "nemotron_h",
        "FalconH1ForCausalLM": "falcon_h1",
    }
    config = CONFIGS[name[arch]](build_tokenizer())
    config.architectures = [arch]
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(UnsupportedModelError, match=named):
        describe_model(config)


def test_nemotron_h_decode_time_steps_skip_the_limit(family_models, monkeypatch):
    """transformers limits dt below by time_step_min on prompt tokens only (its one-token
    decode path applies no limit): the engine's tokens equal transformers' (the greedy test),
    and clamping the decode rows too gives other tokens on this model, so the case is one where
    decoded time steps do fall below the limit."""
    import dataclasses

    from serverless_llm.engine.models import registry
    from tests.engine.family_check import assert_matches_transformers

    describe = registry.MODEL_REGISTRY["NemotronHForCausalLM"]

    def clamping(config):
        spec = describe(config)
        spec.recurrent = dataclasses.replace(spec.recurrent, clamp_decodes=True)
        return spec

    monkeypatch.setitem(registry.MODEL_REGISTRY, "NemotronHForCausalLM", clamping)
    with pytest.raises(AssertionError, match="prompt of"):
        assert_matches_transformers(family_models("nemotron_h"))


def test_falcon_h1_layers_keep_kv_and_state(family_models):
    """Every Falcon-H1 layer attends and keeps a Mamba-2 state: each is in a block group and in
    the state group, its cache a RecurrentState holding its KV tensor."""
    import torch

    from serverless_llm import LLM
    from serverless_llm.engine.kv_cache import RecurrentState

    llm = LLM(family_models("falcon_h1"), max_model_len=64, dtype="float32", max_num_seqs=3)
    e = llm.engine
    layout = e.cache_layout
    assert layout.num_groups >= 1 and layout.state_layers == (0, 1, 2)
    assert sorted(i for g in layout.groups for i in g.layers) == [0, 1, 2]
    caches = e.kv_caches
    assert all(isinstance(c, RecurrentState) and isinstance(c.kv, torch.Tensor) for c in caches)
    assert all(len(c) == 2 for c in caches)  # the conv inputs and the SSM state


def test_folded_multipliers_refuse_quantized_tensors_and_adapters():
    """Falcon-H1's multipliers are folded into float weights at load: a quantized tensor of a
    scaled projection is refused, and so is an adapter on one (its delta would miss the
    scale); an unscaled projection still takes adapters."""
    from types import SimpleNamespace

    import torch

    from serverless_llm.engine.layers.quant_linear import QuantLoadError
    from serverless_llm.engine.models.lora_targets import DecoderLoRA
    from serverless_llm.engine.models.weights import DecoderWeights
    from tests.tiny_models import build_tokenizer

    config = CONFIGS["falcon_h1"](build_tokenizer())
    config.architectures = ["FalconH1ForCausalLM"]
    model = SimpleNamespace(spec=describe_model(config), lora_layers={})
    scales = model.spec.names.scales
    assert set(scales) >= {"self_attn.k_proj", "mamba.in_proj", "feed_forward.down_proj"}
    assert "feed_forward.up_proj" not in scales
    w = torch.ones(2, 3)
    folded = DecoderWeights._fold_scale(model, "k", "weight", w, scales["self_attn.k_proj"])
    assert torch.allclose(folded, w * 1.3 * 0.7)
    with pytest.raises(QuantLoadError, match="quantized"):
        qweight = torch.ones(2, 3, dtype=torch.int32)
        DecoderWeights._fold_scale(model, "k", "qweight", qweight, scales["self_attn.k_proj"])
    with pytest.raises(KeyError, match="multipliers"):
        DecoderLoRA.lora_target(model, "model.layers.0.self_attn.k_proj")
    with pytest.raises(KeyError, match="not a layer adapters can target"):
        DecoderLoRA.lora_target(model, "model.layers.0.feed_forward.up_proj")


def test_non_gated_experts_refuse_quantized_checkpoints():
    from serverless_llm.engine.layers.moe import Experts

    experts = Experts(4, 16, 8, "relu2", use_kernels=False, gated=False)
    assert tuple(experts.w13.weight.shape) == (4, 8, 16)
    with pytest.raises(ValueError, match="non-gated"):
        experts.quantize(None, "dequantize")

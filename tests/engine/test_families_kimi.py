"""Kimi Linear (Kimi Delta Attention beside multi-head latent attention, issue 35) against
transformers: tiny random models whose layers are all KDA, and KDA with multi-head latent
attention on every second layer (NoPE, query LoRA), with a dense first layer and MoE layers of
grouped sigmoid routing, 8 prompts of different lengths batched together, 48 greedy tokens
each.

transformers builds an all-KDA model but its `generate` cannot run it with a cache (its
DynamicCache asks an attention layer for the sequence length, and there is none), so the
reference is transformers' own model stepped by hand: the prompt in one forward, then one token
per forward, its cache carrying the KDA states (`kimi_greedy`)."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from serverless_llm import LLM
from serverless_llm.engine.models.registry import UnsupportedModelError, describe_model
from tests.engine.family_check import (
    engine_greedy,
    family_models_fixture,
    family_prompts,
    tiny_dims,
)
from tests.engine.reference import hf_model
from tests.tiny_models import build_tokenizer

NEW_TOKENS = 48
# The masks transformers would build from the cache (which fails); KDA layers take none.
NO_MASKS = {"full_attention": None, "linear_attention": None}


@functools.lru_cache(maxsize=64)
def kimi_greedy(path: str, prompt: tuple[int, ...], new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy tokens for `prompt`: its chunked KDA over the prompt, then its
    recurrent KDA one token at a time from the states its cache carries."""
    model = hf_model(path)
    cache = transformers.DynamicCache(config=model.config)
    ids, pos, out = torch.tensor([prompt]), 0, []
    with torch.no_grad():
        for _ in range(new_tokens):
            n = ids.shape[1]
            logits = model(
                input_ids=ids,
                past_key_values=cache,
                use_cache=True,
                attention_mask=NO_MASKS,
                position_ids=torch.arange(pos, pos + n)[None],
            ).logits
            pos += n
            out.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


def kimi_config(tok, **overrides) -> transformers.KimiLinearConfig:
    """Three KDA layers (2 heads of 32, a 3-tap convolution): a dense MLP first, then MoE of 8
    experts in 4 groups (the best 2 kept), top-2, renormalised and scaled, one shared expert."""
    kw = dict(
        **tiny_dims(tok, num_hidden_layers=3),
        layer_types=["linear_attention"] * 3,
        mlp_layer_types=["dense", "sparse", "sparse"],
        linear_num_heads=2,
        linear_head_dim=32,
        linear_conv_kernel_dim=3,
        moe_intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=1.7,
        rms_norm_eps=1e-5,
        architectures=["KimiLinearForCausalLM"],
    )
    kw.update(overrides)
    return transformers.KimiLinearConfig(**kw)


def kimi_mla_config(tok) -> transformers.KimiLinearConfig:
    """KDA layers with MLA on every second layer (the released models' every fourth), its
    query LoRA on, NoPE: the rope part of each key cached and attended to unrotated."""
    return kimi_config(
        tok,
        num_hidden_layers=4,
        num_key_value_heads=4,  # MLA's expanded keys: one per query head
        layer_types=["linear_attention", "full_attention"] * 2,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )


CONFIGS = {"kimi_linear": kimi_config, "kimi_linear_mla": kimi_mla_config}

family_models = family_models_fixture(CONFIGS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_family_greedy_equals_transformers(family_models, name):
    """8 prompts batched, 48 greedy tokens each, equal to transformers' (`kimi_greedy`)."""
    path = family_models(name)
    prompts = family_prompts(transformers.AutoConfig.from_pretrained(path).vocab_size)
    got = engine_greedy(path, prompts, NEW_TOKENS)
    for prompt, tokens in zip(prompts, got):
        assert tokens == kimi_greedy(path, tuple(prompt)), f"prompt of {len(prompt)} tokens"


def test_mla_layers_keep_latents(family_models):
    """The MLA layers of a Kimi Linear checkpoint form a latent cache group (one row of
    kv_lora_rank + qk_rope_head_dim values a token) beside the KDA layers' state group."""
    llm = LLM(
        family_models("kimi_linear_mla"),
        block_size=8,
        num_kv_blocks=16,
        max_model_len=64,
        dtype="float32",
    )
    engine = llm.engine
    assert engine.cache_layout.describe() == (
        "2 layers latent attention (24 values a token), 2 layers recurrent state"
    )
    assert engine.kv_bytes_per_token == 2 * 24 * 4


@pytest.mark.parametrize(
    "option, value",
    [
        ("moe_router_activation_func", "softmax"),
        ("moe_layer_freq", 2),
        ("linear_attn_config", {"gate_lower_bound": -5.0}),
    ],
)
def test_options_transformers_ignores_are_refused(option, value):
    """Options of the original checkpoints that transformers does not read are refused, not
    silently run as transformers would."""
    config = kimi_config(build_tokenizer(), **{option: value})
    with pytest.raises(UnsupportedModelError, match=option):
        describe_model(config)


def test_sigmoid_grouped_routing_equals_kimi_router():
    """`route`'s "sigmoid_grouped" picks the experts and weights of transformers'
    `KimiLinearTopkRouter` (8 experts in 4 groups, the best 2 groups, top 3, a correction bias
    large enough to change choices, renormalised and scaled), in float32 from bf16 inputs."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter

    from serverless_llm.engine.layers.moe import BiasedRouter, route

    config = kimi_config(build_tokenizer(), num_experts_per_tok=3)
    torch.manual_seed(0)
    ref = KimiLinearTopkRouter(config)
    torch.nn.init.normal_(ref.weight, std=0.3)
    ref.e_score_correction_bias.normal_(std=0.5)
    ours = BiasedRouter(config.hidden_size, config.num_local_experts)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(256, config.hidden_size).to(torch.bfloat16)
    _, want_w, want_ids = ref(x)
    got_w, got_ids = route(
        ours(x),
        3,
        "sigmoid_grouped",
        True,
        score_bias=ours.e_score_correction_bias,
        groups=(4, 2),
        scale=config.routed_scaling_factor,
    )
    order_want, order_got = want_ids.argsort(-1), got_ids.argsort(-1)
    assert torch.equal(got_ids.gather(1, order_got), want_ids.gather(1, order_want))
    torch.testing.assert_close(got_w.gather(1, order_got), want_w.gather(1, order_want))
    # the groups matter here: choosing among all experts would differ on some tokens
    _, flat_ids = route(
        ours(x), 3, "sigmoid_grouped", True, score_bias=ours.e_score_correction_bias
    )
    assert not torch.equal(flat_ids.sort(-1)[0], got_ids.sort(-1)[0])

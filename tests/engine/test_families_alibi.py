"""The ALiBi families (Bloom, MPT, Falcon RW) and Falcon's other decoders against transformers,
built like test_families.py's: a tiny random model from the family's own config class, 8 prompts
batched together, 48 greedy tokens each. Then the engine against itself on an ALiBi family and a
sliding-window one: preemption, chunked prefill and prefix caching change no token. ALiBi and
Gemma 2's soft-cap through the Triton kernels: tests/kernels/test_families_alibi_triton.py."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.models import UnsupportedModelError, describe_model
from serverless_llm.engine.models.decoder import alibi_slopes
from tests.engine.family_check import (
    assert_matches_transformers,
    family_models_fixture,
    greedy_family_test,
    save_family_model,
    tiny_dims,
)
from tests.tiny_models import build_tokenizer

CONFIGS = {
    "bloom": lambda tok: transformers.BloomConfig(**tiny_dims(tok, "bloom")),
    # 6 heads, not a power of two: the interleaved slopes
    "bloom_6heads": lambda tok: transformers.BloomConfig(
        **tiny_dims(tok, "bloom", hidden_size=96, n_layer=3, n_head=6), tie_word_embeddings=False
    ),
    "mpt": lambda tok: transformers.MptConfig(
        **tiny_dims(tok, "mpt"), attn_config={"clip_qkv": 2.0, "softmax_scale": 0.2}
    ),
    "mpt_6heads": lambda tok: transformers.MptConfig(
        **tiny_dims(tok, "mpt", d_model=96, n_heads=6, n_layers=3)
    ),
    # Falcon 7B: multi-query, rotary, parallel, one norm
    "falcon_multi_query": lambda tok: transformers.FalconConfig(
        **tiny_dims(tok, "falcon"), multi_query=True, parallel_attn=True, alibi=False, bias=False
    ),
    # Falcon RW: [heads, 3, d] q/k/v, ALiBi, sequential, biases
    "falcon_rw": lambda tok: transformers.FalconConfig(
        **tiny_dims(tok, "falcon"), multi_query=False, parallel_attn=False, alibi=True, bias=True
    ),
    # Falcon 40B: grouped q/k/v, two norms, untied head
    "falcon_new": lambda tok: transformers.FalconConfig(
        **tiny_dims(tok, "falcon"),
        new_decoder_architecture=True,
        num_kv_heads=2,
        parallel_attn=True,
        alibi=False,
        bias=False,
        tie_word_embeddings=False,
    ),
    "falcon_new_one_norm": lambda tok: transformers.FalconConfig(
        **tiny_dims(tok, "falcon", num_hidden_layers=3),
        new_decoder_architecture=True,
        num_kv_heads=2,
        num_ln_in_parallel_attn=1,
        bias=True,
    ),
}

family_models = family_models_fixture(CONFIGS)
test_family_greedy_equals_transformers = greedy_family_test(CONFIGS)


# -- the slopes and what is refused --------------------------------------------------------------


@pytest.mark.parametrize("bias_max", [8, 16, 4])
def test_alibi_slopes_are_mpts_for_any_bias_max(bias_max):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    for n in range(1, 70):
        # MPT's bias at key offset -1 is -slope.
        theirs = -build_mpt_alibi_tensor(n, 2, alibi_bias_max=bias_max)[:, 0, 0].float()
        torch.testing.assert_close(alibi_slopes(n, bias_max), theirs, rtol=1e-6, atol=0)
        if bias_max == 8:
            torch.testing.assert_close(alibi_slopes(n), _get_alibi_slopes(n, "cpu"))


def test_falcon_alibi_slopes_carry_the_softmax_scale():
    config = CONFIGS["falcon_rw"](build_tokenizer())
    config.architectures = ["FalconForCausalLM"]
    spec = describe_model(config)
    assert spec.alibi_scale == pytest.approx(16**-0.5) and spec.rope == (None, None)
    bloom = CONFIGS["bloom"](build_tokenizer())
    bloom.architectures = ["BloomForCausalLM"]
    assert describe_model(bloom).alibi_scale == 1.0


@pytest.mark.parametrize(
    "name, change, words",
    [
        ("bloom", {"apply_residual_connection_post_layernorm": True}, "post_layernorm"),
        ("mpt", {"attn_config": {"qk_ln": True}}, "qk_ln"),
        ("mpt", {"attn_config": {"alibi": False}}, "alibi=False"),
        ("mpt", {"attn_config": {"attn_type": "multiquery_attention"}}, "attn_type"),
        ("mpt", {"no_bias": False}, "no_bias"),
        ("falcon_new", {"parallel_attn": False}, "parallel_attn=False"),
    ],
)
def test_unsupported_options_are_refused_by_name(name, change, words):
    config = CONFIGS[name](build_tokenizer())
    for key, value in change.items():
        if key == "attn_config":
            value = transformers.models.mpt.configuration_mpt.MptAttentionConfig(**value)
        setattr(config, key, value)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    with pytest.raises(UnsupportedModelError, match=words):
        describe_model(config)


def test_base_model_checkpoint_names_load(tmp_path):
    """bigscience's Bloom checkpoints are saved from BloomModel: no `transformer.` prefix."""
    import json

    from safetensors.torch import load_file, save_file

    path = save_family_model(str(tmp_path / "bloom"), CONFIGS["bloom"](build_tokenizer()))
    file = tmp_path / "bloom" / "model.safetensors"
    tensors = load_file(str(file))
    bare = {k.removeprefix("transformer."): v for k, v in tensors.items() if k != "lm_head.weight"}
    assert not any(k.startswith("transformer.") for k in bare)
    save_file(bare, str(file), metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "bloom" / "config.json").read_text())
    assert cfg["architectures"] == ["BloomForCausalLM"]
    assert_matches_transformers(path, new_tokens=8, lengths=(3, 20))


# -- preemption, chunked prefill and prefix caching change nothing -------------------------------

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _run(path, prompts, max_tokens, **kw):
    args = dict(block_size=8, num_kv_blocks=160, max_model_len=256, dtype="float32")
    args.update(kw)
    llm = LLM(path, **args)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **GREEDY))
    pool = llm.engine.block_pool
    assert pool.num_free == pool.num_blocks, "KV blocks leaked"
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=["bloom_6heads", "mistral_window"])
def engine_model(request, tmp_path_factory, family_models):
    if request.param in CONFIGS:
        return family_models(request.param)
    config = transformers.MistralConfig(**tiny_dims(build_tokenizer()), sliding_window=16)
    return save_family_model(str(tmp_path_factory.mktemp(request.param)), config)


def _prompts(vocab: int, n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_preemption_changes_no_token(engine_model):
    vocab = len(build_tokenizer())
    prompts = _prompts(vocab, 12, seed=1, lo=5, hi=40)
    _, expected = _run(engine_model, prompts, 24, enable_prefix_caching=False)
    # 12 requests of up to 40 + 24 tokens need up to 12 * 8 blocks of 8; the pool has 20.
    llm, got = _run(
        engine_model, prompts, 24, num_kv_blocks=20, max_model_len=128, enable_prefix_caching=False
    )
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected


def test_chunked_prefill_changes_no_token(engine_model):
    vocab = len(build_tokenizer())
    prompts = _prompts(vocab, 4, seed=2, lo=30, hi=70)
    _, expected = _run(engine_model, prompts, 24, enable_prefix_caching=False)
    _, got = _run(engine_model, prompts, 24, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert got == expected


def test_prefix_caching_changes_no_token(engine_model):
    vocab = len(build_tokenizer())
    rng = random.Random(3)
    prefix = [rng.randrange(5, vocab) for _ in range(41)]  # 5 full blocks, then one more token
    prompts = [
        prefix + [rng.randrange(5, vocab) for _ in range(rng.randint(1, 12))] for _ in range(6)
    ]
    _, expected = _run(engine_model, prompts, 24, enable_prefix_caching=False)
    llm = LLM(engine_model, block_size=8, num_kv_blocks=160, max_model_len=256, dtype="float32")
    params = SamplingParams(max_tokens=24, **GREEDY)
    first = llm.generate(prompts[:1], params)  # caches the shared prefix
    rest = llm.generate(prompts, params)  # every prompt hits it, the first one whole
    assert llm.engine.block_pool.hits >= 5 * (len(prompts) - 1)
    assert first[0].outputs[0].token_ids == expected[0]
    assert [o.outputs[0].token_ids for o in rest] == expected


def test_config_without_a_length_serves_the_default(family_models):
    """Bloom's config names no maximum length: the engine serves 2048 tokens (vLLM's default)
    instead of refusing to start."""
    from serverless_llm.engine.model_builder import DEFAULT_MAX_MODEL_LEN

    llm = LLM(family_models("bloom"), num_kv_blocks=2048 // 16 + 1)
    assert llm.engine.max_model_len == DEFAULT_MAX_MODEL_LEN

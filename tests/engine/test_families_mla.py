"""Multi-head latent attention families against transformers (issue 37): DeepSeek V2 without
a query LoRA (V2-Lite's shape), DeepSeek V3 with the query LoRA and YaRN (mscale and
mscale_all_dim apart, so both the table's attention factor and the softmax scale move),
Mistral 4 (rotary in halves, Llama 4's query scaling past a short original length), each dense
and with DeepSeek's MoE block (families_moe2.py: grouped routing, correction bias, shared
experts, a dense first layer): 8 prompts of different lengths batched, 48 greedy tokens each,
equal to transformers' `generate`. Then: the absorbed decode equals the expanded form; the
cache holds one latent row a token (its bytes tested); chunked prefill, prefix caching and
preemption; DeepSeek V3.2 refused by name."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import transformers

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.kernels.metadata import AttentionMetadata, AttentionSpec
from serverless_llm.engine.layers.attention import TorchAttentionBackend
from serverless_llm.engine.layers.rotary import rope_table, rotary_step
from serverless_llm.engine.models import UnsupportedModelError, describe_model
from serverless_llm.engine.models.decoder import RopeSpec
from serverless_llm.engine.models.mla import LatentAttention, MLASpec
from tests.engine.family_check import (
    NEW_TOKENS,
    family_models_fixture,
    family_prompts,
    greedy_family_test,
    tiny_dims,
)
from tests.engine.reference import hf_greedy
from tests.tiny_models import build_tokenizer

# transformers 5.23 maps mistral4 configs to Mistral4ForCausalLM for pretraining and
# image-text-to-text, not for AutoModelForCausalLM, which the checks build and load with.
transformers.AutoModelForCausalLM.register(
    transformers.Mistral4Config, transformers.Mistral4ForCausalLM, exist_ok=True
)

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24)
# DeepSeek's MoE in the tiny models: 8 experts in 4 groups (the best 2 kept), top 2, one
# shared expert, the first layer dense
MOE = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
)


def _yarn(**extra) -> dict:
    """YaRN stretching 64 original positions 4 times; a new dict each call (transformers edits
    the rope parameters it is given)."""
    return dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=64,
        beta_fast=32.0,
        beta_slow=1.0,
        **extra,
    )


def _dense(tok, **kw) -> dict:
    """Every layer dense: first_k_dense_replace covers them all."""
    return dict(**tiny_dims(tok, num_key_value_heads=4), first_k_dense_replace=2, **kw)


def _arch(config):
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config


CONFIGS = {
    # V2-Lite's shape: queries straight from q_proj, default rope
    "deepseek_v2": lambda tok: _arch(transformers.DeepseekV2Config(**_dense(tok), **MLA)),
    # the query LoRA, YaRN with mscale != mscale_all_dim (attention factor and softmax scale)
    "deepseek_v3": lambda tok: _arch(
        transformers.DeepseekV3Config(
            **_dense(tok),
            **MLA,
            q_lora_rank=24,
            rope_parameters=_yarn(mscale=1.0, mscale_all_dim=0.7),
        )
    ),
    # rotary in halves (rope_interleave off), Llama 4's query scaling from position 32 on
    "mistral4": lambda tok: _arch(
        transformers.Mistral4Config(
            **_dense(tok),
            **MLA,
            q_lora_rank=24,
            rope_interleave=False,
            rope_parameters=_yarn(
                mscale=1.0,
                mscale_all_dim=1.0,
                llama_4_scaling_beta=0.3,
                partial_rotary_factor=1 / 3,
            )
            | {"original_max_position_embeddings": 32},
        )
    ),
    # V2's MoE: softmax, groups ranked by their best probability, no renormalisation
    "deepseek_v2_moe": lambda tok: _arch(
        transformers.DeepseekV2Config(
            **tiny_dims(tok, num_key_value_heads=4),
            **MLA,
            **MOE,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
        )
    ),
    # V3's MoE: sigmoid, the correction bias, groups by their two best, renormalised
    "deepseek_v3_moe": lambda tok: _arch(
        transformers.DeepseekV3Config(
            **tiny_dims(tok, num_key_value_heads=4),
            **MLA,
            **MOE,
            q_lora_rank=24,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            rope_parameters=_yarn(mscale=0.8, mscale_all_dim=0.8),
        )
    ),
    # Mistral 4's MoE: softmax in one group, renormalised, no correction bias
    "mistral4_moe": lambda tok: _arch(
        transformers.Mistral4Config(
            **tiny_dims(tok, num_key_value_heads=4), **MLA, **MOE, q_lora_rank=24
        )
    ),
}

family_models = family_models_fixture(CONFIGS)
test_mla_family_greedy_equals_transformers = greedy_family_test(CONFIGS)


def _engine(path, **kw):
    args = dict(block_size=8, num_kv_blocks=160, max_model_len=256, dtype="float32")
    return LLM(path, **(args | kw))


def test_cache_holds_latents_only(family_models, caplog):
    """Each layer's cache is one row of kv_lora_rank + qk_rope_head_dim values a token (no K
    or V per head); the bytes a token costs are that, times the layers, times 4 (float32), and
    the start-up line says so."""
    with caplog.at_level(logging.INFO, logger="serverless_llm"):
        llm = _engine(family_models("deepseek_v3"))
    engine = llm.engine
    width = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]
    for cache in engine.kv_caches:
        assert tuple(cache.shape) == (1, engine.block_pool.num_blocks, 8, 1, width)
    assert engine.kv_bytes_per_token == 2 * width * 4
    # what per-head K and V of the same heads would take: (nope + rope + v) a head
    gqa = 2 * 4 * (16 + 8 + 24) * 4
    assert engine.kv_bytes_per_token * 4 < gqa
    line = next(r.getMessage() for r in caplog.records if "engine ready" in r.getMessage())
    assert f"{2 * width * 4} B a token" in line and "latent attention (40 values a token)" in line


def test_fp8_latent_cache(family_models):
    """KV_CACHE_DTYPE fp8: the latent rows stored as e4m3 bytes (one byte a value: a token
    costs layers x 40 bytes) and read back times their scale; the engine serves from it (its
    tokens are not transformers': the cache rounds the latents) and frees every block."""
    llm = _engine(family_models("deepseek_v3"), kv_cache_dtype="fp8")
    engine = llm.engine
    assert all(c.dtype == torch.float8_e4m3fn for c in engine.kv_caches)
    assert engine.kv_bytes_per_token == 2 * 40
    prompts = family_prompts(len(build_tokenizer()), lengths=(3, 20))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    # the first token comes from the prompt's own (unrounded) rows: transformers' first token
    assert (
        outs[1].outputs[0].token_ids[0] == hf_greedy(family_models("deepseek_v3"), prompts[1], 1)[0]
    )
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_chunked_prefill_prefix_caching_and_preemption(family_models):
    """Prompts prefilled 16 tokens a step (chunks with context read their latents back),
    a shared prefix taken from the cache, and a pool too small for the batch (preemption and
    recompute): the same tokens as transformers."""
    path = family_models("deepseek_v3")
    vocab = len(build_tokenizer())
    prompts = family_prompts(vocab)
    shared = family_prompts(vocab, seed=1, lengths=(40,))[0]
    prompts = prompts[:6] + [shared + [7, 8], shared + [9]]
    llm = _engine(path, num_kv_blocks=28, max_model_len=128, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = llm.generate(prompts[-1:], params)  # puts the shared prefix in the cache
    outs = llm.generate(prompts, params)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_pool.hits > 0
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
    assert first[0].outputs[0].token_ids == outs[-1].outputs[0].token_ids
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, NEW_TOKENS)


@pytest.mark.parametrize("name,adapter", [("deepseek_v3_moe", None), ("deepseek_v2", "lora")])
def test_two_ranks_greedy_equal_transformers(family_models, tmp_path, name, adapter):
    """Tensor parallel size 2: each rank holds half the heads (their rows of q_proj/q_b_proj and
    kv_b_proj, their columns of o_proj) and the whole latent path, so both cache the same
    latents; experts split by width; an adapter's B rows (A columns for o_proj) split the same
    way. Prompts in 16-token chunks beside the others' decodes."""
    path = family_models(name)
    prompts = family_prompts(len(build_tokenizer()), lengths=(3, 20, 45))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw, reference = {}, path
    if adapter:
        pytest.importorskip("peft")
        from serverless_llm import LoRARequest
        from tests.lora_adapters import make_adapter

        targets = ["q_proj", "kv_a_proj_with_mqa", "o_proj", "down_proj"]
        made = make_adapter(path, str(tmp_path / "adapter"), 8, 16, targets, seed=5)
        reference = made + "-merged"
        kw = dict(lora_request=LoRARequest("a", 1, made))
    with LLM(
        path,
        tensor_parallel_size=2,
        max_num_batched_tokens=16,
        block_size=8,
        num_kv_blocks=64,
        max_model_len=128,
        dtype="float32",
        enable_lora=bool(adapter),
        max_lora_rank=8,
    ) as llm:
        outs = llm.generate(prompts, params, **kw)
        assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 16), len(prompt)


@pytest.mark.parametrize(
    "name,targets",
    [
        ("deepseek_v2", ["q_proj", "kv_a_proj_with_mqa", "o_proj", "down_proj"]),
        ("deepseek_v3", ["q_a_proj", "q_b_proj", "o_proj", "gate_proj", "up_proj"]),
    ],
)
def test_lora_on_latent_attention_and_mlp(family_models, tmp_path, name, targets):
    """A peft adapter on the query and latent projections, o_proj and the dense MLP: greedy
    tokens equal transformers on the merged model; one on kv_b_proj (folded into the queries by
    the absorbed decode) is refused."""
    pytest.importorskip("peft")
    from serverless_llm import LoRARequest
    from serverless_llm.engine import LoRAError
    from tests.lora_adapters import make_adapter

    path = family_models(name)
    adapter = make_adapter(path, str(tmp_path / "adapter"), 8, 16, targets, seed=3)
    llm = _engine(path, enable_lora=True, max_loras=1, max_lora_rank=8)
    prompts = family_prompts(len(build_tokenizer()), lengths=(3, 20, 45))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=LoRARequest("a", 1, adapter))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(adapter + "-merged", prompt, 16)
    assert [o.outputs[0].token_ids for o in outs] != [hf_greedy(path, p, 16) for p in prompts]
    bad = make_adapter(path, str(tmp_path / "bad"), 8, 16, ["kv_b_proj"], seed=4)
    with pytest.raises(LoRAError, match="kv_b_proj is folded into the queries"):
        llm.generate(prompts[:1], params, lora_request=LoRARequest("b", 2, bad))
    assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks


def test_beam_search_and_replayed_decodes(family_models):
    """Beam search (forks copy a partial latent block) equals transformers' beam search, and
    decode steps through the capture buffers (decode_capture="replay", the CPU twin of CUDA
    graphs: padded rows writing nothing) give transformers' greedy tokens."""
    from tests.engine.test_beam_search import beam_params, hf_beam_search

    path = family_models("deepseek_v3")
    prompt = family_prompts(len(build_tokenizer()), lengths=(13,))[0]
    llm = _engine(path)
    params = beam_params(best_of=3, n=3, max_tokens=10, ignore_eos=True)
    got = [o.token_ids for o in llm.generate([prompt], params)[0].outputs]
    vocab = len(build_tokenizer())
    assert got == hf_beam_search(path, prompt, width=3, n=3, eos=[vocab + 1], max_new_tokens=10)
    assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks
    replay = _engine(path, decode_capture="replay", max_num_seqs=4)
    assert replay.engine.runner.captured is not None
    prompts = family_prompts(vocab, lengths=(3, 20, 45))
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for prompt, out in zip(prompts, replay.generate(prompts, greedy)):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 16)


def test_native_cpu_step_takes_the_latent_layers(family_models, monkeypatch):
    """On the CPU default path (native kernels) every latent layer's step writes its rows and
    attends its decodes in the native latent step, not the torch twin: transformers' tokens,
    prompts shorter and longer than a block, batched; the torch backend's twins too."""
    from serverless_llm.engine.kernels import cpu_native

    kernels = cpu_native.load()
    assert kernels is not None, "the native CPU kernels did not build here"
    decodes: list[int] = []
    real = kernels.latent_step

    def spy(step, rows, q, *args):
        decodes.append(0 if q is None else q.shape[0])
        return real(step, rows, q, *args)

    monkeypatch.setattr(kernels, "latent_step", spy)
    path = family_models("deepseek_v2")
    llm = _engine(path)
    assert llm.engine.backend.name == "native"
    prompts = family_prompts(len(build_tokenizer()), lengths=(3, 20, 45))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 16) for p in prompts]
    assert max(decodes) == 3  # the three requests' decodes in one call
    assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks
    # The torch twins (the path where the native build is unavailable): the same tokens, and
    # the native step untouched.
    decodes.clear()
    twin = _engine(path, attention_backend="torch")
    outs = twin.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 16) for p in prompts]
    assert not decodes


def _meta(requests, block_size, num_blocks, decode: bool) -> AttentionMetadata:
    """(context, new) requests over consecutive blocks; `decode`: count them as decodes."""
    tables, slots, seq_lens = [], [], []
    start = 1  # block 0 unused
    for ctx, n in requests:
        seq = ctx + n
        blocks = list(range(start, start + -(-seq // block_size)))
        start += len(blocks)
        tables.append(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(ctx, seq)]
        seq_lens.append(seq)
    assert start <= num_blocks
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q_lens = [n for _, n in requests]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=lens,
        context_lens=lens - torch.tensor(q_lens, dtype=torch.int32),
        block_tables=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decodes=len(requests) if decode else 0,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=q_lens,
        seq_lens_host=seq_lens,
        block_size=block_size,
    )


@pytest.mark.parametrize("q_lora", [None, 24])
def test_absorbed_decode_equals_expanded(q_lora):
    """A decode step of three requests (contexts 5, 17, 30 prefilled before) through the
    absorbed form (q_nope through W_UK, attention over the cached latents, W_UV after) and the
    same step through the expanded form (all cached latents up-projected): equal to float32
    tolerance."""
    torch.manual_seed(0)
    m = MLASpec(32, 16, 8, 24, q_lora_rank=q_lora)
    s = SimpleNamespace(num_heads=4, hidden_size=64, mla=m)
    rope = RopeSpec.of({"rope_type": "default", "rope_theta": 10000.0}, 8, is_neox=False)
    layer = LatentAttention(
        s, AttentionSpec(4, 4, 24, scale=24**-0.5), TorchAttentionBackend(), rope
    )
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    table = rope_table(rope.params_dict(), 8, 128, 128)
    cache = torch.zeros(1, 16, 8, 1, m.width)
    contexts = [5, 17, 30]
    prefill = _meta([(0, c) for c in contexts], 8, 16, decode=False)
    x = torch.randn(sum(contexts), 64)
    pos = torch.cat([torch.arange(c) for c in contexts])
    with torch.no_grad():
        layer(x, rotary_step(table, pos, x.dtype, gather=False), cache, prefill)
        xd = torch.randn(3, 64)
        step = rotary_step(table, torch.tensor(contexts), xd.dtype, gather=False)
        absorbed = layer(xd, step, cache, _meta([(c, 1) for c in contexts], 8, 16, decode=True))
        expanded = layer(xd, step, cache, _meta([(c, 1) for c in contexts], 8, 16, decode=False))
    assert absorbed.abs().max() > 0.1
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)


def test_deepseek_v32_refused_by_name():
    config = transformers.DeepseekV32Config(**tiny_dims(build_tokenizer()), **MLA)
    config.architectures = ["DeepseekV32ForCausalLM"]
    with pytest.raises(UnsupportedModelError, match="sparse attention.*indexer"):
        describe_model(config)


def test_deepseek_v4_refused_by_name():
    config = transformers.DeepseekV4Config(**tiny_dims(build_tokenizer()))
    config.architectures = ["DeepseekV4ForCausalLM"]
    with pytest.raises(UnsupportedModelError, match="hyper-connections"):
        describe_model(config)

"""Gemma 4 across two ranks. The tiny checkpoint has every piece on at once: sliding layers of
two 16-wide KV heads and global layers of one 32-wide KV head (replicated on both ranks, each
rank's cache entries the sliding layers' views into the global layers' width), values that are
the keys' projection on the global layers, the last two layers reading layers 3's and 2's KV,
double-wide MLPs there, per-layer input embeddings (split by vocabulary rows like the
embedding, the projection and each layer's gate whole on every rank), the layer scalars and the
MoE block beside every MLP (experts split by width). Served as the engine runs it (rank 1 a
spawned process, gloo), greedy tokens equal one rank's and transformers'; one prefill's logits
from threads equal transformers' for Gemma4ForCausalLM and for the text part of
Gemma4ForConditionalGeneration; a count that does not split is refused at start by name."""

from __future__ import annotations

import pytest
import torch
import transformers

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.config import ConfigError
from serverless_llm.engine.models import describe_model
from serverless_llm.engine.models.sharding import check_shardable
from tests.engine.family_check import assert_pool_whole, family_prompts
from tests.engine.reference import hf_greedy
from tests.engine.test_families_gemma4 import CONFIGS, WINDOW, _composite, _gemma4, save_gemma4
from tests.engine.tp_harness import sharded_logits
from tests.tiny_models import build_tokenizer

NEW_TOKENS = 24
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
ENGINE = dict(block_size=8, num_kv_blocks=240, max_model_len=256, dtype="float32")


def _config(tok, **kw):
    return _gemma4(tok, **{**MOE, **kw})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_gemma4(str(tmp_path_factory.mktemp("gemma4_tp")), _config(build_tokenizer()))


def test_every_piece_is_on(checkpoint):
    """The spec the ranks split has each Gemma 4 piece this file claims to cover."""
    spec = describe_model(transformers.AutoConfig.from_pretrained(checkpoint))
    assert spec.layer_heads[2] == (1, 32) and spec.layer_heads[0] is None
    assert (spec.num_kv_heads, spec.head_dim) == (2, 16)
    assert spec.k_eq_v == (False, False, True) * 2
    assert spec.kv_source == (None,) * 4 + (3, 2)
    assert spec.mlp_sizes[4:] == (192, 192)
    assert spec.per_layer_input is not None and spec.layer_scalar and spec.v_norm
    assert spec.moe_beside is not None and spec.moe_beside.intermediate_size == 32


def test_two_ranks_greedy_equal_one_rank_and_transformers(checkpoint):
    """Prompts shorter and longer than the window, batched: two ranks (processes) give one
    rank's tokens and transformers', through prefill and decodes, and again with prefills
    chunked into 8-token steps (the shared-KV layers reading their source's cache across
    chunks); no KV block leaks."""
    prompts = family_prompts(
        len(build_tokenizer()), seed=5, lengths=(WINDOW, 5, 2 * WINDOW + 3, 40)
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    want = [hf_greedy(checkpoint, p, NEW_TOKENS) for p in prompts]
    with LLM(checkpoint, **ENGINE) as llm:
        one = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert one == want
    with LLM(checkpoint, tensor_parallel_size=2, **ENGINE) as llm:
        model = llm.engine.model  # rank 0's shard
        assert model.spec.layer_heads[2] == (1, 32)  # the global layers' KV head, replicated
        assert model.layers[4].mlp.down_proj.in_features == 96  # half the double-wide 192
        assert model.layers[0].experts_beside.experts.inter == 16  # half of 32
        vocab = len(build_tokenizer())  # the per-layer embedding: half its rows (padded)
        assert model.embed_tokens_per_layer.weight.shape == (-(-vocab // 2), 6 * 8)
        two = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert_pool_whole(llm)
        assert all(r["alive"] for r in llm.engine.rank_state())
    assert two == want
    chunked = dict(ENGINE, max_num_batched_tokens=8, enable_prefix_caching=False)
    with LLM(checkpoint, tensor_parallel_size=2, **chunked) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        assert_pool_whole(llm)


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)))
    return out.logits[0]


def test_shards_give_transformers_logits(checkpoint):
    """One prefill over two ranks (threads) gives transformers' logits; each rank loads about
    half the model."""
    ids = family_prompts(len(build_tokenizer()), seed=3, lengths=(41,))[0]
    out = sharded_logits(checkpoint, ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    torch.testing.assert_close(out["logits"], _hf_logits(hf, ids), atol=2e-4, rtol=2e-4)
    whole = sum(p.numel() * 4 for p in hf.parameters())
    assert all(whole * 0.45 < loaded < whole * 0.6 for loaded in out["bytes"]), out["bytes"]


def test_global_kv_heads_split_across_ranks(tmp_path):
    """The 31B-style dense decoder (no sharing, no per-layer inputs, separate values) with the
    global layers' two 48-wide KV heads split one per rank: each rank's entries are 1 x 48, the
    sliding layers' 1 x 16 views into them; the logits are transformers'."""
    tok = build_tokenizer()
    plain = CONFIGS["gemma4_plain"](tok)
    assert describe_model(plain).layer_heads[2] == (2, 48)
    path = save_gemma4(str(tmp_path / "m"), plain)
    ids = family_prompts(len(tok), seed=4, lengths=(35,))[0]
    out = sharded_logits(path, ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.testing.assert_close(out["logits"], _hf_logits(hf, ids), atol=2e-4, rtol=2e-4)


def test_text_part_of_the_composite_over_two_ranks(tmp_path):
    """Gemma4ForConditionalGeneration (towers beside the decoder, the decoder under
    model.language_model): two ranks give the composite's own logits for a text prompt."""
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(_composite(tok)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    path = str(tmp_path / "m")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    ids = family_prompts(len(tok), seed=2, lengths=(37,))[0]
    out = sharded_logits(path, ids)
    torch.testing.assert_close(out["logits"], _hf_logits(model, ids), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize(
    "change, size, message",
    [
        (dict(num_global_key_value_heads=3), 2, r"3 KV heads \(layer 2, 32 wide\)"),
        (dict(num_key_value_heads=3), 2, r"model's 3 KV heads: one must divide"),
        (dict(moe_intermediate_size=33), 2, r"expert intermediate size \(33\)"),
        (dict(intermediate_size=100, num_attention_heads=8), 8, r"intermediate size \(100\)"),
        (dict(num_attention_heads=3), 2, r"number of attention heads \(3\)"),
    ],
)
def test_counts_that_do_not_split_are_refused_by_name(change, size, message):
    spec = describe_model(_config(build_tokenizer(), **change))
    with pytest.raises(ConfigError, match=message):
        check_shardable(spec, size)


def test_start_up_refuses_before_any_rank_starts(tmp_path):
    path = save_gemma4(str(tmp_path / "m"), _config(build_tokenizer(), moe_intermediate_size=33))
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 does not divide .*\(33\)"):
        LLM(path, tensor_parallel_size=2, **ENGINE)


def test_lora_over_two_ranks_follows_each_layers_heads(checkpoint, tmp_path):
    """An adapter on q, o and the dense MLP's down projection of every layer (the global
    layers' q and o wider: 4 heads of 32): rank 0 checks it against each layer's whole shape,
    each rank takes its share, and two ranks give the merged model's greedy tokens."""
    pytest.importorskip("peft")
    from serverless_llm import LoRARequest
    from tests.lora_adapters import make_adapter

    adapter = make_adapter(checkpoint, str(tmp_path / "a"), 4, 8, ["q_proj", "o_proj", "down_proj"])
    prompts = family_prompts(len(build_tokenizer()), seed=7, lengths=(9, 30))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    lora = dict(enable_lora=True, max_loras=1, max_lora_rank=4)
    with LLM(checkpoint, tensor_parallel_size=2, **lora, **ENGINE) as llm:
        model = llm.engine.model
        assert model.lora_target("model.layers.2.self_attn.q_proj")[1:] == (0, 64, 128)
        assert model.lora_target("model.layers.2.self_attn.o_proj")[1:] == (None, 128, 64)
        assert model.lora_target("model.layers.0.self_attn.q_proj")[1:] == (0, 64, 64)
        assert model.lora_target("model.layers.4.mlp.down_proj")[1:] == (None, 192, 64)
        outs = llm.generate(prompts, params, lora_request=LoRARequest("a", 1, adapter))
    merged = adapter + "-merged"
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(merged, p, 12) for p in prompts]
    assert outs[0].outputs[0].token_ids != hf_greedy(checkpoint, prompts[0], 12)

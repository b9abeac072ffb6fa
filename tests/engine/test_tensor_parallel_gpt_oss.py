"""gpt-oss across two ranks: each rank holds its heads' sink logits, 1/N of every expert's
width with its w13 bias (gate and up alternating in the checkpoint), rank 0 alone the w2 bias
(added once after the all-reduced down projection), the router and its bias whole. Greedy
tokens at tensor_parallel_size=2 (rank 1 a spawned process, gloo) equal those at 1 and
transformers'; the MXFP4 checkpoint's blocks split by intermediate channel (w13's rows, w2's
input blocks of 32) give transformers' logits (ranks as threads, tp_harness.py)."""

from __future__ import annotations

import pytest
import torch
import transformers

from serverless_llm import LLM, SamplingParams
from tests.engine.family_check import family_prompts, save_family_model
from tests.engine.mxfp4_pack import write_mxfp4_checkpoint
from tests.engine.reference import hf_greedy
from tests.engine.test_families_gpt_oss import gpt_oss_config
from tests.engine.tp_harness import sharded_logits
from tests.tiny_models import build_tokenizer

NEW_TOKENS = 24


def test_two_ranks_greedy_equal_one_rank_and_transformers(tmp_path):
    path = save_family_model(str(tmp_path / "m"), gpt_oss_config(build_tokenizer()))
    prompts = family_prompts(len(build_tokenizer()), lengths=(3, 20, 45))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = dict(block_size=8, num_kv_blocks=160, max_model_len=256, dtype="float32")
    with LLM(path, tensor_parallel_size=2, **engine) as llm:
        two = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        pool = llm.engine.block_pool
        assert pool.num_free == pool.num_blocks, "KV blocks leaked"
    with LLM(path, **engine) as llm:
        one = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert two == one
    for prompt, got in zip(prompts, two):
        assert got == hf_greedy(path, prompt, NEW_TOKENS), len(prompt)


@pytest.mark.parametrize("weights", ["dequantize", "packed"])
def test_mxfp4_checkpoint_two_rank_logits_equal_transformers(tmp_path, weights):
    """Dequantized at load, or kept 4-bit (run by the MXFP4 MoE kernel's torch reference)."""
    src = save_family_model(str(tmp_path / "m"), gpt_oss_config(build_tokenizer()))
    path = str(tmp_path / "mxfp4")
    write_mxfp4_checkpoint(src, path)
    ids = [5 + (7 * i) % 300 for i in range(37)]  # past the 16-token window
    out = sharded_logits(path, ids, quantized_weights=weights)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))).logits[0]
    torch.testing.assert_close(out["logits"], ref, atol=2e-4, rtol=2e-4)


def test_mxfp4_blocks_across_ranks_decoded_then_cut(tmp_path):
    """Experts 32 channels wide (one block) over two ranks: a rank's 16 channels end inside
    the block, so the down projection is decoded whole and cut (transformers' logits); kept
    4-bit, start-up says why it cannot be."""
    src = save_family_model(
        str(tmp_path / "m"), gpt_oss_config(build_tokenizer(), intermediate_size=32)
    )
    path = str(tmp_path / "mxfp4")
    write_mxfp4_checkpoint(src, path)
    ids = [5 + (7 * i) % 300 for i in range(21)]
    out = sharded_logits(path, ids, quantized_weights="dequantize")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))).logits[0]
    torch.testing.assert_close(out["logits"], ref, atol=2e-4, rtol=2e-4)
    with pytest.raises(Exception, match="not a whole number of 32-channel blocks"):
        sharded_logits(path, ids, quantized_weights="packed")


def test_shardable():
    from serverless_llm.engine.models import describe_model
    from serverless_llm.engine.models.sharding import check_shardable

    config = gpt_oss_config(None)
    config.architectures = ["GptOssForCausalLM"]
    check_shardable(describe_model(config), 2)  # sinks and expert biases split: no refusal

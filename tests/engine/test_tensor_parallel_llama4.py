"""Llama 4 across two ranks (rank 1 a spawned process, gloo): its stacked, transposed experts
split by width, chunked and NoPE layers as on one rank; greedy tokens equal transformers'."""

from __future__ import annotations

import transformers

from serverless_llm import LLM, SamplingParams
from tests.engine.family_check import family_prompts, save_family_model
from tests.engine.reference import hf_greedy
from tests.engine.test_families_llama4 import CONFIGS
from tests.tiny_models import build_tokenizer

NEW_TOKENS = 32


def test_two_ranks_greedy_equal_transformers(tmp_path):
    path = save_family_model(str(tmp_path / "m"), CONFIGS["llama4_scout"](build_tokenizer()))
    prompts = family_prompts(
        transformers.AutoConfig.from_pretrained(path).vocab_size, lengths=(3, 20, 45)
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = dict(block_size=8, num_kv_blocks=160, max_model_len=256, dtype="float32")
    with LLM(path, tensor_parallel_size=2, **engine) as llm:
        outs = llm.generate(prompts, params)
        pool = llm.engine.block_pool
        assert pool.num_free == pool.num_blocks, "KV blocks leaked"
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, NEW_TOKENS), len(prompt)

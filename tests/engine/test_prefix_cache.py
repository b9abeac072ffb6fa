"""Prefix caching: shared prefixes are computed once and outputs do not change."""

from __future__ import annotations

import random

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.kv_cache import BlockPool

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def shared_prefix_prompts(vocab: int, n: int = 6, prefix_len: int = 40) -> list[list[int]]:
    rng = random.Random(21)
    prefix = [rng.randrange(5, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(5, vocab) for _ in range(rng.randint(1, 9))] for _ in range(n)]


def test_outputs_equal_with_and_without_prefix_cache(tiny_llama):
    on = LLM(tiny_llama, block_size=8, num_kv_blocks=64, max_model_len=256)
    off = LLM(
        tiny_llama, block_size=8, num_kv_blocks=64, max_model_len=256, enable_prefix_caching=False
    )
    prompts = shared_prefix_prompts(on.engine.vocab_size)
    first = on.generate(prompts[:1], GREEDY)  # fills the cache with the shared prefix
    rest = on.generate(prompts[1:], GREEDY)
    want = off.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in first + rest] == [o.outputs[0].token_ids for o in want]
    # 40 shared tokens = 5 full blocks of 8, found by each of the 5 later prompts.
    assert on.engine.block_pool.hits >= 5 * 5
    assert off.engine.block_pool.hits == 0
    assert on.engine.block_pool.num_free == 64


def test_a_repeated_prompt_recomputes_only_its_last_token(tiny_llama):
    llm = LLM(tiny_llama, block_size=8, num_kv_blocks=64, max_model_len=256)
    prompt = shared_prefix_prompts(llm.engine.vocab_size, n=1, prefix_len=32)[0][:32]
    a = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    seen = []
    execute = llm.engine.runner.execute

    def recording(batch):
        seen.append(list(batch.num_new_tokens))
        return execute(batch)

    llm.engine.runner.execute = recording
    b = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert a == b
    # 32 tokens = 4 full blocks; the last one is recomputed from its last token, so 3 hit.
    assert seen[0] == [32 - 24]


def test_block_pool_reference_counts_and_lru():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.register(a[0], 111)
    pool.free(a)
    assert pool.num_free == 4
    blocks, hashes = pool.lookup([1, 2], block_size=2, max_blocks=1)
    assert blocks == [] and hashes == []  # different tokens, different hash
    from serverless_llm.engine.kv_cache import block_hash

    h = block_hash(None, [1, 2])
    b = pool.allocate(1)
    pool.register(b[0], h)
    pool.free(b)
    got, hashes = pool.lookup([1, 2, 3, 4], block_size=2, max_blocks=2)
    assert got == b and hashes == [h] and pool.num_free == 3
    got2, _ = pool.lookup([1, 2], block_size=2, max_blocks=1)
    assert got2 == b  # shared: two references
    pool.free(got)
    assert pool.num_free == 3
    pool.free(got2)
    assert pool.num_free == 4
    # Allocating everything evicts the cached block and forgets its key.
    pool.allocate(4)
    pool.free(list(range(4)))
    assert pool.lookup([1, 2], block_size=2, max_blocks=1) == ([], [])

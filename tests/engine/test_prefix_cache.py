"""Prefix caching: shared prefixes are computed once and outputs do not change."""

from __future__ import annotations

import random

import pytest

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.kv_cache import BlockPool, block_hash
from serverless_llm.engine.kv_cache_manager import (
    FullAttentionSpec,
    KVCacheManager,
    plan_cache_groups,
)

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


def one_group(num_blocks: int, block_size: int) -> KVCacheManager:
    layout = plan_cache_groups([FullAttentionSpec()] * 2)
    return KVCacheManager(BlockPool(num_blocks), layout, block_size)


def test_block_pool_reference_counts_and_lru():
    kv = one_group(4, 2)
    pool = kv.pool
    a = pool.allocate(2)
    pool.register(a[0], (0, b"some other prefix"), [7, 8])
    pool.free(a)
    assert pool.num_free == 4
    assert kv.take_cached_prefix("x", [1, 2], max_blocks=1) == 0  # other tokens, other key
    assert not kv.holds("x")
    assert kv.allocate("w", 0, 2)
    kv.cache_full_blocks("w", 2, lambda a, b: [1, 2][a:b])
    kv.free("w")
    kv.check()
    assert kv.take_cached_prefix("x", [1, 2, 3, 4], max_blocks=2) == 2
    assert kv.block_tables("x") == [[kv.block_tables("x")[0][0]]] and pool.num_free == 3
    assert kv.take_cached_prefix("y", [1, 2], max_blocks=1) == 2
    assert kv.block_tables("y") == kv.block_tables("x")  # shared: two references
    kv.check()
    kv.free("x")
    assert pool.num_free == 3
    kv.free("y")
    assert pool.num_free == 4
    kv.check()
    # Allocating everything evicts the cached block and forgets its key.
    assert kv.allocate("z", 0, 8)
    kv.free("z")
    assert kv.take_cached_prefix("x", [1, 2, 3], max_blocks=1) == 0


# Two 16-token blocks whose Python `hash((None, tuple(block)))` is equal (found by a birthday
# search): with that as the key, the second prompt was served the first's KV.
COLLIDING = (
    [504, 3512, 1002, 77, 9000, 12, 4242, 31337, 48000, 5, 1, 5406, 3184, 5351, 2209, 3408],
    [504, 3512, 1002, 77, 9000, 12, 4242, 31337, 48000, 5, 1, 3819, 1718, 3382, 1059, 2441],
)


def test_known_hash_collision_gets_distinct_digests():
    a, b = COLLIDING
    assert hash((None, tuple(a))) == hash((None, tuple(b)))  # the old key: equal
    assert block_hash(None, a) != block_hash(None, b)
    assert block_hash(None, a) == block_hash(None, list(a))  # a key, not a nonce
    # The chain and the extra inputs are part of the key; token boundaries are unambiguous.
    assert block_hash(block_hash(None, a), b) != block_hash(block_hash(None, b), b)
    assert block_hash(None, a, b"adapter-1") != block_hash(None, a)
    assert block_hash(None, [1, 2]) != block_hash(None, [1 + (2 << 32)])


def test_equal_digests_never_share_a_block():
    """Even if two blocks' digests were equal, a hit is checked against the block's tokens."""
    a, b = COLLIDING
    kv = one_group(4, 16)
    pool = kv.pool
    blk = pool.allocate(1)
    pool.register(blk[0], (0, block_hash(None, a)), a)
    pool.free(blk)
    assert kv.take_cached_prefix("a", a + [0], 1) == 16
    assert kv.block_tables("a") == [blk]
    kv.free("a")
    forged = {**pool._cached, (0, block_hash(None, b)): blk[0]}  # b's digest points at a's block
    pool._cached = forged
    assert kv.take_cached_prefix("b", b + [0], 1) == 0


@pytest.mark.parametrize("collide", [False, True], ids=["blake2b", "forced-collision"])
def test_colliding_prompts_each_get_their_own_output(tiny_llama, monkeypatch, collide):
    """End to end: the first prompt fills the cache, then the second, whose first block
    collided under the old key, must produce what it produces on a fresh engine. With the
    digest forced to collide (every first block keyed alike), the token check keeps them
    apart."""
    from serverless_llm.engine import kv_cache, kv_cache_manager

    if collide:
        real = kv_cache.block_hash

        def forged(parent, tokens, extra=b""):
            return real(parent, [0] * len(tokens), extra)

        monkeypatch.setattr(kv_cache, "block_hash", forged)
        monkeypatch.setattr(kv_cache_manager, "block_hash", forged)
    tail = [11, 12, 13, 14, 15]
    llm = LLM(tiny_llama, block_size=16, num_kv_blocks=32, max_model_len=128)
    vocab = llm.engine.vocab_size
    first, second = ([t % vocab for t in block] + tail for block in COLLIDING)
    llm.generate([first], GREEDY)
    got = llm.generate([second], GREEDY)[0].outputs[0].token_ids
    fresh = LLM(
        tiny_llama, block_size=16, num_kv_blocks=32, max_model_len=128, enable_prefix_caching=False
    )
    assert got == fresh.generate([second], GREEDY)[0].outputs[0].token_ids
    assert llm.engine.block_pool.hits == 0

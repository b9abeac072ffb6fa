"""Chunked local attention's cache group (Llama 4): the blocks before the current chunk are
released as a window's are, a cached prefix needs only its end's chunk, the start-up count holds
one chunk plus a step, and `with_chunks` turns chunked layers' specs into ChunkedLocalSpec."""

from __future__ import annotations

import math
import random

from serverless_llm.engine.kv_cache import BlockPool
from serverless_llm.engine.kv_cache_manager import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    KVCacheManager,
    blocks_for_one_request,
    layer_cache_specs,
    plan_cache_groups,
    with_chunks,
)

FULL = FullAttentionSpec()
BS = 4
C = 10  # not a multiple of the block size


def _tokens(n: int) -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(1000) for _ in range(n)]


def _manager(num_blocks: int, caching: bool = True) -> KVCacheManager:
    layout = plan_cache_groups([FULL, ChunkedLocalSpec(C)])
    return KVCacheManager(BlockPool(num_blocks, caching), layout, BS)


def test_first_needed_block_is_the_chunks():
    spec = ChunkedLocalSpec(C)
    assert [spec.first_needed_block(n, BS) for n in (0, 9, 10, 19, 20, 31)] == [0, 0, 2, 2, 5, 7]
    assert spec.describe() == "chunked local 10"


def test_with_chunks():
    specs = layer_cache_specs([None, None, 8], 100, [True, False, True])
    assert with_chunks(specs, [C, C, None], 100) == [ChunkedLocalSpec(C), None, specs[2]]
    assert with_chunks(specs, [200, None, None], 100) == specs  # covers every sequence
    assert with_chunks(specs, None, 100) == specs


def test_a_chunked_group_holds_only_its_chunk():
    kv = _manager(64)
    toks = _tokens(45)
    assert kv.allocate("a", 0, 1)
    for done in range(1, 45):  # one decode at a time
        kv.cache_full_blocks("a", done, lambda a, b: toks[a:b])
        kv.release_out_of_window("a", done)
        assert kv.allocate("a", done, done + 1)
        start = done - done % C  # the query at `done` sees its chunk only
        table = kv.block_tables("a")[1]
        assert kv.num_held("a", 1) == len(table) - start // BS  # the chunk's blocks, no more
        assert kv.num_held("a", 1) <= math.ceil(C / BS) + 1
        assert kv.num_held("a", 0) == done // BS + 1
        kv.check()
    kv.free("a")
    assert kv.pool.num_free == 64
    kv.check()


def test_cached_prefix_needs_only_the_chunk_of_its_end():
    kv = _manager(64)
    toks = _tokens(40)
    done = 0
    while done < 24:  # steps of 3, as the scheduler grants them
        assert kv.allocate("a", done, done + 3)
        done += 3
        kv.cache_full_blocks("a", done, lambda a, b: toks[a:b])
        kv.release_out_of_window("a", done)
    kv.free("a")
    # A new request with the same 24 tokens takes 6 full blocks; its chunked group only the
    # blocks from the chunk of position 24 on (block 5), the earlier ones are holes.
    assert kv.take_cached_prefix("b", toks, 6) == 24
    assert kv.num_held("b", 0) == 6 and kv.num_held("b", 1) == 1
    assert len(kv.block_tables("b")[1]) == 6
    kv.free("b")
    kv.check()


def test_blocks_for_one_request():
    layout = plan_cache_groups([FULL, ChunkedLocalSpec(C)])
    # full: 25 blocks of 100 tokens; chunked: 9 earlier tokens + a step of 16 in 7 blocks + 1
    assert blocks_for_one_request(layout, BS, 100, 16) == 25 + math.ceil((C - 1 + 16) / BS) + 1

"""The KV cache manager, an operation at a time: cache groups planned from layer specs, a cached
prefix taken, blocks allocated and keyed, windows released, fork and transfer for beams,
roll-back, free; and after any mix of them the pool is whole."""

from __future__ import annotations

import random

import pytest

from serverless_llm.engine.kv_cache import BlockPool, block_hash
from serverless_llm.engine.kv_cache_manager import (
    FullAttentionSpec,
    KVCacheManager,
    SlidingWindowSpec,
    blocks_for_one_request,
    layer_cache_specs,
    plan_cache_groups,
)

FULL = FullAttentionSpec()
BS = 4


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def manager(num_blocks: int, specs, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, caching), plan_cache_groups(specs), BS)


def run_to(kv: KVCacheManager, owner, toks: list[int], upto: int, start: int = 0) -> None:
    """Computes `owner`'s tokens [start, upto) one grant at a time of 3, as the scheduler would:
    allocate, then after the step cache full blocks and release the window."""
    done = start
    while done < upto:
        n = min(3, upto - done)
        assert kv.allocate(owner, done, done + n)
        done += n
        kv.cache_full_blocks(owner, done, lambda a, b: toks[a:b])
        kv.release_out_of_window(owner, done)


# -- groups -------------------------------------------------------------------------------------


def test_one_kind_of_layer_is_one_group_of_every_layer():
    layout = plan_cache_groups([FULL] * 30)
    assert layout.num_groups == 1 and layout.layers_per_page == 30
    assert layout.slot_of_layer == tuple(range(30)) and set(layout.group_of_layer) == {0}


def test_gemma3_pattern_groups_pad_at_most_a_tenth():
    # Gemma 3 1B: 26 layers, every sixth global -> 4 full, 22 sliding.
    specs = layer_cache_specs([None if (i + 1) % 6 == 0 else 512 for i in range(26)], 32768)
    layout = plan_cache_groups(specs)
    assert layout.layers_per_page == 4
    kinds = [g.spec for g in layout.groups]
    assert kinds.count(FULL) == 1 and kinds.count(SlidingWindowSpec(512)) == 6
    # Every layer in exactly one group, at a distinct slot within it.
    seen = sorted(i for g in layout.groups for i in g.layers)
    assert seen == list(range(26))
    for g in layout.groups:
        assert len(g.layers) <= 4
        assert [layout.slot_of_layer[i] for i in g.layers] == list(range(len(g.layers)))
    padding = sum(4 - len(g.layers) for g in layout.groups)
    assert padding <= 0.1 * 26


def test_a_window_covering_the_context_is_full_attention():
    assert layer_cache_specs([4096, None], 4096) == [FULL, FULL]
    assert layer_cache_specs([4096, None], 4097) == [SlidingWindowSpec(4096), FULL]


def test_blocks_for_one_request_counts_each_groups_share():
    layout = plan_cache_groups([FULL, SlidingWindowSpec(8), SlidingWindowSpec(8), FULL])
    # Full: 64 tokens = 16 blocks. Window 8 with steps of up to 4: 11 tokens -> 3 + 1 blocks.
    assert blocks_for_one_request(layout, BS, 64, 4) == 16 + 4
    assert blocks_for_one_request(plan_cache_groups([FULL]), BS, 64, 4) == 16


# -- one operation at a time ------------------------------------------------------------------


def test_allocate_is_all_or_nothing_across_groups():
    kv = manager(5, [FULL, SlidingWindowSpec(8)])
    assert kv.allocate("a", 0, 8)  # 2 blocks in each group
    assert kv.num_held("a") == 4 and kv.pool.num_free == 1
    assert not kv.allocate("a", 8, 12)  # needs 2, one is free: nothing taken
    assert kv.num_held("a") == 4 and kv.pool.num_free == 1
    assert kv.num_new_blocks("a", 12) == 2
    kv.free("a")
    assert kv.pool.num_free == 5 and not kv.holds("a")
    kv.check()


def released(kv: KVCacheManager, owner, group: int) -> int:
    """Leading entries of the owner's table in `group` that are holes."""
    return len(kv.block_tables(owner)[group]) - kv.num_held(owner, group)


def cached_blocks(kv: KVCacheManager, group: int, toks: list[int], n: int) -> list[int | None]:
    """The block the prefix cache holds for each of the first `n` blocks of `toks`."""
    out, parent = [], None
    for i in range(n):
        chunk = toks[i * BS : (i + 1) * BS]
        parent = block_hash(parent, chunk)
        out.append(kv.pool.cached_block((group, parent), chunk))
    return out


def test_a_sliding_group_keeps_only_its_window():
    w = 8
    kv = manager(64, [FULL, SlidingWindowSpec(w)])
    toks = tokens(40)
    assert kv.allocate("a", 0, 1)
    for done in range(1, 40):  # one decode at a time
        kv.cache_full_blocks("a", done, lambda a, b: toks[a:b])
        kv.release_out_of_window("a", done)
        assert kv.allocate("a", done, done + 1)
        # The query at `done` sees keys done - 7 .. done: blocks before that are holes.
        assert kv.num_held("a", 1) <= -(-w // BS) + 1
        assert released(kv, "a", 1) == max(0, done - w + 1) // BS
        assert kv.num_held("a", 0) == done // BS + 1  # full attention keeps everything
        kv.check()
    kv.free("a")
    assert kv.pool.num_free == 64
    kv.check()


def test_cached_prefix_needs_every_full_block_but_only_the_windows():
    w = 8
    kv = manager(64, [FULL, SlidingWindowSpec(w)])
    toks = tokens(33)
    run_to(kv, "a", toks, 33)
    kv.free("a")
    # Everything is cached: a request with the same 33 tokens takes 8 full blocks (the last
    # token is always computed again).
    assert kv.take_cached_prefix("b", toks, 8) == 32
    first = (32 - w + 1) // BS
    assert kv.num_held("b", 0) == 8 and released(kv, "b", 0) == 0
    assert kv.num_held("b", 1) == 8 - first and released(kv, "b", 1) == first
    assert kv.block_tables("b")[1][first:] == cached_blocks(kv, 1, toks, 8)[first:]
    kv.check()
    kv.free("b")
    # The sliding group's early blocks evicted: the prefix still serves, its end's window is
    # cached.
    for b in cached_blocks(kv, 1, toks, first):
        kv.pool.forget(b)
    assert cached_blocks(kv, 1, toks, first) == [None] * first
    assert kv.take_cached_prefix("c", toks, 8) == 32
    kv.free("c")
    # A block inside the window evicted: the longest prefix whose window is whole is served.
    kv.pool.forget(cached_blocks(kv, 1, toks, 8)[7])
    assert kv.take_cached_prefix("d", toks, 8) == 0  # 7 blocks would need block 5 (evicted)
    kv.check()
    assert kv.pool.num_free == 64


def test_a_full_group_miss_ends_the_prefix():
    kv = manager(64, [FULL, FULL])
    toks = tokens(20)
    run_to(kv, "a", toks, 20)
    assert kv.take_cached_prefix("b", toks[:12] + [7, 7, 7, 7, 7], 4) == 12
    kv.free("a")
    kv.free("b")
    kv.check()


def test_prefix_caching_off_takes_nothing():
    kv = manager(16, [FULL], caching=False)
    toks = tokens(12)
    run_to(kv, "a", toks, 12)
    kv.free("a")
    assert kv.take_cached_prefix("b", toks, 2) == 0 and not kv.holds("b")


def test_fork_shares_full_blocks_and_copies_the_last():
    kv = manager(32, [FULL, SlidingWindowSpec(8)])
    toks = tokens(10)
    run_to(kv, "p", toks, 10)
    computed, copies = kv.fork("p", "c", 10)
    assert computed == 10 and len(copies) == 2  # one partial block per group
    for g, (src_table, dst_table) in enumerate(zip(kv.block_tables("p"), kv.block_tables("c"))):
        assert dst_table[:-1] == src_table[:-1]  # shared full blocks (holes alike)
        assert released(kv, "c", g) == released(kv, "p", g)
        assert (src_table[-1], dst_table[-1]) == copies[g]
    for b in kv.block_tables("p")[0][:2]:
        assert kv.pool.refs(b) == 2
    kv.check()
    # Without room for the copies the child shares the full blocks only.
    spare = [b for b in range(32) if kv.pool.is_free(b)]
    kv.pool.take(spare)  # held outside the manager for a moment
    computed, copies = kv.fork("p", "d", 10)
    assert computed == 8 and copies == []
    kv.pool.free(spare)
    kv.transfer("p", "q")
    assert not kv.holds("p") and kv.holds("q")
    for owner in ("c", "d", "q"):
        kv.free(owner)
    kv.check()
    assert kv.pool.num_free == 32


def test_rollback_frees_blocks_and_forgets_rewritten_ones():
    kv = manager(32, [FULL])
    toks = tokens(16)
    run_to(kv, "a", toks, 16)  # 4 full blocks, all keyed
    (table,) = kv.block_tables("a")
    kept = list(table)
    # Blocks 0, 1 whole; block 2 keeps 2 tokens; block 3 freed.
    assert kv.rollback("a", 10) == (10, [])
    assert kv.block_tables("a") == [kept[:3]]
    assert kv.pool.is_free(kept[3])
    # Block 2 will be written over: it must not serve its old tokens to anyone.
    kv.free("a")
    assert kv.take_cached_prefix("b", toks, 4) == 8
    kv.free("b")
    kv.check()
    assert kv.pool.num_free == 32


def test_rollback_of_a_shared_block_writes_into_a_copy():
    kv = manager(32, [FULL])
    toks = tokens(16)
    run_to(kv, "a", toks, 16)
    assert kv.take_cached_prefix("b", toks, 3) == 12  # shares blocks 0..2 of a
    shared = kv.block_tables("a")[0][2]
    computed, copies = kv.rollback("a", 10)
    assert computed == 10 and len(copies) == 1 and copies[0][0] == shared
    assert kv.block_tables("a")[0][2] == copies[0][1] != shared
    assert kv.block_tables("b")[0][2] == shared and kv.pool.refs(shared) == 1
    kv.check()
    kv.free("a")
    # With no block free for the copy, the shared block is let go and computed again.
    assert kv.take_cached_prefix("a", toks, 3) == 12
    assert kv.block_tables("a")[0][2] == shared
    spare = [b for b in range(32) if kv.pool.is_free(b)]
    kv.pool.take(spare)
    assert kv.rollback("a", 10) == (8, [])
    assert kv.num_held("a") == 2 and kv.block_tables("b")[0][2] == shared
    kv.pool.free(spare)
    kv.free("a")
    kv.free("b")
    kv.check()
    assert kv.pool.num_free == 32


def test_rollback_into_a_released_window_is_refused():
    kv = manager(32, [SlidingWindowSpec(4)])
    toks = tokens(20)
    run_to(kv, "a", toks, 20)
    with pytest.raises(ValueError, match="window"):
        kv.rollback("a", 6)
    assert kv.rollback("a", 19) == (19, [])  # the query at 19 sees 16..19: still kept
    kv.free("a")
    kv.check()
    assert kv.pool.num_free == 32


@pytest.mark.parametrize("seed", range(6))
def test_any_mix_of_operations_leaves_the_pool_whole(seed):
    """Random requests through allocate / cache / release / fork / rollback / preempt / abort /
    finish: the books balance after every operation, and once all end the pool is whole."""
    rng = random.Random(seed)
    kv = manager(48, [FULL, SlidingWindowSpec(8), SlidingWindowSpec(8), FULL])
    live: dict[str, tuple[list[int], int]] = {}
    next_id = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.25 or not live:
            toks = tokens(rng.randrange(1, 40), seed=rng.randrange(4))  # shared prefixes
            name = f"r{next_id}"
            next_id += 1
            done = kv.take_cached_prefix(name, toks, (len(toks) - 1) // BS)
            live[name] = (toks, done)
        else:
            name = rng.choice(sorted(live))
            toks, done = live[name]
            if op < 0.6:  # a step
                n = min(rng.randrange(1, 6), len(toks) - done) or 1
                if done + n > len(toks):
                    toks.append(rng.randrange(1000))
                if kv.allocate(name, done, done + n):
                    done += n
                    kv.cache_full_blocks(name, done, lambda a, b, t=toks: t[a:b])
                    kv.release_out_of_window(name, done)
                live[name] = (toks, done)
            elif op < 0.7 and done:  # a beam forks
                child = f"r{next_id}"
                next_id += 1
                computed, _ = kv.fork(name, child, done)
                live[child] = (list(toks), computed)
            elif op < 0.8 and done > 2:  # speculative tokens rejected
                back = rng.randrange(1, 3)
                try:
                    computed, _ = kv.rollback(name, done - back)
                    live[name] = (toks[: done - back], computed)
                except ValueError:
                    pass
            elif op < 0.9:  # preempted: recomputed later
                kv.free(name)
                live[name] = (toks, 0)
            else:  # finished or aborted
                kv.free(name)
                del live[name]
        kv.check()
    for name in live:
        kv.free(name)
    kv.check()
    assert kv.pool.num_free == 48 and not kv.owners()

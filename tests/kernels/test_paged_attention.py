"""Paged attention (Triton, interpreted) against the per-request torch reference.

Every batch mixes decodes and prefill chunks of query lengths 1, 2, 7 and 33 over contexts
spanning several shuffled (non-contiguous) blocks, with a decode of a first token (no context)
and padding tokens after the last request. The grid is every combination of dtype x block size
x head dim x GQA ratio x sliding window on tiny head counts (1-2 KV heads); split-KV, tile
shapes and odd sizes get their own smaller grids.

Tolerances: float32 atol = rtol = 1e-5 (the kernel's error is ~1e-6 against float32 math);
float16 atol = rtol = 4e-3 (the kernel rounds the probabilities to fp16 before P @ V, as flash
attention does, and the output to fp16: a few fp16 ulps at |o| ~ 1).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm.engine.kernels.kv_write import reshape_and_cache_reference  # noqa: E402
from serverless_llm.engine.kernels.paged_attention import (  # noqa: E402
    TileConfig,
    choose_num_splits,
    paged_attention,
    paged_attention_reference,
    prefill_tiles,
)
from serverless_llm.engine.layers.attention import (  # noqa: E402
    TorchAttentionBackend,
    TritonAttentionBackend,
)
from tests.kernels.batch import Batch, make_batch  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}

# (context_len, query_len): decodes over 1..several blocks and a first-token decode, then
# prefill chunks of 2, 7 and 33 tokens with and without context.
MIXED = [(45, 1), (0, 1), (77, 1), (50, 2), (0, 7), (19, 7), (0, 33), (40, 33)]
# (num_heads, num_kv_heads) for GQA ratios 1, 4, 8: one KV head keeps the interpreter quick;
# several KV heads are covered by the split, odd-size and backend tests.
HEADS = {1: (1, 1), 4: (4, 1), 8: (8, 1)}


def _check(batch: Batch, out: torch.Tensor, dtype: torch.dtype) -> None:
    ref = paged_attention_reference(batch.q, batch.kv_cache, batch.meta, batch.spec)
    n = int(batch.meta.query_start_loc[-1])
    torch.testing.assert_close(out[:n], ref[:n], **TOL[dtype])


def _run(batch: Batch, **kwargs) -> torch.Tensor:
    # The torch writer: the Triton one has its own tests, and the interpreter is slow.
    reshape_and_cache_reference(batch.k, batch.v, batch.kv_cache, batch.meta.slot_mapping)
    return paged_attention(batch.q, batch.kv_cache, batch.meta, batch.spec, **kwargs)


@pytest.mark.parametrize("window", [None, 24], ids=["full", "window24"])
@pytest.mark.parametrize("gqa", [1, 4, 8], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("block_size", [8, 16, 32], ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_mixed_batch_matches_reference(dtype, block_size, head_dim, gqa, window):
    h, kvh = HEADS[gqa]
    batch = make_batch(
        MIXED,
        block_size=block_size,
        num_heads=h,
        num_kv_heads=kvh,
        head_dim=head_dim,
        dtype=dtype,
        sliding_window=window,
        num_padding=3,
        seed=block_size * 1000 + head_dim + gqa,
    )
    _check(batch, _run(batch, num_splits=1), dtype)


def test_wide_heads_with_the_default_tiles():
    """head_dim 256 (Gemma) in float16 with the tiles the launcher picks: the prefill's 64-row x
    32-key tiles (sized to fit sm86/sm89's shared memory) and the decode's, over a mixed batch
    with a window."""
    batch = make_batch(
        MIXED,
        block_size=16,
        num_heads=4,
        num_kv_heads=2,
        head_dim=256,
        dtype=torch.float16,
        sliding_window=24,
        num_padding=2,
        seed=256,
    )
    assert prefill_tiles(2, 256, 200, torch.float16) == TileConfig(64, 32, 8, 3)
    _check(batch, _run(batch, num_splits=1), torch.float16)


@pytest.mark.parametrize("window", [None, 100], ids=["full", "window100"])
@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_split_kv_matches_reference(dtype, num_splits, window):
    """Split-KV on long contexts, including splits that get no key at all (the window leaves
    early splits empty, and 5 splits of a 1-tile range are mostly empty)."""
    batch = make_batch(
        [(700, 1), (5, 1), (300, 1), (400, 7), (0, 33)],
        block_size=16,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=dtype,
        sliding_window=window,
        num_padding=1,
        seed=num_splits,
    )
    _check(batch, _run(batch, num_splits=num_splits), dtype)


def test_split_kv_chosen_by_heuristic_for_a_lone_long_decode():
    batch = make_batch(
        [(1500, 1)], block_size=32, num_heads=4, num_kv_heads=1, head_dim=64, dtype=torch.float32
    )
    # One tile x 1 KV head against 16 SMs: the heuristic splits (1500 keys allow 5 splits).
    assert choose_num_splits(1, 1501, sms=16) == 5
    _check(batch, _run(batch, sms=16), torch.float32)


def test_choose_num_splits():
    assert choose_num_splits(num_programs=512, max_seq_len=2048, sms=132) == 1  # batch fills it
    assert choose_num_splits(num_programs=8, max_seq_len=8192, sms=132) == 32
    assert choose_num_splits(num_programs=8, max_seq_len=100, sms=132) == 1  # too short to split
    assert choose_num_splits(num_programs=1, max_seq_len=1 << 20, sms=132) == 64  # capped


TILES = [
    # key tile smaller than a cache block; 16-row prefill tile (2 tokens x 8 heads)
    TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1),
    # key tile spanning 4 blocks of 8; 32-row decode tile (mostly padding rows)
    TileConfig(block_m=32, block_n=32, num_warps=4, num_stages=2),
]


@pytest.mark.parametrize("tiles", TILES, ids=["m16n16", "m32n32"])
@pytest.mark.parametrize("block_size", [8, 32], ids=lambda b: f"bs{b}")
def test_tile_shapes(block_size, tiles):
    batch = make_batch(
        MIXED,
        block_size=block_size,
        num_heads=8,
        num_kv_heads=1,
        head_dim=64,
        dtype=torch.float32,
        sliding_window=10,
        num_padding=2,
    )
    out = _run(batch, num_splits=1, decode_config=tiles, prefill_config=tiles)
    _check(batch, out, torch.float32)


@pytest.mark.parametrize(
    "requests",
    [[(33, 1), (64, 1), (0, 1)], [(0, 2), (10, 7)], [(0, 1)]],
    ids=["decodes-only", "prefills-only", "one-token"],
)
def test_batch_kinds(requests):
    batch = make_batch(
        requests, block_size=16, num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32
    )
    _check(batch, _run(batch), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_odd_head_dim_and_group(dtype):
    """head_dim 80 (padded to 128 lanes) and 3 query heads per KV head (padded to 4)."""
    batch = make_batch(
        MIXED[:6],
        block_size=16,
        num_heads=6,
        num_kv_heads=2,
        head_dim=80,
        dtype=dtype,
        sliding_window=30,
        num_padding=1,
    )
    _check(batch, _run(batch, num_splits=3), dtype)


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize("window", [None, 16], ids=["full", "window16"])
def test_backend_matches_torch_backend(window, head_major):
    """The engine contract: same inputs, same cache after the write, same output; on either
    cache layout (the kernels take the cache's strides)."""
    batch = make_batch(
        MIXED,
        block_size=16,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
        sliding_window=window,
        num_padding=2,
        head_major=head_major,
    )
    cache_t = batch.kv_cache.clone()
    torch_backend = TorchAttentionBackend()
    torch_backend.prepare(batch.meta)
    expected = torch_backend.forward(batch.q, batch.k, batch.v, cache_t, batch.meta, batch.spec)
    triton_backend = TritonAttentionBackend()
    triton_backend.prepare(batch.meta)
    got = triton_backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.meta, batch.spec)
    n = int(batch.meta.query_start_loc[-1])
    assert torch.equal(batch.kv_cache, cache_t)
    torch.testing.assert_close(got[:n], expected[:n], **TOL[torch.float32])


@pytest.mark.parametrize("window", [None, 8], ids=["full", "window8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_bidirectional_spans_match_reference(dtype, window):
    """Gemma 3's images: rows inside a span also see the span's later keys (the key limits of
    AttentionMetadata); other requests of the step stay causal."""
    batch = make_batch(
        MIXED,
        block_size=8,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        dtype=dtype,
        sliding_window=window,
        num_padding=2,
        seed=7,
    )
    meta = batch.meta
    limits: list[list[int] | None] = []
    for n, seq in zip(meta.query_lens_host, meta.seq_lens_host):
        ctx = seq - n
        if n < 7:
            limits.append(None)
            continue
        rows = list(range(ctx, seq))
        a, b = 2, min(n, 2 + 20)  # a span [ctx+2, ctx+b) inside the chunk
        rows[a:b] = [ctx + b - 1] * (b - a)
        limits.append(rows)
    meta.key_limits_host = limits
    out = _run(batch, num_splits=1)
    _check(batch, out, dtype)
    # the spans matter: without them the output differs
    causal = paged_attention_reference(
        batch.q, batch.kv_cache, dataclasses.replace(meta, key_limits_host=None), batch.spec
    )
    n = int(meta.query_start_loc[-1])
    assert not torch.allclose(out[:n], causal[:n], **TOL[dtype])

"""KV cache write (Triton, interpreted) against the torch writer: every slot it should fill
holds exactly the token's K and V, padding tokens (slot -1) and every other slot are untouched.
A copy is exact, so the comparison is bit-for-bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm.engine.kernels.kv_write import (  # noqa: E402
    kv_write_index,
    reshape_and_cache,
    reshape_and_cache_reference,
)
from tests.kernels.batch import DEVICE, make_batch  # noqa: E402


@pytest.mark.parametrize("head_dim", [64, 128, 80], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("block_size", [8, 16, 32], ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_reference(dtype, block_size, head_dim):
    _write_both(dtype, block_size, head_dim, head_major=False)


@pytest.mark.parametrize("head_dim", [64, 80], ids=lambda d: f"d{d}")
def test_head_major_cache(head_dim):
    """The torch backend's cache layout: both writers fill the same logical slots, and the
    kernel's result equals the token-major write read back logically."""
    got = _write_both(torch.float32, 16, head_dim, head_major=True)
    token_major = _write_both(torch.float32, 16, head_dim, head_major=False)
    assert torch.equal(got, token_major)


def _write_both(dtype, block_size, head_dim, head_major):
    batch = make_batch(
        [(45, 1), (0, 1), (50, 2), (19, 7), (40, 33)],
        block_size=block_size,
        num_heads=2,
        num_kv_heads=2,
        head_dim=head_dim,
        dtype=dtype,
        num_padding=3,
        seed=block_size + head_dim,
        head_major=head_major,
    )
    assert batch.kv_cache.transpose(2, 3).is_contiguous() == head_major
    expected = batch.kv_cache.clone()
    reshape_and_cache_reference(batch.k, batch.v, expected, batch.meta.slot_mapping)
    reshape_and_cache(batch.k, batch.v, batch.kv_cache, batch.meta.slot_mapping)
    assert torch.equal(batch.kv_cache, expected)
    return batch.kv_cache


def test_strided_inputs_and_interleaved_padding():
    """K/V as views into a fused QKV output (token stride > heads x dim), padding tokens in the
    middle of the batch, int32 slots."""
    T, kvh, d, bs = 11, 3, 64, 8
    qkv = torch.randn(T, (4 + 2 * kvh) * d, device=DEVICE)
    k = qkv[:, 4 * d : (4 + kvh) * d].view(T, kvh, d)
    v = qkv[:, (4 + kvh) * d :].view(T, kvh, d)
    slots = torch.tensor(
        [5, -1, 17, 40, -1, 3, 63, 0, -7, 22, 31], dtype=torch.int32, device=DEVICE
    )
    cache = torch.randn(2, 8, bs, kvh, d, device=DEVICE)
    expected = cache.clone()
    reshape_and_cache_reference(k, v, expected, slots.long())
    reshape_and_cache(k, v, cache, slots)
    assert torch.equal(cache, expected)


def test_all_padding_writes_nothing():
    cache = torch.randn(2, 4, 16, 1, 64, device=DEVICE)
    before = cache.clone()
    k = torch.randn(5, 1, 64, device=DEVICE)
    reshape_and_cache(k, k, cache, torch.full((5,), -1, dtype=torch.int64, device=DEVICE))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("slots", [[5, -1, 17, 40, -1, 3], [9, 0, 31]], ids=["padding", "none"])
def test_reference_with_the_steps_index_writes_the_same(slots):
    """The torch backend computes the write index once a step (`kv_write_index`) and hands it
    to every layer's write: the same cache as computing it per call."""
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    k = torch.randn(len(slots), 2, 16)
    v = torch.randn(len(slots), 2, 16)
    cache = torch.randn(2, 6, 8, 2, 16)
    expected = cache.clone()
    reshape_and_cache_reference(k, v, expected, slot_mapping)
    index = kv_write_index(slot_mapping, 8)
    assert (index[0] is None) == (-1 not in slots)
    reshape_and_cache_reference(k, v, cache, slot_mapping, index)
    assert torch.equal(cache, expected)

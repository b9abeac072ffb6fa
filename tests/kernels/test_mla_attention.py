"""Latent attention (MLA) kernels against their references, interpreted on the CPU (see
conftest.py): the absorbed decode over latent blocks (split-KV and not, fp32 and fp16, latent
and rope widths that need padding, more heads than a program takes), the expanded prefill
(ragged, with context, strided keys and values as the model hands them over), the row write;
and the torch twins against the same references."""

from __future__ import annotations

import pytest
import torch

from serverless_llm.engine.kernels.kv_write import is_fp8
from serverless_llm.engine.kernels.mla_attention import (
    ExpandedBatch,
    LatentTiles,
    expanded_prefill,
    expanded_prefill_reference,
    expanded_prefill_torch,
    latent_decode,
    latent_decode_reference,
    latent_decode_torch,
    write_latents,
    write_latents_reference,
)
from tests.kernels.batch import DEVICE, make_batch

triton = pytest.importorskip("triton")

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}


def latent_batch(decodes, *, rank, rope, heads, dtype, block_size=8, seed=0, prefills=()):
    """A step of `decodes` (context lengths) and `prefills` ((context, new) pairs) over a latent
    cache [1, NB, bs, 1, rank + rope] full of random rows (garbage past each request's keys
    too), and absorbed queries [T, heads, rank + rope]."""
    requests = [(c, 1) for c in decodes] + list(prefills)
    b = make_batch(
        requests,
        block_size=block_size,
        num_heads=heads,
        num_kv_heads=1,
        head_dim=rank + rope,
        dtype=dtype,
        seed=seed,
    )
    cache = b.kv_cache[:1].contiguous()
    return b.q, cache, b.meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "rank,rope,heads,splits",
    [(32, 16, 4, None), (32, 16, 20, 3), (24, 8, 4, 2), (64, 16, 16, 1)],
)
def test_latent_decode_kernel_equals_reference(dtype, rank, rope, heads, splits):
    q, cache, meta = latent_batch([0, 4, 36, 70], rank=rank, rope=rope, heads=heads, dtype=dtype)
    scale = 0.3
    want = latent_decode_reference(q, cache, meta, scale, rank)
    got = latent_decode(
        q, cache, meta, scale, rank, num_splits=splits, tiles=LatentTiles(16, 16, 4, 1)
    )
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_latent_decode_kernel_default_tiles_and_splits():
    """The launcher's own choices (tiles from the widths, split-KV from the lengths: a lone
    long decode is split)."""
    q, cache, meta = latent_batch([600], rank=32, rope=16, heads=4, dtype=torch.float32)
    want = latent_decode_reference(q, cache, meta, 0.25, 32)
    torch.testing.assert_close(latent_decode(q, cache, meta, 0.25, 32), want, **TOL[torch.float32])


@pytest.mark.parametrize("head_major", [False, True])
def test_latent_decode_torch_equals_reference(head_major):
    """The torch backend's batched decode, on either cache layout, with NaN in the slots past
    every request's keys (a cache is not zero-filled on CPU)."""
    q, cache, meta = latent_batch([0, 5, 17, 40], rank=24, rope=8, heads=3, dtype=torch.float32)
    if head_major:
        cache = cache.transpose(2, 3).contiguous().transpose(2, 3)
    want = latent_decode_reference(q, cache, meta, 0.2, 24)
    for i, seq in enumerate(meta.seq_lens_host):  # poison the unwritten tail of each last block
        last = meta.block_tables[i, (seq - 1) // meta.block_size]
        cache[0, last, seq % meta.block_size or meta.block_size :] = float("nan")
    got = latent_decode_torch(q, cache, meta, 0.2, 24)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def expanded_batch(requests, *, heads, nope, rope, vdim, dtype, seed=0):
    """Ragged prefill requests ((context, new) pairs) with keys and values made as the layer
    makes them: views into one up-projection output [Tk, H, nope + V] (strided)."""
    g = torch.Generator().manual_seed(seed)
    tq = sum(n for _, n in requests)
    tk = sum(c + n for c, n in requests)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    kv = rand(tk, heads, nope + vdim)
    return ExpandedBatch(
        q_nope=rand(tq, heads, nope),
        q_pe=rand(tq, heads, rope),
        k_nope=kv[..., :nope],
        k_pe=rand(tk, rope),
        v=kv[..., nope:],
        q_lens=[n for _, n in requests],
        k_lens=[c + n for c, n in requests],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("nope,rope,vdim", [(16, 16, 16), (24, 8, 40)])
def test_expanded_prefill_kernel_equals_reference(dtype, nope, rope, vdim):
    b = expanded_batch(
        [(0, 1), (0, 19), (13, 5), (40, 33)],
        heads=3,
        nope=nope,
        rope=rope,
        vdim=vdim,
        dtype=dtype,
    )
    want = expanded_prefill_reference(b, 0.2)
    torch.testing.assert_close(expanded_prefill(b, 0.2), want, **TOL[dtype])


def test_expanded_prefill_torch_equals_reference():
    b = expanded_batch(
        [(0, 7), (9, 4), (0, 1)], heads=2, nope=16, rope=8, vdim=24, dtype=torch.float32
    )
    want = expanded_prefill_reference(b, 0.3)
    torch.testing.assert_close(expanded_prefill_torch(b, 0.3), want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_latents_kernel_equals_reference(dtype):
    """The KV write kernel on the stride-0 view writes each row once at its slot and skips
    padding (slot -1)."""
    _, cache, meta = latent_batch(
        [3], rank=32, rope=16, heads=1, dtype=dtype, prefills=[(0, 6), (5, 3)]
    )
    meta.slot_mapping = torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((2,), -1)])
    rows = torch.randn(meta.slot_mapping.shape[0], 48).to(dtype).to(DEVICE)
    want = cache.clone()
    write_latents_reference(rows, want, meta)
    got = cache.clone()
    write_latents(rows, got, meta.slot_mapping)
    assert not is_fp8(got.dtype)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize(
    "cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"]
)
def test_latent_decode_fp8_cache(cache_dtype):
    """An 8-bit float cache holds row / scale: the kernel and the torch twin read it back as the
    reference does (times the scale), split-KV included."""
    q, cache, meta = latent_batch([3, 40, 70], rank=32, rope=16, heads=4, dtype=torch.float16)
    cache8 = (cache.float() / 2.0).to(cache_dtype)
    want = latent_decode_reference(q, cache8, meta, 0.3, 32, kv_scale=2.0)
    got = latent_decode(q, cache8, meta, 0.3, 32, kv_scale=2.0, num_splits=2)
    torch.testing.assert_close(got, want, **TOL[torch.float16])
    meta.backend_state.clear()
    got = latent_decode_torch(q, cache8, meta, 0.3, 32, kv_scale=2.0)
    torch.testing.assert_close(got, want, **TOL[torch.float16])


def test_write_latents_fp8_reference_bytes():
    """The kernel's write to an e5m2 cache (row / scale, clamped) lands on the reference's
    values up to one rounding step of the format."""
    _, cache, meta = latent_batch([3], rank=32, rope=16, heads=1, dtype=torch.float16)
    cache8 = cache.to(torch.float8_e5m2)
    rows = (torch.randn(meta.slot_mapping.shape[0], 48) * 3).to(torch.float16).to(DEVICE)
    want, got = cache8.clone(), cache8.clone()
    write_latents_reference(rows, want, meta, scale=0.5)
    write_latents(rows, got, meta.slot_mapping, scale=0.5)
    # one step of e5m2 (two mantissa bits) is up to half of a value: the interpreter rounds some
    # ties its own way (tests/kernels/test_kv_fp8.py)
    torch.testing.assert_close(got.float(), want.float(), atol=0.3, rtol=0.5)

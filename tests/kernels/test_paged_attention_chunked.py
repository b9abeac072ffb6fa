"""Chunked local attention (Llama 4) in paged attention: the query at position p sees only keys
p - p % C .. p. The Triton kernel (interpreted) and the torch backend against the per-request
reference, on mixed batches whose contexts cross several chunks, with chunks that are and are not
a multiple of the block size, split-KV included; the reference's mask against the definition."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from serverless_llm.engine.kernels.kv_write import reshape_and_cache_reference
from serverless_llm.engine.kernels.paged_attention import (
    attention_mask,
    paged_attention,
    paged_attention_reference,
)
from serverless_llm.engine.layers.attention import TorchAttentionBackend
from tests.kernels.batch import make_batch

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}
MIXED = [(45, 1), (0, 1), (77, 1), (50, 2), (0, 7), (19, 7), (0, 33), (40, 33)]


def _batch(dtype, chunk: int, seed: int = 0, **kw):
    batch = make_batch(
        kw.pop("requests", MIXED),
        block_size=kw.pop("block_size", 8),
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        dtype=dtype,
        num_padding=2,
        seed=seed,
        **kw,
    )
    return dataclasses.replace(batch, spec=dataclasses.replace(batch.spec, chunk_size=chunk))


def _check(batch, out, dtype):
    ref = paged_attention_reference(batch.q, batch.kv_cache, batch.meta, batch.spec)
    n = int(batch.meta.query_start_loc[-1])
    torch.testing.assert_close(out[:n], ref[:n], **TOL[dtype])


def test_mask_is_the_chunk_rule():
    positions = torch.arange(30, 40)
    mask = attention_mask(positions, 40, None, chunk_size=16)
    for r, p in enumerate(positions.tolist()):
        want = [p - p % 16 <= j <= p for j in range(40)]
        assert mask[r].tolist() == want


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("chunk", [16, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_matches_reference(dtype, chunk, num_splits):
    pytest.importorskip("triton")
    batch = _batch(dtype, chunk, seed=chunk + num_splits)
    reshape_and_cache_reference(batch.k, batch.v, batch.kv_cache, batch.meta.slot_mapping)
    out = paged_attention(batch.q, batch.kv_cache, batch.meta, batch.spec, num_splits=num_splits)
    _check(batch, out, dtype)


@pytest.mark.parametrize("softcap", [None, 30.0], ids=["sdpa", "explicit"])
@pytest.mark.parametrize("chunk", [16, 20])
def test_torch_backend_matches_reference(chunk, softcap):
    batch = _batch(torch.float32, chunk, seed=3, head_major=True)
    batch = dataclasses.replace(batch, spec=dataclasses.replace(batch.spec, logit_softcap=softcap))
    backend = TorchAttentionBackend()
    backend.prepare(batch.meta)
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.meta, batch.spec)
    _check(batch, out, torch.float32)

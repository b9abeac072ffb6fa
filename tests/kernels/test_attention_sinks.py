"""Paged attention with learned per-head sink logits (gpt-oss): the reference against attention
written out score by score, then the Triton kernel (interpreted; prefill, decode, split-KV, with
and without a window), the torch backend's path (both cache layouts) and the native CPU step
against the reference.

A sink is one more logit per head inside the softmax, with no value: it only adds
exp(sink[h]) to the denominator, so a large sink shrinks the head's output towards zero.
Tolerances as in test_paged_attention.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm.engine.kernels import cpu_native  # noqa: E402
from serverless_llm.engine.kernels.kv_write import reshape_and_cache_reference  # noqa: E402
from serverless_llm.engine.kernels.metadata import AttentionSpec  # noqa: E402
from serverless_llm.engine.kernels.paged_attention import (  # noqa: E402
    paged_attention,
    paged_attention_reference,
    paged_attention_torch,
    plan_torch_decodes,
)
from tests.kernels.batch import Batch, make_batch  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
# Decodes (one with no context), prefills with and without context, prefill chunks.
MIXED = [(45, 1), (0, 1), (77, 1), (50, 2), (0, 7), (19, 7), (30, 19)]
WINDOWS = pytest.mark.parametrize("window", [None, 24], ids=["full", "window"])


def _batch(dtype, requests=MIXED, window=None, heads=(4, 2), seed=0, head_major=False) -> Batch:
    batch = make_batch(
        requests,
        block_size=16,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=64,
        dtype=dtype,
        sliding_window=window,
        num_padding=2,
        seed=seed,
        head_major=head_major,
    )
    # Sinks of the scores' own size (std ~1) and larger: some heads keep most of their mass,
    # some give much of it to the sink.
    g = torch.Generator().manual_seed(seed + 100)
    sinks = (torch.randn(heads[0], generator=g) * 2 + 1).to(batch.q.device)
    batch.spec = dataclasses.replace(batch.spec, sinks=sinks)
    reshape_and_cache_reference(batch.k, batch.v, batch.kv_cache, batch.meta.slot_mapping)
    return batch


def _check(batch: Batch, out: torch.Tensor, dtype: torch.dtype) -> None:
    ref = paged_attention_reference(batch.q, batch.kv_cache, batch.meta, batch.spec)
    n = int(batch.meta.query_start_loc[-1])
    torch.testing.assert_close(out[:n], ref[:n], **TOL[dtype])


def _dense(batch: Batch) -> torch.Tensor:
    """Score by score in float64: softmax over the allowed keys' scores and the head's sink,
    the sink's share dropped."""
    spec, meta = batch.spec, batch.meta
    bs, group = meta.block_size, spec.num_heads // spec.num_kv_heads
    out = torch.zeros(batch.q.shape[0], spec.num_heads, spec.head_dim, dtype=torch.float64)
    qsl = meta.query_start_loc.tolist()
    for r in range(meta.num_requests):
        seq_len = meta.seq_lens_host[r]
        table = meta.block_tables[r].tolist()
        kv = [batch.kv_cache[:, table[j // bs], j % bs].double() for j in range(seq_len)]
        ctx = seq_len - (qsl[r + 1] - qsl[r])
        for t in range(qsl[r], qsl[r + 1]):
            p = ctx + t - qsl[r]
            w = spec.sliding_window
            keys = [j for j in range(p + 1) if w is None or p - j < w]
            for h in range(spec.num_heads):
                q = batch.q[t, h].double()
                scores = [float(q @ kv[j][0, h // group]) * spec.scale for j in keys]
                sink = float(spec.sinks[h])
                m = max(scores + [sink])
                total = sum(math.exp(s - m) for s in scores) + math.exp(sink - m)
                for s, j in zip(scores, keys):
                    out[t, h] += math.exp(s - m) / total * kv[j][1, h // group]
    return out.reshape(out.shape[0], -1)


@WINDOWS
def test_reference_matches_dense_attention(window):
    batch = _batch(torch.float32, requests=[(21, 1), (0, 5), (13, 4)], window=window, seed=1)
    ref = paged_attention_reference(batch.q, batch.kv_cache, batch.meta, batch.spec)
    n = int(batch.meta.query_start_loc[-1])
    torch.testing.assert_close(ref[:n].double(), _dense(batch)[:n], atol=1e-5, rtol=1e-5)
    # the sinks change the result
    plain = dataclasses.replace(batch.spec, sinks=None)
    without = paged_attention_reference(batch.q, batch.kv_cache, batch.meta, plain)
    assert not torch.allclose(without[:n], ref[:n], atol=1e-3)


@WINDOWS
@DTYPES
def test_kernel_matches_reference(dtype, window):
    batch = _batch(dtype, window=window, seed=2)
    _check(batch, paged_attention(batch.q, batch.kv_cache, batch.meta, batch.spec), dtype)


@WINDOWS
@DTYPES
def test_kernel_split_kv_counts_the_sink_once(dtype, window):
    """Split-KV over long contexts with 3 query heads per KV head (padded to 4): the sink
    starts the first split's softmax only, and the reduce merges it with the others."""
    batch = _batch(
        dtype, requests=[(300, 1), (5, 1), (200, 7), (0, 19)], window=window, heads=(6, 2), seed=3
    )
    out = paged_attention(batch.q, batch.kv_cache, batch.meta, batch.spec, num_splits=3)
    _check(batch, out, dtype)


def test_kernel_reads_bfloat16_sinks():
    """A bfloat16 model's sinks parameter: the kernel loads it and converts to float32."""
    batch = _batch(torch.float32, seed=4)
    bf16 = batch.spec.sinks.to(torch.bfloat16)
    batch.spec = dataclasses.replace(batch.spec, sinks=bf16)
    want = dataclasses.replace(batch.spec, sinks=bf16.float())
    out = paged_attention(batch.q, batch.kv_cache, batch.meta, batch.spec)
    ref = paged_attention_reference(batch.q, batch.kv_cache, batch.meta, want)
    n = int(batch.meta.query_start_loc[-1])
    torch.testing.assert_close(out[:n], ref[:n], **TOL[torch.float32])


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@WINDOWS
@DTYPES
def test_torch_path_matches_reference(dtype, window, head_major):
    batch = _batch(dtype, window=window, seed=5, head_major=head_major)
    plan_torch_decodes(batch.meta)
    out = paged_attention_torch(batch.q, batch.k, batch.v, batch.kv_cache, batch.meta, batch.spec)
    _check(batch, out, dtype)


@WINDOWS
def test_native_decode_matches_reference(window):
    """The native CPU step's decode rows (its prefill rows are the torch path's)."""
    kernels = cpu_native.load()
    if kernels is None:
        pytest.skip("the native CPU kernels cannot be built here")
    batch = _batch(torch.float32, window=window, seed=6, head_major=True, heads=(6, 2))
    meta, spec = batch.meta, batch.spec
    T = int(meta.query_start_loc[-1])
    keep: list = []
    step = cpu_native.make_step(meta, torch.zeros(T, dtype=torch.int64), keep)
    layer = cpu_native.make_layer(spec, batch.kv_cache, None)
    out = torch.empty(meta.num_decodes, spec.num_heads * spec.head_dim)
    q, k, v = (t[:T].contiguous() for t in (batch.q, batch.k, batch.v))
    kernels.attention_step(layer, step, q, k, v, out)
    ref = paged_attention_reference(batch.q, batch.kv_cache, meta, spec)[: meta.num_decodes]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_spec_equality_and_checks():
    base = AttentionSpec(4, 2, 64, 0.125)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    with_sinks = dataclasses.replace(base, sinks=sinks)
    assert with_sinks == dataclasses.replace(base, sinks=sinks.clone())
    assert hash(with_sinks) == hash(dataclasses.replace(base, sinks=sinks.clone()))
    assert with_sinks != base
    assert with_sinks != dataclasses.replace(base, sinks=sinks * 2)
    with pytest.raises(ValueError, match="sinks"):
        dataclasses.replace(base, sinks=torch.ones(3))

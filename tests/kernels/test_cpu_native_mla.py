"""The native CPU kernels for multi-head latent attention and chunked local attention
(kernels/cpu_native.c `mla_decode_f32`, `attention_step_f32` with a chunk) against their torch
references: the absorbed latent decode (row write included) over paged latent blocks at several
block sizes, ragged context lengths, head counts odd and even, with and without split-KV, with
NaN in every slot no request owns; the chunk rule in the paged decode, chunks shorter than the
contexts, multiples of the block size and not; and the backends wired to them (the MLA layer's
decode and the native backend's chunked layers) against the torch backend."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from serverless_llm.engine.kernels import cpu_native
from serverless_llm.engine.kernels.cpu_native import LayerPrep, make_layer, make_step
from serverless_llm.engine.kernels.kv_write import reshape_and_cache_reference
from serverless_llm.engine.kernels.metadata import AttentionSpec
from serverless_llm.engine.kernels.mla_attention import (
    latent_decode_reference,
    latent_decode_torch,
    write_latents_reference,
)
from serverless_llm.engine.kernels.paged_attention import paged_attention_reference
from serverless_llm.engine.layers.attention import NativeCpuBackend, TorchAttentionBackend
from tests.kernels.test_cpu_native import ragged_step, rope_table


@pytest.fixture(scope="module")
def kernels():
    k = cpu_native.load()
    assert k is not None, "the native CPU kernels did not build (is a C compiler installed?)"
    return k


def latent_step(lens, qlens, block_size, width, g, pad_rows=0):
    """A step's metadata and a latent cache [1, NB, bs, 1, W] of NaN except each request's
    context rows (random): rows a kernel must not read would poison its result."""
    num_blocks = sum(-(-n // block_size) for n in lens) + 4
    meta, positions = ragged_step(lens, qlens, block_size, num_blocks, g, pad_rows=pad_rows)
    cache = torch.full((1, num_blocks, block_size, 1, width), float("nan"))
    cache[0, 0] = 0.0  # block 0: the padding rows' (allocate_kv_cache zeroes it)
    nd = meta.num_decodes
    for i, (n, q) in enumerate(zip(meta.seq_lens_host, meta.query_lens_host)):
        if i < nd and meta.slot_mapping[i] < 0:
            continue  # a padding row
        for p in range(n - q):
            b = int(meta.block_tables[i, p // block_size])
            cache[0, b, p % block_size, 0] = torch.randn(width, generator=g)
    return meta, positions, cache


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
@pytest.mark.parametrize(
    ("heads", "rank", "rope"), [(4, 32, 16), (5, 24, 8), (16, 64, 16), (1, 16, 4)]
)
def test_latent_step_matches_the_references(kernels, block_size, heads, rank, rope):
    g = torch.Generator().manual_seed(block_size * 100 + heads)
    W = rank + rope
    # Ragged decodes (one token, one key past a block, long ones that split), then a prefill
    # and a chunk with context: their rows are written, not attended.
    lens, qlens = [1, 5, 17, 130, 300, 9, 23], [1, 1, 1, 1, 1, 9, 4]
    meta, positions, cache = latent_step(lens, qlens, block_size, W, g, pad_rows=2)
    T = positions.shape[0]
    rows = torch.randn(T, W, generator=g)
    ref_cache = cache.clone()
    write_latents_reference(rows, ref_cache, meta)
    nd = meta.num_decodes
    q = torch.randn(nd, heads, W, generator=g)
    scale = 0.7 / W**0.5
    want = latent_decode_reference(q, ref_cache, meta, scale, rank)
    got = kernels.latent_step(make_step(meta, positions, []), rows, q, cache, scale, rank)
    assert torch.equal(cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0))  # a copy: exact
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_latent_step_is_one_result_for_any_thread_count(kernels, threads):
    """A lone long decode is cut into splits by thread count; the merge gives the reference's
    result whatever the cut (to float32 rounding) and the same bits when called again."""
    g = torch.Generator().manual_seed(11)
    meta, positions, cache = latent_step([700, 3], [1, 1], 16, 40, g)
    rows = torch.randn(2, 40, generator=g)
    q = torch.randn(2, 6, 40, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step = make_step(meta, positions, [])
        got = kernels.latent_step(step, rows, q, cache, 0.2, 32)
        again = kernels.latent_step(step, None, q, cache, 0.2, 32)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, again)
    torch.testing.assert_close(
        got, latent_decode_reference(q, cache, meta, 0.2, 32), rtol=1e-5, atol=1e-5
    )


def test_latent_step_writes_only_without_decodes(kernels):
    g = torch.Generator().manual_seed(5)
    meta, positions, cache = latent_step([12, 7], [12, 3], 4, 20, g)
    rows = torch.randn(positions.shape[0], 20, generator=g)
    ref_cache = cache.clone()
    write_latents_reference(rows, ref_cache, meta)
    got = kernels.latent_step(make_step(meta, positions, []), rows, None, cache, 1.0, 16)
    assert got.shape == (0, 0, 16)
    assert torch.equal(cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0))


def test_latent_step_refuses_a_query_count_unlike_the_steps(kernels):
    g = torch.Generator().manual_seed(6)
    meta, positions, cache = latent_step([5, 9], [1, 1], 4, 20, g)
    with pytest.raises(ValueError, match="decode queries"):
        kernels.latent_step(
            make_step(meta, positions, []), None, torch.zeros(1, 2, 20), cache, 1.0, 16
        )


def test_native_latent_decode_equals_the_torch_twin(kernels):
    """The backend's entry the MLA layer calls, against the torch twin it replaces."""
    g = torch.Generator().manual_seed(8)
    meta, positions, cache = latent_step([33, 64, 2], [1, 1, 1], 16, 72, g)
    rows = torch.randn(3, 72, generator=g)
    q = torch.randn(3, 16, 72, generator=g)
    ref_cache = cache.clone()
    write_latents_reference(rows, ref_cache, meta)
    TorchAttentionBackend().prepare(meta)
    want = latent_decode_torch(q, ref_cache, meta, 0.1, 64)
    backend = NativeCpuBackend(kernels)
    backend.prepare(meta)
    assert backend.latent_ready(rows, cache)
    got = backend.latent_step(rows, q, cache, meta, 0.1, 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not backend.latent_ready(rows.double(), cache)  # float32 only
    assert not backend.latent_ready(rows, cache.to(torch.bfloat16))


# -- chunked local attention ---------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("chunk", [5, 8, 16])
@pytest.mark.parametrize("window", [None, 6])
def test_chunked_attention_step_matches_the_reference(kernels, block_size, chunk, window):
    g = torch.Generator().manual_seed(block_size * 10 + chunk)
    H, KVH, D = 4, 2, 16
    spec = AttentionSpec(H, KVH, D, D**-0.5, chunk_size=chunk, sliding_window=window)
    prep = LayerPrep(rope=rope_table(D, g))
    # Contexts shorter than, equal to and many times the chunk; positions on a boundary and not.
    lens, qlens = [1, 5, 8, 16, 17, 40, 63, 23], [1, 1, 1, 1, 1, 1, 1, 4]
    meta, positions = ragged_step(lens, qlens, block_size, 80, g, pad_rows=1)
    T = positions.shape[0]
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g)
    cache = torch.randn(2, 80, KVH, block_size, D, generator=g).transpose(2, 3)
    ref_cache = cache.clone()
    q, k, v = qkv.view(T, -1, D).split([H, KVH, KVH], dim=1)
    rq, rk, rv = cpu_native.prepare_reference(q, k, v, positions, prep)
    reshape_and_cache_reference(rk, rv, ref_cache, meta.slot_mapping)
    want = paged_attention_reference(rq, ref_cache, meta, spec)
    nd = meta.num_decodes
    out = torch.full((nd, H * D), float("nan"))
    kernels.attention_step(
        make_layer(spec, cache, prep), make_step(meta, positions, []), q, k, v, out
    )
    torch.testing.assert_close(out, want[:nd], rtol=1e-5, atol=1e-5)
    # The chunk changes the answer here (else the test would not see a missing rule).
    full = paged_attention_reference(
        rq, ref_cache, meta, dataclasses.replace(spec, chunk_size=None)
    )
    assert not torch.allclose(full[:nd], want[:nd], atol=1e-3)


def test_chunked_keys_before_the_chunk_are_never_read(kernels):
    """The blocks a chunked group has released become holes (block 0) in the table: NaN there,
    and in every key before each decode's chunk, leaves the result finite and the reference's."""
    g = torch.Generator().manual_seed(2)
    H, KVH, D, bs, chunk = 2, 1, 8, 4, 8
    spec = AttentionSpec(H, KVH, D, D**-0.5, chunk_size=chunk)
    meta, positions = ragged_step([21, 30], [1, 1], bs, 20, g)
    cache = torch.randn(2, 20, KVH, bs, D, generator=g).transpose(2, 3)
    q, k, v = (torch.randn(2, n, D, generator=g) for n in (H, KVH, KVH))
    ref_cache = cache.clone()
    reshape_and_cache_reference(k, v, ref_cache, meta.slot_mapping)
    want = paged_attention_reference(q, ref_cache, meta, spec)
    for i, n in enumerate(meta.seq_lens_host):
        start = (n - 1) - (n - 1) % chunk
        for p in range(start):
            b = int(meta.block_tables[i, p // bs])
            cache[:, b, p % bs] = float("nan")
    out = torch.empty(2, H * D)
    kernels.attention_step(
        make_layer(spec, cache, None), make_step(meta, positions, []), q, k, v, out
    )
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_native_backend_runs_chunked_layers_natively(kernels, monkeypatch):
    """The backend's forward on a chunked spec takes the native step (not the torch path) and
    gives the torch backend's result, prefill rows included."""
    g = torch.Generator().manual_seed(4)
    H, KVH, D, bs = 4, 2, 16, 8
    spec = AttentionSpec(H, KVH, D, D**-0.5, chunk_size=12)
    meta, positions = ragged_step([30, 13, 25], [1, 1, 6], bs, 20, g)
    T = positions.shape[0]
    q, k, v = (torch.randn(T, n, D, generator=g) for n in (H, KVH, KVH))
    cache = torch.randn(2, 20, KVH, bs, D, generator=g).transpose(2, 3)
    ref_cache = cache.clone()
    torch_backend = TorchAttentionBackend()
    torch_backend.prepare(meta)
    want = torch_backend.forward(q, k, v, ref_cache, meta, spec)
    meta.backend_state.clear()
    backend = NativeCpuBackend(kernels)
    backend.prepare(meta)
    calls = []
    real = kernels.attention_step
    monkeypatch.setattr(kernels, "attention_step", lambda *a: calls.append(1) or real(*a))
    got = backend.forward(q, k, v, cache, meta, spec)
    assert calls, "the chunked layer did not take the native step"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)


def test_the_cpu_benchmark_runs_and_agrees(kernels):
    """bench/mla_decode.py --cpu's rows at tiny shapes: both sides ran, and gave one result."""
    from bench.mla_decode import run_cpu

    rows = run_cpu([(1, 40), (3, 70)], 4, 32, 16, repeats=1, retries=0, settle=0.0)
    assert [r[:2] for r in rows] == [[1, 40], [3, 70]]
    assert all(r[2] > 0 and r[3] > 0 and r[6] < 1e-5 for r in rows)


def test_self_check_catches_a_missing_chunk_rule_or_a_wrong_latent_step(kernels, monkeypatch):
    """The load-time self-check probes both: a layer struct without its chunk, or a latent
    step whose attention is off, fails it (and the torch path would run instead)."""
    assert cpu_native.self_check(kernels) is None
    real_layer = cpu_native.make_layer

    def no_chunk(spec, cache, prep):
        layer = real_layer(spec, cache, prep)
        layer.chunk = 0
        return layer

    monkeypatch.setattr(cpu_native, "make_layer", no_chunk)
    assert "attention_step (chunked)" in cpu_native.self_check(kernels)
    monkeypatch.setattr(cpu_native, "make_layer", real_layer)
    real_step = kernels.latent_step
    monkeypatch.setattr(
        kernels, "latent_step", lambda step, rows, q, *a: real_step(step, rows, q, *a) * 1.01
    )
    assert "latent_step: attention" in cpu_native.self_check(kernels)

"""The kernel comparisons compiled for a real GPU, at Llama-3-8B attention shapes (32 query
heads, 8 KV heads, head dim 128; hidden 4096, intermediate 14336), contexts up to 8k, in
float32, float16 and bfloat16. Run with `pytest -m gpu` on a CUDA machine; skipped elsewhere.

Tolerances (atol = rtol): float32 1e-4 (IEEE dots, but sums over up to 8k keys), float16 5e-3
and bfloat16 3e-2 (the probabilities are rounded to the input dtype before P @ V, as flash
attention does; bf16 keeps 8 bits of mantissa).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1",
        reason="TRITON_INTERPRET=1 is set: these tests are for compiled kernels "
        "(run `TRITON_INTERPRET=0 pytest -m gpu tests/kernels`)",
    ),
]

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
# Decodes over short and 8k contexts, a prefill chunk over a 4k context, a 2k prefill, and a
# handful of short chunks.
LLAMA3_BATCH = [(8191, 1), (2047, 1), (100, 1), (5000, 1), (4096, 512), (0, 2048), (37, 7)]


def _batch(requests, dtype, block_size=16, window=None, seed=0):
    from tests.kernels.batch import make_batch

    return make_batch(
        requests,
        block_size=block_size,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=dtype,
        sliding_window=window,
        num_padding=5,
        seed=seed,
        device="cuda",
    )


def _attention(batch):
    from serverless_llm.engine.kernels.kv_write import reshape_and_cache_reference
    from serverless_llm.engine.kernels.paged_attention import (
        paged_attention,
        paged_attention_reference,
    )

    reshape_and_cache_reference(batch.k, batch.v, batch.kv_cache, batch.meta.slot_mapping)
    out = paged_attention(batch.q, batch.kv_cache, batch.meta, batch.spec)
    ref = paged_attention_reference(batch.q, batch.kv_cache, batch.meta, batch.spec)
    n = int(batch.meta.query_start_loc[-1])
    return out[:n], ref[:n]


@pytest.mark.parametrize("window", [None, 4096], ids=["full", "window4096"])
@DTYPES
def test_paged_attention_llama3_shapes(dtype, window):
    out, ref = _attention(_batch(LLAMA3_BATCH, dtype, window=window))
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("block_size", [8, 32], ids=lambda b: f"bs{b}")
def test_paged_attention_block_sizes(block_size):
    out, ref = _attention(_batch(LLAMA3_BATCH, torch.bfloat16, block_size=block_size))
    torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])


@DTYPES
def test_lone_long_decode_splits_kv(dtype):
    from serverless_llm.engine.kernels.paged_attention import choose_num_splits, num_sms

    assert choose_num_splits(8, 8192, num_sms(torch.device("cuda"))) > 1
    out, ref = _attention(_batch([(8191, 1)], dtype))
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("group", [1, 4, 8], ids=lambda g: f"gqa{g}")
def test_gqa_ratios(group):
    from tests.kernels.batch import make_batch

    batch = make_batch(
        [(3000, 1), (0, 1), (1000, 33), (0, 300)],
        block_size=16,
        num_heads=8 * group,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
    )
    out, ref = _attention(batch)
    torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])


@DTYPES
def test_triton_backend_matches_torch_backend(dtype):
    from serverless_llm.engine.layers.attention import (
        TorchAttentionBackend,
        TritonAttentionBackend,
    )

    batch = _batch([(2047, 1), (500, 1), (1000, 64), (0, 700)], dtype, window=None)
    cache = batch.kv_cache.clone()
    torch_backend = TorchAttentionBackend()
    torch_backend.prepare(batch.meta)
    ref = torch_backend.forward(batch.q, batch.k, batch.v, cache, batch.meta, batch.spec)
    got = TritonAttentionBackend().forward(
        batch.q, batch.k, batch.v, batch.kv_cache, batch.meta, batch.spec
    )
    n = int(batch.meta.query_start_loc[-1])
    assert torch.equal(batch.kv_cache, cache)
    torch.testing.assert_close(got[:n], ref[:n], **TOL[dtype])


@DTYPES
def test_kv_write(dtype):
    from serverless_llm.engine.kernels.kv_write import (
        reshape_and_cache,
        reshape_and_cache_reference,
    )

    batch = _batch([(4000, 1), (0, 1), (100, 512)], dtype)
    expected = batch.kv_cache.clone()
    reshape_and_cache_reference(batch.k, batch.v, expected, batch.meta.slot_mapping)
    reshape_and_cache(batch.k, batch.v, batch.kv_cache, batch.meta.slot_mapping)
    assert torch.equal(batch.kv_cache, expected)


@DTYPES
def test_rms_norm_silu_rotary(dtype):
    from serverless_llm.engine.kernels.activation import silu_and_mul, silu_and_mul_reference
    from serverless_llm.engine.kernels.rms_norm import rms_norm, rms_norm_reference
    from serverless_llm.engine.kernels.rotary import rotary_embedding, rotary_embedding_reference
    from serverless_llm.engine.layers.rotary import cos_sin_cache, inv_frequencies

    tol = TOL[dtype] if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)
    g = torch.Generator(device="cuda").manual_seed(0)
    T = 1000
    x = torch.randn(T, 4096, device="cuda", generator=g).to(dtype)
    res = torch.randn(T, 4096, device="cuda", generator=g).to(dtype)
    w = (torch.rand(4096, device="cuda", generator=g) + 0.5).to(dtype)
    got, got_res = rms_norm(x, w, 1e-5, res)
    ref, ref_res = rms_norm_reference(x, w, 1e-5, res)
    torch.testing.assert_close(got, ref, **tol)
    assert torch.equal(got_res, ref_res)

    gate_up = torch.randn(T, 2 * 14336, device="cuda", generator=g).to(dtype)
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up), **tol)

    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    table = cos_sin_cache(inv_frequencies(params, 128, 8192), 8192).cuda()
    positions = torch.randint(0, 8192, (T,), device="cuda", generator=g)
    qkv = torch.randn(T, 48 * 128, device="cuda", generator=g).to(dtype)
    q, k = qkv[:, : 32 * 128].view(T, 32, 128), qkv[:, 32 * 128 : 40 * 128].view(T, 8, 128)
    for is_neox in (True, False):
        q_ref, k_ref = rotary_embedding_reference(positions, q, k, table, is_neox)
        q_out, k_out = rotary_embedding(positions, q.clone(), k.clone(), table, is_neox)
        torch.testing.assert_close(q_out, q_ref, **tol)
        torch.testing.assert_close(k_out, k_ref, **tol)

"""Encoders' bidirectional attention over the ragged batch (no cache): the Triton paged kernel
with DENSE_KV + BIDIRECTIONAL (under TRITON_INTERPRET=1), the torch backend's SDPA path and the
native CPU kernel (kernels/cpu_native.c's encoder_attention_f32, the CPU backend's), all
against the plain float32 reference."""

import pytest
import torch

from serverless_llm.engine.kernels import cpu_native
from serverless_llm.engine.kernels.metadata import AttentionMetadata, AttentionSpec
from serverless_llm.engine.kernels.paged_attention import (
    TileConfig,
    encoder_attention,
    encoder_attention_reference,
    encoder_attention_torch,
)
from serverless_llm.engine.layers.attention import NativeCpuBackend
from tests.kernels.batch import DEVICE


def _meta(lens: list[int]) -> AttentionMetadata:
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    t = torch.tensor(lens, dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=t,
        context_lens=torch.zeros_like(t),
        block_tables=torch.zeros(len(lens), 0, dtype=torch.int32),
        slot_mapping=torch.empty(0, dtype=torch.int64),
        num_decodes=sum(1 for n in lens if n == 1),
        max_query_len=max(lens),
        max_seq_len=max(lens),
        query_lens_host=lens,
        seq_lens_host=lens,
    )


def _inputs(lens, heads, kv_heads, d, dtype, seed=0, window=None):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, heads, d, generator=g).to(dtype)
    k = torch.randn(T, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(T, kv_heads, d, generator=g).to(dtype)
    return q, k, v, AttentionSpec(heads, kv_heads, d, d**-0.5, sliding_window=window)


LENS = [1, 7, 33, 16, 70]


def test_torch_path_equals_reference_and_is_bidirectional():
    q, k, v, spec = _inputs(LENS, 4, 2, 16, torch.float32)
    meta = _meta(LENS)
    ref = encoder_attention_reference(q, k, v, meta, spec)
    out = encoder_attention_torch(q, k, v, meta, spec)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # The first row of a request sees its later keys: changing the last key of request 2
    # changes its first row (it would not under a causal mask), and no other request's rows.
    k2 = k.clone()
    last = sum(LENS[:3]) - 1
    k2[last] += 1.0
    out2 = encoder_attention_reference(q, k2, v, meta, spec)
    first = sum(LENS[:2])
    assert not torch.allclose(out2[first], ref[first])
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[first : last + 1] = False
    torch.testing.assert_close(out2[others], ref[others])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "kv_heads,splits,window", [(4, None, None), (2, None, None), (1, 3, None), (4, None, 9)]
)
def test_triton_dense_bidirectional_equals_reference(dtype, kv_heads, splits, window):
    pytest.importorskip("triton")
    q, k, v, spec = _inputs(LENS, 4, kv_heads, 16, dtype, seed=kv_heads, window=window)
    meta = _meta(LENS)
    ref = encoder_attention_reference(q.float(), k.float(), v.float(), meta, spec)
    cfg = TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    dev = [x.to(DEVICE) for x in (q, k, v)]
    meta_dev = _meta(LENS)
    for name in ("query_start_loc", "seq_lens", "context_lens", "block_tables"):
        setattr(meta_dev, name, getattr(meta_dev, name).to(DEVICE))
    out = encoder_attention(*dev, meta_dev, spec, config=cfg, num_splits=splits, sms=16).cpu()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_two_sided_window_torch_path():
    """ModernBERT's local layers: a query sees keys within window - 1 positions either side."""
    q, k, v, spec = _inputs(LENS, 4, 2, 16, torch.float32, window=5)
    meta = _meta(LENS)
    ref = encoder_attention_reference(q, k, v, meta, spec)
    torch.testing.assert_close(encoder_attention_torch(q, k, v, meta, spec), ref)
    # Key 70-long request's position 10 does not see key 15 (distance 5) but sees key 14.
    base = sum(LENS[:4])
    for far, changes in ((15, False), (14, True)):
        k2 = k.clone()
        k2[base + far] += 1.0
        out = encoder_attention_reference(q, k2, v, meta, spec)
        assert torch.allclose(out[base + 10], ref[base + 10]) != changes


@pytest.mark.parametrize("window", [None, 4])
def test_torch_path_with_repeated_lengths(window):
    """Requests of the same length side by side in a step, in any order of lengths: each sees
    only its own rows, as the reference computes."""
    lens = [5, 3, 5, 1, 5, 9, 3, 1]
    q, k, v, spec = _inputs(lens, 4, 2, 16, torch.float32, seed=3, window=window)
    meta = _meta(lens)
    ref = encoder_attention_reference(q, k, v, meta, spec)
    torch.testing.assert_close(encoder_attention_torch(q, k, v, meta, spec), ref)


@pytest.fixture(scope="module")
def kernels():
    k = cpu_native.load()
    assert k is not None, "the native CPU kernels did not build (is a C compiler installed?)"
    return k


def _starts(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)


@pytest.mark.parametrize("d", [16, 20, 32, 64, 80])
@pytest.mark.parametrize("kv_heads,window", [(4, None), (2, None), (4, 5), (1, 33)])
def test_native_kernel_equals_reference(kernels, d, kv_heads, window):
    """Requests of 1 to 150 rows (crossing the kernel's 16-key tiles, its 8-row query blocks and
    its 32-key score blocks), head widths on and off the vector width, grouped KV heads, with
    and without a two-sided window; q, k, v as views into one QKV row, as the encoder hands
    them."""
    lens = [1, 7, 33, 16, 70, 150, 8, 9]
    H = 4
    g = torch.Generator().manual_seed(d + kv_heads)
    T = sum(lens)
    qkv = torch.randn(T, (H + 2 * kv_heads) * d, generator=g) * 2
    q, k, v = qkv.view(T, -1, d).split([H, kv_heads, kv_heads], dim=1)
    spec = AttentionSpec(H, kv_heads, d, d**-0.5, sliding_window=window)
    ref = encoder_attention_reference(q, k, v, _meta(lens), spec)
    out = kernels.encoder_attention(q, k, v, _starts(lens), spec)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_native_kernel_on_threads_equals_one_thread(kernels):
    """The OpenMP team over (request, head) tasks gives the one-thread result exactly."""
    lens = [70, 3, 128, 40] * 4
    q, k, v, spec = _inputs(lens, 6, 6, 32, torch.float32, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.encoder_attention(q, k, v, _starts(lens), spec)
        torch.set_num_threads(max(2, threads))
        many = kernels.encoder_attention(q, k, v, _starts(lens), spec)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_native_backend_takes_plain_float32_heads_only(kernels, monkeypatch):
    """The CPU backend's encoder attention: the native call for float32 heads with or without a
    window; the torch path for a soft-cap (which the kernel does not apply) and other dtypes."""
    backend = NativeCpuBackend(kernels)
    calls = []
    native = kernels.encoder_attention
    monkeypatch.setattr(
        kernels, "encoder_attention", lambda *a: calls.append(1) or native(*a), raising=False
    )
    meta = _meta(LENS)
    for window in (None, 5):
        q, k, v, spec = _inputs(LENS, 4, 2, 16, torch.float32, window=window)
        out = backend.encoder_attention(q, k, v, meta, spec)
        torch.testing.assert_close(out, encoder_attention_reference(q, k, v, meta, spec))
    assert len(calls) == 2
    q, k, v, _ = _inputs(LENS, 4, 2, 16, torch.float32)
    capped = AttentionSpec(4, 2, 16, 0.25, logit_softcap=3.0)
    backend.encoder_attention(q, k, v, meta, capped)
    q16, k16, v16, spec16 = _inputs(LENS, 4, 2, 16, torch.bfloat16)
    out16 = backend.encoder_attention(q16, k16, v16, meta, spec16)
    assert out16.dtype == torch.bfloat16 and len(calls) == 2

"""Paged attention with logit soft-capping (Gemma 2) and ALiBi (BLOOM, MPT, Falcon-ALiBi...):
the reference against a dense attention written out here, and the Triton kernel (interpreted)
and the torch backend's fast path against the reference, over ragged batches of decodes,
prefills and prefill chunks with context, with a sliding window and with split-KV.

Tolerances as in test_paged_attention.py: float32 atol = rtol = 1e-5 (the kernel's tanh is
built from exp, a few float32 ulps off libm's), float16 atol = rtol = 4e-3.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm.engine.kernels import paged_attention as pa  # noqa: E402
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
# Decodes (one with no context), prefills with and without context, chunks of 2, 7 and 19.
MIXED = [(45, 1), (0, 1), (77, 1), (50, 2), (0, 7), (19, 7), (30, 19)]
# (softcap, ALiBi, sliding window); a cap of 2 bites hard on scores of std ~1.
OPTIONS = {
    "softcap": (2.0, False, None),
    "alibi": (None, True, None),
    "both-window": (2.0, True, 24),
}


def bloom_slopes(num_heads: int) -> torch.Tensor:
    """BLOOM's slopes for a power-of-two head count: 2^(-8 (h + 1) / H)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)])


def _batch(
    option: str,
    dtype: torch.dtype,
    requests=MIXED,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    head_major: bool = False,
) -> Batch:
    softcap, alibi, window = OPTIONS[option]
    batch = make_batch(
        requests,
        block_size=16,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        dtype=dtype,
        sliding_window=window,
        num_padding=2,
        seed=seed,
        head_major=head_major,
    )
    batch.spec = dataclasses.replace(
        batch.spec,
        logit_softcap=softcap,
        alibi_slopes=bloom_slopes(num_heads).to(batch.q.device) if alibi else None,
    )
    reshape_and_cache_reference(batch.k, batch.v, batch.kv_cache, batch.meta.slot_mapping)
    return batch


def _check(batch: Batch, out: torch.Tensor, dtype: torch.dtype) -> None:
    ref = paged_attention_reference(batch.q, batch.kv_cache, batch.meta, batch.spec)
    n = int(batch.meta.query_start_loc[-1])
    torch.testing.assert_close(out[:n], ref[:n], **TOL[dtype])


def _dense(batch: Batch) -> torch.Tensor:
    """Attention written out score by score in float64: the keys read from the cache one
    position at a time, ALiBi in BLOOM's own form (slope * key position, which differs from
    slope * (j - p) by a per-row constant the softmax ignores)."""
    spec, meta = batch.spec, batch.meta
    bs = meta.block_size
    group = spec.num_heads // spec.num_kv_heads
    out = torch.zeros(batch.q.shape[0], spec.num_heads, spec.head_dim, dtype=torch.float64)
    qsl = meta.query_start_loc.tolist()
    for r in range(meta.num_requests):
        seq_len = meta.seq_lens_host[r]
        table = meta.block_tables[r].tolist()
        kv = [batch.kv_cache[:, table[j // bs], j % bs].double() for j in range(seq_len)]
        ctx = seq_len - (qsl[r + 1] - qsl[r])
        for t in range(qsl[r], qsl[r + 1]):
            p = ctx + t - qsl[r]
            for h in range(spec.num_heads):
                q = batch.q[t, h].double()
                keys = [
                    j
                    for j in range(p + 1)
                    if spec.sliding_window is None or p - j < spec.sliding_window
                ]
                scores = []
                for j in keys:
                    s = float(q @ kv[j][0, h // group]) * spec.scale
                    if spec.logit_softcap is not None:
                        s = spec.logit_softcap * math.tanh(s / spec.logit_softcap)
                    if spec.alibi_slopes is not None:
                        s += float(spec.alibi_slopes[h]) * j
                    scores.append(s)
                m = max(scores)
                w = [math.exp(s - m) for s in scores]
                for wj, j in zip(w, keys):
                    out[t, h] += wj / sum(w) * kv[j][1, h // group]
    return out.reshape(out.shape[0], -1)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_reference_matches_dense_attention(option):
    batch = _batch(option, torch.float32, requests=[(21, 1), (0, 5), (13, 4)], seed=1)
    ref = paged_attention_reference(batch.q, batch.kv_cache, batch.meta, batch.spec)
    n = int(batch.meta.query_start_loc[-1])
    torch.testing.assert_close(ref[:n].double(), _dense(batch)[:n], atol=1e-5, rtol=1e-5)
    # The options change the result (a test that passed with them ignored would be useless).
    plain = dataclasses.replace(batch.spec, logit_softcap=None, alibi_slopes=None)
    assert not torch.allclose(
        paged_attention_reference(batch.q, batch.kv_cache, batch.meta, plain)[:n],
        ref[:n],
        atol=1e-3,
    )


@pytest.mark.parametrize("option", list(OPTIONS))
@DTYPES
def test_kernel_matches_reference(dtype, option):
    batch = _batch(option, dtype, seed=2)
    _check(batch, paged_attention(batch.q, batch.kv_cache, batch.meta, batch.spec), dtype)


@DTYPES
def test_kernel_split_kv_and_odd_group(dtype):
    """Split-KV over long contexts (the window empties early splits) with 3 query heads per KV
    head (padded to 4): slopes indexed per query head, not per row of the tile."""
    batch = _batch(
        "both-window",
        dtype,
        requests=[(300, 1), (5, 1), (200, 7), (0, 19)],
        num_heads=6,
        num_kv_heads=2,
        seed=3,
    )
    batch.spec = dataclasses.replace(
        batch.spec, sliding_window=100, alibi_slopes=torch.linspace(0.3, 0.01, 6)
    )
    out = paged_attention(batch.q, batch.kv_cache, batch.meta, batch.spec, num_splits=3)
    _check(batch, out, dtype)


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize("option", list(OPTIONS))
@DTYPES
def test_torch_path_matches_reference(dtype, option, head_major):
    """On both cache layouts: the torch backend allocates head-major (one gather per layer),
    the Triton backend token-major (the torch code then gathers by logical index)."""
    batch = _batch(option, dtype, seed=4, head_major=head_major)
    plan_torch_decodes(batch.meta)
    out = paged_attention_torch(batch.q, batch.k, batch.v, batch.kv_cache, batch.meta, batch.spec)
    _check(batch, out, dtype)


def test_gather_blocks_is_layout_free():
    """The head-major fast path (one index_select of (block, head) rows) and the logical gather
    of any other layout read the same keys in the same order."""
    batch = _batch("alibi", torch.float32, num_heads=6, num_kv_heads=3, seed=6)
    head_major = batch.kv_cache.transpose(2, 3).contiguous().transpose(2, 3)
    blocks = batch.meta.block_tables[:3]
    a = pa.gather_blocks(batch.kv_cache[1], blocks)
    b = pa.gather_blocks(head_major[1], blocks)
    assert a.shape == (3, 3, blocks.shape[1] * 16, 64)
    assert torch.equal(a, b)
    # key j of request 0, head h, is cache slot (table[j // bs], j % bs)
    j = 37
    assert torch.equal(a[0, :, j], batch.kv_cache[1, blocks[0, j // 16], j % 16])


@pytest.mark.parametrize("option", list(OPTIONS))
def test_torch_decode_never_reads_unwritten_values(option):
    """The torch decode gathers whole blocks; every slot a request has not written (the tail of
    its last block, table padding past block 0, every other block) is poisoned with NaN, and
    the output stays equal to the reference's, which reads only written slots."""
    batch = _batch(option, torch.float32, num_heads=4, num_kv_heads=4, seed=8, head_major=True)
    written = torch.zeros(batch.kv_cache.shape[1] * 16, dtype=torch.bool)
    for i, seq_len in enumerate(batch.meta.seq_lens_host):
        written[pa.key_slots(batch.meta.block_tables[i], seq_len, 16)] = True
    written[:16] = True  # block 0: zeroed at allocation, the tables' padding
    poison = (~written).view(-1, 16)
    batch.kv_cache[:, poison] = float("nan")
    plan_torch_decodes(batch.meta)
    out = paged_attention_torch(batch.q, batch.k, batch.v, batch.kv_cache, batch.meta, batch.spec)
    assert not out.isnan().any()
    _check(batch, out, torch.float32)


def test_torch_explicit_scores_in_row_blocks(monkeypatch):
    """A soft-capped prefill longer than the score budget runs in blocks of query rows."""
    monkeypatch.setattr(pa, "SCORE_BUDGET", 4 * 60 * 5)  # 5 rows of 4 heads x 60 keys
    batch = _batch("both-window", torch.float32, requests=[(41, 19), (0, 17)], seed=5)
    plan_torch_decodes(batch.meta)
    out = paged_attention_torch(batch.q, batch.k, batch.v, batch.kv_cache, batch.meta, batch.spec)
    _check(batch, out, torch.float32)


def test_spec_equality_hash_and_checks():
    base = AttentionSpec(4, 2, 64, 0.125)
    slopes = bloom_slopes(4)
    with_alibi = dataclasses.replace(base, alibi_slopes=slopes)
    assert with_alibi == dataclasses.replace(base, alibi_slopes=slopes.clone())
    assert hash(with_alibi) == hash(dataclasses.replace(base, alibi_slopes=slopes.clone()))
    assert with_alibi != base
    assert with_alibi != dataclasses.replace(base, alibi_slopes=slopes * 2)
    assert dataclasses.replace(base, logit_softcap=50.0) != base
    assert len({base, AttentionSpec(4, 2, 64, 0.125), with_alibi}) == 2
    with pytest.raises(ValueError, match="alibi_slopes"):
        dataclasses.replace(base, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="logit_softcap"):
        dataclasses.replace(base, logit_softcap=0.0)

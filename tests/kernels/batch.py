"""Random ragged batches over a paged KV cache, laid out as the model runner lays them out:
decode requests first, block ids shuffled (so no request's blocks are contiguous), garbage in
every cache slot nobody owns, optional padding tokens (slot -1) after the last request."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from serverless_llm.engine.kernels.metadata import AttentionMetadata, AttentionSpec

# Where kernel tests put their tensors: the GPU when there is one (compiled kernels), else the
# CPU (interpreted kernels; tests/kernels/conftest.py sets TRITON_INTERPRET=1).
DEVICE = torch.device(
    "cuda"
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    else "cpu"
)


@dataclass
class Batch:
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, KVH, D]
    v: torch.Tensor
    kv_cache: torch.Tensor  # [2, NB, bs, KVH, D] (logical), context already written
    meta: AttentionMetadata
    spec: AttentionSpec


def make_batch(
    requests: list[tuple[int, int]],
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    num_padding: int = 0,
    seed: int = 0,
    device: str | torch.device = DEVICE,
    head_major: bool = False,
) -> Batch:
    """`requests`: (context_len, query_len) pairs; decodes (query_len 1) are moved first.
    `head_major`: the cache's memory laid out as the torch backend allocates it (same values,
    same logical shape; see `allocate_kv_cache`)."""
    g = torch.Generator().manual_seed(seed)
    reqs = sorted(requests, key=lambda r: r[1] != 1)
    seq_lens = [c + n for c, n in reqs]
    query_lens = [n for _, n in reqs]
    per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = 2 * sum(per_req) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables: list[list[int]] = []
    used = 0
    for nb in per_req:
        tables.append(perm[used : used + nb])
        used += nb
    slots: list[int] = []
    for (ctx, n), table in zip(reqs, tables):
        for p in range(ctx, ctx + n):
            slots.append(table[p // block_size] * block_size + p % block_size)
    slots += [-1] * num_padding
    T = len(slots)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    kv_cache = rand(2, num_blocks, block_size, num_kv_heads, head_dim)
    if head_major:
        kv_cache = kv_cache.transpose(2, 3).contiguous().transpose(2, 3)
    q, k, v = (
        rand(T, num_heads, head_dim),
        rand(T, num_kv_heads, head_dim),
        rand(T, num_kv_heads, head_dim),
    )
    width = max(per_req)
    table_t = torch.zeros(len(reqs), width, dtype=torch.int32)
    for r, t in enumerate(tables):
        table_t[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=seq_t,
        context_lens=seq_t - torch.tensor(query_lens, dtype=torch.int32),
        block_tables=table_t,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decodes=sum(1 for n in query_lens if n == 1),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
        block_size=block_size,
    )
    spec = AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        scale=head_dim**-0.5,
        sliding_window=sliding_window,
    )
    dev = torch.device(device)
    to = lambda t: t.to(dev)  # noqa: E731
    meta.query_start_loc, meta.seq_lens = to(meta.query_start_loc), to(meta.seq_lens)
    meta.context_lens, meta.block_tables = to(meta.context_lens), to(meta.block_tables)
    meta.slot_mapping = to(meta.slot_mapping)
    return Batch(to(q), to(k), to(v), to(kv_cache), meta, spec)

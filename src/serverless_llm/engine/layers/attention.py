"""Attention over the paged KV cache: the metadata every backend is fed, the backend interface,
and the torch reference backend (CPU).

A step's batch is ragged: request `i` brings `query_lens[i]` new tokens (1 for a decode, more for
a prefill or a prefill chunk) whose K/V are written into the cache at `slot_mapping`, and its
queries attend causally to everything up to their own position, `seq_lens[i]` keys in all, read
through `block_tables[i]`. The model runner puts decode requests first, so the first
`num_decodes` tokens are exactly the decode tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B + 1] int32: request i's tokens are [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # [B] int32: keys each request attends to (context + new)
    context_lens: torch.Tensor  # [B] int32: keys already in the cache before this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token; < 0 means padding
    num_decodes: int  # requests 0..num_decodes-1 have exactly one new token
    max_query_len: int
    max_seq_len: int
    # Host copies, for decisions in Python without a device sync.
    query_lens_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    block_size: int = 16
    # What a backend precomputes once per step and reuses in every layer.
    backend_state: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_host)


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # a query attends to the last `sliding_window` keys


class AttentionBackend(ABC):
    name: str

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Per-step work shared by all layers (index tensors, split plans...)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
        meta: AttentionMetadata,
        spec: AttentionSpec,
    ) -> torch.Tensor:  # [T, H * D]
        """Writes k, v into the cache, then attends."""


def write_kv_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Stores each token's K and V at its slot; padding slots (< 0) are skipped."""
    kvh, d = k.shape[1], k.shape[2]
    flat = kv_cache.view(2, -1, kvh, d)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def key_slots(block_table: torch.Tensor, num_keys: int, block_size: int) -> torch.Tensor:
    """Cache slots of keys 0..num_keys-1 of one request, from its block table row."""
    pos = torch.arange(num_keys, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


def attention_mask(
    query_positions: torch.Tensor, num_keys: int, sliding_window: int | None
) -> torch.Tensor:
    """[q, num_keys] bool: causal, and inside the sliding window when there is one."""
    keys = torch.arange(num_keys, device=query_positions.device)
    diff = query_positions[:, None] - keys[None, :]
    allowed = diff >= 0
    if sliding_window is not None:
        allowed &= diff < sliding_window
    return allowed


class TorchAttentionBackend(AttentionBackend):
    """The reference backend. Decodes run as one batched gather-and-matmul over padded key
    lists; prefills run one request at a time through scaled_dot_product_attention."""

    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        nd = meta.num_decodes
        if nd == 0:
            return
        device = meta.block_tables.device
        lens = meta.seq_lens[:nd].long()
        max_len = max(meta.seq_lens_host[:nd])
        pos = torch.arange(max_len, device=device)
        blocks = (
            meta.block_tables[:nd]
            .long()
            .gather(
                1, (pos // meta.block_size).clamp(max=meta.block_tables.shape[1] - 1).expand(nd, -1)
            )
        )
        slots = blocks * meta.block_size + pos % meta.block_size
        valid = pos[None, :] < lens[:, None]
        # Padded keys read slot 0 (always allocated memory) and are masked out.
        meta.backend_state["decode_slots"] = torch.where(valid, slots, 0)
        meta.backend_state["decode_valid"] = valid
        meta.backend_state["decode_pos"] = pos
        meta.backend_state["decode_last"] = lens - 1

    def forward(self, q, k, v, kv_cache, meta, spec):
        write_kv_ref(k, v, kv_cache, meta.slot_mapping)
        T = q.shape[0]
        out = torch.empty(T, spec.num_heads * spec.head_dim, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, spec)
        s = nd
        for i in range(nd, meta.num_requests):
            e = s + meta.query_lens_host[i]
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], kv_cache, meta, spec, i)
            s = e
        return out

    def _decode(self, q, kv_cache, meta, spec):
        st = meta.backend_state
        slots, valid = st["decode_slots"], st["decode_valid"]
        nd, L = slots.shape
        kvh, g, d = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim
        flat = kv_cache.view(2, -1, kvh, d)
        # index_select on the flattened slots takes half the time of `flat[0][slots]` on CPU.
        # (The math below stays plain matmul + softmax: unlike SDPA's blocked kernel, it gives
        # each request the same result whatever the padding, so outputs do not depend on what
        # else is in the batch.)
        index = slots.reshape(-1)
        keys = flat[0].index_select(0, index).view(nd, L, kvh, d)
        values = flat[1].index_select(0, index).view(nd, L, kvh, d)
        qg = q.view(nd, kvh, g, d)
        scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)) * spec.scale  # [nd, KVH, G, L]
        mask = valid
        if spec.sliding_window is not None:
            mask = mask & (
                st["decode_last"][:, None] - st["decode_pos"][None, :] < spec.sliding_window
            )
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        o = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [nd, KVH, G, D]
        return o.reshape(nd, kvh * g * d)

    def _prefill(self, q, k, v, kv_cache, meta, spec, i):
        n = q.shape[0]
        seq_len = meta.seq_lens_host[i]
        ctx = seq_len - n
        if ctx > 0:
            slots = key_slots(meta.block_tables[i], seq_len, meta.block_size)
            flat = kv_cache.view(2, -1, spec.num_kv_heads, spec.head_dim)
            k, v = flat[0].index_select(0, slots), flat[1].index_select(0, slots)
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        gqa = spec.num_heads != spec.num_kv_heads
        if ctx == 0 and spec.sliding_window is None:
            o = F.scaled_dot_product_attention(
                qh, kh, vh, is_causal=True, scale=spec.scale, enable_gqa=gqa
            )
        else:
            positions = torch.arange(ctx, seq_len, device=q.device)
            mask = attention_mask(positions, seq_len, spec.sliding_window)
            o = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=mask, scale=spec.scale, enable_gqa=gqa
            )
        return o.transpose(0, 1).reshape(n, spec.num_heads * spec.head_dim)

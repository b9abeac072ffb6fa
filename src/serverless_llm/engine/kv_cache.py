"""The paged KV cache: a pool of fixed-size blocks and the tensors that hold them.

Layout, shared by every attention backend: one tensor per layer of shape
`[2, num_blocks, block_size, num_kv_heads, head_dim]` (index 0 keys, 1 values). Token `t` of a
request lives in slot `block_ids[t // block_size] * block_size + t % block_size`.
"""

from __future__ import annotations

import math
from collections import deque

import torch


class BlockPool:
    """Free-list allocator of block ids. All-or-nothing allocation, so a failed request for
    blocks never leaves a partial allocation behind."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        # Recently freed blocks go to the back: the cache of other requests stays warm longest.
        self._free.extend(block_ids)
        assert len(self._free) <= self.num_blocks, "a block was freed twice"


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

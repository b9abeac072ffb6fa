"""The paged KV cache: a pool of fixed-size blocks, the prefix cache over them, and the
tensors that hold them.

Layout, shared by every attention backend: one tensor per layer of logical shape
`[2, num_blocks, block_size, num_kv_heads, head_dim]` (index 0 keys, 1 values); its memory is
token-major (that order) for the Triton backend and head-major inside each block for the torch
backend (`allocate_kv_cache`). Token `t` of a request lives in slot
`block_ids[t // block_size] * block_size + t % block_size`.

Prefix caching: a block whose `block_size` tokens are all computed is keyed by a chained digest
of (parent block's digest, its token ids), so the key names the whole prefix up to it. Blocks are
reference-counted; a block nobody holds goes back to the free list but keeps its key, so a later
request with the same prefix takes it back instead of recomputing it. Free blocks are reused
least recently freed first, and a reused block loses its key.

The digest is cryptographic (BLAKE2b, 32 bytes), not Python's 64-bit `hash`: two different
blocks with equal `hash((parent, tokens))` can be found in seconds, and the second prompt would
then be served the first's KV, i.e. another user's text. A hit is also checked against the
block's own tokens, so even equal digests could never share a block with different tokens.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .kernels.kv_write import is_fp8

# The root every chain starts from. A version tag: a change to what a digest covers changes it.
_ROOT = b"serverless-llm prefix-cache v1"


def block_hash(
    parent: bytes | None, tokens: list[int] | tuple[int, ...], extra: bytes = b""
) -> bytes:
    """The key of a full block: BLAKE2b-256 of the parent's key (or, for a first block, of the
    root), `extra` (whatever else changes the block's KV: an adapter, the images it holds) and
    the token ids as fixed-width 64-bit integers, so no two token lists encode alike."""
    h = hashlib.blake2b(digest_size=32)
    h.update(parent if parent is not None else _ROOT)
    h.update(len(extra).to_bytes(8, "little"))
    h.update(extra)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockPool:
    """Reference-counted blocks with an LRU free list. Allocation is all or nothing, so a failed
    request for blocks never leaves a partial allocation behind."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: list = [None] * num_blocks  # each block's key in `_cached`
        self._tokens_of: list[tuple[int, ...] | None] = [None] * num_blocks
        self._cached: dict = {}  # key -> block id
        self.hits = 0  # blocks taken from the prefix cache
        self.queries = 0  # blocks looked up

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._unkey(block)
            self._refs[block] = 1
            out.append(block)
        return out

    def share(self, block_ids: list[int]) -> None:
        """Adds a holder to blocks already held (a beam that forks from another)."""
        for block in block_ids:
            assert self._refs[block] > 0, "only a held block can be shared"
            self._refs[block] += 1

    def free(self, block_ids: list[int]) -> None:
        # Freed in reverse so a request's tail blocks are evicted before its head: the head is
        # the prefix other requests are likeliest to share.
        for block in reversed(block_ids):
            self._refs[block] -= 1
            assert self._refs[block] >= 0, "a block was freed twice"
            if self._refs[block] == 0:
                self._free[block] = None

    def refs(self, block: int) -> int:
        return self._refs[block]

    def is_free(self, block: int) -> bool:
        return block in self._free

    # -- prefix cache -----------------------------------------------------------------------
    # A key is whatever names a block's contents in full: the KV cache manager's is
    # (cache group, prefix digest).

    def cached_block(self, key, tokens: Sequence[int]) -> int | None:
        """The block cached under `key`, if its tokens are `tokens` (not taken)."""
        block = self._cached.get(key)
        if block is None or self._tokens_of[block] != tuple(tokens):
            return None
        return block

    def take(self, blocks: list[int]) -> None:
        """Adds a holder to cached blocks, held or free (a free one leaves the free list)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def forget(self, block: int) -> bool:
        """Takes a block its one holder is about to write over out of the prefix cache. False
        when others hold it too (then it must not be written)."""
        if self._refs[block] > 1:
            return False
        self._unkey(block)
        return True

    def _unkey(self, block: int) -> None:
        """The block leaves the prefix cache (reused, or about to be written over)."""
        h = self._hash_of[block]
        if h is not None:
            if self._cached.get(h) == block:
                del self._cached[h]
            self._hash_of[block] = None
            self._tokens_of[block] = None

    def register(self, block: int, h, tokens: Sequence[int]) -> None:
        """Marks a full, computed block holding `tokens` as cached under key `h`."""
        if not self.enable_prefix_caching or self._hash_of[block] is not None:
            return
        self._hash_of[block] = h
        self._tokens_of[block] = tuple(tokens)
        self._cached.setdefault(h, block)

    def reset_prefix_cache(self) -> None:
        self._cached.clear()
        self._hash_of = [None] * self.num_blocks
        self._tokens_of = [None] * self.num_blocks


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


def bytes_per_block(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    parts: int = 2,
) -> int:
    """Bytes of one block over `num_layers` layer tensors: `parts` rows (K and V: 2; a latent
    attention layer's one row of latent and rotary key: 1) of KVH x D values per token."""
    elem = torch.empty((), dtype=dtype).element_size()
    return parts * num_layers * block_size * num_kv_heads * head_dim * elem


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    head_major: bool = False,
    parts: int = 2,
) -> list[torch.Tensor]:
    """One cache per layer, each of logical shape [2, num_blocks, block_size, KVH, D] (K, V);
    `parts` = 1 makes [1, num_blocks, block_size, 1, W], a latent attention layer's cache (one
    row of W = latent + rotary key values a token; KVH = 1, D = W), which block copies
    (`copy_blocks`) treat like any other.

    `head_major` lays the memory out as [2, num_blocks, KVH, block_size, D] under that same
    logical shape (a transposed view): each (block, head) pair is then one contiguous row, which
    the torch backend's decode attention gathers straight into the [heads, keys, dim] order of
    its matmuls (see `paged_attention.gather_blocks`). The Triton kernels take the strides they
    are given and work on either layout; the token-major default is what they are tuned for.

    On CPU the cache is left uninitialised: zero-filling gigabytes at start-up cost ~13 s of
    cold start for a 4 GiB cache, while untouched pages cost nothing until a block is first
    used. A request reads only slots it wrote first, except where the torch backend's decode
    reads whole blocks (its padding, and the unwritten tail of a last block, are masked out and
    their values zeroed after the gather) and the padding of block tables, block 0, which is
    zeroed here so it always holds finite values."""
    physical = (parts, num_blocks, num_kv_heads, block_size, head_dim)
    if not head_major:
        physical = (parts, num_blocks, block_size, num_kv_heads, head_dim)

    # An 8-bit float cache is made as bytes and viewed as its type: filling and copying bytes
    # works on every device, while torch's float8 support for those ops varies by build.
    raw = torch.uint8 if is_fp8(dtype) else dtype

    def one(make):
        cache = make(physical, dtype=raw, device=device).view(dtype)
        return cache.transpose(2, 3) if head_major else cache

    if device.type != "cpu":
        return [one(torch.zeros) for _ in range(num_layers)]
    caches = [one(torch.empty) for _ in range(num_layers)]
    for cache in caches:
        cache[:, 0].zero_()
    return caches


def layer_view(cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """A layer's cache of narrower entries (`num_kv_heads` x `head_dim`, fewer values a token
    than `cache`'s: Gemma 4's layers of another head width) inside a layer tensor of
    `allocate_kv_cache`, on either layout: token-major, each token's entry starts the wider
    one's; head-major, head h of a token starts the wider entry's head h when the heads fit
    (no more heads, none wider), else each block's [heads, block_size, dim] starts the wider
    block's. Either way a block's entries stay in that block (a block is one group's at a time,
    so layers of other shapes never see them); the first two keep each token's entry inside the
    wider entry of the same token. Logical shape [2, num_blocks, block_size, num_kv_heads,
    head_dim] as usual, strided: the Triton kernels and the native CPU step take the strides,
    the torch decode gathers whole rows of the wide tensor where the view's rows lie at fixed
    offsets in it (`paged_attention.head_layout`), else indexes by (block, offset)."""
    parts, num_blocks, block_size, heads, dim = cache.shape
    if num_kv_heads * head_dim > heads * dim:
        raise ValueError(f"{num_kv_heads} x {head_dim} entries do not fit in {heads} x {dim}")
    s0, s1, s2, s3, _ = cache.stride()
    if s3 == dim and s2 == heads * dim:  # token-major
        strides = (s0, s1, s2, head_dim, 1)
    elif s2 == dim and s3 == block_size * dim and num_kv_heads <= heads and head_dim <= dim:
        strides = (s0, s1, dim, block_size * dim, 1)  # head-major, head inside head
    elif s2 == dim and s3 == block_size * dim:  # head-major, packed at the block's start
        strides = (s0, s1, head_dim, block_size * head_dim, 1)
    else:
        raise ValueError(f"a cache of strides {cache.stride()} has no layer views")
    shape = (parts, num_blocks, block_size, num_kv_heads, head_dim)
    return cache.as_strided(shape, strides, cache.storage_offset())


class StateCopy(NamedTuple):
    """A state slot to copy (src -> dst) in every recurrent layer: a forked beam's state. It
    travels among the (src, dst) block pairs the KV cache manager hands out, so one list carries
    both kinds."""

    src: int
    dst: int


class RecurrentState:
    """One recurrent layer's per-request state tensors, each `[num_slots, ...]` (a convolution's
    last inputs, a recurrent matrix; the layer says which, `state_shapes`), indexed by the
    request's state slot (kv_cache_manager.StatePool). `kv`: the layer's KV cache too, for a
    layer that both attends and keeps a state (Falcon-H1's parallel hybrid), else None."""

    def __init__(self, tensors: list[torch.Tensor], kv: torch.Tensor | None = None) -> None:
        self.tensors = tensors
        self.kv = kv

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tensors[i]

    def __len__(self) -> int:
        return len(self.tensors)


def state_bytes(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes of one slot of a layer's state tensors (`shapes`: per tensor its per-request shape
    and dtype)."""
    total = 0
    for shape, dtype in shapes:
        total += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return total


def allocate_state(
    shapes: list[tuple[tuple[int, ...], torch.dtype]], num_slots: int, device: torch.device
) -> list[torch.Tensor]:
    """A layer's state tensors for `num_slots` slots. Left uninitialised on CPU: a request's
    first step starts from zeros without reading its slot (`has_initial_state`), and what a
    padded row computes from the scratch slot 0 is never read."""
    make = torch.zeros if device.type != "cpu" else torch.empty
    return [make((num_slots, *shape), dtype=dtype, device=device) for shape, dtype in shapes]


def kv_tensors(kv_caches: list) -> list[torch.Tensor]:
    """The distinct KV tensors among the layers' caches (layers of different cache groups share
    tensors; a recurrent layer's cache holds one only when the layer also attends)."""
    out: dict[int, torch.Tensor] = {}
    for c in kv_caches:
        t = c.kv if isinstance(c, RecurrentState) else c
        if t is not None:
            out[id(t)] = t
    return list(out.values())


def copy_blocks(kv_caches: list, pairs: list[tuple[int, int]]) -> None:
    """Copies the K and V of block `src` into block `dst`, in every layer tensor, for each pair;
    a `StateCopy` pair copies a state slot in every recurrent layer."""
    states = [p for p in pairs if isinstance(p, StateCopy)]
    blocks = [p for p in pairs if not isinstance(p, StateCopy)]
    _copy_rows(kv_tensors(kv_caches), blocks, dim=1)  # [2, num_blocks, ...]
    slots = [t for c in kv_caches if isinstance(c, RecurrentState) for t in c.tensors]
    _copy_rows(slots, states, dim=0)  # [num_slots, ...]


def _copy_rows(tensors: list[torch.Tensor], pairs: list[tuple[int, int]], dim: int) -> None:
    """Row `src` of each tensor along `dim` copied into row `dst`, for each pair: every source
    is read before any row is written, and of two pairs writing one row the later wins (a slot
    freed and taken again within one batch of copies)."""
    if not pairs or not tensors:
        return
    if len({b for _, b in pairs}) < len(pairs):
        pairs = list({b: (a, b) for a, b in pairs}.values())
    device = tensors[0].device
    src = torch.tensor([a for a, _ in pairs], device=device)
    dst = torch.tensor([b for _, b in pairs], device=device)
    for t in tensors:
        if is_fp8(t.dtype):  # bytes are bytes (see allocate_kv_cache)
            t = t.view(torch.uint8)
        t.index_copy_(dim, dst, t.index_select(dim, src))

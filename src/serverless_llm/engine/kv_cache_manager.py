"""The KV cache manager: the one owner of "which request holds which cache blocks".

Layers that keep the same kind of cache form a **cache group**, and every group has its own block
table per request:
- full attention keeps every token;
- a sliding window of W tokens keeps only what its next query can still see: a block whose tokens
  all fell out of the window goes back to the pool while the request runs (its slot in the
  request's table becomes a hole, block 0, which no kernel reads: they start at the window);
- a latent (multi-head latent attention, DeepSeek's MLA) keeps every token like full attention,
  but one compressed row per token instead of K and V per head: its own group, whose tensors
  have the latent's width (`LatentAttentionSpec`).

Recurrent layers (Gated DeltaNet, Mamba, short convolutions) keep no KV: each request has a
fixed-size state instead (its convolution's last inputs and its recurrent matrix, in every such
layer). Those layers form the **state group**, whose one page is a request's whole state: a
**slot** of the `StatePool`, an index into every recurrent layer's state tensors
(`[num_slots, ...]`). A request holds one slot from its first scheduled step to its end (or its
preemption); allocation takes the slot and the blocks together, all or nothing. A state cannot
be rebuilt from blocks or rolled back, so a model with a state group takes no cached prefix (the
engine turns prefix caching off for it and says why) and refuses roll-back; a beam forks its
parent's state by copying the slot (`StateCopy`).

All groups draw on **one block pool**. To make a block the same number of bytes whatever group
holds it, groups have the same number of layers, `layers_per_page` (S): a block id names one
`block_size`-token page in S layer tensors, and layer `l` lives in tensor `slot_of_layer[l]`
(`plan_cache_groups`). A block is held by one group at a time, so layers of different groups
may share a tensor without ever touching the same memory. With one kind of layer there is one
group of every layer, exactly the cache of a model without groups.

Prefix caching with groups: a full block is keyed by the chained digest of its tokens (the same
digests for every group) and its group. A new request starts after the longest prefix every group
can serve: a full-attention group needs every block of the prefix, a sliding-window group only the
blocks inside the window of the prefix's end.

An owner is any hashable object: the scheduler's are the requests themselves (identity, so no
request id a client chooses can reach another request's blocks).

Nothing but this module edits the pool's reference counts: the scheduler asks it to take a cached
prefix, allocate, cache full blocks, release what fell out of a window, free, roll back; beam
search asks it to hand a finished beam's blocks to the beams that extend it (`fork`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from .kv_cache import BlockPool, StateCopy, block_hash

HOLE = 0  # a released block's place in a table: block 0 is always finite memory, never read
NO_SLOT = 0  # state slot 0 is never handed out: padded rows of captured steps write into it


# -- what a layer keeps -------------------------------------------------------------------------


@dataclass(frozen=True)
class FullAttentionSpec:
    """Keys and values of every token."""

    def first_needed_block(self, num_computed: int, block_size: int) -> int:
        return 0

    def describe(self) -> str:
        return "full attention"


@dataclass(frozen=True)
class SlidingWindowSpec:
    """Keys and values of the last `window` tokens: the query at position p sees p - W < j <= p."""

    window: int

    def first_needed_block(self, num_computed: int, block_size: int) -> int:
        """The first block the next query (at position `num_computed`) can see."""
        return max(0, num_computed - self.window + 1) // block_size

    def describe(self) -> str:
        return f"sliding window {self.window}"


@dataclass(frozen=True)
class LatentAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one row of `width` values per token (the compressed KV
    latent and the shared rotary key), every token kept, as full attention keeps them (so it
    is a FullAttentionSpec to every rule about which blocks a group holds); a kind of its own,
    so its layers form their own groups, whose tensors are `width` wide."""

    width: int

    def describe(self) -> str:
        return f"latent attention ({self.width} values a token)"


CacheSpec = FullAttentionSpec | SlidingWindowSpec


def layer_cache_specs(
    windows: Sequence[int | None],
    max_model_len: int,
    attention: Sequence[bool] | None = None,
    latent: Sequence[int | None] | None = None,
) -> list[CacheSpec | None]:
    """Each layer's spec from its sliding window (None: full attention). A window that covers the
    longest sequence keeps everything, so it is full attention for the cache. `attention`: per
    layer, whether it attends at all (None where it does not: it keeps no KV). `latent`: per
    layer, the width of its latent row when it is a latent-attention layer (else None)."""
    specs: list[CacheSpec | None] = [
        FullAttentionSpec() if w is None or w >= max_model_len else SlidingWindowSpec(int(w))
        for w in windows
    ]
    if latent is not None:
        specs = [s if w is None else LatentAttentionSpec(int(w)) for s, w in zip(specs, latent)]
    if attention is not None:
        specs = [s if a else None for s, a in zip(specs, attention)]
    return specs


@dataclass(frozen=True)
class ChunkedLocalSpec:
    """Chunked local attention (Llama 4): the sequence is cut into chunks of `chunk` tokens and
    the query at position p sees only the keys of its own chunk, p - p % chunk <= j <= p. A new
    chunk sees nothing before it, so every block before the current chunk can go back to the
    pool, as a sliding window's blocks do; at most `chunk` - 1 earlier tokens are ever needed."""

    chunk: int

    def first_needed_block(self, num_computed: int, block_size: int) -> int:
        """The first block the next query (at position `num_computed`) can see: its chunk's."""
        return (num_computed - num_computed % self.chunk) // block_size

    def describe(self) -> str:
        return f"chunked local {self.chunk}"


def with_chunks(specs: Sequence, chunks: Sequence[int | None] | None, max_model_len: int) -> list:
    """`specs` with the layers of a local attention chunk (`chunks[i]`, None: none) keeping a
    `ChunkedLocalSpec`; a chunk that covers the longest sequence keeps everything."""
    if chunks is None:
        return list(specs)
    return [
        ChunkedLocalSpec(int(c)) if s is not None and c is not None and c < max_model_len else s
        for s, c in zip(specs, chunks)
    ]


# -- groups -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheGroup:
    spec: CacheSpec
    layers: tuple[int, ...]


@dataclass(frozen=True)
class CacheLayout:
    groups: tuple[CacheGroup, ...]
    layers_per_page: int  # S: layer tensors a block spans
    group_of_layer: tuple[int, ...]
    slot_of_layer: tuple[int, ...]  # which of the S tensors holds the layer
    state_layers: tuple[int, ...] = ()  # the state group: layers keeping a recurrent state

    @property
    def num_groups(self) -> int:
        """Block groups (the state group is not one: it holds slots, not blocks)."""
        return len(self.groups)

    @property
    def has_state(self) -> bool:
        return bool(self.state_layers)

    def per_layer(self, per_group: list):
        """From one value per group (each group's attention metadata) to what the model's
        forward takes: the one value, or the list of each layer's group's (a layer without KV
        takes group 0's, or the one value of a model without block groups)."""
        if len(per_group) == 1:
            return per_group[0]
        return [per_group[g] for g in self.group_of_layer]

    def describe(self) -> str:
        state = f"{len(self.state_layers)} layers recurrent state" if self.state_layers else ""
        if self.num_groups == 0:
            return state
        if self.num_groups == 1:
            g = self.groups[0]
            kind = g.spec.describe()
            return f"{len(g.layers)} layers {kind}, {state}" if state else kind
        kinds: dict[str, int] = {}
        for g in self.groups:
            kinds[g.spec.describe()] = kinds.get(g.spec.describe(), 0) + len(g.layers)
        parts = ", ".join(
            [f"{n} layers {k}" for k, n in kinds.items()] + ([state] if state else [])
        )
        return f"{self.num_groups} groups of {self.layers_per_page} layers ({parts})"


def plan_cache_groups(
    specs: Sequence[CacheSpec | None],
    max_padding: float = 0.1,
    state_layers: Sequence[int] = (),
) -> CacheLayout:
    """Groups the layers that keep keys and values by spec, `S` layers a group (a layer whose
    spec is None keeps none). S is the largest size, up to the smallest kind's layer count,
    whose padding (tensor slots a group's blocks leave unused, when a kind's count is not a
    multiple of S) stays within `max_padding` of the layers; S = 1 never pads. A larger S means
    fewer groups, so fewer block tables to build each step. `state_layers`: the layers that keep
    a recurrent state (the state group; a layer may keep both)."""
    kinds: dict[CacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        if spec is not None:
            kinds.setdefault(spec, []).append(i)
    if not kinds and not state_layers:
        raise ValueError("a model without layers has no cache")
    total = sum(len(v) for v in kinds.values())
    if not kinds:  # only recurrent layers (Mamba-2): no block groups at all
        n = len(specs)
        return CacheLayout((), 1, (0,) * n, (0,) * n, tuple(state_layers))
    size = 1
    for s in range(min(len(v) for v in kinds.values()), 0, -1):
        padded = sum(math.ceil(len(v) / s) * s for v in kinds.values())
        if padded - total <= max_padding * total:
            size = s
            break
    groups = []
    group_of = [0] * len(
        specs
    )  # a layer without KV reads group 0's metadata (only the shared part)
    slot_of = [0] * len(specs)
    for spec, layers in kinds.items():
        for start in range(0, len(layers), size):
            members = tuple(layers[start : start + size])
            for slot, layer in enumerate(members):
                group_of[layer] = len(groups)
                slot_of[layer] = slot
            groups.append(CacheGroup(spec, members))
    return CacheLayout(tuple(groups), size, tuple(group_of), tuple(slot_of), tuple(state_layers))


# -- the state pool -----------------------------------------------------------------------------


class StatePool:
    """The recurrent-state slots 1 .. num_slots - 1 (slot 0 is scratch), the last freed first.

    A free slot may hold a cached prefix's state (prefix caching, `cache`): like a cached KV
    block it counts as free, and `allocate` takes the least recently used one when no slot is
    free otherwise."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(
                f"a state pool needs at least 2 slots (one is scratch), got {num_slots}"
            )
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))  # a stack: pop() gives the lowest
        # digest of a prefix's last block -> the slot holding the state after that prefix,
        # least recently used first
        self.cached: OrderedDict[bytes, int] = OrderedDict()

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self.cached)

    def allocate(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self.cached:
            return self.cached.popitem(last=False)[1]
        return None

    def free(self, slot: int) -> None:
        assert 0 < slot < self.num_slots and not self.is_free(slot), (
            f"state slot {slot} freed twice"
        )
        self._free.append(slot)

    def is_free(self, slot: int) -> bool:
        return slot in self._free or slot in self.cached.values()

    def lookup(self, digest: bytes) -> int | None:
        """The slot holding the state cached under `digest` (None: none), made the most
        recently used."""
        slot = self.cached.get(digest)
        if slot is not None:
            self.cached.move_to_end(digest)
        return slot

    def cache(self, digest: bytes) -> int | None:
        """A slot to keep the state of the prefix `digest` names in (None: already kept, or no
        slot free); the caller copies the state into it."""
        if digest in self.cached:
            self.cached.move_to_end(digest)
            return None
        slot = self.allocate()
        if slot is not None:
            self.cached[digest] = slot
        return slot


# -- the manager --------------------------------------------------------------------------------


@dataclass
class HeldBlocks:
    """One owner's blocks: per group a table (block ids; HOLE where released) and how many of its
    leading entries are released; the prefix digests of its full, computed blocks; and its state
    slot (NO_SLOT: none, or a model without recurrent layers)."""

    tables: list[list[int]]
    released: list[int]
    hashes: list[bytes] = field(default_factory=list)
    state: int = NO_SLOT
    # A copy of `state` taken before a speculative verification step (`snapshot_state`), and
    # the tokens computed when it was taken: a rollback goes back to it (NO_SLOT: none).
    snapshot: int = NO_SLOT
    snapshot_tokens: int = 0
    # Its state went back to a snapshot in this step (set by rollback, cleared when the step's
    # blocks are keyed): no prefix state is cached from it then (cache_full_blocks).
    restored: bool = False


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        layout: CacheLayout,
        block_size: int,
        state_pool: StatePool | None = None,
    ) -> None:
        if layout.has_state and state_pool is None:
            raise ValueError("a layout with recurrent layers needs a state pool")
        self.pool = pool
        self.layout = layout
        self.block_size = block_size
        self.specs = [g.spec for g in layout.groups]
        self.state_pool = state_pool if layout.has_state else None
        self._held: dict[Hashable, HeldBlocks] = {}
        # State copies the manager decided on outside a step's update (a cached prefix's state
        # into its new owner's slot): the scheduler takes them (take_copies).
        self._copies: list[tuple[int, int]] = []

    # -- looking --------------------------------------------------------------------------------

    def holds(self, owner: Hashable) -> bool:
        return owner in self._held

    def block_tables(self, owner: Hashable) -> list[list[int]]:
        """Per group, the owner's table (HOLE where a block was released)."""
        held = self._held.get(owner)
        if held is None:
            return [[] for _ in self.specs]
        return held.tables

    def state_slot(self, owner: Hashable) -> int:
        """The owner's state slot (NO_SLOT when it holds none)."""
        held = self._held.get(owner)
        return NO_SLOT if held is None else held.state

    def num_held(self, owner: Hashable, group: int | None = None) -> int:
        """Blocks the owner holds (in one group, or in all)."""
        held = self._held.get(owner)
        if held is None:
            return 0
        groups = range(len(self.specs)) if group is None else (group,)
        return sum(len(held.tables[g]) - held.released[g] for g in groups)

    def owners(self) -> list[Hashable]:
        return list(self._held)

    def _new(self) -> HeldBlocks:
        n = len(self.specs)
        return HeldBlocks([[] for _ in range(n)], [0] * n)

    def _key(self, group: int, digest: bytes) -> tuple[int, bytes]:
        return (group, digest)

    def take_copies(self) -> list[tuple[int, int]]:
        """The state copies decided outside a step's update, to run before the next forward."""
        copies, self._copies = self._copies, []
        return copies

    # -- a new request's cached prefix ----------------------------------------------------------

    def take_cached_prefix(
        self,
        owner: Hashable,
        tokens: Sequence[int],
        max_blocks: int,
        salt: bytes | Callable[[int], bytes] = b"",
    ) -> int:
        """Takes the blocks of the longest prefix of `tokens` (at most `max_blocks` blocks) every
        group can serve from the prefix cache; returns the number of tokens they hold (0 when
        none). The owner must hold nothing yet."""
        assert owner not in self._held, f"{owner} already holds blocks"
        pool, bs = self.pool, self.block_size
        if not pool.enable_prefix_caching or max_blocks <= 0:
            return 0
        full_groups = [g for g, s in enumerate(self.specs) if isinstance(s, FullAttentionSpec)]
        digests: list[bytes] = []
        found: list[list[int | None]] = [[] for _ in self.specs]
        parent = None
        for i in range(max_blocks):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            parent = block_hash(parent, chunk, salt(i) if callable(salt) else salt)
            digests.append(parent)
            missed = False
            for g in range(len(self.specs)):
                block = pool.cached_block(self._key(g, parent), chunk)
                found[g].append(block)
                missed |= block is None and g in full_groups
            if missed:  # a full-attention group's prefix ends here: no longer prefix can serve
                break
        pool.queries += len(digests)
        length = len(digests)
        for g in full_groups:
            run = next((i for i, b in enumerate(found[g]) if b is None), len(found[g]))
            length = min(length, run)
        states = self.state_pool  # with recurrent layers, the state after the prefix too
        while length > 0 and (
            not self._serves(found, length)
            or (states is not None and digests[length - 1] not in states.cached)
        ):
            length -= 1
        if length == 0:
            return 0
        held = self._new()
        if states is not None:
            cached = states.lookup(digests[length - 1])
            # (if this takes the cached slot itself, the least recently used, it holds the
            # state already: the copy is onto itself)
            slot = states.allocate()
            if slot is None:
                return 0
            held.state = slot
            self._copies.append(StateCopy(cached, slot))
        for g, spec in enumerate(self.specs):
            first = spec.first_needed_block(length * bs, bs)
            blocks = list(found[g][first:length])
            pool.take(blocks)
            held.tables[g] = [HOLE] * first + blocks
            held.released[g] = first
        held.hashes = digests[:length]
        self._held[owner] = held
        pool.hits += length
        return length * bs

    def _serves(self, found: list[list[int | None]], length: int) -> bool:
        """Whether every group has the blocks a prefix of `length` blocks needs."""
        for g, spec in enumerate(self.specs):
            first = spec.first_needed_block(length * self.block_size, self.block_size)
            if any(b is None for b in found[g][first:length]):
                return False
        return True

    # -- growing and shrinking ------------------------------------------------------------------

    def num_new_blocks(self, owner: Hashable, num_tokens: int) -> int:
        """Blocks a grant up to `num_tokens` tokens needs beyond what the owner's tables cover
        (a released block's hole counts as covered: the window has passed it)."""
        held = self._held.get(owner)
        need = 0
        target = math.ceil(num_tokens / self.block_size)
        for g in range(len(self.specs)):
            have = 0 if held is None else len(held.tables[g])
            need += max(0, target - have)
        return need

    def allocate(self, owner: Hashable, num_computed: int, num_tokens: int) -> bool:
        """Makes the owner hold blocks for its first `num_tokens` tokens in every group (those
        a window has passed excepted), and a state slot when the model has recurrent layers;
        all or nothing. False when the pool (or the state pool) is short."""
        self.release_out_of_window(owner, num_computed)
        held = self._held.get(owner)
        slot = NO_SLOT
        if self.state_pool is not None and (held is None or held.state == NO_SLOT):
            slot = self.state_pool.allocate()
            if slot is None:
                return False
        need = self.num_new_blocks(owner, num_tokens)
        new = self.pool.allocate(need) if need else []
        if new is None:
            if slot != NO_SLOT:
                self.state_pool.free(slot)
            return False
        if not new and slot == NO_SLOT:
            return True
        if held is None:
            held = self._held[owner] = self._new()
        if slot != NO_SLOT:
            held.state = slot
        target = math.ceil(num_tokens / self.block_size)
        for table in held.tables:
            grow = max(0, target - len(table))
            table.extend(new[:grow])
            del new[:grow]
        return True

    def release_out_of_window(self, owner: Hashable, num_computed: int) -> int:
        """Frees, in each sliding-window group, the blocks no query from position
        `num_computed` on can see. Returns how many were freed."""
        held = self._held.get(owner)
        if held is None:
            return 0
        freed = 0
        for g, spec in enumerate(self.specs):
            first = min(spec.first_needed_block(num_computed, self.block_size), len(held.tables[g]))
            start = held.released[g]
            if first > start:
                table = held.tables[g]
                self.pool.free(table[start:first])
                table[start:first] = [HOLE] * (first - start)
                held.released[g] = first
                freed += first - start
        return freed

    def cache_full_blocks(
        self,
        owner: Hashable,
        num_computed: int,
        token_slice: Callable[[int, int], Sequence[int]],
        salt: bytes | Callable[[int], bytes] = b"",
    ) -> None:
        """Keys each block that has just become full and computed, in every group that still
        holds it, so later requests can take it. `salt`: bytes for every block, or block
        index -> bytes (a prompt's images key the blocks they overlap)."""
        held = self._held.get(owner)
        if held is None or not self.pool.enable_prefix_caching:
            return
        bs = self.block_size
        full = num_computed // bs
        parent = held.hashes[-1] if held.hashes else None
        for i in range(len(held.hashes), full):
            tokens = token_slice(i * bs, (i + 1) * bs)
            parent = block_hash(parent, tokens, salt(i) if callable(salt) else salt)
            held.hashes.append(parent)
            for g, table in enumerate(held.tables):
                if i >= held.released[g] and i < len(table):
                    self.pool.register(table[i], self._key(g, parent), tokens)
        if self.state_pool is not None:
            self._cache_state(held, num_computed)

    def _cache_state(self, held: HeldBlocks, num_computed: int) -> None:
        """With recurrent layers: when the owner's computed tokens end on a block boundary
        after a step, its state is that of the prefix of whole blocks: a copy goes into a slot
        of its own under the last block's digest (a free slot, else the least recently used
        cached state's). Not after a rollback in this step (the state is being restored) or
        without a state."""
        restored, held.restored = held.restored, False
        if restored or held.state == NO_SLOT or num_computed == 0:
            return
        if num_computed % self.block_size or len(held.hashes) != num_computed // self.block_size:
            return
        slot = self.state_pool.cache(held.hashes[-1])
        if slot is not None:
            self._copies.append(StateCopy(held.state, slot))

    def free(self, owner: Hashable) -> None:
        """Gives back every block the owner holds (full ones stay cached until evicted)."""
        held = self._held.pop(owner, None)
        if held is None:
            return
        for g, table in enumerate(held.tables):
            self.pool.free(table[held.released[g] :])
        if held.state != NO_SLOT:
            self.state_pool.free(held.state)
        if held.snapshot != NO_SLOT:
            self.state_pool.free(held.snapshot)

    # -- recurrent state around a speculative step ------------------------------------------------

    def snapshot_state(self, owner: Hashable, num_computed: int) -> StateCopy | None:
        """Before a step that verifies drafts on a model with recurrent layers: a spare slot
        takes a copy of the owner's state (the returned pair, to copy before the step's
        forward), so that a rollback can go back to `num_computed` tokens. None: no spare slot
        free (the owner then decodes without drafts), or no state to copy."""
        held = self._held.get(owner)
        if self.state_pool is None or held is None or held.state == NO_SLOT:
            return None
        if held.snapshot == NO_SLOT:
            slot = self.state_pool.allocate()
            if slot is None:
                return None
            held.snapshot = slot
        held.snapshot_tokens = num_computed
        return StateCopy(held.state, held.snapshot)

    def drop_snapshot(self, owner: Hashable) -> None:
        """The owner's snapshot is not needed (its drafts were all kept): its slot goes back."""
        held = self._held.get(owner)
        if held is not None and held.snapshot != NO_SLOT:
            self.state_pool.free(held.snapshot)
            held.snapshot = NO_SLOT

    def rollback(self, owner: Hashable, num_tokens: int) -> tuple[int, list[tuple[int, int]]]:
        """Forgets every token from `num_tokens` on: blocks that held only such tokens are freed,
        digests of blocks no longer full are dropped. A kept, partly filled last block that the
        prefix cache knows under its old tokens is taken out of the cache, so no one reads the
        tokens written over it; if another owner holds it too, this owner writes into a copy
        (returned as a (src, dst) pair to copy), or, with no block free for one, lets it go and
        computes its tokens again. Returns the tokens still computed and the copies. Rolling
        back past what a window has released is refused (ValueError).

        With recurrent layers the state cannot be rolled back part of the way: the owner goes
        back to its snapshot (`snapshot_state`) at once, its KV as far, its state copied back
        from the snapshot (a `StateCopy` among the returned pairs), and the tokens after it are
        computed again; without a snapshot, ValueError."""
        held = self._held.get(owner)
        if held is None:
            return 0, []
        restore: list[tuple[int, int]] = []
        if self.state_pool is not None:
            if held.snapshot == NO_SLOT or num_tokens < held.snapshot_tokens:
                raise ValueError(
                    f"cannot roll {owner} back to {num_tokens} tokens: a recurrent state goes "
                    "back only to its snapshot"
                )
            num_tokens = held.snapshot_tokens
            restore.append(StateCopy(held.snapshot, held.state))
            held.restored = True
            # Freed now: a copy into it taken later reads after this copy (all of a batch of
            # copies read their sources before any writes; kv_cache.copy_blocks).
            self.state_pool.free(held.snapshot)
            held.snapshot = NO_SLOT
        bs = self.block_size
        for g, spec in enumerate(self.specs):
            if spec.first_needed_block(num_tokens, bs) < held.released[g]:
                raise ValueError(
                    f"cannot roll {owner} back to {num_tokens} tokens: "
                    "its window has released blocks the next query would see"
                )
        keep = math.ceil(num_tokens / bs)
        full = num_tokens // bs
        for table in held.tables:
            if len(table) > keep:
                self.pool.free(table[keep:])
                del table[keep:]
        del held.hashes[full:]
        if full == keep:
            return num_tokens, restore
        shared = [g for g, t in enumerate(held.tables) if not self.pool.forget(t[keep - 1])]
        new = self.pool.allocate(len(shared)) if shared else []
        if new is None:  # no room for copies: the partial block is computed again
            if restore:  # (never: the snapshot's partial block was partly filled when it was
                # taken, so never keyed in the prefix cache nor shared)
                raise ValueError(f"cannot roll {owner} back: its last block is shared")
            for table in held.tables:
                self.pool.free(table[keep - 1 :])
                del table[keep - 1 :]
            return full * bs, []
        copies = restore
        for g, block in zip(shared, new):
            table = held.tables[g]
            copies.append((table[keep - 1], block))
            self.pool.free([table[keep - 1]])
            table[keep - 1] = block
        return num_tokens, copies

    # -- beam search ----------------------------------------------------------------------------

    def transfer(self, src: Hashable, dst: Hashable) -> None:
        """The owner `dst` takes over every block `src` holds."""
        held = self._held.pop(src, None)
        if held is not None:
            assert dst not in self._held, f"{dst} already holds blocks"
            self._held[dst] = held

    def fork(
        self, src: Hashable, dst: Hashable, num_computed: int
    ) -> tuple[int, list[tuple[int, int]]]:
        """`dst` shares `src`'s full blocks and gets a copy of its last, partly filled one (in
        every group: copy-on-write done at once, as either is about to write into it), and a
        copy of its state slot with recurrent layers (a `StateCopy` among the pairs). Returns
        the tokens `dst` now has computed and the (src, dst) pairs to copy; without room for the
        copies, `dst` shares the full blocks only and computes the rest again (with recurrent
        layers, whose state is at `num_computed` only, it then takes nothing and computes all
        again)."""
        held = self._held.get(src)
        if held is None:
            return 0, []
        bs = self.block_size
        full = num_computed // bs
        partial = num_computed > full * bs
        child = self._new()
        child.hashes = list(held.hashes[:full])
        new = self.pool.allocate(len(self.specs)) if partial and self.specs else None
        if self.state_pool is not None:
            slot = self.state_pool.allocate() if held.state != NO_SLOT else None
            if slot is None or (partial and self.specs and new is None):
                if slot is not None:
                    self.state_pool.free(slot)
                if new is not None:
                    self.pool.free(new)
                return 0, []
            child.state = slot
        copies: list[tuple[int, int]] = []
        for g, table in enumerate(held.tables):
            r = min(held.released[g], full)
            shared = table[r:full]
            self.pool.share(shared)
            child.tables[g] = [HOLE] * r + shared
            child.released[g] = r
            if new is not None:
                copies.append((table[full], new[g]))
                child.tables[g].append(new[g])
        self._held[dst] = child
        if child.state != NO_SLOT:
            copies.append(StateCopy(held.state, child.state))
            return num_computed, copies
        return (num_computed if new is not None else full * bs), copies

    # -- checks ---------------------------------------------------------------------------------

    def check(self) -> None:
        """Asserts the pool's books balance: each block's references are the owners holding it,
        no held block is on the free list, and every free block is unreferenced."""
        refs = [0] * self.pool.num_blocks
        for held in self._held.values():
            for g, table in enumerate(held.tables):
                assert all(b == HOLE for b in table[: held.released[g]])
                for b in table[held.released[g] :]:
                    refs[b] += 1
        for b in range(self.pool.num_blocks):
            assert self.pool.refs(b) == refs[b], (
                f"block {b}: {self.pool.refs(b)} refs, {refs[b]} owners"
            )
            assert (refs[b] == 0) == self.pool.is_free(b), f"block {b}: free list disagrees"
        if self.state_pool is not None:
            held_slots = [
                slot
                for h in self._held.values()
                for slot in (h.state, h.snapshot)
                if slot != NO_SLOT
            ]
            assert len(held_slots) == len(set(held_slots)), "a state slot has two owners"
            for slot in range(1, self.state_pool.num_slots):
                assert (slot in held_slots) != self.state_pool.is_free(slot), (
                    f"state slot {slot}: free list disagrees"
                )


def blocks_for_one_request(
    layout: CacheLayout, block_size: int, max_model_len: int, max_step_tokens: int
) -> int:
    """The most blocks one request of `max_model_len` tokens holds at once: every block in a
    full-attention group; in a sliding-window group its window (a chunked group: its chunk),
    plus the step that writes the most new tokens (they are all written before the window
    passes them)."""
    whole = math.ceil(max_model_len / block_size)
    total = 0
    for group in layout.groups:
        spec = group.spec
        local = getattr(spec, "window", None) or getattr(spec, "chunk", None)
        if isinstance(spec, (SlidingWindowSpec, ChunkedLocalSpec)):
            span = local - 1 + min(max_step_tokens, max_model_len)
            total += min(whole, math.ceil(span / block_size) + 1)
        else:
            total += whole
    return total

"""Captured decode steps: the model's forward pass of a decode-only step, for batch sizes padded
up to a few buckets, recorded once and replayed every step (CUDA graphs), so a step costs one
launch instead of the ~35 kernel launches per layer of an eager pass.

What a captured step reads lives in fixed buffers (`StaticDecodeBatch`): token ids, positions,
cache slots, block tables and sequence lengths for up to the largest bucket's rows. A step of
`n` decode rows fills the first `n` and pads the bucket's remaining rows: token 0 at position 0,
cache slot -1 (the KV write skips negative slots, so a padded row never writes the cache), one
key of block 0 to attend to (always finite memory), and its hidden state is never read (the
runner samples only the real rows). The attention metadata a capture sees is fixed too: every
row a decode, and the longest context the capture serves (`max_seq_len`), so the Triton decode
launch sizes its split-KV grid for that length; the kernel reads the real lengths from
`seq_lens` at replay, and a split with no keys left contributes nothing.

A step runs captured only when it is decode-only (every request brings one new token), fits the
largest bucket, and no request's context exceeds `max_seq_len`; anything else runs eagerly.

Two ways to "capture", one set of buffers and checks:
- `cuda`: a `torch.cuda.CUDAGraph` per bucket, largest first, sharing one memory pool;
- `replay`: the same buffers and padding with an eager forward at replay (CPU). It saves
  nothing; it is the twin that lets CPU tests exercise the bucketing, padding and self-check
  every CUDA step depends on.

Capture ends with a self-check: per bucket, a probe batch (one row short of the bucket, so
padding is exercised) with contexts of different lengths runs eagerly and replayed, and the
hidden states must agree. Any capture error or mismatch turns capture off with a warning line,
so a bad capture can never serve wrong tokens.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from .kv_cache import RecurrentState, kv_tensors
from .kv_cache_manager import CacheLayout
from .layers.attention import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

CAPTURE_LIMIT = 256  # the largest bucket, whatever max_num_seqs is (vLLM captures as many)
PROBE_MAX_CONTEXT = 2048  # the self-check's longest probe context

# A test hook: when set, applied to every replayed probe result of the self-check (so a test can
# make an engine's capture mismatch).
SELF_CHECK_HOOK: Callable[[torch.Tensor], torch.Tensor] | None = None


def capture_sizes(max_num_seqs: int, limit: int | None = None) -> list[int]:
    """The buckets: 1, 2, 4, then every multiple of 8, up to min(max_num_seqs, limit) (limit
    default: CAPTURE_LIMIT); that top itself is a bucket, so every batch the scheduler can form
    up to it has one."""
    top = max(1, min(max_num_seqs, CAPTURE_LIMIT if limit is None else limit))
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def bucket_for(rows: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds `rows`, or None past the largest."""
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None


class StaticDecodeBatch:
    """The fixed input buffers of captured steps, on the model's device."""

    def __init__(
        self,
        max_rows: int,
        max_blocks: int,
        device: torch.device,
        num_groups: int = 1,
        has_state: bool = False,
    ) -> None:
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(max_rows, dtype=i64, device=device)
        self.positions = torch.zeros(max_rows, dtype=i64, device=device)
        # Per cache group (kv_cache_manager): its slots and block tables.
        self.slot_mapping = torch.full((num_groups, max_rows), -1, dtype=i64, device=device)
        self.block_tables = torch.zeros(num_groups, max_rows, max_blocks, dtype=i32, device=device)
        self.seq_lens = torch.ones(max_rows, dtype=i32, device=device)
        self.context_lens = torch.zeros(max_rows, dtype=i32, device=device)
        self.query_start_loc = torch.arange(max_rows + 1, dtype=i32, device=device)
        # Recurrent layers: each row's state slot (padding: the scratch slot 0, started from
        # zeros, so a padded row reads nothing and what it writes is never read).
        self.state_slots = torch.zeros(max_rows, dtype=i32, device=device) if has_state else None
        self.has_initial_state = (
            torch.zeros(max_rows, dtype=torch.bool, device=device) if has_state else None
        )
        self.prompt_rows = (
            torch.zeros(max_rows, dtype=torch.bool, device=device) if has_state else None
        )

    def fill(
        self,
        size: int,
        input_ids: list[int],
        positions: list[int],
        slots: list[list[int]],  # per cache group
        seq_lens: list[int],
        block_tables: list[torch.Tensor],  # per cache group, [rows, <= max_blocks] int32, host
        state_slots: list[int] | None = None,  # per row, with recurrent layers
        prompt_rows: list[bool] | None = None,  # per row, a prompt token (default: none is)
    ) -> None:
        """Rows 0..n-1 from the step, rows n..size-1 as padding. Table columns past
        `max_blocks` are dropped: no row of a captured step (context <= the capture's longest)
        reads them, whatever else its request holds."""
        n = len(input_ids)
        if n > size or size > self.max_rows:
            raise ValueError(f"{n} rows do not fit bucket {size} (largest {self.max_rows})")
        self.input_ids[:n].copy_(torch.tensor(input_ids, dtype=torch.int64), non_blocking=True)
        self.positions[:n].copy_(torch.tensor(positions, dtype=torch.int64), non_blocking=True)
        for g, (group_slots, table) in enumerate(zip(slots, block_tables)):
            table = table[:, : self.max_blocks]
            w = table.shape[1]
            self.slot_mapping[g, :n].copy_(
                torch.tensor(group_slots, dtype=torch.int64), non_blocking=True
            )
            self.block_tables[g, :n, :w].copy_(table, non_blocking=True)
            self.block_tables[g, :n, w:].zero_()
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.seq_lens[:n].copy_(lens, non_blocking=True)
        self.context_lens[:n].copy_(lens - 1, non_blocking=True)
        if self.state_slots is not None:
            self.state_slots[:n].copy_(torch.tensor(state_slots, dtype=torch.int32))
            self.has_initial_state[:n].copy_(lens > 1)
            self.prompt_rows[:n].copy_(torch.tensor(prompt_rows or [False] * n))
        self.pad(n, size)

    def pad(self, start: int, end: int) -> None:
        """Rows start..end-1 as padding: token 0 at position 0, no cache write, one key of
        block 0."""
        if start >= end:
            return
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[:, start:end].fill_(-1)
        self.block_tables[:, start:end].zero_()
        self.seq_lens[start:end].fill_(1)
        self.context_lens[start:end].zero_()
        if self.state_slots is not None:
            self.state_slots[start:end].zero_()
            self.has_initial_state[start:end].fill_(False)
            self.prompt_rows[start:end].fill_(False)

    def metadata(
        self, size: int, seq_lens_host: list[int], block_size: int
    ) -> list[AttentionMetadata]:
        """Attention metadata viewing the first `size` rows, one per cache group: all decodes.
        `seq_lens_host` is what host-side choices see (a capture's: its longest context on
        every row). A model of recurrent layers alone has one (unread) group."""
        groups = self.slot_mapping.shape[0]
        metas = [
            AttentionMetadata(
                query_start_loc=self.query_start_loc[: size + 1],
                seq_lens=self.seq_lens[:size],
                context_lens=self.context_lens[:size],
                block_tables=self.block_tables[g, :size],
                slot_mapping=self.slot_mapping[g, :size],
                num_decodes=size,
                max_query_len=1,
                max_seq_len=max(seq_lens_host),
                query_lens_host=[1] * size,
                seq_lens_host=list(seq_lens_host),
                block_size=block_size,
                state_slots=None if self.state_slots is None else self.state_slots[:size],
                has_initial_state=(
                    None if self.has_initial_state is None else self.has_initial_state[:size]
                ),
                prompt_rows=None if self.prompt_rows is None else self.prompt_rows[:size],
            )
            for g in range(groups)
        ]
        return metas


class CapturedDecode:
    """Decode buckets captured (`mode="cuda"`) or replayed eagerly on the same buffers
    (`mode="replay"`, the CPU twin); see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        block_size: int,
        device: torch.device,
        max_num_seqs: int,
        max_seq_len: int,
        mode: str = "cuda",
        *,
        layout: CacheLayout,
    ) -> None:
        if mode not in ("cuda", "replay"):
            raise ValueError(f"capture mode {mode!r}: allowed cuda, replay")
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.mode = mode
        self.max_seq_len = max_seq_len
        self.sizes = capture_sizes(max_num_seqs)
        max_blocks = -(-max_seq_len // block_size)
        self.layout = layout  # the cache groups, each with its slots and block tables
        self.static = StaticDecodeBatch(
            self.sizes[-1], max_blocks, device, max(layout.num_groups, 1), layout.has_state
        )
        # bucket -> (graph, its output buffer, the metadata it was captured with)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, list]] = {}
        self.enabled = False
        self.capture_seconds = 0.0
        self.replays = 0  # steps served captured (tests, stats)

    # -- start -----------------------------------------------------------------------------------

    def capture(self) -> bool:
        """Captures every bucket, then runs the self-check; True if captured steps are on."""
        t0 = time.perf_counter()
        try:
            if self.mode == "cuda":
                self._capture_cuda()
            self._self_check()
        except Exception as exc:  # a capture must never stop the engine: eager is always right
            self._turn_off(f"{type(exc).__name__}: {exc}")
            return False
        finally:
            self.capture_seconds = time.perf_counter() - t0
        if not self.enabled:
            return False
        logger.info(
            "decode steps captured (%s) for batch sizes %s, contexts up to %d tokens, in %.1f s; "
            "self-check passed",
            "CUDA graphs" if self.mode == "cuda" else "eager replay",
            _sizes_text(self.sizes),
            self.max_seq_len,
            self.capture_seconds,
        )
        return True

    def _turn_off(self, reason: str) -> None:
        self.enabled = False
        self.graphs.clear()
        logger.warning("decode capture turned off, every step runs eagerly: %s", reason)

    @torch.inference_mode()
    def _capture_cuda(self) -> None:
        s = self.static
        s.pad(0, s.max_rows)  # captures write no cache slot and read block 0 only
        pool = None
        for size in reversed(self.sizes):
            metas = s.metadata(size, [self.max_seq_len] * size, self.block_size)
            meta = self._prepare(metas)
            ids, pos = s.input_ids[:size], s.positions[:size]
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up: Triton compiles outside the capture
                for _ in range(2):
                    self.model(ids, pos, self.kv_caches, meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(ids, pos, self.kv_caches, meta)
            pool = graph.pool()
            # The metadata stays alive with its graph: the backend's per-step plans cached in it
            # during the warm-up were made outside the graph's pool, and the graph reads them.
            self.graphs[size] = (graph, out, metas)
        torch.cuda.synchronize(self.device)

    # -- steps -----------------------------------------------------------------------------------

    def bucket(self, rows: int, max_seq_len: int) -> int | None:
        """The bucket a decode-only step of `rows` rows runs in, or None (eager)."""
        if not self.enabled or max_seq_len > self.max_seq_len:
            return None
        return bucket_for(rows, self.sizes)

    def run(
        self,
        size: int,
        input_ids: list[int],
        positions: list[int],
        slots: list[list[int]],
        seq_lens: list[int],
        block_tables: list[torch.Tensor],
        state_slots: list[int] | None = None,
        prompt_rows: list[bool] | None = None,
    ) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step's n rows, through bucket `size`. The
        result is a view of the capture's output buffer: valid until the next step."""
        n = len(input_ids)
        self.static.fill(
            size, input_ids, positions, slots, seq_lens, block_tables, state_slots, prompt_rows
        )
        self.replays += 1
        return self._replay(size, seq_lens + [1] * (size - n))[:n]

    def _replay(self, size: int, seq_lens_host: list[int]) -> torch.Tensor:
        if self.mode == "cuda":
            graph, out, _ = self.graphs[size]
            graph.replay()
            return out
        # The twin: the same buffers and metadata shape, run now (host lengths are the step's,
        # which the torch backend sizes its gather by).
        meta = self._prepare(self.static.metadata(size, seq_lens_host, self.block_size))
        s = self.static
        return self.model(s.input_ids[:size], s.positions[:size], self.kv_caches, meta)

    def _prepare(self, metas: list[AttentionMetadata]):
        """Each group's metadata prepared by the backend; what the model's forward takes."""
        for meta in metas:
            self.backend.prepare(meta)
        return self.layout.per_layer(metas)

    # -- the self-check ----------------------------------------------------------------------------

    @torch.inference_mode()
    def _self_check(self) -> None:
        """Each bucket against the eager forward on a probe batch; sets `enabled`."""
        kv = kv_tensors(self.kv_caches)
        states = [c for c in self.kv_caches if isinstance(c, RecurrentState)]
        bs = self.block_size
        groups = max(self.layout.num_groups, 1)
        longest = max(1, min(self.max_seq_len, PROBE_MAX_CONTEXT))
        if kv:
            longest = min(longest, kv[0].shape[1] // groups * bs)
        probe_blocks = -(-longest // bs)
        # The probe's keys: finite values in the blocks it reads (an unused cache may hold
        # anything, NaN included). Nothing is served yet, so the blocks are free to scribble on.
        g = torch.Generator(device="cpu").manual_seed(0)
        for layer_cache in kv:
            junk = torch.randn(
                (layer_cache.shape[0], groups * probe_blocks, *layer_cache.shape[2:]),
                generator=g,
                dtype=torch.float32,
            )
            layer_cache[:, : groups * probe_blocks].copy_((junk * 0.5).to(layer_cache.dtype))
        # Recurrent states: finite values in every slot; rows past the slots there are start
        # from zeros in the scratch slot 0 (as padded rows do).
        num_slots = states[0][0].shape[0] if states else 0
        for layer in states:
            for t in layer.tensors:
                junk = torch.randn(t.shape, generator=g, dtype=torch.float32) * 0.1
                t.copy_(junk.to(t.dtype))
        # Each cache group reads blocks of its own, as in serving (a block is one group's at a
        # time): layers of different groups share tensors, and where a layer's entries are a
        # view of another shape (Gemma 4's head widths that do not nest), one group's writes in
        # a block would land on what another group's layers read there.
        tables_of = [
            torch.arange(probe_blocks, dtype=torch.int32) + grp * probe_blocks
            for grp in range(groups)
        ]
        vocab = self.model.embed_tokens.num_embeddings
        dtype = self.model.embed_tokens.weight.dtype
        tol = 1e-3 if dtype == torch.float32 else 3e-2
        self.enabled = True  # for `run` below; reset on any failure
        for size in self.sizes:
            n = max(1, size - 1)
            # Different lengths per row, each row's new token at its own last position; rows that
            # share a length would write one slot twice, so lengths are distinct where they fit.
            lens = [1 + (longest - 1 - (r * 131) % longest) for r in range(n)]
            state_slots = None
            if states:  # a row without a slot of its own starts a state in slot 0: its first token
                state_slots = [r + 1 if r + 1 < num_slots else 0 for r in range(n)]
                lens = [x if s else 1 for x, s in zip(lens, state_slots)]
            ids = torch.randint(0, vocab, (n,), generator=g).tolist()
            positions = [x - 1 for x in lens]
            # Rows past `longest` repeat a length: they write nothing (two writes of one slot in
            # one step would race on a GPU), reading what the others wrote.
            writes = [p not in positions[:r] for r, p in enumerate(positions)]
            width = max(-(-x // bs) for x in lens)
            slots = [
                [int(t[p // bs]) * bs + p % bs if w else -1 for p, w in zip(positions, writes)]
                for t in tables_of
            ]
            tables = [t[:width].expand(n, -1).contiguous() for t in tables_of]
            # The eager pass sees the host lengths the graph was captured with (they choose
            # the split-KV grid), so both run the same kernels on the same inputs and agree
            # to rounding whatever the dtype; the twin replays with the real lengths.
            host = lens if self.mode == "replay" else [self.max_seq_len] * n
            # Both passes advance the states in place: each starts from the same saved ones.
            saved = [[t.clone() for t in layer.tensors] for layer in states]
            expected = self._eager(ids, positions, slots, lens, tables, host, state_slots)
            for layer, kept in zip(states, saved):
                for t, k in zip(layer.tensors, kept):
                    t.copy_(k)
            got = self.run(size, ids, positions, slots, lens, tables, state_slots)
            got = got.clone()
            if SELF_CHECK_HOOK is not None:
                got = SELF_CHECK_HOOK(got)
            err = _mismatch(got, expected)
            if not err <= tol:
                self.enabled = False
                raise RuntimeError(
                    f"self-check: bucket {size} differs from the eager forward by {err:.3g} "
                    f"(tolerance {tol:g})"
                )
        self.replays = 0

    def _eager(self, ids, positions, slots, lens, tables, host_lens, state_slots) -> torch.Tensor:
        # Built without StaticDecodeBatch on purpose: the check must not share the code it checks.
        dev = self.device
        n = len(ids)
        metas = []
        for group_slots, group_table in zip(slots, tables):  # one metadata per cache group
            meta = AttentionMetadata(
                query_start_loc=torch.arange(n + 1, dtype=torch.int32).to(dev),
                seq_lens=torch.tensor(lens, dtype=torch.int32).to(dev),
                context_lens=torch.tensor([x - 1 for x in lens], dtype=torch.int32).to(dev),
                block_tables=group_table.to(dev),
                slot_mapping=torch.tensor(group_slots, dtype=torch.int64).to(dev),
                num_decodes=n,
                max_query_len=1,
                max_seq_len=max(host_lens),
                query_lens_host=[1] * n,
                seq_lens_host=list(host_lens),
                block_size=self.block_size,
            )
            if state_slots is not None:
                meta.state_slots = torch.tensor(state_slots, dtype=torch.int32).to(dev)
                meta.has_initial_state = torch.tensor([x > 1 for x in lens]).to(dev)
                meta.prompt_rows = torch.zeros(n, dtype=torch.bool, device=dev)
            self.backend.prepare(meta)
            metas.append(meta)
        ids_t = torch.tensor(ids, dtype=torch.int64).to(dev)
        pos_t = torch.tensor(positions, dtype=torch.int64).to(dev)
        return self.model(ids_t, pos_t, self.kv_caches, self.layout.per_layer(metas)).clone()


def _mismatch(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference relative to the values' scale (inf when shapes differ or a value is
    not finite)."""
    if got.shape != expected.shape or not bool(torch.isfinite(got).all()):
        return float("inf")
    scale = max(1.0, float(expected.abs().max()))
    return float((got.float() - expected.float()).abs().max()) / scale


def _sizes_text(sizes: list[int]) -> str:
    return (
        ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}..{sizes[-1]} ({len(sizes)})"
    )

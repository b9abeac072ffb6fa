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

Verification steps of a model with recurrent layers (`verify_rows` > 0: speculation is on): a
step whose requests bring up to `verify_rows` rows each (a decode; a verification, its last
token and its drafts; the kept tokens computed again after a rollback) runs in a second set of
graphs, one per bucket of rows. Attention sees every row as a decode of its own (row j of a
request attending to its keys up to its own position, as on a model without recurrent layers);
the recurrent layers get metadata of their own (`StaticDecodeBatch.recurrent_metadata`): one
entry per row of the bucket, the step's requests first, each with its rows in order from its
state slot (the multi-token form of the kernels, which launch from shapes alone), then padding
entries of one row each while rows are left and of none after, all in the scratch slot 0
started from zeros. The snapshot a rollback goes back to is copied before the step's forward,
as for an eager step. A model whose layers keep attention and a state side by side (Falcon-H1)
verifies eagerly: one layer would need both metadata at once.

Capture ends with a self-check: per bucket, a probe batch (one row short of the bucket, so
padding is exercised) with contexts of different lengths runs eagerly and replayed, and the
hidden states must agree. Any capture error or mismatch turns capture off with a warning line,
so a bad capture can never serve wrong tokens. The verification graphs have a check of their own
(a probe of requests of 1 .. `verify_rows` rows, one row short of the bucket); it failing turns
off the verification graphs only.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

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
# The same for the verification graphs' self-check.
VERIFY_CHECK_HOOK: Callable[[torch.Tensor], torch.Tensor] | None = None


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


@dataclass
class _Probe:
    """What the self-checks' probe steps share (`CapturedDecode._probe_caches`)."""

    states: list  # the model's RecurrentState caches
    num_slots: int  # state slots of each (0: none)
    longest: int  # the longest context a probe row reads
    tables_of: list[torch.Tensor]  # each cache group's probe blocks
    generator: torch.Generator
    vocab: int
    tol: float  # the largest mismatch allowed


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
        # Verification steps: the recurrent layers' request entries (one per row of the bucket;
        # `state_slots` and `has_initial_state` then hold the entries', not the rows').
        self.entry_start_loc = (
            torch.arange(max_rows + 1, dtype=i32, device=device) if has_state else None
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
            if state_slots is not None:  # a decode step: each row its request's
                self.state_slots[:n].copy_(torch.tensor(state_slots, dtype=torch.int32))
                self.has_initial_state[:n].copy_(lens > 1)
            self.prompt_rows[:n].copy_(torch.tensor(prompt_rows or [False] * n))
        self.pad(n, size)

    def fill_entries(
        self, size: int, query_lens: list[int], state_slots: list[int], seq_lens: list[int]
    ) -> None:
        """A verification step's request entries for the recurrent layers (after `fill` of its
        rows): request i's rows follow request i-1's from its state slot, continuing its state
        when its first row is not at position 0 (`seq_lens`: per row, as `fill` took them);
        entries past the requests are padding, one row each while rows are left, then none, in
        the scratch slot 0 from zeros."""
        r, rows = len(query_lens), sum(query_lens)
        if r > size or rows > size:
            raise ValueError(f"{r} requests of {rows} rows do not fit bucket {size}")
        bounds = [0]
        for q in query_lens:
            bounds.append(bounds[-1] + q)
        firsts = bounds[:-1]
        bounds.extend(min(rows + i, size) for i in range(1, size - r + 1))
        self.entry_start_loc[: size + 1].copy_(torch.tensor(bounds, dtype=torch.int32))
        self.state_slots[:r].copy_(torch.tensor(state_slots, dtype=torch.int32))
        self.state_slots[r:size].zero_()
        self.has_initial_state[:r].copy_(torch.tensor([seq_lens[f] > 1 for f in firsts]))
        self.has_initial_state[r:size].fill_(False)

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

    def recurrent_metadata(
        self, size: int, max_query_len: int, max_seq_len: int, block_size: int
    ) -> AttentionMetadata:
        """The recurrent layers' metadata of a verification step in bucket `size`: its `size`
        request entries (`fill_entries`), none a decode, none longer than `max_query_len` rows
        (what a kernel's grid covers), over the rows' tokens."""
        return AttentionMetadata(
            query_start_loc=self.entry_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            context_lens=self.context_lens[:size],
            block_tables=self.block_tables[0, :size],
            slot_mapping=self.slot_mapping[0, :size],
            num_decodes=0,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            block_size=block_size,
            state_slots=self.state_slots[:size],
            has_initial_state=self.has_initial_state[:size],
            prompt_rows=self.prompt_rows[:size],
        )


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
        verify_rows: int = 0,
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
        # Verification steps of a model with recurrent layers (see the module docstring): the
        # most rows a request brings (0: none captured), their buckets (every one past 1 row)
        # and graphs; `verify_off` says why there are none where asked for.
        self.verify_rows = verify_rows if layout.has_state else 0
        self.verify_off: str | None = None
        side_by_side = set(layout.state_layers) & {i for g in layout.groups for i in g.layers}
        if self.verify_rows and side_by_side:
            self.verify_off = "its layers keep attention and a recurrent state side by side"
            self.verify_rows = 0
        self.verify_sizes = [x for x in self.sizes if x > 1] if self.verify_rows > 1 else []
        self.verify_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, list]] = {}
        self.verify_enabled = False
        self.verify_replays = 0  # verification steps served captured
        self._pool = None  # the graphs' shared memory pool

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
        if self.verify_off is not None:
            logger.info("verification steps run eagerly: %s", self.verify_off)
        if self.verify_sizes:
            self._capture_verification()
        return True

    def _capture_verification(self) -> None:
        """The verification graphs and their self-check; any failure turns them off alone."""
        t0 = time.perf_counter()
        try:
            if self.mode == "cuda":
                self._capture_cuda(verify=True)
            self._self_check_verify()
        except Exception as exc:  # eager verification is always right
            self.verify_enabled = False
            self.verify_graphs.clear()
            self.verify_replays = 0
            logger.warning(
                "verification capture turned off, verification steps run eagerly: %s: %s",
                type(exc).__name__,
                exc,
            )
            return
        finally:
            self.capture_seconds += time.perf_counter() - t0
        logger.info(
            "verification steps captured for %s rows, requests of up to %d rows each; "
            "self-check passed",
            _sizes_text(self.verify_sizes),
            self.verify_rows,
        )

    def _turn_off(self, reason: str) -> None:
        self.enabled = False
        self.graphs.clear()
        logger.warning("decode capture turned off, every step runs eagerly: %s", reason)

    @torch.inference_mode()
    def _capture_cuda(self, verify: bool = False) -> None:
        s = self.static
        s.pad(0, s.max_rows)  # captures write no cache slot and read block 0 only
        pool = self._pool
        graphs = self.verify_graphs if verify else self.graphs
        for size in reversed(self.verify_sizes if verify else self.sizes):
            if verify:
                s.fill_entries(size, [], [], [])  # every entry padding: one row each
            metas = s.metadata(size, [self.max_seq_len] * size, self.block_size)
            if verify:
                metas = [metas, s.recurrent_metadata(size, self.verify_rows, self.max_seq_len,
                                                     self.block_size)]  # fmt: skip
                meta = self._verify_metas(*metas)
            else:
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
            pool = self._pool = graph.pool()
            # The metadata stays alive with its graph: the backend's per-step plans cached in it
            # during the warm-up were made outside the graph's pool, and the graph reads them.
            graphs[size] = (graph, out, metas)
        torch.cuda.synchronize(self.device)

    # -- steps -----------------------------------------------------------------------------------

    def bucket(self, rows: int, max_seq_len: int) -> int | None:
        """The bucket a decode-only step of `rows` rows runs in, or None (eager)."""
        if not self.enabled or max_seq_len > self.max_seq_len:
            return None
        return bucket_for(rows, self.sizes)

    def verify_bucket(self, rows: int, max_seq_len: int, longest_query: int) -> int | None:
        """The bucket a step of `rows` rows whose requests bring up to `longest_query` rows each
        runs in on a model with recurrent layers (the verification graphs), or None (eager)."""
        if not (self.enabled and self.verify_enabled) or longest_query > self.verify_rows:
            return None
        if max_seq_len > self.max_seq_len:
            return None
        return bucket_for(max(rows, 2), self.verify_sizes)

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
        query_lens: list[int] | None = None,
    ) -> torch.Tensor:
        """Hidden states [n, hidden] of a step's n rows, through bucket `size`: each row a decode
        (`seq_lens` and `block_tables` per row); on a model with recurrent layers, requests of
        several rows (`query_lens` per request, `state_slots` per request) run in the
        verification graphs (`verify_bucket` chose the bucket). The result is a view of the
        capture's output buffer: valid until the next step."""
        n = len(input_ids)
        verify = query_lens is not None and len(query_lens) != n and self.verify_rows > 0
        if not verify:
            self.static.fill(
                size, input_ids, positions, slots, seq_lens, block_tables, state_slots, prompt_rows
            )
            self.replays += 1
            return self._replay(size, seq_lens + [1] * (size - n))[:n]
        s = self.static
        s.fill(size, input_ids, positions, slots, seq_lens, block_tables, None, prompt_rows)
        s.fill_entries(size, query_lens, state_slots, seq_lens)
        self.verify_replays += 1
        return self._replay(size, seq_lens + [1] * (size - n), verify=True)[:n]

    def _replay(self, size: int, seq_lens_host: list[int], verify: bool = False) -> torch.Tensor:
        if self.mode == "cuda":
            graph, out, _ = (self.verify_graphs if verify else self.graphs)[size]
            graph.replay()
            return out
        # The twin: the same buffers and metadata shape, run now (host lengths are the step's,
        # which the torch backend sizes its gather by).
        s = self.static
        metas = s.metadata(size, seq_lens_host, self.block_size)
        if verify:
            own = s.recurrent_metadata(size, self.verify_rows, max(seq_lens_host), self.block_size)
            meta = self._verify_metas(metas, own)
        else:
            meta = self._prepare(metas)
        return self.model(s.input_ids[:size], s.positions[:size], self.kv_caches, meta)

    def _prepare(self, metas: list[AttentionMetadata]):
        """Each group's metadata prepared by the backend; what the model's forward takes."""
        for meta in metas:
            self.backend.prepare(meta)
        return self.layout.per_layer(metas)

    def _verify_metas(self, metas: list[AttentionMetadata], own: AttentionMetadata) -> list:
        """Per layer, a verification step's metadata: the recurrent layers' `own`, the others'
        their cache group's (prepared by the backend)."""
        for meta in metas:
            self.backend.prepare(meta)
        state = set(self.layout.state_layers)
        return [own if i in state else metas[g] for i, g in enumerate(self.layout.group_of_layer)]

    # -- the self-check ----------------------------------------------------------------------------

    def _probe_caches(self, seed: int, min_context: int = 0) -> _Probe:
        """The self-checks' common start: finite random keys in the blocks the probe reads (an
        unused cache may hold anything, NaN included; nothing is served yet, so the blocks are
        free to scribble on) and in every recurrent state slot (rows past the slots there start
        from zeros in the scratch slot 0, as padded rows do); each cache group's block table
        of its own, as in serving (a block is one group's at a time: layers of different
        groups share tensors, and where a layer's entries are a view of another shape, Gemma
        4's head widths that do not nest, one group's writes in a block would land on what
        another group's layers read there). Contexts of at most `min_context` tokens are an
        error."""
        kv = kv_tensors(self.kv_caches)
        states = [c for c in self.kv_caches if isinstance(c, RecurrentState)]
        groups = max(self.layout.num_groups, 1)
        longest = max(1, min(self.max_seq_len, PROBE_MAX_CONTEXT))
        if kv:
            longest = min(longest, kv[0].shape[1] // groups * self.block_size)
        if longest <= min_context:
            raise RuntimeError(f"contexts of {longest} tokens leave no room for a probe")
        probe_blocks = -(-longest // self.block_size)
        g = torch.Generator(device="cpu").manual_seed(seed)
        for layer_cache in kv:
            junk = torch.randn(
                (layer_cache.shape[0], groups * probe_blocks, *layer_cache.shape[2:]),
                generator=g,
                dtype=torch.float32,
            )
            layer_cache[:, : groups * probe_blocks].copy_((junk * 0.5).to(layer_cache.dtype))
        for layer in states:
            for t in layer.tensors:
                t.copy_((torch.randn(t.shape, generator=g, dtype=torch.float32) * 0.1).to(t.dtype))
        tables_of = [
            torch.arange(probe_blocks, dtype=torch.int32) + grp * probe_blocks
            for grp in range(groups)
        ]
        dtype = self.model.embed_tokens.weight.dtype
        return _Probe(
            states=states,
            num_slots=states[0][0].shape[0] if states else 0,
            longest=longest,
            tables_of=tables_of,
            generator=g,
            vocab=self.model.embed_tokens.num_embeddings,
            tol=1e-3 if dtype == torch.float32 else 3e-2,
        )

    @staticmethod
    def _check_bucket(probe: _Probe, eager, replay, hook, what: str) -> None:
        """One bucket's check: the eager forward and the captured step (or its twin) from the
        same recurrent states (both advance them in place: the second starts from a copy
        taken before the first), the captured output through `hook` (the tests' way of
        making a mismatch), equal within the probe's tolerance or a RuntimeError naming
        `what`."""
        saved = [[t.clone() for t in layer.tensors] for layer in probe.states]
        expected = eager()
        for layer, kept in zip(probe.states, saved):
            for t, k in zip(layer.tensors, kept):
                t.copy_(k)
        got = replay().clone()
        if hook is not None:
            got = hook(got)
        err = _mismatch(got, expected)
        if not err <= probe.tol:
            raise RuntimeError(
                f"self-check: {what} differs from the eager forward by {err:.3g} "
                f"(tolerance {probe.tol:g})"
            )

    @torch.inference_mode()
    def _self_check(self) -> None:
        """Each bucket against the eager forward on a probe batch; sets `enabled`."""
        probe = self._probe_caches(seed=0)
        bs, longest, g = self.block_size, probe.longest, probe.generator
        self.enabled = True  # for `run` below; the caller turns capture off on any failure
        for size in self.sizes:
            n = max(1, size - 1)
            # Different lengths per row, each row's new token at its own last position; rows that
            # share a length would write one slot twice, so lengths are distinct where they fit.
            lens = [1 + (longest - 1 - (r * 131) % longest) for r in range(n)]
            state_slots = None
            # A row without a slot of its own starts a state in slot 0 (its first token).
            if probe.states:
                state_slots = [r + 1 if r + 1 < probe.num_slots else 0 for r in range(n)]
                lens = [x if s else 1 for x, s in zip(lens, state_slots)]
            ids = torch.randint(0, probe.vocab, (n,), generator=g).tolist()
            positions = [x - 1 for x in lens]
            # Rows past `longest` repeat a length: they write nothing (two writes of one slot in
            # one step would race on a GPU), reading what the others wrote.
            writes = [p not in positions[:r] for r, p in enumerate(positions)]
            width = max(-(-x // bs) for x in lens)
            slots = [
                [int(t[p // bs]) * bs + p % bs if w else -1 for p, w in zip(positions, writes)]
                for t in probe.tables_of
            ]
            tables = [t[:width].expand(n, -1).contiguous() for t in probe.tables_of]
            # The eager pass sees the host lengths the graph was captured with (they choose
            # the split-KV grid), so both run the same kernels on the same inputs and agree
            # to rounding whatever the dtype; the twin replays with the real lengths.
            host = lens if self.mode == "replay" else [self.max_seq_len] * n
            self._check_bucket(
                probe,
                partial(self._eager, ids, positions, slots, lens, tables, host, state_slots),
                partial(self.run, size, ids, positions, slots, lens, tables, state_slots),
                SELF_CHECK_HOOK,
                f"bucket {size}",
            )
        self.replays = 0

    def _probe_requests(self, rows: int) -> list[int]:
        """Row counts of the verification probe's requests, `rows` in all: the one-row requests
        first (as the runner orders a step), then 2 .. verify_rows rows each, the longest
        first."""
        lens, left, q = [], rows, self.verify_rows
        while left:
            lens.append(min(q, left))
            left -= lens[-1]
            q = q - 1 if q > 1 else self.verify_rows
        return sorted(lens, key=lambda x: x != 1)

    @torch.inference_mode()
    def _self_check_verify(self) -> None:
        """Each verification bucket against the eager forward on a probe step; sets
        `verify_enabled`. Requests with a state slot continue a state in it (after finite
        random values) at distinct positions; those past the slots there are start from zeros
        in slot 0 at position 0, as a fresh prompt's chunk does. The twin is checked against
        the eager step as the runner makes it (every request's rows one ragged query); CUDA
        graphs against the same forward with the graph's metadata made anew, run eagerly."""
        probe = self._probe_caches(seed=1, min_context=self.verify_rows)
        bs, longest, g = self.block_size, probe.longest, probe.generator
        self.verify_enabled = True  # for `run` below; the caller turns it off on any failure
        for size in self.verify_sizes:
            query_lens = self._probe_requests(max(2, size - 1))
            state_slots = [i + 1 if i + 1 < probe.num_slots else 0 for i in range(len(query_lens))]
            # Distinct positions for the requests with a slot, from the longest context down;
            # a position written twice in one step (the fresh requests' 0.., or no room left)
            # is written by its first row only, as in the decode check.
            starts, top = [], longest
            for q, slot in zip(query_lens, state_slots):
                start = min(max(1, top - q), longest - q) if slot else 0
                starts.append(start)
                top = start if slot else top
            positions = [p for st, q in zip(starts, query_lens) for p in range(st, st + q)]
            writes = [p not in positions[:r] for r, p in enumerate(positions)]
            slots = [
                [int(t[p // bs]) * bs + p % bs if w else -1 for p, w in zip(positions, writes)]
                for t in probe.tables_of
            ]
            ends = [st + q for st, q in zip(starts, query_lens)]
            width = max(-(-x // bs) for x in ends)
            tables = [t[:width] for t in probe.tables_of]
            ids = torch.randint(0, probe.vocab, (len(positions),), generator=g).tolist()
            prompt_rows = [(r % 3) == 0 for r in range(len(positions))]
            rows_lens = [p + 1 for p in positions]
            counts = torch.tensor(query_lens)
            row_tables = [t.expand(len(query_lens), -1).repeat_interleave(counts, 0)
                          for t in tables]  # fmt: skip
            eager = partial(self._eager_verify, ids, positions, slots, query_lens, ends, tables,
                            state_slots, prompt_rows)  # fmt: skip
            replay = partial(self.run, size, ids, positions, slots, rows_lens, row_tables,
                             state_slots, prompt_rows, query_lens)  # fmt: skip
            self._check_bucket(
                probe, eager, replay, VERIFY_CHECK_HOOK, f"verification bucket {size}"
            )
        self.verify_replays = 0

    def _eager_verify(
        self, ids, positions, slots, query_lens, ends, tables, state_slots, prompt_rows
    ) -> torch.Tensor:
        """The probe's eager forward, built without StaticDecodeBatch. The twin's: one ragged
        query per request (the one-row ones as decodes), as the runner's eager step. CUDA's: the
        graph's structure (rows as decodes at the capture's host lengths, the requests' rows
        through the recurrent layers' multi-token form), so both launch the same kernels."""
        dev = self.device
        n, r = len(ids), len(query_lens)
        bounds = [0]
        for q in query_lens:
            bounds.append(bounds[-1] + q)
        i32 = dict(dtype=torch.int32, device=dev)
        slots_t = torch.tensor(state_slots, **i32)
        init = torch.tensor([e - q > 0 for e, q in zip(ends, query_lens)], device=dev)
        rows_t = torch.tensor(prompt_rows, dtype=torch.bool, device=dev)
        metas = []
        as_graph = self.mode == "cuda"
        for group_slots, table in zip(slots, tables):
            if as_graph:  # every row a decode, row j of a request at its own length
                lens = [p + 1 for p in positions]
                host = [self.max_seq_len] * n
                qsl, nd, longest_query = list(range(n + 1)), n, 1
                table = table.expand(n, -1)
            else:
                lens, host = ends, ends
                qsl, longest_query = bounds, max(query_lens)
                nd = next((i for i, q in enumerate(query_lens) if q != 1), r)
                table = table.expand(r, -1)
            lens_t = torch.tensor(lens, **i32)
            q_t = torch.tensor(qsl, **i32)
            meta = AttentionMetadata(
                query_start_loc=q_t,
                seq_lens=lens_t,
                context_lens=lens_t - (q_t[1:] - q_t[:-1]),
                block_tables=table.contiguous().to(dev),
                slot_mapping=torch.tensor(group_slots, dtype=torch.int64).to(dev),
                num_decodes=nd,
                max_query_len=longest_query,
                max_seq_len=max(host),
                query_lens_host=[b - a for a, b in zip(qsl, qsl[1:])],
                seq_lens_host=list(host),
                block_size=self.block_size,
            )
            if not as_graph:
                meta.state_slots, meta.has_initial_state, meta.prompt_rows = slots_t, init, rows_t
            self.backend.prepare(meta)
            metas.append(meta)
        if as_graph:
            own = AttentionMetadata(
                query_start_loc=torch.tensor(bounds, **i32),
                seq_lens=torch.tensor(ends, **i32),
                context_lens=torch.tensor([e - q for e, q in zip(ends, query_lens)], **i32),
                block_tables=metas[0].block_tables[:r],
                slot_mapping=metas[0].slot_mapping,
                num_decodes=0,
                max_query_len=self.verify_rows,
                max_seq_len=self.max_seq_len,
                block_size=self.block_size,
                state_slots=slots_t,
                has_initial_state=init,
                prompt_rows=rows_t,
            )
            state = set(self.layout.state_layers)
            meta = [
                own if i in state else metas[g] for i, g in enumerate(self.layout.group_of_layer)
            ]
        else:
            meta = self.layout.per_layer(metas)
        ids_t = torch.tensor(ids, dtype=torch.int64).to(dev)
        pos_t = torch.tensor(positions, dtype=torch.int64).to(dev)
        return self.model(ids_t, pos_t, self.kv_caches, meta).clone()

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

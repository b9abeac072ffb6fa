"""Turns a scheduled batch into the model's flat ragged inputs, runs the model, and returns the
logits of the tokens that will be sampled (the last token of each request that reaches the end
of what it has; a prefill chunk that stops short of it samples nothing).

Requests that asked for prompt_logprobs also get the logits of their prompt positions in the
chunk, turned into logprobs here a few hundred positions at a time (a [prompt, vocab] tensor
would be large).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .decode_capture import CapturedDecode
from .kv_cache import copy_blocks
from .kv_cache_manager import CacheLayout, KVCacheManager
from .layers.attention import AttentionBackend, AttentionMetadata
from .request import Request
from .sampling.logprobs import prompt_logprobs
from .scheduler import ScheduledBatch


@dataclass
class PromptLogprobWork:
    """Prompt positions of this step whose logits score the next prompt token."""

    requests: list[Request] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # indices into the flat token batch
    targets: list[int] = field(default_factory=list)
    k: int = 0  # the most top logprobs a request of the step asked for


@dataclass
class HostBatch:
    """A step's flat inputs on the host, before they become device tensors (or fill a captured
    step's buffers)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[list[int]]  # per cache group, each token's slot
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[torch.Tensor]  # per cache group, [requests, max blocks] int32, 0-padded
    num_decodes: int
    sample_reqs: list[Request]
    sample_idx: list[int]
    prompt_work: PromptLogprobWork
    lora_rows: list[tuple[int, int, int]] = field(default_factory=list)  # (lora id, start, n)
    state_slots: list[int] | None = None  # per request, its recurrent-state slot (hybrid models)
    prompt_rows: list[bool] | None = None  # per token, a prompt token (with state_slots)
    # KV blocks to copy (src, dst) before the forward: beam forks made since the last step,
    # when every tensor-parallel rank must copy them in its own cache.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # For the other tensor-parallel ranks: the step's adapter slots (lora id -> slot), and the
    # slots loaded since the last step ((slot, LoRARequest, local directory)).
    lora_slots: dict[int, int] = field(default_factory=dict)
    lora_loads: list[tuple] = field(default_factory=list)

    def for_peers(self) -> HostBatch:
        """What the other tensor-parallel ranks need to run the same step: no requests."""
        work = dataclasses.replace(self.prompt_work, requests=[], counts=[])
        return dataclasses.replace(self, sample_reqs=[], prompt_work=work)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        block_size: int,
        device: torch.device,
        layout: CacheLayout,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.layout = layout  # the cache groups, each with its block tables
        self.kv: KVCacheManager | None = None  # the block tables' owner (the engine's)
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.captured: CapturedDecode | None = None  # set by the engine when capture is on
        self.lora_step = None  # the model's LoRAStep, set by the engine when LoRA is on
        self.lora_slots: dict[int, int] = {}  # this step's adapter id -> slot (the engine's)
        self.lora_loads: list[tuple] = []  # slot loads for the peers (HostBatch.lora_loads)
        # Tensor parallelism: the other ranks, sent each step's inputs (parallel/workers.py).
        self.peers = None
        self._pending_copies: list[tuple[int, int]] = []

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies KV blocks (src, dst) in every layer: now, or with tensor parallelism at the
        start of the next step, on every rank (nothing writes the cache in between)."""
        if self.peers is None:
            copy_blocks(self.kv_caches, pairs)
        else:
            self._pending_copies.extend(pairs)

    def host_inputs(self, batch: ScheduledBatch) -> HostBatch:
        """The step's flat inputs as host lists, decodes first."""
        # Decodes first: the backend then finds them as one contiguous run of tokens.
        order = sorted(range(len(batch)), key=lambda i: batch.num_new_tokens[i] != 1)
        bs = self.block_size
        num_groups = self.layout.num_groups
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(num_groups)]
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
        sample_reqs: list[Request] = []
        sample_idx: list[int] = []
        prompt_work = PromptLogprobWork()
        lora_rows: list[tuple[int, int, int]] = []
        state_slots: list[int] | None = [] if self.layout.has_state else None
        prompt_rows: list[bool] | None = [] if self.layout.has_state else None
        num_decodes = 0
        for i in order:
            req, n = batch.requests[i], batch.num_new_tokens[i]
            start = req.num_computed_tokens
            end = start + n
            if n == 1:
                num_decodes += 1
            if req.needs_prompt_logprobs:
                # Position j scores prompt token j + 1; the first still missing is len(list).
                lo = max(start, len(req.out.prompt_logprobs) - 1)
                hi = min(end, req.num_prompt_tokens - 1)
                if lo < hi:
                    base = len(input_ids) - start
                    prompt_work.requests.append(req)
                    prompt_work.counts.append(hi - lo)
                    prompt_work.positions.extend(range(base + lo, base + hi))
                    prompt_work.targets.extend(req.prompt_token_ids[lo + 1 : hi + 1])
            if req.lora_id:
                lora_rows.append((req.lora_id, len(input_ids), n))
            input_ids.extend(req.token_slice(start, end))
            if n == 1:
                positions.append(start)
            else:
                positions.extend(range(start, end))
            for g, blocks in enumerate(self.kv.block_tables(req)):
                if n == 1:
                    slots[g].append(blocks[start // bs] * bs + start % bs)
                else:
                    slots[g].extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
                tables[g].append(blocks)
            if state_slots is not None:
                state_slots.append(self.kv.state_slot(req))
                k = min(max(req.num_prompt_tokens - start, 0), n)
                prompt_rows.extend([True] * k + [False] * (n - k))
            query_lens.append(n)
            seq_lens.append(end)
            if end == req.num_tokens:
                sample_reqs.append(req)
                sample_idx.append(len(input_ids) - 1)
        if prompt_work.requests:
            prompt_work.k = max(r.params.prompt_logprobs for r in prompt_work.requests)
        return HostBatch(
            input_ids,
            positions,
            slots,
            query_lens,
            seq_lens,
            [_table_tensor(t) for t in tables],
            num_decodes,
            sample_reqs,
            sample_idx,
            prompt_work,
            lora_rows,
            state_slots,
            prompt_rows,
        )

    def device_inputs(self, h: HostBatch) -> tuple[torch.Tensor, torch.Tensor, list]:
        """input_ids, positions and the attention metadata on the model's device: one per cache
        group (the groups share everything but their block tables and slots)."""
        dev = self.device
        qsl = [0]
        for n in h.query_lens:
            qsl.append(qsl[-1] + n)
        seq_t = torch.tensor(h.seq_lens, dtype=torch.int32)
        q_t = torch.tensor(h.query_lens, dtype=torch.int32)
        context = seq_t - q_t
        # A model of recurrent layers alone has no block group: its one metadata has no tables.
        table = h.block_tables[0] if h.block_tables else torch.zeros(len(h.seq_lens), 0)
        slots = h.slots[0] if h.slots else []
        first = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(dev),
            seq_lens=seq_t.to(dev),
            context_lens=context.to(dev),
            block_tables=table.to(dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev),
            num_decodes=h.num_decodes,
            max_query_len=max(h.query_lens),
            max_seq_len=max(h.seq_lens),
            query_lens_host=h.query_lens,
            seq_lens_host=h.seq_lens,
            block_size=self.block_size,
        )
        if h.state_slots is not None:
            first.state_slots = torch.tensor(h.state_slots, dtype=torch.int32).to(dev)
            first.has_initial_state = (context > 0).to(dev)
            first.prompt_rows = torch.tensor(h.prompt_rows, dtype=torch.bool).to(dev)
        metas = [first] + [
            dataclasses.replace(
                first,
                block_tables=table.to(dev),
                slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev),
                backend_state={},
            )
            for table, slots in zip(h.block_tables[1:], h.slots[1:])
        ]
        ids_t = torch.tensor(h.input_ids, dtype=torch.int64).to(dev)
        pos_t = torch.tensor(h.positions, dtype=torch.int64).to(dev)
        return ids_t, pos_t, metas

    def lora_groups(self, h: HostBatch, slots: dict[int, int]) -> tuple[list, torch.Tensor]:
        """Each adapter slot's rows of the step (a slice when they are one run, else indices),
        and each token's slot (-1: none)."""
        rows: dict[int, list[tuple[int, int]]] = {}
        token_slots = torch.full((len(h.input_ids),), -1, dtype=torch.int64)
        for lid, start, n in h.lora_rows:
            rows.setdefault(slots[lid], []).append((start, n))
            token_slots[start : start + n] = slots[lid]
        groups = []
        for slot, runs in rows.items():
            first, last = runs[0][0], runs[-1][0] + runs[-1][1]
            if sum(n for _, n in runs) == last - first:
                groups.append((slot, slice(first, last)))
            else:
                idx = [i for start, n in runs for i in range(start, start + n)]
                groups.append((slot, torch.tensor(idx, dtype=torch.int64, device=self.device)))
        return groups, token_slots.to(self.device)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Request], torch.Tensor | None]:
        """Runs one step; returns the requests that sample and their logits [N, vocab]. Prompt
        logprobs of the step are appended to their requests. The step's adapters are in the
        slots `lora_slots` names (set by the engine before the step)."""
        h = self.host_inputs(batch)
        if self.peers is not None:
            h.block_copies, self._pending_copies = self._pending_copies, []
            if h.lora_rows or self.lora_loads:
                h.lora_slots = dict(self.lora_slots)
                h.lora_loads = list(self.lora_loads)
                self.lora_loads.clear()  # the engine's LoRAManager appends to this list
            self.peers.send(h.for_peers())
        logits, entries = self.run(h)
        if entries:
            self._give_prompt_logprobs(entries, h.prompt_work)
        return (h.sample_reqs, logits) if h.sample_reqs else ([], None)

    def run(self, h: HostBatch) -> tuple[torch.Tensor | None, list]:
        """The step's device work, the same on every tensor-parallel rank: the forward, the
        prompt logprob entries and the sampled rows' logits (on rank 0; the other ranks only
        take part in the collectives and get None and [])."""
        if h.block_copies:
            copy_blocks(self.kv_caches, h.block_copies)
        size = None if h.lora_rows else self._captured_bucket(h)
        if size is not None:
            hidden = self.captured.run(
                size,
                h.input_ids,
                h.positions,
                h.slots,
                h.seq_lens,
                h.block_tables,
                h.state_slots,
                h.prompt_rows,
            )
        else:
            input_ids, positions, metas = self.device_inputs(h)
            for meta in metas:
                self.backend.prepare(meta)
            if h.lora_rows:
                self.lora_step.set(*self.lora_groups(h, self.lora_slots))
            try:
                hidden = self.model(
                    input_ids, positions, self.kv_caches, self.layout.per_layer(metas)
                )
            finally:
                if self.lora_step is not None:
                    self.lora_step.clear()
        entries = []
        work = h.prompt_work
        if work.positions:
            idx = torch.tensor(work.positions, dtype=torch.int64, device=hidden.device)
            rows = hidden.index_select(0, idx)
            entries = prompt_logprobs(self.model.compute_logits, rows, work.targets, work.k)
        if not h.sample_idx:
            return None, entries
        if len(h.sample_idx) == hidden.shape[0]:  # every row samples, in order (decodes)
            return self.model.compute_logits(hidden), entries
        idx = torch.tensor(h.sample_idx, dtype=torch.int64, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, idx)), entries

    def _captured_bucket(self, h: HostBatch) -> int | None:
        """The capture bucket of a decode-only step without prompt logprobs, else None."""
        if self.captured is None or h.prompt_work.requests:
            return None
        rows = len(h.query_lens)
        if h.num_decodes != rows:
            return None
        return self.captured.bucket(rows, max(h.seq_lens))

    @staticmethod
    def _give_prompt_logprobs(entries: list, work: PromptLogprobWork) -> None:
        start = 0
        for req, count in zip(work.requests, work.counts):
            mine = req.params.prompt_logprobs
            for entry in entries[start : start + count]:
                if len(entry.top_ids) > mine:
                    entry.top_ids = entry.top_ids[:mine]
                    entry.top_logprobs = entry.top_logprobs[:mine]
                req.out.prompt_logprobs.append(entry)
            start += count


def _table_tensor(tables: list[list[int]]) -> torch.Tensor:
    """[requests, longest] int32, padded with block 0."""
    table = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int32)
    for r, t in enumerate(tables):
        table[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return table

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
from .multimodal import EncoderCache, ImageItem
from .pooling import PoolState, pooled_result
from .request import Request
from .sampling.logprobs import prompt_logprobs
from .sampling.ops import block_argmax
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
    # Images: the flat token rows that take image features, and where those come from, in
    # the same order: (image, its first feature row, rows); the tower runs for images whose
    # features are not in the encoder cache.
    mm_rows: list[int] = field(default_factory=list)
    mm_parts: list[tuple[ImageItem, int, int]] = field(default_factory=list)
    # Multimodal rotary positions: (first flat row, [3, n] positions) of prompt runs whose
    # three position streams differ (every other token's streams all equal `positions`).
    mrope_runs: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # Bidirectional image spans (Gemma 3): per request, None or its tokens' key limits
    # (AttentionMetadata.key_limits_host); None when no request of the step has one.
    key_limits: list[list[int] | None] | None = None
    # Speculative decoding: flat rows whose logits verify drafts (after the sampled rows'),
    # and per verifying request (request, its row count: 1 + its drafts).
    verify_idx: list[int] = field(default_factory=list)
    verify: list[tuple[Request, int]] = field(default_factory=list)
    # Pooling requests (engine/pooling.py): (request, its first flat row, rows, prompt done).
    pool_work: list[tuple[Request, int, int, bool]] = field(default_factory=list)
    # With `ModelRunner.keep_hidden`: per request, (request, its first flat row, its first
    # position, rows), for a proposer that drafts from the target's hidden states (eagle.py).
    spans: list[tuple[Request, int, int, int]] = field(default_factory=list)

    def for_peers(self) -> HostBatch:
        """What the other tensor-parallel ranks need to run the same step: no requests."""
        work = dataclasses.replace(self.prompt_work, requests=[], counts=[])
        return dataclasses.replace(
            self, sample_reqs=[], verify=[], prompt_work=work, pool_work=[], spans=[]
        )


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
        # A vision-language model's tower and the cache of its images' features (set by the
        # engine for such models).
        self.vision_tower = None
        self.encoder_cache: EncoderCache | None = None
        self.bidirectional_images = False  # an image's tokens attend to each other both ways
        self._limited_groups: tuple[bool, ...] | None = None  # "sliding": the groups that do
        self._pending_copies: list[tuple[int, int]] = []
        # Speculative decoding: the last step's verifying requests, each with the argmax token
        # at each of its 1 + k rows (speculative.py).
        self.verified: list[tuple[Request, list[int]]] = []
        self.verify_logits: torch.Tensor | None = None  # their rows' logits, in that order
        # A proposer that drafts from the target's hidden states (eagle.py) sets `keep_hidden`:
        # each step then leaves its final hidden states [T, hidden] (what the LM head reads) in
        # `hidden` and its requests' rows in `hidden_spans` (HostBatch.spans). Off: no cost.
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None
        self.hidden_spans: list[tuple[Request, int, int, int]] = []
        # The pooling requests whose prompt the last step completed (their `embedding` set).
        self.pooled: list[Request] = []
        # The classifier head classify/score requests read (pooling.py), set by the engine.
        self.pooling_head = None

    def attach_vision(self, tower, cache_bytes: int, bidirectional: str) -> bool:
        """A vision-language model's tower and an encoder cache of `cache_bytes` (every
        tensor-parallel rank holds both: the cache evolves the same on every rank).
        `bidirectional` (VisionFamily.bidirectional): "none", "all" or "sliding" (the key limits
        on the sliding-window layers' cache groups only). False (images then causal: the
        engine must not serve them) where "sliding" meets a group of both kinds of layers."""
        self.vision_tower = tower
        self.encoder_cache = EncoderCache(cache_bytes)
        self.bidirectional_images = bidirectional != "none"
        self._limited_groups = None
        if bidirectional != "sliding":
            return True
        windows = getattr(getattr(self.model, "spec", None), "windows", None)
        windows = windows or (None,) * len(self.layout.group_of_layer)
        sliding = [[windows[i] is not None for i in g.layers] for g in self.layout.groups]
        if not all(all(kinds) or not any(kinds) for kinds in sliding):
            self.bidirectional_images = False
            return False
        self._limited_groups = tuple(all(kinds) for kinds in sliding)
        return True

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies KV blocks (src, dst) in every layer: now, or with tensor parallelism at the
        start of the next step, on every rank (nothing writes the cache in between)."""
        if self.peers is None:
            copy_blocks(self.kv_caches, pairs)
        else:
            self._pending_copies.extend(pairs)

    def host_inputs(self, batch: ScheduledBatch) -> HostBatch:
        """The step's flat inputs as host lists, decodes first."""
        if self._plain_decodes(batch):
            return self._decode_inputs(batch)
        return self._any_inputs(batch)

    def _plain_decodes(self, batch: ScheduledBatch) -> bool:
        """Whether every request of the step is a plain one-token grant (no drafts, prompt
        logprobs, adapter, images or pooling): most steps of generation, which
        `_decode_inputs` builds without the general path's per-request branches."""
        if batch.drafts or self.bidirectional_images:
            return False
        for req, n in zip(batch.requests, batch.num_new_tokens):
            if (
                n != 1
                or req.mm is not None
                or req.lora is not None
                or req.pooling is not None
                or req.needs_prompt_logprobs
            ):
                return False
        return True

    def _decode_inputs(self, batch: ScheduledBatch) -> HostBatch:
        """`_any_inputs` of a step of plain one-token grants (`_plain_decodes`), the same
        HostBatch with fewer steps per request."""
        bs = self.block_size
        kv = self.kv
        reqs = batch.requests
        num_groups = self.layout.num_groups
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(num_groups)]
        seq_lens: list[int] = []
        tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
        sample_reqs: list[Request] = []
        sample_idx: list[int] = []
        for i, req in enumerate(reqs):
            start = req.num_computed_tokens
            prompt, out = req.prompt_token_ids, req.output_token_ids
            p = len(prompt)
            input_ids.append(prompt[start] if start < p else out[start - p])
            positions.append(start)
            block, offset = divmod(start, bs)
            for g, blocks in enumerate(kv.block_tables(req)):
                slots[g].append(blocks[block] * bs + offset)
                tables[g].append(blocks)
            seq_lens.append(start + 1)
            if start + 1 == p + len(out):
                sample_reqs.append(req)
                sample_idx.append(i)
        n = len(reqs)
        state_slots = prompt_rows = None
        if self.layout.has_state:
            state_slots = [kv.state_slot(req) for req in reqs]
            prompt_rows = [req.num_computed_tokens < req.num_prompt_tokens for req in reqs]
        h = HostBatch(
            input_ids,
            positions,
            slots,
            [1] * n,
            seq_lens,
            [_table_tensor(t) for t in tables],
            n,
            sample_reqs,
            sample_idx,
            PromptLogprobWork(),
            [],
            state_slots,
            prompt_rows,
        )
        if self.keep_hidden:
            h.spans = [(req, i, req.num_computed_tokens, 1) for i, req in enumerate(reqs)]
        return h

    def _any_inputs(self, batch: ScheduledBatch) -> HostBatch:
        """`host_inputs` of any step."""
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
        pool_work: list[tuple[Request, int, int, bool]] = []
        lora_rows: list[tuple[int, int, int]] = []
        mm_rows: list[int] = []
        mm_parts: list[tuple[ImageItem, int, int]] = []
        mrope_runs: list[tuple[int, torch.Tensor]] = []
        key_limits: list[list[int] | None] = []
        state_slots: list[int] | None = [] if self.layout.has_state else None
        prompt_rows: list[bool] | None = [] if self.layout.has_state else None
        num_decodes = 0
        verify_idx: list[int] = []
        verify: list[tuple[Request, int]] = []
        spans: list[tuple[Request, int, int, int]] = []
        for i in order:
            req, n = batch.requests[i], batch.num_new_tokens[i]
            start = req.num_computed_tokens
            end = start + n
            if self.keep_hidden:
                spans.append((req, len(input_ids), start, n))
            drafts = batch.drafts.get(req.request_id) if batch.drafts else None
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
            if req.mm is not None:
                self._image_rows(req, start, end, len(input_ids), mm_rows, mm_parts, mrope_runs)
            if self.bidirectional_images:
                key_limits.append(_key_limits(req, start, end))
            if drafts:
                input_ids.extend(req.token_slice(start, end - len(drafts)))
                input_ids.extend(drafts)
            else:
                input_ids.extend(req.token_slice(start, end))
            delta = req.mrope_delta
            if n == 1:
                positions.append(start + delta)
            else:
                positions.extend(range(start + delta, end + delta))
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
            if req.pooling is not None:
                pool_work.append((req, len(input_ids) - n, n, end == req.num_tokens))
            elif drafts:
                verify.append((req, len(drafts) + 1))
                verify_idx.extend(range(len(input_ids) - len(drafts) - 1, len(input_ids)))
            elif end == req.num_tokens:
                sample_reqs.append(req)
                sample_idx.append(len(input_ids) - 1)
        if prompt_work.requests:
            prompt_work.k = max(r.params.prompt_logprobs for r in prompt_work.requests)
        h = HostBatch(
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
        h.mm_rows, h.mm_parts, h.mrope_runs = mm_rows, mm_parts, mrope_runs
        h.pool_work = pool_work
        h.verify_idx, h.verify = verify_idx, verify
        h.spans = spans
        if any(limits is not None for limits in key_limits):
            h.key_limits = key_limits
        return h

    @staticmethod
    def _image_rows(req: Request, start: int, end: int, base: int, rows, parts, mrope_runs):
        """The rows of tokens [start, end) of `req` (flat rows from `base`) that take image
        features, and their sources; and the multimodal positions of its prompt tokens among
        them."""
        mm = req.mm
        for item in mm.items:
            lo, hi = max(start, item.offset), min(end, item.end)
            if lo >= hi:
                continue
            first = base + lo - start
            if item.embed_mask is None:
                rows.extend(range(first, first + hi - lo))
                parts.append((item, lo - item.offset, hi - lo))
                continue
            mask = item.embed_mask
            skip = int(mask[: lo - item.offset].sum())
            taken = torch.nonzero(mask[lo - item.offset : hi - item.offset]).flatten().tolist()
            if taken:
                rows.extend(first + j for j in taken)
                parts.append((item, skip, len(taken)))
        if mm.mrope_positions is not None and start < req.num_prompt_tokens:
            hi = min(end, req.num_prompt_tokens)
            mrope_runs.append((base, mm.mrope_positions[:, start:hi]))

    def device_inputs(self, h: HostBatch) -> tuple[torch.Tensor, torch.Tensor, list]:
        """input_ids, positions and the attention metadata on the model's device: one per cache
        group (the groups share everything but their block tables and slots)."""
        dev = self.device
        on_host = dev.type == "cpu"  # host tensors are the device's: no copies to make

        def to_dev(t: torch.Tensor) -> torch.Tensor:
            return t if on_host else t.to(dev)

        qsl = [0]
        for n in h.query_lens:
            qsl.append(qsl[-1] + n)
        context_host = [s - q for s, q in zip(h.seq_lens, h.query_lens)]
        context = torch.tensor(context_host, dtype=torch.int32)
        # A model of recurrent layers alone has no block group: its one metadata has no tables.
        table = h.block_tables[0] if h.block_tables else torch.zeros(len(h.seq_lens), 0)
        slots = h.slots[0] if h.slots else []
        first = AttentionMetadata(
            query_start_loc=to_dev(torch.tensor(qsl, dtype=torch.int32)),
            seq_lens=to_dev(torch.tensor(h.seq_lens, dtype=torch.int32)),
            context_lens=to_dev(context),
            block_tables=table.to(dtype=torch.int32, device=dev),
            slot_mapping=to_dev(torch.tensor(slots, dtype=torch.int64)),
            num_decodes=h.num_decodes,
            max_query_len=max(h.query_lens),
            max_seq_len=max(h.seq_lens),
            query_lens_host=h.query_lens,
            seq_lens_host=h.seq_lens,
            block_size=self.block_size,
            key_limits_host=h.key_limits,
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
        if self._limited_groups is not None and h.key_limits is not None:
            for meta, limited in zip(metas, self._limited_groups):
                if not limited:  # a global layers' group of "sliding": causal
                    meta.key_limits_host = None
        ids_t = to_dev(torch.tensor(h.input_ids, dtype=torch.int64))
        pos_t = to_dev(torch.tensor(h.positions, dtype=torch.int64))
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
        self.pooled = []
        h = self.host_inputs(batch)
        if self.peers is not None:
            h.block_copies, self._pending_copies = self._pending_copies, []
            if h.lora_rows or self.lora_loads:
                h.lora_slots = dict(self.lora_slots)
                h.lora_loads = list(self.lora_loads)
                self.lora_loads.clear()  # the engine's LoRAManager appends to this list
            self.peers.send(h.for_peers())
        logits, entries = self.run(h)
        self.hidden_spans = h.spans
        if entries:
            self._give_prompt_logprobs(entries, h.prompt_work)
        self.verified = []
        if h.verify:
            ns = len(h.sample_idx)
            self.verify_logits = logits[ns:].contiguous()
            tokens = block_argmax(self.verify_logits).tolist()
            first = 0
            for req, count in h.verify:
                self.verified.append((req, tokens[first : first + count]))
                first += count
            logits = logits[:ns] if ns else None
        return (h.sample_reqs, logits) if h.sample_reqs else ([], None)

    def run(self, h: HostBatch) -> tuple[torch.Tensor | None, list]:
        """The step's device work, the same on every tensor-parallel rank: the forward, the
        prompt logprob entries and the sampled rows' logits (on rank 0; the other ranks only
        take part in the collectives and get None and [])."""
        if h.block_copies:
            copy_blocks(self.kv_caches, h.block_copies)
        size = None if h.lora_rows else self._captured_bucket(h)
        if size is not None:
            seq_lens, tables = _rows_as_decodes(h)
            hidden = self.captured.run(
                size,
                h.input_ids,
                h.positions,
                h.slots,
                seq_lens,
                tables,
                h.state_slots,
                h.prompt_rows,
                h.query_lens,
            )
        else:
            input_ids, positions, metas = self.device_inputs(h)
            for meta in metas:
                self.backend.prepare(meta)
            if h.lora_rows:
                self.lora_step.set(*self.lora_groups(h, self.lora_slots))
            images = self._image_embeds(h) if h.mm_rows else None
            if h.mrope_runs:
                positions = self._mrope_positions(positions, h.mrope_runs)
            try:
                hidden = self.model(
                    input_ids,
                    positions,
                    self.kv_caches,
                    self.layout.per_layer(metas),
                    images=images,
                )
            finally:
                if self.lora_step is not None:
                    self.lora_step.clear()
        if self.keep_hidden:
            self.hidden = hidden
        entries = []
        work = h.prompt_work
        if work.positions:
            idx = torch.tensor(work.positions, dtype=torch.int64, device=hidden.device)
            rows = hidden.index_select(0, idx)
            entries = prompt_logprobs(self.model.compute_logits, rows, work.targets, work.k)
        if h.pool_work:
            self._pool(hidden, h.pool_work)
        rows = h.sample_idx + h.verify_idx if h.verify_idx else h.sample_idx
        if not rows:
            return None, entries
        if not h.verify_idx and len(rows) == hidden.shape[0]:  # every row samples (decodes)
            return self.model.compute_logits(hidden), entries
        idx = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, idx)), entries

    def _pool(self, hidden: torch.Tensor, work: list[tuple[Request, int, int, bool]]) -> None:
        """Adds each pooling request's rows of the step to its pool; a request whose prompt
        is now computed gets its embedding and joins `pooled`. A chunk that starts the prompt
        (again, after a preemption) starts a fresh pool."""
        for req, first, n, done in work:
            params = req.pooling
            assert params is not None
            start = req.num_computed_tokens  # not advanced yet: the step's update does that
            if req.pool is None or start == 0:
                req.pool = PoolState()
            mean = params.pooling_type == "mean"  # (classify/score: the head's row)
            rows = hidden[first : first + n] if mean else hidden[first + n - 1 : first + n]
            req.pool.add(rows, mean)
            if start == 0:
                req.pool.first = hidden[first].float()
            if done:
                req.embedding = pooled_result(req.pool, params, self.pooling_head)
                req.pool = None
                self.pooled.append(req)

    def _image_embeds(self, h: HostBatch):
        """(flat rows, their image embeddings, deepstack embeddings or None) of the step: each
        image's features from the encoder cache, or from the tower, which encodes every image
        of the step not in the cache in one call."""
        cache, dev = self.encoder_cache, self.device
        found: dict[bytes, object] = {}
        missing: list[ImageItem] = []
        for item, _, _ in h.mm_parts:
            if item.hash in found:
                continue
            hit = cache.get(item.hash)
            found[item.hash] = hit
            if hit is None:
                missing.append(item)
        if missing:
            datas = [{k: _to(v, dev) for k, v in it.data.items()} for it in missing]
            for item, feats in zip(missing, self.vision_tower.encode(datas)):
                if feats.num_rows != item.num_embeds:
                    raise RuntimeError(
                        f"the vision tower gave {feats.num_rows} rows for an image with "
                        f"{item.num_embeds} placeholder tokens"
                    )
                found[item.hash] = feats
                cache.put(item.hash, feats, keep=found)  # the step's images stay
        pieces = [(found[item.hash], f0, n) for item, f0, n in h.mm_parts]
        embeds = torch.cat([f.embeds[f0 : f0 + n] for f, f0, n in pieces])
        deepstack = None
        if pieces[0][0].deepstack is not None:
            levels = len(pieces[0][0].deepstack)
            deepstack = [
                torch.cat([f.deepstack[i][f0 : f0 + n] for f, f0, n in pieces])
                for i in range(levels)
            ]
        rows = torch.tensor(h.mm_rows, dtype=torch.int64).to(dev)
        return rows, embeds, deepstack

    def _mrope_positions(self, positions: torch.Tensor, runs) -> torch.Tensor:
        """[3, T] positions: every token's single position in all three streams, but the
        prompt runs with multimodal positions."""
        pos = positions.unsqueeze(0).repeat(3, 1)
        for first, run in runs:
            pos[:, first : first + run.shape[1]] = run.to(pos.device)
        return pos

    def _captured_bucket(self, h: HostBatch) -> int | None:
        """The capture bucket of a step of decodes (and speculative verifications: each of
        their rows runs as a decode of its own, `_rows_as_decodes`; with recurrent layers, any
        request of up to the capture's `verify_rows` rows) without prompt logprobs or images,
        else None."""
        if self.captured is None or h.prompt_work.requests:
            return None
        if h.mm_rows or h.mrope_runs or h.key_limits is not None:  # image rows, M-RoPE, spans
            return None
        requests = len(h.query_lens)
        if h.num_decodes != requests:
            if self.layout.has_state:
                # Recurrent layers: requests of a few rows each (verifications, and the kept
                # tokens computed again after a rollback) in the verification graphs, each
                # request's rows in order from its state slot. Not pooling prompts' chunks:
                # their pools may keep views of the graph's output past the step.
                if h.pool_work:
                    return None
                rows, longest = len(h.input_ids), max(h.query_lens)
                return self.captured.verify_bucket(rows, max(h.seq_lens), longest)
            # Verifications only besides the decodes on a model without recurrent layers.
            if h.num_decodes + len(h.verify) != requests:
                return None
        return self.captured.bucket(len(h.input_ids), max(h.seq_lens))

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


def _rows_as_decodes(h: HostBatch) -> tuple[list[int], list[torch.Tensor]]:
    """Per-row sequence lengths and block tables of a captured step: a decode's own; a
    speculative verification's n rows each as a decode of its own, row j of a request whose
    step ends at length L attending to its first L - n + 1 + j keys through the request's
    table. The step writes every row's K and V before any row attends, so row j sees its own
    key and those before it, as the causal prefill of those rows would."""
    if len(h.query_lens) == len(h.input_ids):
        return h.seq_lens, h.block_tables
    seq_lens: list[int] = []
    for n, end in zip(h.query_lens, h.seq_lens):
        seq_lens.extend(range(end - n + 1, end + 1))
    counts = torch.tensor(h.query_lens)
    return seq_lens, [t.repeat_interleave(counts, dim=0) for t in h.block_tables]


def _key_limits(req: Request, start: int, end: int) -> list[int] | None:
    """Per token of [start, end), the last key it attends to when the chunk holds an image
    span whose tokens attend both ways (its own position otherwise); None when it holds none."""
    if req.mm is None:
        return None
    limits = None
    for item in req.mm.items:
        lo, hi = max(start, item.offset), min(end, item.end)
        if lo >= hi:
            continue
        if limits is None:
            limits = list(range(start, end))
        limits[lo - start : hi - start] = [item.end - 1] * (hi - lo)
    return limits


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _table_tensor(tables: list[list[int]]) -> torch.Tensor:
    """[requests, longest] int32, padded with block 0 (one tensor made from padded lists)."""
    width = max(len(t) for t in tables)
    if width == 0:
        return torch.zeros(len(tables), 0, dtype=torch.int32)
    padded = [t if len(t) == width else t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.int32)

"""Turns a scheduled batch into the model's flat ragged inputs, runs the model, and returns the
logits of the tokens that will be sampled (the last token of each request that reaches the end
of what it has; a prefill chunk that stops short of it samples nothing)."""

from __future__ import annotations

import torch

from .layers.attention import AttentionBackend, AttentionMetadata
from .request import Request
from .scheduler import ScheduledBatch


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = device

    def prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[Request], list[int]]:
        # Decodes first: the backend then finds them as one contiguous run of tokens.
        order = sorted(range(len(batch)), key=lambda i: batch.num_new_tokens[i] != 1)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_reqs: list[Request] = []
        sample_idx: list[int] = []
        num_decodes = 0
        for i in order:
            req, n = batch.requests[i], batch.num_new_tokens[i]
            start = req.num_computed_tokens
            end = start + n
            if n == 1:
                num_decodes += 1
            input_ids.extend(req.token_slice(start, end))
            blocks = req.block_ids
            if n == 1:
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                rng = range(start, end)
                positions.extend(rng)
                slots.extend(blocks[p // bs] * bs + p % bs for p in rng)
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(blocks)
            if end == req.num_tokens:
                sample_reqs.append(req)
                sample_idx.append(len(input_ids) - 1)
        max_blocks = max(len(t) for t in tables)
        table = torch.zeros(len(tables), max_blocks, dtype=torch.int32)
        for r, t in enumerate(tables):
            table[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
        dev = self.device
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        seq_t = torch.tensor(seq_lens, dtype=torch.int32)
        q_t = torch.tensor(query_lens, dtype=torch.int32)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(dev),
            seq_lens=seq_t.to(dev),
            context_lens=(seq_t - q_t).to(dev),
            block_tables=table.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev),
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            block_size=bs,
        )
        ids_t = torch.tensor(input_ids, dtype=torch.int64).to(dev)
        pos_t = torch.tensor(positions, dtype=torch.int64).to(dev)
        return ids_t, pos_t, meta, sample_reqs, sample_idx

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Request], torch.Tensor | None]:
        """Runs one step; returns the requests that sample and their logits [N, vocab]."""
        input_ids, positions, meta, sample_reqs, sample_idx = self.prepare(batch)
        self.backend.prepare(meta)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not sample_reqs:
            return [], None
        idx = torch.tensor(sample_idx, dtype=torch.int64, device=hidden.device)
        return sample_reqs, self.model.compute_logits(hidden.index_select(0, idx))

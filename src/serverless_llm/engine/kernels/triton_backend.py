"""The Triton attention backend: the KV write and paged attention kernels behind the same
`AttentionBackend` interface, cache layout and metadata as the torch reference backend."""

from __future__ import annotations

import torch

from ..layers.attention import AttentionBackend, AttentionMetadata, AttentionSpec
from .kv_write import reshape_and_cache
from .paged_attention import TileConfig, num_sms, paged_attention


class TritonAttentionBackend(AttentionBackend):
    """`num_splits`, `decode_config` and `prefill_config` override the heuristics (tests,
    tuning); left as None the kernel module chooses per step.

    No `prepare` work: the per-step tile plans depend on the layers' query-head group, so the
    first layer builds them and caches them in `meta.backend_state` for the others."""

    name = "triton"

    def __init__(
        self,
        num_splits: int | None = None,
        decode_config: TileConfig | None = None,
        prefill_config: TileConfig | None = None,
    ) -> None:
        self.num_splits = num_splits
        self.decode_config = decode_config
        self.prefill_config = prefill_config
        self._sms: dict[torch.device, int] = {}

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
        sms = self._sms.get(q.device)
        if sms is None:
            sms = self._sms[q.device] = num_sms(q.device)
        return paged_attention(
            q,
            kv_cache,
            meta,
            spec,
            num_splits=self.num_splits,
            decode_config=self.decode_config,
            prefill_config=self.prefill_config,
            sms=sms,
        )

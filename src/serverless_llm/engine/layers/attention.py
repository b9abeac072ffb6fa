"""Attention over the paged KV cache: the backend interface and its two backends, the torch
reference (the CPU path) and Triton (CUDA; Triton's interpreter in tests), fed the same metadata
(kernels/metadata.py) and the same cache layout.

A backend also carries the engine's one choice between Triton kernels and torch references:
`make_attention_backend` makes it once, and the model hands `use_kernels` to its norms, rotary
and activation as it builds them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from ..kernels.cpu_native import (
    LayerPrep,
    NativeKernels,
    make_layer,
    make_step,
    native_cache_ok,
)
from ..kernels.kv_write import kv_write_index, reshape_and_cache, reshape_and_cache_reference
from ..kernels.metadata import AttentionMetadata, AttentionSpec
from ..kernels.paged_attention import (
    TileConfig,
    encoder_attention,
    encoder_attention_torch,
    num_sms,
    paged_attention,
    paged_attention_torch,
    plan_torch_decodes,
    prefill_torch,
)
from ..kernels.triton_lazy import require_triton

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionSpec",
    "NativeCpuBackend",
    "TorchAttentionBackend",
    "TritonAttentionBackend",
]


class AttentionBackend(ABC):
    name: str
    use_kernels: bool = False  # whether the model's other layers run their Triton kernels too
    head_major_cache: bool = False  # the cache layout it is fastest on (`allocate_kv_cache`)

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

    def encoder_attention(self, q, k, v, meta: AttentionMetadata, spec: AttentionSpec):
        """Bidirectional attention within each request's own rows (encoders: no cache):
        q [T, H, D], k and v [T, KVH, D] -> [T, H * D]. The torch path; Triton overrides."""
        return encoder_attention_torch(q, k, v, meta, spec)


class TorchAttentionBackend(AttentionBackend):
    """The reference backend: the torch code of kernels/kv_write.py and
    kernels/paged_attention.py."""

    name = "torch"
    head_major_cache = True

    def prepare(self, meta: AttentionMetadata) -> None:
        plan_torch_decodes(meta)
        meta.backend_state["kv_write"] = kv_write_index(meta.slot_mapping, meta.block_size)

    def forward(self, q, k, v, kv_cache, meta, spec):
        index = meta.backend_state.get("kv_write")
        reshape_and_cache_reference(
            k, v, kv_cache, meta.slot_mapping, index, spec.k_scale, spec.v_scale
        )
        return paged_attention_torch(q, k, v, kv_cache, meta, spec)


class NativeCpuBackend(TorchAttentionBackend):
    """The CPU path with the native kernels (kernels/cpu_native.py): each layer's KV write and
    decode attention in one call over the head-major cache, read in place (soft-cap, ALiBi,
    sliding window, chunked local attention, sinks); prefill rows through the torch backend's
    code. `forward_native` also takes over the layer's q/k preparation (clip, q/k norm,
    rotary), as the layer's struct (`layer`, from its `LayerPrep`) describes it. Latent (MLA)
    layers write their rows and attend their decodes in `latent_step`. A float32 cache only: any
    other (bfloat16 models, an 8-bit cache) runs the torch backend's path."""

    name = "native"

    def __init__(self, kernels: NativeKernels) -> None:
        self.kernels = kernels

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.backend_state["native"] = None  # built by the first layer that needs it

    def forward(self, q, k, v, kv_cache, meta, spec):
        if not (q.dtype == torch.float32 and native_cache_ok(kv_cache)):
            if "kv_write" not in meta.backend_state:  # the torch backend's plan, once a step
                super().prepare(meta)
            return super().forward(q, k, v, kv_cache, meta, spec)
        return self.forward_native(q, k, v, kv_cache, meta, spec, self.layer(spec, kv_cache))

    def latent_ready(self, rows: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether `latent_step` takes a latent (MLA) layer's step: float32 rows and cache."""
        return rows.dtype == torch.float32 and native_cache_ok(kv_cache)

    def encoder_attention(self, q, k, v, meta, spec):
        """The step's every request and head in one native call (`NativeKernels.
        encoder_attention`) for float32 rows with plain heads; anything else (soft-cap, ALiBi,
        sinks, chunks, other dtypes) through the torch path."""
        if not (
            q.dtype == k.dtype == v.dtype == torch.float32
            and q.device.type == "cpu"
            and spec.logit_softcap is None
            and spec.alibi_slopes is None
            and spec.sinks is None
            and spec.chunk_size is None
            and all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (q, k, v))
        ):
            return super().encoder_attention(q, k, v, meta, spec)
        starts = meta.backend_state.get("encoder_starts")
        if starts is None:  # once a step: the layers share it
            starts = meta.backend_state["encoder_starts"] = meta.query_start_loc.to(
                device="cpu", dtype=torch.int64
            ).contiguous()
        return self.kernels.encoder_attention(q, k, v, starts, spec)

    def latent_step(self, rows, q, kv_cache, meta, scale: float, rank: int) -> torch.Tensor:
        """A latent layer's row write (rows [T, W]: latent | rotated key) and its decodes'
        absorbed attention (q [num_decodes, H, W]: q_lat | q_pe; None: the write only) in one
        native call: the weighted latents [num_decodes, H, rank], as
        mla_attention.latent_decode_torch gives them."""
        return self.kernels.latent_step(self.step(meta, None), rows, q, kv_cache, scale, rank)

    def layer(self, spec: AttentionSpec, kv_cache: torch.Tensor, prep: LayerPrep | None = None):
        return make_layer(spec, kv_cache, prep)

    def step(self, meta: AttentionMetadata, positions: torch.Tensor | None):
        """The step's struct for the native calls, made by the first layer that needs it (and
        given the positions by the first that rotates)."""
        st = meta.backend_state
        step = st.get("native")
        if step is None:
            keep = st["native_keep"] = []
            pos = positions if positions is not None else meta.slot_mapping  # unread: no rope
            step = st["native"] = make_step(meta, pos, keep)
            st["native_positions"] = positions
        elif positions is not None and st.get("native_positions") is not positions:
            pos = positions.contiguous()
            st["native_keep"].append(pos)
            step.positions = pos.data_ptr()
            st["native_positions"] = positions
        return step

    def forward_native(self, q, k, v, kv_cache, meta, spec, layer, positions=None):
        """q [T, H, D], k and v [T, KVH, D] (views into the QKV projection are fine: they are
        prepared in place) -> [T, H * D]. `layer`: `make_layer`'s struct for this layer and
        cache; `positions` [T] when its prep rotates."""
        step = self.step(meta, positions)
        T = q.shape[0]
        out = torch.empty(T, spec.num_heads * spec.head_dim, dtype=q.dtype)
        self.kernels.attention_step(layer, step, q, k, v, out)
        s = meta.num_decodes
        for i in range(meta.num_decodes, meta.num_requests):
            e = s + meta.query_lens_host[i]
            out[s:e] = prefill_torch(q[s:e], k[s:e], v[s:e], kv_cache, meta, spec, i)
            s = e
        return out


class TritonAttentionBackend(AttentionBackend):
    """The KV write and paged attention Triton kernels. `num_splits`, `decode_config` and
    `prefill_config` override the heuristics (tests, tuning); left as None the kernel module
    chooses per step.

    No `prepare` work: the per-step tile plans depend on the layers' query-head group, so the
    first layer builds them and caches them in `meta.backend_state` for the others."""

    name = "triton"
    use_kernels = True

    def __init__(
        self,
        num_splits: int | None = None,
        decode_config: TileConfig | None = None,
        prefill_config: TileConfig | None = None,
    ) -> None:
        # ImportError here, at engine build, rather than at the first step without Triton.
        require_triton()
        self.num_splits = num_splits
        self.decode_config = decode_config
        self.prefill_config = prefill_config
        self._sms: dict[torch.device, int] = {}

    def forward(self, q, k, v, kv_cache, meta, spec):
        reshape_and_cache(k, v, kv_cache, meta.slot_mapping, spec.k_scale, spec.v_scale)
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

    def encoder_attention(self, q, k, v, meta, spec):
        sms = self._sms.get(q.device)
        if sms is None:
            sms = self._sms[q.device] = num_sms(q.device)
        return encoder_attention(
            q, k, v, meta, spec, config=self.prefill_config, num_splits=self.num_splits, sms=sms
        )


def alibi_slopes(num_heads: int, bias_max: float = 8.0) -> torch.Tensor:
    """The ALiBi slopes of Press et al., in MPT's general form: over n2, the power of two at or
    above num_heads, 2 ** (-bias_max * i / n2) for i = 1..n2; past a power of two the even i
    first, then the odd ones, the first num_heads of them. With bias_max 8 these are Bloom's and
    Falcon's slopes (a sequence from the power of two below, interleaved past it)."""
    n2 = 2 ** math.ceil(math.log2(num_heads))
    slopes = [2.0 ** (-bias_max * (i + 1) / n2) for i in range(n2)]
    if n2 != num_heads:
        slopes = (slopes[1::2] + slopes[::2])[:num_heads]
    return torch.tensor(slopes, dtype=torch.float32)

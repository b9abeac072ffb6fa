"""Multi-head latent attention (MLA), the attention of DeepSeek V2/V3, Kimi K2, Moonlight and
Mistral 4, as transformers' DeepseekV2Attention computes it, over a cache of latents.

Per token the layer computes a compressed KV latent (kv_a_proj_with_mqa, then an RMSNorm over
its first kv_lora_rank values) and one rotary key of qk_rope_head_dim values shared by every
head; the cache keeps exactly that row (kernels/mla_attention.py, the `LatentAttentionSpec`
group). Each head's key is [k_nope | k_pe], its no-rope part and its value brought up from the
latent by kv_b_proj; its query [q_nope | q_pe] comes from q_proj, or with a query LoRA
(q_lora_rank) from q_b_proj(RMSNorm(q_a_proj(x))). q_pe and k_pe are rotated (interleaved pairs,
or halves when a config turns rope_interleave off), with YaRN's attention factor in the table.

Two forms, chosen per step, the same attention:
- prefill rows, expanded: the request's latents (its cached context read back from the cache,
  its new ones as computed) go through kv_b_proj to per-head k_nope and v, and the queries
  attend to [k_nope | k_pe] causally;
- decodes, absorbed: q_nope is moved into latent space through the key half of kv_b_proj
  (W_UK, per head [nope, L]), the scores are taken against the cached rows directly, and the
  weighted latents come up through the value half (W_UV) once; the expanded keys are never
  made, and a decode reads L + R values a cached token for all heads.

The Triton backend runs both on the kernels of kernels/mla_attention.py; the native CPU backend
writes the rows and runs the absorbed decode in one native call (`NativeCpuBackend.latent_step`,
cpu_native.c `mla_decode_f32`; float32 caches), its prefill rows on the torch twin; the torch
backend (and the native one on any other cache) on the torch twins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.e4m3 import e4m3_as_bytes
from ..kernels.metadata import AttentionMetadata, AttentionSpec
from ..kernels.mla_attention import (
    ExpandedBatch,
    cached_rows,
    expanded_prefill,
    expanded_prefill_torch,
    latent_decode,
    latent_decode_torch,
    write_latents,
    write_latents_reference,
)
from ..layers.attention import NativeCpuBackend
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryStep, apply_rotary, yarn_mscale
from ..parallel.group import SINGLE, TensorParallel


@dataclass(frozen=True)
class MLASpec:
    """A latent attention layer's shape. `q_lora_rank` None: queries straight from q_proj
    (DeepSeek-V2-Lite); else through q_a_proj, its RMSNorm and q_b_proj. `bias`: the config's
    attention_bias (on q_a_proj, kv_a_proj_with_mqa and o_proj). `query_scale`: Mistral 4's
    (beta, original_max_position_embeddings): every query times
    1 + beta * log(1 + floor(position / original)) (Llama 4's attention scaling)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    norm_eps: float = 1e-6  # the latent norms' (transformers builds them with the default)
    bias: bool = False
    query_scale: tuple[float, int] | None = None

    @property
    def width(self) -> int:
        """Values a token's cache row holds: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class LatentAttention(nn.Module):
    """The MLA layer; its parameters carry the checkpoint's names. With tensor parallelism it
    holds this rank's heads (`s.num_heads` of its shard: their rows of q_proj or q_b_proj and
    kv_b_proj, their columns of o_proj, whose partial sums are all-reduced) and the whole
    latent path (q_a_proj, kv_a_proj_with_mqa, the norms), so every rank caches the same
    latents."""

    native_prep = False  # the native CPU step does not prepare MLA's queries
    g_proj = None

    def __init__(
        self,
        s,
        attn: AttentionSpec,
        backend,
        rope,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        m: MLASpec = s.mla
        self.mla = m
        self.tp = tp
        self.spec = attn  # its scale is the softmax's; its k_scale an 8-bit cache's
        self.backend = backend
        self.rope = rope
        self.use_kernels = backend.use_kernels
        H = self.num_heads = s.num_heads
        hidden = s.hidden_size
        qk = m.qk_head_dim
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, H * qk, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=m.bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, m.norm_eps, self.use_kernels)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.width, bias=m.bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, m.norm_eps, self.use_kernels)
        self.kv_b_proj = nn.Linear(
            m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(H * m.v_head_dim, hidden, bias=m.bias)
        self._dense_kv_b: tuple | None = None  # (module, weight) of a kv_b_proj not a Linear

    # -- the pieces ------------------------------------------------------------------------------

    def kv_b_weight(self) -> torch.Tensor:
        """kv_b_proj's weight [H * (nope + V), L], for the absorbed form. A plain Linear's own
        (always current); any other kind (packed for oneDNN, quantized) gives it back by
        projecting the identity (exact: each output is one weight times 1 plus zeros), once."""
        lin = self.kv_b_proj
        if type(lin) is nn.Linear:
            return lin.weight
        cached = self._dense_kv_b
        if cached is None or cached[0] is not lin:
            ref = self.kv_a_layernorm.weight
            eye = torch.eye(self.mla.kv_lora_rank, dtype=ref.dtype, device=ref.device)
            with torch.no_grad():
                cached = self._dense_kv_b = (lin, lin(eye).t().contiguous())
        return cached[1]

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, L], W_UV [H, V, L]): the key and value halves of kv_b_proj."""
        m = self.mla
        w = self.kv_b_weight().view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, -1)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _fp8_bytes(self, cache: torch.Tensor) -> bool:
        """An e4m3 cache that this GPU reads only as bytes: the kernels here do not decode
        those, so such a step takes the torch path."""
        return e4m3_as_bytes(cache.dtype, cache.device)

    # -- the step --------------------------------------------------------------------------------

    def forward(self, x, rope: RotaryStep | None, kv_cache, meta: AttentionMetadata, q_scale=None):
        """`q_scale`: per-token query factors ([T, 1, 1]) a decoder may hand every attention
        layer (Llama 4's temperature tuning); none of the MLA families has them."""
        m, H = self.mla, self.num_heads
        T = x.shape[0]
        L, R, N, V = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
        if type(self.kv_b_proj) is not nn.Linear:
            # Read back at the first step whatever it is (the start-up profile's prefill on
            # CUDA), never first inside a captured decode step, which must not allocate it.
            self.kv_b_weight()
        q = self._queries(x).view(T, H, N + R)
        ckv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(ckv[:, :L].contiguous())
        k_pe = ckv[:, L:].reshape(T, 1, R)
        q_nope, q_pe = q[..., :N], q[..., N:]
        if rope is not None:
            q_pe, k_pe = apply_rotary(q_pe, k_pe, rope, self.rope.is_neox)
        if m.query_scale is not None and rope is not None:
            beta, orig = m.query_scale
            factor = 1 + beta * torch.log1p(torch.floor(rope.positions.float() / orig))
            factor = factor.to(q.dtype)[:, None, None]
            q_nope, q_pe = q_nope * factor, q_pe * factor
        if q_scale is not None:
            q_nope = (q_nope.float() * q_scale).to(q.dtype)
            q_pe = (q_pe.float() * q_scale).to(q.dtype)
        rows = torch.cat([latent, k_pe.reshape(T, R)], dim=-1)  # the cache's row a token
        out = x.new_empty(T, H, V)
        nd = meta.num_decodes
        kernels = self.use_kernels and not self._fp8_bytes(kv_cache)
        backend = self.backend
        if isinstance(backend, NativeCpuBackend) and backend.latent_ready(rows, kv_cache):
            # The write and the decodes' attention in one native call.
            q = self._absorbed_queries(q_nope[:nd], q_pe[:nd]) if nd else None
            o_lat = backend.latent_step(rows, q, kv_cache, meta, self.spec.scale, L)
            if nd:
                out[:nd] = self._up(o_lat)
        else:
            if kernels:
                write_latents(rows, kv_cache, meta.slot_mapping, self.spec.k_scale)
            else:
                write_latents_reference(rows, kv_cache, meta, self.spec.k_scale)
            if nd:
                out[:nd] = self._absorbed(q_nope[:nd], q_pe[:nd], kv_cache, meta, kernels)
        if meta.num_requests > nd:
            out[nd:] = self._expanded(q_nope[nd:], q_pe[nd:], rows, kv_cache, meta, kernels)
        return self.tp.all_reduce(self.o_proj(out.view(T, H * V)))

    def _absorbed_queries(self, q_nope, q_pe) -> torch.Tensor:
        """The decodes' queries in latent space, [nd, H, L + R]: q_nope through W_UK, q_pe."""
        w_uk = self.absorbed_weights()[0]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [nd, H, L]
        return torch.cat([q_lat, q_pe], dim=-1)

    def _up(self, o_lat: torch.Tensor) -> torch.Tensor:
        """The weighted latents [nd, H, L] up through W_UV: [nd, H, V]."""
        w_uv = self.absorbed_weights()[1]
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _absorbed(self, q_nope, q_pe, kv_cache, meta, kernels: bool) -> torch.Tensor:
        """The decodes' outputs [nd, H, V] in the absorbed form."""
        q = self._absorbed_queries(q_nope, q_pe)
        decode = latent_decode if kernels else latent_decode_torch
        o_lat = decode(q, kv_cache, meta, self.spec.scale, self.mla.kv_lora_rank, self.spec.k_scale)
        return self._up(o_lat)

    def _expanded(self, q_nope, q_pe, rows, kv_cache, meta, kernels: bool) -> torch.Tensor:
        """The prefill rows' outputs [Tp, H, V] in the expanded form: each request's latents
        (fresh when it has no context, else all read back from the cache) up-projected in one
        matmul for all of them."""
        m, H = self.mla, self.num_heads
        L, N = m.kv_lora_rank, m.qk_nope_head_dim
        nd = meta.num_decodes
        q_lens = meta.query_lens_host[nd:]
        k_lens = meta.seq_lens_host[nd:]
        pieces = []
        s = meta.num_decodes  # the decodes' tokens come first, one each
        for i, (n, k_len) in enumerate(zip(q_lens, k_lens), start=nd):
            if k_len == n:
                pieces.append(rows[s : s + n])
            else:
                pieces.append(cached_rows(kv_cache, meta, i, rows.dtype, self.spec.k_scale))
            s += n
        keys = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        kv = self.kv_b_proj(keys[:, :L].contiguous()).view(keys.shape[0], H, -1)
        batch = ExpandedBatch(
            q_nope=q_nope,
            q_pe=q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous(),
            k_nope=kv[..., :N],
            k_pe=keys[:, L:],
            v=kv[..., N:],
            q_lens=list(q_lens),
            k_lens=list(k_lens),
        )
        attend = expanded_prefill if kernels else expanded_prefill_torch
        return attend(batch, self.spec.scale)


def deepseek_softmax_scale(qk_head_dim: int, rope_params: dict) -> float:
    """The softmax scale of DeepSeek's MLA: qk_head_dim ** -0.5, times mscale(factor,
    mscale_all_dim) squared under a scaled rope whose config names mscale_all_dim (as
    transformers' yarn_apply_mscale does)."""
    scale = qk_head_dim**-0.5
    if rope_params.get("rope_type", "default") != "default":
        mscale_all_dim = rope_params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            scale = scale * yarn_mscale(float(rope_params["factor"]), mscale_all_dim) ** 2
    return scale

"""Multi-head latent attention (MLA: DeepSeek V2/V3, Kimi K2, Mistral 4) over a paged cache of
latents: Triton kernels and their torch twins.

What the cache holds (`kv_cache.allocate_kv_cache(parts=1)`): per layer one tensor of logical
shape [1, num_blocks, block_size, 1, W], a row of W = L + R values a token: the token's
compressed KV latent (L = kv_lora_rank values, after its RMSNorm) and its rotary key (R =
qk_rope_head_dim values, rotated), shared by every head. Nothing per head is cached.

Attention comes in two forms that compute the same thing (models/mla.py chooses per step):

- **absorbed** (decode): each head's query is moved into latent space beforehand
  (q_lat = q_nope @ W_UK[h], the key half of that head's up-projection), so a score is
  q_lat . latent_j + q_pe . rope_j, one dot over the cached row; the output is the softmax
  weighted sum of latents, [T, H, L], which the caller brings up with W_UV[h] (the value half).
  It reads L + R values a key, once for all heads: `latent_decode` (Triton), `latent_decode_torch`
  (the torch backend's, batched) and `latent_decode_reference` (per request, float32); the CPU
  default path runs cpu_native.c's `mla_decode_f32` instead (`NativeKernels.latent_step`,
  tested against the reference here);
- **expanded** (prefill): the latents are brought up to per-head keys (no-rope part) and values
  first, k_nope, v = W_UK latent, W_UV latent, each key the concatenation [k_nope | rope_j];
  then ordinary causal attention with a query-key width (nope + R) unlike the value width:
  `expanded_prefill` (Triton: a ragged flash-attention kernel over the expanded keys, whose rope
  half it reads from the one shared row a key, `[Tk, R]`, never repeated per head) and
  `expanded_prefill_torch` (scaled_dot_product_attention per request).

Both kernels keep the key's two halves apart (nope and rope), so every width they load is the
model's own power of two (128 + 64, 512 + 64) rather than a padded 192 or 576.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_write import dequantize_kv, is_fp8, kv_write_index, quantize_kv
from .metadata import AttentionMetadata
from .paged_attention import (
    LOG2E,
    _reduce_splits_kernel,
    attention_mask,
    choose_num_splits,
    gather_blocks,
    head_rows,
    key_slots,
    num_sms,
    plan_torch_decodes,
)
from .triton_lazy import cdiv, jit, next_power_of_2

tl = None  # triton.language, bound at the first launch (see triton_lazy)


def _rows_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache's one part, [num_blocks, block_size, 1, W]; an 8-bit float cache seen as bytes
    (gathers of float8 tensors are not implemented on every device; bytes are bytes)."""
    rows = cache[0]
    return rows.view(torch.uint8) if is_fp8(rows.dtype) else rows


def _as_stored(rows: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Gathered rows back in the cache's dtype (undoing `_rows_view`)."""
    return rows.view(cache.dtype) if is_fp8(cache.dtype) else rows


# -- writing the cache ---------------------------------------------------------------------------


def write_latents_reference(
    rows: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float = 1.0
) -> None:
    """Each new token's row [T, W] (latent | rotary key) at its slot; padding slots (< 0)
    skipped. The torch path's write (any cache layout: indexed by block and offset)."""
    st = meta.backend_state
    index = st.get("mla_write")
    if index is None:
        index = st["mla_write"] = kv_write_index(meta.slot_mapping, meta.block_size)
    keep, at = index
    if keep is not None:
        rows = rows[keep]
    if is_fp8(cache.dtype):
        rows = quantize_kv(rows, scale, cache.dtype).view(torch.uint8)
    _rows_view(cache).index_put_((*at, torch.zeros_like(at[0])), rows)


def write_latents(
    rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale: float = 1.0
) -> None:
    """The Triton path's write: the KV write kernel (kv_write.py) with K and V both the row and
    the cache's one part seen twice (a stride-0 view), so each row lands once per copy, at the
    same place."""
    from .kv_write import reshape_and_cache

    row = rows.unsqueeze(1)  # [T, 1, W]: one "head"
    reshape_and_cache(row, row, cache.expand(2, *cache.shape[1:]), slot_mapping, scale, scale)


# -- absorbed decode: torch ----------------------------------------------------------------------


def _decode_rows(
    cache: torch.Tensor, meta: AttentionMetadata, dtype, kv_scale: float
) -> torch.Tensor:
    """The decodes' cached rows, [nd, keys, W] in `dtype` (an 8-bit cache times its scale;
    unwritten rows zeroed), through the torch backend's per-step decode plan (made here when
    the backend did not make it)."""
    st = meta.backend_state
    if "decode_blocks" not in st:
        plan_torch_decodes(meta)
    blocks = st["decode_blocks"]
    rows_index = st.get(("decode_rows", 1))
    if rows_index is None:
        rows_index = st[("decode_rows", 1)] = head_rows(blocks, 1)
    rows = _as_stored(gather_blocks(_rows_view(cache), blocks, rows_index)[:, 0], cache)
    if is_fp8(rows.dtype):
        rows = dequantize_kv(rows, kv_scale, dtype)
    elif rows.dtype != dtype:
        rows = rows.to(dtype)
    n_idx, p_idx = st["decode_unwritten"]
    rows[n_idx, p_idx] = 0  # never written: a zero weight times NaN would still be NaN
    return rows


def latent_decode_torch(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    rank: int,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """The absorbed decode in torch, all decodes at once: q [nd, H, W] (q_lat | q_pe) over each
    decode's cached rows; returns the weighted latents [nd, H, rank]. Plain matmul and softmax
    (float32), so a request's result does not depend on the batch's padding."""
    rows = _decode_rows(cache, meta, q.dtype, kv_scale)
    scores = torch.matmul(q, rows.transpose(1, 2)).float() * scale  # [nd, H, keys]
    valid = meta.backend_state["decode_valid"]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, rows[..., :rank])


def latent_decode_reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    rank: int,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Decode by decode, float32: gather the request's rows through its block table, score
    every key, softmax, weight the latents. Slow and obvious on purpose."""
    nd = meta.num_decodes
    out = torch.zeros(nd, q.shape[1], rank, dtype=q.dtype, device=q.device)
    factor = kv_scale if is_fp8(cache.dtype) else 1.0
    for i in range(nd):
        seq_len = meta.seq_lens_host[i]
        slots = key_slots(meta.block_tables[i], seq_len, meta.block_size)
        at = (slots // meta.block_size, slots % meta.block_size, 0)
        rows = _as_stored(_rows_view(cache)[at], cache).float() * factor
        scores = q[i].float() @ rows.T * scale  # [H, keys]
        out[i] = (torch.softmax(scores, dim=-1) @ rows[:, :rank]).to(q.dtype)
    return out


# -- absorbed decode: Triton ---------------------------------------------------------------------


@jit
def _latent_decode_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2e,
    kv_scale,
    num_splits,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ct,
    stride_bt,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    L_PAD: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One decode (program 0), BLOCK_H of its heads (program 1), one split of its keys (program
    2): the heads' absorbed queries against the latent rows, BLOCK_N keys a step, each row read
    once for all BLOCK_H heads (latent and rope halves loaded apart)."""
    req = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    tok = tl.load(query_start_loc_ptr + req).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req)
    hmask = heads < num_heads
    dl = tl.arange(0, L_PAD)
    dr = tl.arange(0, R_PAD)
    lmask = dl < RANK
    rmask = dr < ROPE
    q_row = q_ptr + tok * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + dl[None, :], mask=hmask[:, None] & lmask[None, :], other=0.0)
    q_pe = tl.load(q_row + RANK + dr[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)

    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    if SPLIT:
        per = tl.cdiv(n_tiles, num_splits)
        t_begin = split * per
        t_end = tl.minimum(t_begin + per, n_tiles)
    else:
        t_begin = 0
        t_end = n_tiles

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, L_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    for t in range(t_begin, t_end):
        keys = t * BLOCK_N + offs_n
        kmask = keys < seq_len
        blk = tl.load(table_row + keys // CACHE_BLOCK, mask=kmask, other=0).to(tl.int64)
        row = blk * stride_cb + (keys % CACHE_BLOCK) * stride_ct
        lat = tl.load(
            cache_ptr + row[:, None] + dl[None, :], mask=kmask[:, None] & lmask[None, :], other=0.0
        )
        pe = tl.load(
            cache_ptr + row[:, None] + RANK + dr[None, :],
            mask=kmask[:, None] & rmask[None, :],
            other=0.0,
        )
        if KV_FP8:  # an 8-bit float cache holds row / kv_scale
            lat = (lat.to(tl.float32) * kv_scale).to(q_lat.dtype)
            pe = (pe.to(tl.float32) * kv_scale).to(q_lat.dtype)
        if IEEE:
            s = tl.dot(q_lat, tl.trans(lat), input_precision="ieee")
            s += tl.dot(q_pe, tl.trans(pe), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(lat))
            s += tl.dot(q_pe, tl.trans(pe))
        s = tl.where(kmask[None, :], s * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if IEEE:
            acc += tl.dot(p.to(lat.dtype), lat, input_precision="ieee")
        else:
            acc += tl.dot(p.to(lat.dtype), lat)
        m_i = m_new

    out_mask = hmask[:, None] & lmask[None, :]
    if SPLIT:
        # Partial row r = (token * num_heads + head) * num_splits + split, as paged_attention's
        # reduce kernel reads them.
        prow = (tok * num_heads + heads) * num_splits + split
        tl.store(part_acc_ptr + prow[:, None] * L_PAD + dl[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + 2 * prow, m_i, mask=hmask)
        tl.store(part_ml_ptr + 2 * prow + 1, l_i, mask=hmask)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + tok * stride_ot + heads[:, None] * stride_oh + dl[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


@dataclass(frozen=True)
class LatentTiles:
    block_h: int  # heads a program takes (at least 16 rows for tl.dot)
    block_n: int  # keys a step
    num_warps: int
    num_stages: int


def latent_decode_tiles(
    num_heads: int, rank: int, dtype: torch.dtype, fp8: bool = False
) -> LatentTiles:
    """16 heads a program (the smallest tl.dot row tile; DeepSeek-V3's 128 heads are 8 programs
    a decode, reading the same rows from L2), 32 keys a step at a 512-wide latent (a 32 x 512
    tile of bf16 is 32 KiB; 55 KiB of shared memory in all on sm90), more keys for narrower
    latents; float32 (IEEE dots) halves them, and so does an 8-bit cache at 512 (its tiles
    are converted in shared memory: 32 keys took 104 KiB, past the 99 KiB of sm86/sm89)."""
    block_n = 32 if rank >= 256 else 64
    if dtype == torch.float32 or (fp8 and rank >= 512):
        block_n //= 2
    return LatentTiles(block_h=16, block_n=block_n, num_warps=4 if rank <= 256 else 8, num_stages=2)


def latent_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    rank: int,
    kv_scale: float = 1.0,
    *,
    num_splits: int | None = None,
    tiles: LatentTiles | None = None,
    sms: int | None = None,
) -> torch.Tensor:
    """The absorbed decode by the Triton kernel: q [nd, H, W] (q_lat | q_pe; the step's decodes
    are its first nd tokens and requests) -> weighted latents [nd, H, rank]. Split-KV (partial
    softmaxes merged by paged_attention's reduce kernel) when the decodes cannot fill the GPU;
    `num_splits` forces it (tests)."""
    nd, H, W = q.shape
    rope = W - rank
    if q.stride(-1) != 1:
        q = q.contiguous()
    rows = cache[0]  # [num_blocks, block_size, 1, W]
    if rows.stride(-1) != 1:
        raise ValueError("the latent cache needs unit stride on its row")
    out = torch.empty(nd, H, rank, dtype=q.dtype, device=q.device)
    if nd == 0:
        return out
    cfg = tiles or latent_decode_tiles(H, rank, q.dtype, is_fp8(rows.dtype))
    head_blocks = cdiv(H, cfg.block_h)
    if num_splits is None:
        sms = sms if sms is not None else num_sms(q.device)
        num_splits = choose_num_splits(nd * head_blocks, max(meta.seq_lens_host[:nd]), sms)
    split = num_splits > 1
    l_pad = max(16, next_power_of_2(rank))
    r_pad = max(16, next_power_of_2(rope))
    if split:
        part_acc = torch.empty(nd, H, num_splits, l_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(nd, H, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _latent_decode_kernel[(nd, head_blocks, num_splits)](
        q,
        rows,
        out,
        part_acc,
        part_ml,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale * LOG2E,
        float(kv_scale),
        num_splits,
        H,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        rows.stride(0),
        rows.stride(1),
        meta.block_tables.stride(0),
        RANK=rank,
        ROPE=rope,
        L_PAD=l_pad,
        R_PAD=r_pad,
        BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n,
        CACHE_BLOCK=rows.shape[1],
        SPLIT=split,
        IEEE=q.dtype == torch.float32,
        KV_FP8=is_fp8(rows.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        s_pad = next_power_of_2(num_splits)
        heads = max(1, min(next_power_of_2(H), 4096 // (s_pad * l_pad)))
        _reduce_splits_kernel[(nd, cdiv(H, heads))](
            part_acc,
            part_ml,
            out,
            0,
            H,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=rank,
            D_PAD=l_pad,
            S_PAD=s_pad,
            HEADS=heads,
            num_warps=4,
        )
    return out


# -- expanded prefill ----------------------------------------------------------------------------


@dataclass
class ExpandedBatch:
    """A step's prefill requests with their keys expanded: per request its new queries and all
    its keys (cached context, then the new ones), ragged, in request order.

    q_nope [Tq, H, N], q_pe [Tq, H, R]: the queries' halves; k_nope [Tk, H, N] and v [Tk, H, V]:
    the up-projected latents (any strides, unit on the last dim); k_pe [Tk, R]: the one shared
    rotary key a token. `q_lens`, `k_lens`: per request (host); a request's queries are its last
    q_len positions of k_len (causal)."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    k_nope: torch.Tensor
    k_pe: torch.Tensor
    v: torch.Tensor
    q_lens: list[int]
    k_lens: list[int]


def expanded_prefill_torch(b: ExpandedBatch, scale: float) -> torch.Tensor:
    """The expanded attention in torch: per request, keys [k_nope | k_pe] (the rope half
    repeated over the heads), scaled_dot_product_attention, causal from the request's context
    on. Returns [Tq, H, V]."""
    H = b.q_nope.shape[1]
    out = b.q_nope.new_empty(b.q_nope.shape[0], H, b.v.shape[-1])
    qs = ks = 0
    for n, k_len in zip(b.q_lens, b.k_lens):
        q = torch.cat([b.q_nope[qs : qs + n], b.q_pe[qs : qs + n]], dim=-1).transpose(0, 1)
        pe = b.k_pe[ks : ks + k_len, None, :].expand(k_len, H, -1)
        k = torch.cat([b.k_nope[ks : ks + k_len], pe], dim=-1).transpose(0, 1)
        v = b.v[ks : ks + k_len].transpose(0, 1)
        ctx = k_len - n
        if ctx == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            mask = attention_mask(torch.arange(ctx, k_len, device=q.device), k_len, None)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[qs : qs + n] = o.transpose(0, 1)
        qs, ks = qs + n, ks + k_len
    return out


def expanded_prefill_reference(b: ExpandedBatch, scale: float) -> torch.Tensor:
    """Request by request in float32 with the scores written out: the reference both the torch
    path and the kernel are tested against."""
    out = torch.zeros(b.q_nope.shape[0], b.q_nope.shape[1], b.v.shape[-1], dtype=b.q_nope.dtype)
    qs = ks = 0
    for n, k_len in zip(b.q_lens, b.k_lens):
        qn, qp = b.q_nope[qs : qs + n].float(), b.q_pe[qs : qs + n].float()
        kn, kp = b.k_nope[ks : ks + k_len].float(), b.k_pe[ks : ks + k_len].float()
        scores = torch.einsum("qhd,khd->hqk", qn, kn) + torch.einsum("qhd,kd->hqk", qp, kp)
        mask = attention_mask(torch.arange(k_len - n, k_len), k_len, None)
        probs = torch.softmax((scores * scale).masked_fill(~mask, float("-inf")), dim=-1)
        o = torch.einsum("hqk,khd->qhd", probs, b.v[ks : ks + k_len].float())
        out[qs : qs + n] = o.to(out.dtype)
        qs, ks = qs + n, ks + k_len
    return out.to(b.q_nope.device)


@jit
def _expanded_prefill_kernel(
    qn_ptr,
    qp_ptr,
    kn_ptr,
    kp_ptr,
    v_ptr,
    out_ptr,
    cu_q_ptr,
    cu_k_ptr,
    tile_req_ptr,
    tile_q0_ptr,
    scale_log2e,
    stride_qnt,
    stride_qnh,
    stride_qpt,
    stride_qph,
    stride_knt,
    stride_knh,
    stride_kpt,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    VDIM: tl.constexpr,
    N_PAD: tl.constexpr,
    R_PAD: tl.constexpr,
    V_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One query tile (BLOCK_M consecutive new tokens of one request: program 0 through the
    tile plan) of one head (program 1) against its request's expanded keys, flash-style: a
    score is q_nope . k_nope + q_pe . k_pe (the rope half read from the shared row a key)."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    q_start = tl.load(cu_q_ptr + req)
    q_len = tl.load(cu_q_ptr + req + 1) - q_start
    k_start = tl.load(cu_k_ptr + req)
    k_len = tl.load(cu_k_ptr + req + 1) - k_start
    ctx = k_len - q_len

    rows = q0 + tl.arange(0, BLOCK_M)
    rvalid = rows < q_len
    tok = (q_start + rows).to(tl.int64)
    pos = ctx + rows
    dn = tl.arange(0, N_PAD)
    dr = tl.arange(0, R_PAD)
    dv = tl.arange(0, V_PAD)
    nmask, rmask, vmask = dn < NOPE, dr < ROPE, dv < VDIM
    qn = tl.load(
        qn_ptr + tok[:, None] * stride_qnt + head * stride_qnh + dn[None, :],
        mask=rvalid[:, None] & nmask[None, :],
        other=0.0,
    )
    qp = tl.load(
        qp_ptr + tok[:, None] * stride_qpt + head * stride_qph + dr[None, :],
        mask=rvalid[:, None] & rmask[None, :],
        other=0.0,
    )
    hi = tl.minimum(ctx + q0 + BLOCK_M, k_len)  # keys up to the tile's last query
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, V_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(0, hi, BLOCK_N):
        keys = start + offs_n
        kmask = keys < hi
        krow = (k_start + keys).to(tl.int64)
        kn = tl.load(
            kn_ptr + krow[:, None] * stride_knt + head * stride_knh + dn[None, :],
            mask=kmask[:, None] & nmask[None, :],
            other=0.0,
        )
        kp = tl.load(
            kp_ptr + krow[:, None] * stride_kpt + dr[None, :],
            mask=kmask[:, None] & rmask[None, :],
            other=0.0,
        )
        if IEEE:
            s = tl.dot(qn, tl.trans(kn), input_precision="ieee")
            s += tl.dot(qp, tl.trans(kp), input_precision="ieee")
        else:
            s = tl.dot(qn, tl.trans(kn))
            s += tl.dot(qp, tl.trans(kp))
        allowed = (keys[None, :] <= pos[:, None]) & kmask[None, :]
        s = tl.where(allowed, s * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + krow[:, None] * stride_vt + head * stride_vh + dv[None, :],
            mask=kmask[:, None] & vmask[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None]
        if IEEE:
            acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + head * stride_oh + dv[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=rvalid[:, None] & vmask[None, :],
    )


def expanded_prefill_tiles(dtype: torch.dtype, max_q_len: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): 64 query rows x 32 keys on 4 warps in half precision (64
    KiB of shared memory at nope 128 + rope 64 + value 128 on sm90; 64 keys took 104 KiB, past
    the 99 KiB of sm86/sm89), fewer rows for short queries; 16 x 32 in float32 (IEEE dots)."""
    if dtype == torch.float32:
        return 16, 32, 4
    return max(16, min(64, next_power_of_2(max(1, max_q_len)))), 32, 4


def expanded_prefill(b: ExpandedBatch, scale: float) -> torch.Tensor:
    """The expanded attention by the Triton kernel: [Tq, H, V]."""
    Tq, H, nope = b.q_nope.shape
    rope, vdim = b.q_pe.shape[-1], b.v.shape[-1]
    out = b.q_nope.new_empty(Tq, H, vdim)
    if Tq == 0:
        return out
    for t in (b.q_nope, b.q_pe, b.k_nope, b.k_pe, b.v):
        if t.stride(-1) != 1:
            raise ValueError("expanded_prefill needs unit stride on the last dim")
    block_m, block_n, warps = expanded_prefill_tiles(b.q_nope.dtype, max(b.q_lens))
    reqs, firsts = [], []
    for r, n in enumerate(b.q_lens):
        for q0 in range(0, n, block_m):
            reqs.append(r)
            firsts.append(q0)
    device = b.q_nope.device
    plan = torch.tensor([reqs, firsts], dtype=torch.int32).to(device, non_blocking=True)
    cu = [0], [0]
    for n, k in zip(b.q_lens, b.k_lens):
        cu[0].append(cu[0][-1] + n)
        cu[1].append(cu[1][-1] + k)
    cus = torch.tensor(cu, dtype=torch.int32).to(device, non_blocking=True)
    _expanded_prefill_kernel[(len(reqs), H)](
        b.q_nope,
        b.q_pe,
        b.k_nope,
        b.k_pe,
        b.v,
        out,
        cus[0],
        cus[1],
        plan[0],
        plan[1],
        scale * LOG2E,
        b.q_nope.stride(0),
        b.q_nope.stride(1),
        b.q_pe.stride(0),
        b.q_pe.stride(1),
        b.k_nope.stride(0),
        b.k_nope.stride(1),
        b.k_pe.stride(0),
        b.v.stride(0),
        b.v.stride(1),
        out.stride(0),
        out.stride(1),
        NOPE=nope,
        ROPE=rope,
        VDIM=vdim,
        N_PAD=max(16, next_power_of_2(nope)),
        R_PAD=max(16, next_power_of_2(rope)),
        V_PAD=max(16, next_power_of_2(vdim)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE=b.q_nope.dtype == torch.float32,
        num_warps=warps,
        num_stages=2,
    )
    return out


def cached_rows(
    cache: torch.Tensor, meta: AttentionMetadata, i: int, dtype, kv_scale: float = 1.0
) -> torch.Tensor:
    """Request i's rows [seq_len, W] from the cache (its context and this step's new tokens,
    already written), through its block table; in `dtype` (an 8-bit cache times its scale)."""
    seq_len = meta.seq_lens_host[i]
    slots = key_slots(meta.block_tables[i], seq_len, meta.block_size)
    rows = _as_stored(
        _rows_view(cache)[slots // meta.block_size, slots % meta.block_size, 0], cache
    )
    if is_fp8(cache.dtype):
        return dequantize_kv(rows, kv_scale, dtype)
    return rows.to(dtype)

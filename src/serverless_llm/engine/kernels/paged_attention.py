"""Paged attention over the ragged batch of a step, in one Triton kernel for every query length.

What a program computes: one *query tile* (up to BLOCK_Q consecutive new tokens of one request)
against one KV head, for all the query heads that share that KV head (GQA/MQA). The tile's rows
are (token, head-in-group) pairs, BLOCK_M = BLOCK_Q * G_PAD of them, so a decode with 4 query
heads per KV head still feeds `tl.dot` a 16-row operand and reads each K/V tile once for the
whole group. Keys are read through the block table in tiles of BLOCK_N (independent of the cache
block size: a tile may span several cache blocks or part of one). A query at absolute position
p = context_len + i attends key j when j <= p and, with a sliding window W, p - j < W (with a
local chunk C, Llama 4's chunked layers: j >= p - p % C, the start of p's chunk). Its score
is q.k * scale, soft-capped (cap * tanh(score / cap)) when the spec has a `logit_softcap`, plus
slope[h] * (j - p) when it has `alibi_slopes`; the kernel works in log2 units (scores times
log2(e), for exp2), so the cap and the slopes are scaled by log2(e) too. A head's sink logit
(`sinks`, gpt-oss) joins the online softmax as one more score with no value: it starts the
running max and sum of the first key split.

Two launches of the same kernel per step: the decode tokens (which the model runner puts first)
with a small row tile, then everything else with a large one; each launch may split the key
range of its programs across `num_splits` programs (split-KV) when there are too few programs
to fill the GPU, and a reduce kernel merges the partial softmaxes.

Two torch implementations stand beside it: `paged_attention_torch`, the torch backend's (the
engine's CPU path: decodes batched, prefills through scaled_dot_product_attention), and
`paged_attention_reference`, a plain per-request one in float32 that both are tested against.
Triton is imported at the kernel's first launch, never for the torch code (see `triton_lazy`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .e4m3 import e4m3_as_bytes, e4m3_decode
from .kv_write import dequantize_kv, is_fp8
from .metadata import AttentionMetadata, AttentionSpec
from .triton_common import tanh
from .triton_lazy import cdiv, jit, next_power_of_2

tl = None  # triton.language, bound at the first launch (see triton_lazy)

LOG2E = 1.4426950408889634
# -1.0e30 in the kernels is a finite "minus infinity" for the running max, so a row with no
# allowed key in a tile (or in a whole split) gives exp2(-inf + 1e30) = 0 and a rescale of
# exp2(0) = 1, never NaN. A literal: a compiled kernel reads only tl.constexpr globals, and making
# one would import Triton with this module.
MAX_SPLITS = 64
MIN_KEYS_PER_SPLIT = 256
REDUCE_TILE = 4096  # partial-accumulator elements one reduce program merges
SCORE_BUDGET = 1 << 24  # float32 scores the torch path materialises at once (soft-cap)


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # rows of a query tile: BLOCK_Q tokens x G_PAD heads
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int


@jit
def _load_kv_tile(cache_ptr, blk, in_blk, kv_head, stride_b, stride_t, stride_h, dims, mask):
    """Keys or values of one KV head at cache rows (blk, in_blk): a [BLOCK_N, D_PAD] tile."""
    return tl.load(
        cache_ptr
        + blk[:, None] * stride_b
        + in_blk[:, None] * stride_t
        + kv_head * stride_h
        + dims[None, :],
        mask=mask,
        other=0.0,
    )


@jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tile_req_ptr,
    tile_q0_ptr,
    alibi_ptr,
    key_limit_ptr,
    sink_ptr,
    tok_base,
    scale_log2e,
    softcap_log2e,
    window,
    chunk,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    num_heads,
    k_scale,
    v_scale,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_E4M3_BYTES: tl.constexpr,
    HAS_LIMITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DENSE_KV: tl.constexpr = False,
    BIDIRECTIONAL: tl.constexpr = False,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req = tl.load(tile_req_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    tok_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - tok_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    row_q = q0 + rows // G_PAD  # query index inside the request
    row_h = rows % G_PAD
    row_valid = (row_q < q_len) & (row_h < GROUP)
    head = kv_head * GROUP + row_h
    tok = (tok_start + row_q).to(tl.int64)
    pos = ctx + row_q  # absolute position of each row's query

    dims = tl.arange(0, D_PAD)
    dmask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dmask[None, :],
        other=0.0,
    )
    if HAS_ALIBI:
        # Slopes in log2 units (times log2(e)), like the scores.
        slope = tl.load(alibi_ptr + head, mask=row_valid, other=0.0) * 1.4426950408889634

    # Keys this tile can see: up to its last query's position, from its first query's window.
    hi = tl.minimum(ctx + q0 + BLOCK_Q, seq_len)
    reach = pos  # the last key each row attends to
    if HAS_LIMITS:
        # Bidirectional spans (Gemma 3's images): a row may see keys after its own position,
        # up to its limit, all within the request's keys.
        limit = tl.load(key_limit_ptr + tok, mask=row_valid, other=0)
        reach = tl.maximum(pos, limit)
        hi = seq_len
    if BIDIRECTIONAL:  # encoders: every row sees all of its request's keys
        reach = tl.zeros_like(pos) + seq_len - 1
        hi = seq_len
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx + q0 - window + 1, 0)
    if HAS_CHUNK:  # nothing before the first query's chunk (later queries' start later)
        lo = tl.maximum(lo, ctx + q0 - (ctx + q0) % chunk)
    t_lo = lo // BLOCK_N
    t_hi = tl.cdiv(hi, BLOCK_N)
    if SPLIT:
        per = tl.cdiv(t_hi - t_lo, num_splits)
        t_begin = t_lo + split * per
        t_end = tl.minimum(t_begin + per, t_hi)
    else:
        t_begin = t_lo
        t_end = t_hi

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        # The head's sink is one more logit with no value: it starts the running max and sum
        # (exp2(sink - sink) = 1) of the first split only, so the reduce counts it once.
        sink = tl.load(sink_ptr + head, mask=row_valid, other=0.0).to(tl.float32)
        first = split == 0
        m_i = tl.where(first, sink * 1.4426950408889634, m_i)
        l_i = tl.where(first, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    for t in range(t_begin, t_end):
        keys = t * BLOCK_N + offs_n
        kmask = keys < hi
        if DENSE_KV:  # k and v are the step's own [T, KVH, D] rows (one "block" a token)
            blk = (tok_start + keys).to(tl.int64)
        else:
            blk = tl.load(table_row + keys // CACHE_BLOCK, mask=kmask, other=0).to(tl.int64)
        in_blk = keys % CACHE_BLOCK
        kv_mask = kmask[:, None] & dmask[None, :]
        k_tile = _load_kv_tile(
            k_cache_ptr, blk, in_blk, kv_head, stride_kb, stride_kt, stride_kh, dims, kv_mask
        )
        if KV_E4M3_BYTES:  # e4m3 held as bytes (GPUs before sm89): kernels/e4m3.py
            k = (e4m3_decode(k_tile.to(tl.int32)) * k_scale).to(q.dtype)
        elif KV_FP8:  # an 8-bit float cache holds k / k_scale
            k = (k_tile.to(tl.float32) * k_scale).to(q.dtype)
        else:
            k = k_tile
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2e
        if HAS_SOFTCAP:
            s = softcap_log2e * tanh(s / softcap_log2e)
        if HAS_ALIBI:
            s += slope[:, None] * (keys[None, :] - pos[:, None]).to(tl.float32)
        allowed = (keys[None, :] <= reach[:, None]) & kmask[None, :]
        if HAS_WINDOW:
            allowed = allowed & (pos[:, None] - keys[None, :] < window)
            if BIDIRECTIONAL:  # ModernBERT's local layers: a window on both sides
                allowed = allowed & (keys[None, :] - pos[:, None] < window)
        if HAS_CHUNK:
            allowed = allowed & (keys[None, :] >= (pos - pos % chunk)[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_tile = _load_kv_tile(
            v_cache_ptr, blk, in_blk, kv_head, stride_vb, stride_vt, stride_vh, dims, kv_mask
        )
        if KV_E4M3_BYTES:
            v = (e4m3_decode(v_tile.to(tl.int32)) * v_scale).to(q.dtype)
        elif KV_FP8:
            v = (v_tile.to(tl.float32) * v_scale).to(q.dtype)
        else:
            v = v_tile
        acc = acc * alpha[:, None]
        if IEEE:
            acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if SPLIT:
        # Partial row r = ((token - tok_base) * num_heads + head) * num_splits + split.
        prow = ((tok - tok_base) * num_heads + head) * num_splits + split
        tl.store(
            part_acc_ptr + prow[:, None] * D_PAD + dims[None, :],
            acc,
            mask=row_valid[:, None] & dmask[None, :],
        )
        tl.store(part_ml_ptr + 2 * prow, m_i, mask=row_valid)
        tl.store(part_ml_ptr + 2 * prow + 1, l_i, mask=row_valid)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dmask[None, :],
        )


@jit
def _reduce_splits_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    tok_base,
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    HEADS: tl.constexpr,
):
    """Merges the split partial softmaxes of HEADS heads of one token: rescales each split's
    sum and accumulator to the global max and divides once."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    hmask = heads < num_heads
    splits = tl.arange(0, S_PAD)
    dims = tl.arange(0, D_PAD)
    dmask = dims < HEAD_DIM
    ml_mask = hmask[:, None] & (splits < num_splits)[None, :]
    base = (t * num_heads + heads[:, None]) * num_splits + splits[None, :]  # [HEADS, S_PAD]
    m = tl.load(part_ml_ptr + 2 * base, mask=ml_mask, other=-1.0e30)
    l = tl.load(part_ml_ptr + 2 * base + 1, mask=ml_mask, other=0.0)  # noqa: E741
    m_all = tl.max(m, axis=1)
    w = tl.where(ml_mask, tl.exp2(m - m_all[:, None]), 0.0)
    denom = tl.sum(w * l, axis=1)
    denom = tl.where(denom > 0.0, denom, 1.0)
    acc = tl.load(
        part_acc_ptr + base[:, :, None] * D_PAD + dims[None, None, :],
        mask=ml_mask[:, :, None] & dmask[None, None, :],
        other=0.0,
    )
    o = tl.sum(acc * w[:, :, None], axis=1) / denom[:, None]  # [HEADS, D_PAD]
    tl.store(
        out_ptr + (tok_base + t) * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=hmask[:, None] & dmask[None, :],
    )


# -- planning --------------------------------------------------------------------------------


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a stand-in of 16 elsewhere (the interpreter),
    so split-KV is exercised at the small shapes tests use."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 16


def decode_tiles(group: int, head_dim: int, dtype: torch.dtype) -> TileConfig:
    """One token per request: the row tile is just the query-head group (at least 16 rows for
    tl.dot). Decode is bound by K/V reads: 64-key tiles on 4 warps keep ~110 registers a thread
    at head_dim 128 (sm90, bf16), so four programs share an SM with loads in flight."""
    g_pad = next_power_of_2(group)
    block_m = max(16, g_pad)
    block_n = 64 if head_dim <= 128 else 32
    return TileConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2)


def prefill_tiles(group: int, head_dim: int, max_query_len: int, dtype: torch.dtype) -> TileConfig:
    """Many tokens per request: flash-attention-sized tiles (128 rows x 64 keys on 8 warps, 3
    stages: ~190 registers, 96 KiB shared memory at head_dim 128 in bf16, no spills), fewer rows
    when the longest query is short so padding rows are not computed. Heads wider than 128
    (Gemma's 256) take at most 64 rows x 32 keys: 128 rows needed 104-128 KiB of shared memory,
    past the 99 KiB a block may use on sm86 and sm89 GPUs (RTX 30xx/40xx, A40, L4, L40S); 64
    rows use 68-96 KiB, without spills (tests/kernels/gpu_compile.py checks both). float32 (IEEE
    dots, a debugging dtype on GPU) spills with anything bigger than the decode tiles, so it
    uses them."""
    if dtype == torch.float32:
        return decode_tiles(group, head_dim, dtype)
    g_pad = next_power_of_2(group)
    rows_needed = next_power_of_2(max(1, max_query_len)) * g_pad
    if head_dim > 128:
        block_m = max(16, g_pad, min(64, rows_needed))
        return TileConfig(block_m=block_m, block_n=32, num_warps=8 if block_m >= 64 else 4,
                          num_stages=3)  # fmt: skip
    block_m = max(16, g_pad, min(128, rows_needed))
    num_warps = 8 if block_m >= 128 and head_dim >= 128 else 4
    return TileConfig(block_m=block_m, block_n=64, num_warps=num_warps, num_stages=3)


def choose_num_splits(num_programs: int, max_seq_len: int, sms: int) -> int:
    """Split-KV when the programs of a launch cannot fill the GPU (fewer than two per SM) and
    the keys are long enough that each split still reads at least MIN_KEYS_PER_SPLIT of them:
    a lone 8k-token decode over 8 KV heads becomes 8 x 32 programs of 256 keys each."""
    target = 2 * sms
    if num_programs >= target:
        return 1
    by_occupancy = cdiv(target, max(1, num_programs))
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    return max(1, min(MAX_SPLITS, by_occupancy, by_length))


def _tile_plan(
    meta: AttentionMetadata, first: int, last: int, block_q: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """For requests first..last-1: (request index, first query index) of each query tile.
    Built from the host copies of the query lengths (no device sync), once per step: the
    layers share it through meta.backend_state."""
    key = ("tiles", first, last, block_q)
    cached = meta.backend_state.get(key)
    if cached is not None:
        return cached
    lens = meta.query_lens_host[first:last]
    if all(n <= block_q for n in lens):  # decodes: one tile a request, made on the device
        reqs = torch.arange(first, last, dtype=torch.int32, device=device)
        plan = (reqs, torch.zeros_like(reqs))
    else:
        tiles: list[tuple[int, int, int]] = []  # (keys to read, request, first query)
        for r, n in enumerate(lens, start=first):
            ctx = meta.seq_lens_host[r] - n
            for q0 in range(0, n, block_q):
                tiles.append((ctx + min(q0 + block_q, n), r, q0))
        # Longest first: the causal tail of a long prompt starts early instead of running alone
        # at the end of the grid.
        tiles.sort(key=lambda t: -t[0])
        both = torch.tensor([[t[1] for t in tiles], [t[2] for t in tiles]], dtype=torch.int32)
        both = both.to(device, non_blocking=True)
        plan = (both[0], both[1])
    meta.backend_state[key] = plan
    return plan


# -- launch ------------------------------------------------------------------------------------


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    spec: AttentionSpec,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    decode_config: TileConfig | None = None,
    prefill_config: TileConfig | None = None,
    sms: int | None = None,
    e4m3_bytes: bool | None = None,
) -> torch.Tensor:
    """Attention of the step's queries q [T, H, D] over the paged cache (the new tokens' K/V
    must already be written). Returns [T, H * D]; rows of padding tokens past the last request
    are left unwritten. `num_splits` forces split-KV (tests); None lets the heuristic choose.
    `e4m3_bytes`: read an e4m3 cache as bytes through kernels/e4m3.py (None: where the GPU
    needs it)."""
    T, H, D = q.shape
    if H != spec.num_heads or D != spec.head_dim:
        raise ValueError(f"q is {tuple(q.shape)}, spec says {spec.num_heads} heads x {D}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(T, H * D, dtype=q.dtype, device=q.device)
    out3 = out.view(T, H, D)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the KV cache needs unit stride on head_dim")
    group = H // spec.num_kv_heads
    sms = sms if sms is not None else num_sms(q.device)
    if e4m3_bytes is None:
        e4m3_bytes = e4m3_as_bytes(key_cache.dtype, key_cache.device)
    fp8 = is_fp8(key_cache.dtype)
    if e4m3_bytes:
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    nd = meta.num_decodes
    n_req = meta.num_requests
    _device_key_limits(meta, q.device)
    if nd:
        cfg = decode_config or decode_tiles(group, D, q.dtype)
        _launch(q, key_cache, value_cache, out3, meta, spec, 0, nd, 0, cfg, num_splits, sms, fp8)
    if n_req > nd:
        max_q = max(meta.query_lens_host[nd:])
        cfg = prefill_config or prefill_tiles(group, D, max_q, q.dtype)
        _launch(
            q, key_cache, value_cache, out3, meta, spec, nd, n_req, nd, cfg, num_splits, sms, fp8
        )
    return out


def _device_key_limits(meta: AttentionMetadata, device: torch.device) -> None:
    """The step's key limits as one int32 tensor over its tokens (every request's rows; a
    causal request's limit is its own position), built once a step in backend_state."""
    if meta.key_limits_host is None or "key_limits" in meta.backend_state:
        return
    flat: list[int] = []
    for n, seq, limits in zip(meta.query_lens_host, meta.seq_lens_host, meta.key_limits_host):
        flat.extend(limits if limits is not None else range(seq - n, seq))
    meta.backend_state["key_limits"] = torch.tensor(flat, dtype=torch.int32, device=device)


def _launch(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out3: torch.Tensor,
    meta: AttentionMetadata,
    spec: AttentionSpec,
    first: int,
    last: int,
    tok_base: int,
    cfg: TileConfig,
    num_splits: int | None,
    sms: int,
    fp8: bool,
    dense: bool = False,
) -> None:
    """One launch over requests first..last-1, whose tokens start at `tok_base`; `fp8`: the
    cache holds 8-bit floats (as bytes when its dtype is uint8: e4m3 through kernels/e4m3.py).
    `dense`: the "cache" halves are the step's own k and v as [T, 1, KVH, D], attended both
    ways within each request (`encoder_attention`)."""
    H, D = spec.num_heads, spec.head_dim
    kvh = spec.num_kv_heads
    group = H // kvh
    g_pad = next_power_of_2(group)
    block_m = max(cfg.block_m, g_pad)
    block_q = block_m // g_pad
    tile_req, tile_q0 = _tile_plan(meta, first, last, block_q, q.device)
    n_tiles = tile_req.shape[0]
    if num_splits is None:
        max_seq = max(meta.seq_lens_host[first:last])
        num_splits = choose_num_splits(n_tiles * kvh, max_seq, sms)
    split = num_splits > 1
    d_pad = next_power_of_2(D)
    n_tok = sum(meta.query_lens_host[first:last])
    if split:
        part_acc = torch.empty(n_tok, H, num_splits, d_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(n_tok, H, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out3  # unused
    window = spec.sliding_window or 0
    softcap = spec.logit_softcap
    slopes = spec.alibi_slopes
    if slopes is not None:
        slopes = slopes.to(q.device, torch.float32)  # a no-op when the model put them there
    key_cache_block = key_cache.shape[1]
    limits = meta.backend_state.get("key_limits")
    tables = tile_req if dense else meta.block_tables  # unread when dense
    _paged_attention_kernel[(n_tiles, kvh, num_splits)](
        q,
        key_cache,
        value_cache,
        out3,
        part_acc,
        part_ml,
        tables,
        meta.seq_lens,
        meta.query_start_loc,
        tile_req,
        tile_q0,
        slopes if slopes is not None else tile_req,  # unused without ALiBi
        limits if limits is not None else tile_req,  # unused without bidirectional spans
        spec.sinks if spec.sinks is not None else tile_req,  # unused without sinks
        tok_base,
        spec.scale * LOG2E,
        (softcap or 1.0) * LOG2E,
        window,
        spec.chunk_size or 1,
        num_splits,
        q.stride(0),
        q.stride(1),
        out3.stride(0),
        out3.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        tables.stride(0),
        H,
        float(spec.k_scale),
        float(spec.v_scale),
        GROUP=group,
        G_PAD=g_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        HEAD_DIM=D,
        D_PAD=d_pad,
        CACHE_BLOCK=key_cache_block,
        HAS_WINDOW=spec.sliding_window is not None,
        HAS_CHUNK=spec.chunk_size is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_ALIBI=slopes is not None,
        SPLIT=split,
        IEEE=q.dtype == torch.float32,
        KV_FP8=fp8,
        KV_E4M3_BYTES=key_cache.dtype == torch.uint8,
        HAS_LIMITS=limits is not None,
        HAS_SINKS=spec.sinks is not None,
        DENSE_KV=dense,
        BIDIRECTIONAL=dense,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        s_pad = next_power_of_2(num_splits)
        heads = max(1, min(next_power_of_2(H), REDUCE_TILE // (s_pad * d_pad)))
        _reduce_splits_kernel[(n_tok, cdiv(H, heads))](
            part_acc,
            part_ml,
            out3,
            tok_base,
            H,
            num_splits,
            out3.stride(0),
            out3.stride(1),
            HEAD_DIM=D,
            D_PAD=d_pad,
            S_PAD=s_pad,
            HEADS=heads,
            num_warps=4,
        )


def encoder_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    spec: AttentionSpec,
    *,
    config: TileConfig | None = None,
    num_splits: int | None = None,
    sms: int | None = None,
) -> torch.Tensor:
    """Bidirectional attention of encoder rows: q [T, H, D], k and v [T, KVH, D], each request's
    queries over all of its own keys (the step's requests whole: no cache, no context), in the
    paged kernel with its K/V read straight from k and v (DENSE_KV) and no causal mask
    (BIDIRECTIONAL). Returns [T, H * D]."""
    T, H, D = q.shape
    if H != spec.num_heads or D != spec.head_dim:
        raise ValueError(f"q is {tuple(q.shape)}, spec says {spec.num_heads} heads x {D}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    out = torch.empty(T, H * D, dtype=q.dtype, device=q.device)
    n_req = meta.num_requests
    if n_req == 0:
        return out
    group = H // spec.num_kv_heads
    cfg = config or prefill_tiles(group, D, max(meta.query_lens_host), q.dtype)
    sms = sms if sms is not None else num_sms(q.device)
    _launch(
        q, k.unsqueeze(1), v.unsqueeze(1), out.view(T, H, D), meta, spec, 0, n_req, 0, cfg,
        num_splits, sms, False, dense=True,
    )  # fmt: skip
    return out


# -- torch: the torch backend's attention and the reference --------------------------------


def encoder_attention_torch(q, k, v, meta: AttentionMetadata, spec: AttentionSpec):
    """What `encoder_attention` computes, one request at a time through SDPA (no mask: each
    request's rows see all of its rows; with a sliding window, those within window - 1
    positions either side). The torch backend's encoder path."""
    T = q.shape[0]
    out = torch.empty(T, spec.num_heads * spec.head_dim, dtype=q.dtype, device=q.device)
    gqa = spec.num_heads != spec.num_kv_heads
    s = 0
    for n in meta.query_lens_host:
        e = s + n
        qh, kh, vh = (x[s:e].transpose(0, 1) for x in (q, k, v))
        mask = _two_sided_window(n, spec.sliding_window, q.device)
        o = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, scale=spec.scale, enable_gqa=gqa
        )
        out[s:e] = o.transpose(0, 1).reshape(n, -1)
        s = e
    return out


def _two_sided_window(n: int, window: int | None, device) -> torch.Tensor | None:
    """[n, n] bool: |i - j| < window (None without a window, or one covering all n)."""
    if window is None or window >= n:
        return None
    idx = torch.arange(n, device=device)
    return (idx[:, None] - idx[None, :]).abs() < window


def encoder_attention_reference(q, k, v, meta: AttentionMetadata, spec: AttentionSpec):
    """Plain float32 per-request softmax(q k^T * scale) v over the request's own rows."""
    group = spec.num_heads // spec.num_kv_heads
    out = torch.zeros(q.shape[0], spec.num_heads * spec.head_dim, dtype=q.dtype)
    s = 0
    for n in meta.query_lens_host:
        e = s + n
        keys = k[s:e].float().repeat_interleave(group, dim=1)  # [n, H, D]
        values = v[s:e].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q[s:e].float(), keys) * spec.scale
        mask = _two_sided_window(n, spec.sliding_window, q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask[None], float("-inf"))
        o = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), values)
        out[s:e] = o.reshape(n, -1).to(q.dtype)
        s = e
    return out


def key_slots(block_table: torch.Tensor, num_keys: int, block_size: int) -> torch.Tensor:
    """Cache slots of keys 0..num_keys-1 of one request, from its block table row."""
    pos = torch.arange(num_keys, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


def attention_mask(
    query_positions: torch.Tensor,
    num_keys: int,
    sliding_window: int | None,
    key_limits: list[int] | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """[q, num_keys] bool: causal, and inside the sliding window when there is one (inside the
    query's chunk with `chunk_size`); with `key_limits` (a bidirectional span), query r also
    attends to keys after it up to key_limits[r]."""
    keys = torch.arange(num_keys, device=query_positions.device)
    diff = query_positions[:, None] - keys[None, :]
    allowed = diff >= 0
    if sliding_window is not None:
        allowed &= diff < sliding_window
    if chunk_size is not None:
        allowed &= keys[None, :] >= (query_positions - query_positions % chunk_size)[:, None]
    if key_limits is not None:
        limits = torch.tensor(key_limits, device=query_positions.device)
        allowed |= (diff < 0) & (keys[None, :] <= limits[:, None])
    return allowed


def request_key_limits(meta: AttentionMetadata, i: int) -> list[int] | None:
    """Request i's key limits (a bidirectional span in its chunk), or None: causal."""
    limits = meta.key_limits_host
    return None if limits is None else limits[i]


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, rows=None) -> torch.Tensor:
    """One half of a layer's cache (logical [num_blocks, block_size, KVH, D], any layout) read at
    `blocks` ([..., n] block ids): [..., KVH, n * block_size, D], keys in order.

    On a head-major cache (`allocate_kv_cache(head_major=True)`, the torch backend's) each
    (block, head) pair is one row of block_size x D, so this is one index_select of those rows:
    the result is already in the [heads, keys, dim] order `matmul` wants, with no second copy.
    A layer's view of narrower entries in a wider layer's tensor (`kv_cache.layer_view`, Gemma
    4) is read the same way: its rows lie at fixed offsets in the wide tensor (`head_layout`),
    each a block_size x stride tile whose first D values a token are the layer's, so the tiles
    are copied whole and the result is their [..., :D] slice (strided: matmul reads it as is).
    `rows` is the row index when the caller has it (`head_rows(blocks, KVH, period)`). Any
    other layout is gathered by logical indexing, then reordered (two copies: tests and
    references only)."""
    nb, bs, kvh, d = cache.shape
    lead, n = blocks.shape[:-1], blocks.shape[-1]
    layout = head_layout(cache)
    if layout is not None:
        period, token_stride = layout
        if rows is None:
            rows = head_rows(blocks, kvh, period)
        tiles = cache.as_strided(
            (nb * period, bs, token_stride), (cache.stride(0) // period, token_stride, 1)
        )
        out = tiles.index_select(0, rows).view(*lead, kvh, n * bs, token_stride)
        return out if token_stride == d else out[..., :d]
    picked = cache[blocks.long()]  # [..., n, bs, KVH, D]
    return picked.movedim(-2, -4).reshape(*lead, kvh, n * bs, d)


def head_layout(cache: torch.Tensor) -> tuple[int, int] | None:
    """(period, token stride) of a head-major cache half (logical [num_blocks, block_size, KVH,
    D]) whose (block, head) rows are whole tiles of the tensor: row (b, h) starts at
    (b * period + h) tiles of block_size x token stride values, a token's D values first in its
    tile row. The cache `allocate_kv_cache` makes: period KVH, token stride D; a
    `kv_cache.layer_view` of it: the wide tensor's period and token stride (heads inside heads)
    or the narrow ones (packed at the block's start) when a block holds whole tiles. None for
    any other layout (token-major)."""
    nb, bs, kvh, d = cache.shape
    sb, st, sh, sd = cache.stride()
    st = d if bs == 1 else st  # (a dim of one: its stride means nothing)
    sh = bs * st if kvh == 1 else sh
    if (sd != 1 and d > 1) or st < d or sh != bs * st:
        return None
    if nb > 1 and sb % sh:
        return None
    period = sb // sh if nb > 1 else kvh
    if period < kvh:
        return None
    return period, st


def head_rows(blocks: torch.Tensor, num_kv_heads: int, period: int | None = None) -> torch.Tensor:
    """The head-major cache's (block, head) rows for `blocks` [..., n], flattened in the order
    [..., head, block]; `period`: rows a block spans (`head_layout`; default num_kv_heads)."""
    heads = torch.arange(num_kv_heads, device=blocks.device)[:, None]
    period = num_kv_heads if period is None else period
    return (blocks.long().unsqueeze(-2) * period + heads).reshape(-1)


def plan_torch_decodes(meta: AttentionMetadata) -> None:
    """Once a step, for `paged_attention_torch` in every layer: the decodes' blocks (their block
    table rows cut to the longest decode's blocks) and which key positions of the gathered
    blocks are real, into meta.backend_state."""
    nd = meta.num_decodes
    if nd == 0:
        return
    device = meta.block_tables.device
    lens = meta.seq_lens[:nd].long()
    bs = meta.block_size
    num_blocks = -(-max(meta.seq_lens_host[:nd]) // bs)
    pos = torch.arange(num_blocks * bs, device=device)
    valid = pos[None, :] < lens[:, None]
    st = meta.backend_state
    # Table padding is block 0: real memory, masked out like every position past a decode's
    # length.
    st["decode_blocks"] = meta.block_tables[:nd, :num_blocks].long()
    st["decode_valid"] = valid
    st["decode_masked"] = ~valid[:, None, None, :]  # [nd, 1, 1, L]: the scores' shape
    st["decode_pos"] = pos
    st["decode_last"] = lens - 1
    # Positions past a decode's length in its last block may never have been written (the cache
    # is not zero-filled): their values are zeroed after the gather, since a zero probability
    # times NaN would still be NaN. (Their keys are harmless: the mask replaces their scores.)
    st["decode_unwritten"] = (~valid).nonzero(as_tuple=True)


def paged_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    spec: AttentionSpec,
) -> torch.Tensor:
    """What `paged_attention` computes, in torch (the new tokens' K/V already written; k and v
    are still read directly by a prefill with no context). Decodes run as one batched
    gather-and-matmul over padded key lists (planned by `plan_torch_decodes`); prefills run one
    request at a time through scaled_dot_product_attention (ALiBi as its additive float mask),
    or with a soft-cap through `_attend_explicit`, which materialises the scores."""
    T = q.shape[0]
    out = torch.empty(T, spec.num_heads * spec.head_dim, dtype=q.dtype, device=q.device)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode_torch(q[:nd], kv_cache, meta, spec)
    s = nd
    for i in range(nd, meta.num_requests):
        e = s + meta.query_lens_host[i]
        out[s:e] = prefill_torch(q[s:e], k[s:e], v[s:e], kv_cache, meta, spec, i)
        s = e
    return out


def _decode_torch(q, kv_cache, meta, spec):
    st = meta.backend_state
    blocks, valid = st["decode_blocks"], st["decode_valid"]
    nd, L = valid.shape
    kvh, g, d = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim
    layout = head_layout(kv_cache[0])
    period = kvh if layout is None else layout[0]
    rows = st.get(("decode_rows", kvh, period))
    if rows is None:
        rows = st[("decode_rows", kvh, period)] = head_rows(blocks, kvh, period)
    # (The math below stays plain matmul + softmax: unlike SDPA's blocked kernel, it gives each
    # request the same result whatever the padding, so outputs do not depend on what else is in
    # the batch.)
    keys = gather_blocks(kv_cache[0], blocks, rows)  # [nd, KVH, L, D]
    values = gather_blocks(kv_cache[1], blocks, rows)
    if is_fp8(kv_cache.dtype):
        keys = dequantize_kv(keys, spec.k_scale, q.dtype)
        values = dequantize_kv(values, spec.v_scale, q.dtype)
    n_idx, p_idx = st["decode_unwritten"]
    values[n_idx, :, p_idx] = 0
    qg = q.view(nd, kvh, g, d)
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * spec.scale  # [nd, KVH, G, L]
    if spec.logit_softcap is not None or spec.alibi_slopes is not None:
        scores = _softcap(scores.float(), spec)
        if spec.alibi_slopes is not None:
            rel = st["decode_pos"][None, :] - st["decode_last"][:, None]  # [nd, L]: j - p
            scores = scores + _slopes(spec, q.device, kvh, g, 1) * rel[:, None, None, :]
    masked = st["decode_masked"]
    if spec.sliding_window is not None:
        inside = st["decode_last"][:, None] - st["decode_pos"][None, :] < spec.sliding_window
        masked = ~(valid & inside)[:, None, None, :]
    if spec.chunk_size is not None:  # keys before the decode's chunk
        last = st["decode_last"]
        before = st["decode_pos"][None, :] < (last - last % spec.chunk_size)[:, None]
        masked = masked | before[:, None, None, :]
    scores = scores.masked_fill(masked, float("-inf"))
    probs = _softmax(scores.float(), spec, (1, kvh, g, 1)).to(q.dtype)
    o = torch.matmul(probs, values)  # [nd, KVH, G, D]
    return o.reshape(nd, kvh * g * d)


def prefill_torch(q, k, v, kv_cache, meta, spec, i):
    """Request i's prefill rows (its K/V already written), through SDPA or `_attend_explicit`."""
    n = q.shape[0]
    seq_len = meta.seq_lens_host[i]
    ctx = seq_len - n
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, n, D]
    fp8 = is_fp8(kv_cache.dtype)
    if ctx > 0 or fp8:  # an 8-bit float cache: attend to what it holds, as the kernel does
        blocks = meta.block_tables[i, : -(-seq_len // meta.block_size)]
        kh = gather_blocks(kv_cache[0], blocks)[:, :seq_len]
        vh = gather_blocks(kv_cache[1], blocks)[:, :seq_len]
        if fp8:
            kh = dequantize_kv(kh, spec.k_scale, q.dtype)
            vh = dequantize_kv(vh, spec.v_scale, q.dtype)
    limits = request_key_limits(meta, i)
    if spec.logit_softcap is not None or spec.sinks is not None:
        # tanh between the scores and the softmax, or a sink logit inside it: no fused kernel
        # has room for them.
        return _attend_explicit(q, kh, vh, ctx, spec, limits)
    qh = q.transpose(0, 1)
    gqa = spec.num_heads != spec.num_kv_heads
    local = spec.sliding_window is not None or spec.chunk_size is not None
    if ctx == 0 and not local and spec.alibi_slopes is None and not limits:
        o = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=spec.scale, enable_gqa=gqa
        )
    else:
        positions = torch.arange(ctx, seq_len, device=q.device)
        mask = attention_mask(positions, seq_len, spec.sliding_window, limits, spec.chunk_size)
        if spec.alibi_slopes is not None:
            # ALiBi as an additive float32 mask [H, n, L]: SDPA adds it to the scaled scores.
            rel = torch.arange(seq_len, device=q.device)[None, :] - positions[:, None]
            bias = _slopes(spec, q.device, -1, 1, 1) * rel[None]
            mask = bias.masked_fill(~mask[None], float("-inf"))
        o = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, scale=spec.scale, enable_gqa=gqa
        )
    return o.transpose(0, 1).reshape(n, spec.num_heads * spec.head_dim)


def _softcap(scores: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    cap = spec.logit_softcap
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _softmax(scores: torch.Tensor, spec: AttentionSpec, shape: tuple) -> torch.Tensor:
    """Softmax over the last dim of float32 scores whose heads are laid out as `shape` (with
    1 for the other dims); with sinks, over the scores and one sink logit per head, dropped
    after (it has no value)."""
    if spec.sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = spec.sinks.to(scores.device, torch.float32).view(shape)
    both = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(both, dim=-1)[..., :-1]


def _slopes(spec: AttentionSpec, device: torch.device, *shape: int) -> torch.Tensor:
    """The ALiBi slopes in float32, viewed as `shape` to broadcast against a score layout."""
    return spec.alibi_slopes.to(device, torch.float32).view(*shape)


def _attend_explicit(q, k, v, ctx, spec, limits=None):
    """Attention with the scores materialised (the soft-cap's tanh, the sinks): q [n, H, D] at
    positions ctx.., over keys k, v [KVH, L, D]; float32 scores, a block of query rows at a
    time so a long prompt's scores stay within SCORE_BUDGET elements."""
    n, L = q.shape[0], k.shape[1]
    kvh, d = spec.num_kv_heads, spec.head_dim
    g = spec.num_heads // kvh
    kt = k.transpose(1, 2)  # [KVH, D, L]
    vv = v  # [KVH, L, D]
    keys = torch.arange(L, device=q.device)
    slopes = _slopes(spec, q.device, kvh, 1, g, 1) if spec.alibi_slopes is not None else None
    out = torch.empty(n, spec.num_heads * d, dtype=q.dtype, device=q.device)
    step = max(1, SCORE_BUDGET // (spec.num_heads * L))
    for a in range(0, n, step):
        b = min(n, a + step)
        m = b - a
        qa = q[a:b].view(m, kvh, g, d).transpose(0, 1).reshape(kvh, m * g, d)
        scores = torch.matmul(qa, kt).view(kvh, m, g, L).float() * spec.scale
        scores = _softcap(scores, spec)
        rel = keys[None, :] - torch.arange(ctx + a, ctx + b, device=q.device)[:, None]  # j - p
        if slopes is not None:
            scores = scores + slopes * rel[:, None, :]
        allowed = rel <= 0
        if spec.sliding_window is not None:
            allowed &= rel > -spec.sliding_window
        if spec.chunk_size is not None:
            qpos = torch.arange(ctx + a, ctx + b, device=q.device)
            allowed &= keys[None, :] >= (qpos - qpos % spec.chunk_size)[:, None]
        if limits:
            lim = torch.tensor(limits[a:b], device=q.device)
            allowed |= (rel > 0) & (keys[None, :] <= lim[:, None])
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
        probs = _softmax(scores, spec, (kvh, 1, g, 1)).to(q.dtype).view(kvh, m * g, L)
        o = torch.matmul(probs, vv).view(kvh, m, g, d)  # [KVH, m, G, D]
        out[a:b] = o.transpose(0, 1).reshape(m, -1)
    return out


def paged_attention_reference(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, spec: AttentionSpec
) -> torch.Tensor:
    """Request by request: gather the keys through the block table, scale, soft-cap and add
    the ALiBi bias (when the spec has them), mask causally (and by the window or chunk), softmax in
    float32 (with the sink logits as one more column when the spec has them, dropped after).
    Slow and obvious on purpose."""
    T = q.shape[0]
    out = torch.zeros(T, spec.num_heads * spec.head_dim, dtype=q.dtype, device=q.device)
    qsl = meta.query_start_loc.tolist()
    for i in range(meta.num_requests):
        out[qsl[i] : qsl[i + 1]] = reference_request(q, kv_cache, meta, spec, i, qsl)
    return out


def reference_request(q, kv_cache, meta: AttentionMetadata, spec: AttentionSpec, i: int, qsl):
    """Request i's rows of `paged_attention_reference` (the Triton backend also takes it for
    a request whose chunk holds a bidirectional span, which its kernel does not mask)."""
    kvh = spec.num_kv_heads
    group = spec.num_heads // kvh
    s, e = qsl[i], qsl[i + 1]
    seq_len = meta.seq_lens_host[i]
    ctx = seq_len - (e - s)
    slots = key_slots(meta.block_tables[i], seq_len, meta.block_size)
    at = (slots // meta.block_size, slots % meta.block_size)  # logical: any cache layout
    k_scale, v_scale = (x if is_fp8(kv_cache.dtype) else 1.0 for x in (spec.k_scale, spec.v_scale))
    keys = (kv_cache[0][at].float() * k_scale).repeat_interleave(group, dim=1)  # [L, H, D]
    values = (kv_cache[1][at].float() * v_scale).repeat_interleave(group, dim=1)
    qi = q[s:e].float()  # [n, H, D]
    scores = torch.einsum("nhd,lhd->hnl", qi, keys) * spec.scale
    if spec.logit_softcap is not None:
        scores = spec.logit_softcap * torch.tanh(scores / spec.logit_softcap)
    positions = torch.arange(ctx, seq_len, device=q.device)
    if spec.alibi_slopes is not None:
        rel = torch.arange(seq_len, device=q.device)[None, :] - positions[:, None]  # j - p
        scores = scores + spec.alibi_slopes.float().to(q.device)[:, None, None] * rel[None]
    limits = request_key_limits(meta, i)
    mask = attention_mask(positions, seq_len, spec.sliding_window, limits, spec.chunk_size)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    if spec.sinks is not None:  # one more logit per head, with no value
        sink = spec.sinks.float().to(q.device)[:, None, None].expand(-1, e - s, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :seq_len]
    o = torch.einsum("hnl,lhd->nhd", probs, values)
    return o.reshape(e - s, -1).to(q.dtype)

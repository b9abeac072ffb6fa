"""KV cache write (reshape_and_cache): each new token's K and V into its cache slot, as a Triton
kernel and as its torch reference.

The cache of a layer is [2, num_blocks, block_size, num_kv_heads, head_dim] (its logical shape;
the memory may be head-major inside each block, see `allocate_kv_cache`); slot s is offset
s % block_size of block s // block_size. A negative slot marks a padding token and is skipped.
A program of the kernel copies a few whole tokens (all their heads), so each row it moves is
contiguous. Triton is imported at the kernel's first launch, never for the reference (see
`triton_lazy`).

An 8-bit float cache (KV_CACHE_DTYPE fp8) stores k / k_scale and v / v_scale, computed in float32,
clamped to the format's largest finite value and rounded to it (`quantize_kv`); the readers
multiply the scale back (`dequantize_kv`).
"""

from __future__ import annotations

import torch

from .e4m3 import e4m3_as_bytes, e4m3_encode
from .triton_lazy import cdiv, jit, next_power_of_2

tl = None  # triton.language, bound at the first launch (see triton_lazy)


KvWriteIndex = tuple  # (rows to keep or None, (block ids, offsets))

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in `dtype`, clamped to its finite range (an 8-bit float cache)."""
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-top, top).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """An 8-bit float cache's values back in `dtype` (x * scale, in float32)."""
    return (x.float() * scale).to(dtype)


def kv_write_index(slot_mapping: torch.Tensor, block_size: int) -> KvWriteIndex:
    """Where the torch reference writes: the rows with a real slot (None: all of them) and
    their (block, offset) pairs. The same for every layer of a step, so a backend makes it once
    a step."""
    valid = slot_mapping >= 0
    keep = None if bool(valid.all()) else valid
    slots = slot_mapping if keep is None else slot_mapping[keep]
    return keep, (slots // block_size, slots % block_size)


def reshape_and_cache_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    index: KvWriteIndex | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """The torch reference (what the torch backend runs): each token's K and V at its slot;
    padding slots (< 0) are skipped. Indexed by (block, offset), so it writes any cache layout
    (the torch backend's is head-major, see `allocate_kv_cache`). `index`: the step's
    `kv_write_index`, when the caller has it. An 8-bit float cache gets k / k_scale and
    v / v_scale."""
    keep, at = index if index is not None else kv_write_index(slot_mapping, kv_cache.shape[2])
    if keep is not None:
        k, v = k[keep], v[keep]
    if is_fp8(kv_cache.dtype):
        k, v = quantize_kv(k, k_scale, kv_cache.dtype), quantize_kv(v, v_scale, kv_cache.dtype)
    kv_cache[0].index_put_(at, k)
    kv_cache[1].index_put_(at, v)


@jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    num_kv_heads,
    head_dim,
    k_scale,
    v_scale,
    fp8_max,
    QUANT: tl.constexpr,
    E4M3_BYTES: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    TOKENS: tl.constexpr,
    D_PAD: tl.constexpr,
    ROW_PAD: tl.constexpr,
):
    """A [TOKENS, ROW_PAD] tile: TOKENS tokens, each row all its heads (head-major, D_PAD lanes
    a head)."""
    toks = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    tmask = toks < num_tokens
    slots = tl.load(slot_ptr + toks, mask=tmask, other=-1).to(tl.int64)
    # A padding slot (< 0) masks its whole row: nothing is read or written for it.
    live = tmask & (slots >= 0)
    slots = tl.maximum(slots, 0)
    cols = tl.arange(0, ROW_PAD)
    heads = cols // D_PAD
    dims = cols % D_PAD
    cmask = (heads < num_kv_heads) & (dims < head_dim)
    mask = live[:, None] & cmask[None, :]
    toks64 = toks.to(tl.int64)[:, None]
    src_k = toks64 * stride_kt + (heads * stride_kh + dims)[None, :]
    src_v = toks64 * stride_vt + (heads * stride_vh + dims)[None, :]
    dst = (slots // CACHE_BLOCK) * stride_cb + (slots % CACHE_BLOCK) * stride_ct
    dst = dst[:, None] + (heads * stride_ch + dims)[None, :]
    k = tl.load(k_ptr + src_k, mask=mask, other=0.0)
    v = tl.load(v_ptr + src_v, mask=mask, other=0.0)
    if QUANT:  # k / k_scale, clamped to the 8-bit format's range (no variable changes type)
        kq = tl.minimum(tl.maximum(k.to(tl.float32) / k_scale, -fp8_max), fp8_max)
        vq = tl.minimum(tl.maximum(v.to(tl.float32) / v_scale, -fp8_max), fp8_max)
        if E4M3_BYTES:  # an e4m3 cache seen as bytes (GPUs before sm89): kernels/e4m3.py
            tl.store(k_cache_ptr + dst, e4m3_encode(kq).to(tl.uint8), mask=mask)
            tl.store(v_cache_ptr + dst, e4m3_encode(vq).to(tl.uint8), mask=mask)
        else:
            tl.store(k_cache_ptr + dst, kq.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dst, vq.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# Elements a program moves (per tensor): enough to amortise a program, small in registers.
KV_WRITE_TILE = 4096


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    e4m3_bytes: bool | None = None,
) -> None:
    """k, v: [T, KVH, D] (any token/head strides, unit stride on D); kv_cache as above (an
    8-bit float cache gets k / k_scale and v / v_scale). `e4m3_bytes`: write an e4m3 cache as
    bytes through kernels/e4m3.py (None: where the GPU needs it, `e4m3_as_bytes`)."""
    T, kvh, d = k.shape
    if T == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1:
        raise ValueError("the K and V caches must share one layout with unit stride on head_dim")
    if e4m3_bytes is None:
        e4m3_bytes = e4m3_as_bytes(kv_cache.dtype, kv_cache.device)
    if e4m3_bytes:
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    block_size = key_cache.shape[1]
    d_pad = next_power_of_2(d)
    row_pad = next_power_of_2(kvh) * d_pad
    tokens = max(1, min(KV_WRITE_TILE // row_pad, next_power_of_2(T)))
    _kv_write_kernel[(cdiv(T, tokens),)](
        k,
        v,
        key_cache,
        value_cache,
        slot_mapping,
        T,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        kvh,
        d,
        float(k_scale),
        float(v_scale),
        float(torch.finfo(kv_cache.dtype).max) if is_fp8(kv_cache.dtype) else 0.0,
        QUANT=is_fp8(kv_cache.dtype),
        E4M3_BYTES=e4m3_bytes,
        CACHE_BLOCK=block_size,
        TOKENS=tokens,
        D_PAD=d_pad,
        ROW_PAD=row_pad,
        num_warps=4,
    )

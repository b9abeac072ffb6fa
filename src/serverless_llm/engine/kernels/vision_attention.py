"""Non-causal attention over variable-length sequences packed in one tensor: the vision towers'
attention, every image (or frame, or Qwen2.5-VL window) of a step in one launch.

q, k, v are [total_tokens, heads, head_dim], the sequences one after another; `cu_seqlens`
[n + 1] int32 holds their boundaries (sequence i is rows cu_seqlens[i]:cu_seqlens[i + 1]). Every
token of a sequence attends to every token of that sequence and to nothing else. Windowed
attention is no special case: its windows are just more, shorter sequences.

The kernel is flash attention's forward: a program takes BLOCK_M query rows of one sequence and
one head, walks the sequence's keys BLOCK_N at a time with an online softmax (running max and
sum, in log2 units for exp2) and accumulates in float32. head_dim is padded to a power of two
(at least 16, for `tl.dot`) and masked. Vision towers have as many key heads as query heads.

`vision_attention_reference` is the torch reference (scaled_dot_product_attention per sequence,
in float32); `vision_attention` picks one. Triton is imported at the kernel's first launch only
(see `triton_lazy`).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from .paged_attention import TileConfig
from .triton_lazy import cdiv, jit, next_power_of_2

tl = None  # triton.language, bound at the first launch (see triton_lazy)

LOG2E = 1.4426950408889634


@jit
def _vision_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_seqlens_ptr,
    scale_log2e,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)

    start = tl.load(cu_seqlens_ptr + seq)
    length = tl.load(cu_seqlens_ptr + seq + 1) - start
    q0 = tile * BLOCK_M
    rows = q0 + tl.arange(0, BLOCK_M)
    row_valid = rows < length
    dims = tl.arange(0, D_PAD)
    dmask = dims < HEAD_DIM
    q_tok = (start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + q_tok[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dmask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    # A tile past its sequence's end (the grid is sized by the longest one) reads no key.
    hi = tl.where(q0 < length, length, 0)
    for n0 in range(0, hi, BLOCK_N):
        keys = n0 + offs_n
        kmask = keys < length
        kv_tok = (start + keys).to(tl.int64)
        kv_mask = kmask[:, None] & dmask[None, :]
        k = tl.load(
            k_ptr + kv_tok[:, None] * stride_kt + head * stride_kh + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(kmask[None, :], s * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + kv_tok[:, None] * stride_vt + head * stride_vh + dims[None, :],
            mask=kv_mask,
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
        out_ptr + q_tok[:, None] * stride_ot + head * stride_oh + dims[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dmask[None, :],
    )


def vision_tiles(head_dim: int, max_seqlen: int, dtype: torch.dtype) -> TileConfig:
    """Flash-attention-sized tiles: up to 128 query rows x 64 keys, fewer rows when every
    sequence is short (Qwen2.5-VL's windows are 64 patches). K and V tiles are pipelined (unlike
    the paged kernel's, read through a block table), so the stages are what shared memory allows
    on sm86/sm89 (99 KiB a block): 3 at padded head dims up to 64, 2 at 128 (96 KiB with 128
    rows on 8 warps, no spills), 64 x 32 tiles at 256. float32 (IEEE dots, a debugging dtype on
    GPU) takes small tiles, as the paged kernel's float32 path does."""
    d_pad = max(16, next_power_of_2(head_dim))
    rows = max(16, min(128, next_power_of_2(max(1, max_seqlen))))
    if dtype == torch.float32:
        return TileConfig(block_m=min(rows, 32 if d_pad <= 128 else 16), block_n=32, num_warps=4,
                          num_stages=2)  # fmt: skip
    if d_pad > 128:
        rows = min(rows, 64)
        return TileConfig(block_m=rows, block_n=32, num_warps=8 if rows >= 64 else 4,
                          num_stages=2)  # fmt: skip
    if d_pad == 128:
        return TileConfig(block_m=rows, block_n=64, num_warps=8 if rows >= 128 else 4,
                          num_stages=2)  # fmt: skip
    return TileConfig(block_m=rows, block_n=64, num_warps=4, num_stages=3)


def cu_seqlens_of(lengths: list[int], device: torch.device | str) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] as the kernel's int32 boundaries, on `device`."""
    bounds = [0, *itertools.accumulate(lengths)]
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def vision_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    max_seqlen: int | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """The kernel: q, k, v [T, heads, head_dim] (any strides but a unit last one), cu_seqlens
    [n + 1] -> [T, heads, head_dim] in q's dtype. `max_seqlen` (the longest sequence; read from
    cu_seqlens, a device sync, when not given) sizes the grid; `config` overrides the tiles."""
    if q.shape != k.shape or q.shape != v.shape or q.dim() != 3:
        raise ValueError(
            f"vision attention takes q, k, v of one shape [tokens, heads, head_dim], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    tokens, heads, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    n = cu_seqlens.numel() - 1
    if tokens == 0 or n <= 0:
        return out
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max())
    if max_seqlen <= 0:
        return out
    q, k, v = _rows(q), _rows(k), _rows(v)
    cfg = config or vision_tiles(head_dim, max_seqlen, q.dtype)
    scale = head_dim**-0.5 if scale is None else scale
    _vision_attention_kernel[(n, cdiv(max_seqlen, cfg.block_m), heads)](
        q,
        k,
        v,
        out,
        cu,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        D_PAD=max(16, next_power_of_2(head_dim)),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        IEEE=q.dtype == torch.float32,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def vision_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """scaled_dot_product_attention over each sequence alone, in float32, back in q's dtype."""
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e <= s:
            continue
        qs, ks, vs = (t[s:e].transpose(0, 1).float() for t in (q, k, v))  # [heads, L, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        out[s:e] = o.transpose(0, 1).to(q.dtype)
    return out


def kernel_wanted(use_kernel: bool | None, x: torch.Tensor) -> bool:
    """`use_kernel` when it is set (the engine sets it from its attention backend), else whether
    x is on a CUDA device."""
    return x.is_cuda if use_kernel is None else use_kernel


def vision_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    use_kernel: bool | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Attention within each packed sequence: the Triton kernel when `use_kernel` (None: when q
    is on CUDA; True off CUDA runs Triton's interpreter, valid only with TRITON_INTERPRET=1), the
    torch reference otherwise. `scale` defaults to head_dim ** -0.5."""
    if kernel_wanted(use_kernel, q):
        return vision_attention_triton(q, k, v, cu_seqlens, scale, max_seqlen)
    return vision_attention_reference(q, k, v, cu_seqlens, scale)

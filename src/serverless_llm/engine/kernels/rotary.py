"""Rotary embedding applied to the query and key heads of each token: a Triton kernel (in place)
and its torch reference (out of place).

The table is the one `layers.rotary.cos_sin_cache` builds: [max_position, rot_dim] float32, cos in
the first half, sin in the second, with any llama3/linear/dynamic scaling already folded in. The
kernel looks rows up by position itself, so no per-step [T, D] cos/sin copies are made. Two
layouts: neox rotates the two halves of the rotary dims against each other (Llama, Mistral,
Qwen2); gpt-j rotates interleaved pairs (GPT-J, some GLM/Phi variants). Dims past rot_dim
(partial rotary) are left as they are.

cos and sin are rounded to the input dtype first, as the torch reference does; the kernel then
computes the rotation in float32 and rounds once. Triton is imported at the kernel's first launch,
never for the reference (see `triton_lazy`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_lazy import jit, next_power_of_2

tl = None  # triton.language, bound at the first launch (see triton_lazy)

# -- torch reference -------------------------------------------------------------------------


def gather_cos_sin(cache: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin for each token, [T, 1, head_dim] in `dtype`; once a step, shared by layers."""
    cs = cache.index_select(0, positions)
    half = cs.shape[-1] // 2
    cos = cs[:, :half].to(dtype).repeat(1, 2).unsqueeze(1)
    sin = cs[:, half:].to(dtype).repeat(1, 2).unsqueeze(1)
    return cos, sin


def apply_rotary_ref(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Neox layout (rotate halves), as Llama/Mistral/Qwen2 use. q: [T, H, D], k: [T, KVH, D]."""
    return rotate_neox_ref(q, cos, sin), rotate_neox_ref(k, cos, sin)


def rotate_neox_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, D] rotated by halves; cos, sin [T, 1, D] (gather_cos_sin's)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rotate_table_ref(
    positions: Tensor,
    x: Tensor,
    cache: Tensor,
    is_neox: bool = True,
) -> Tensor:
    """Any layout, straight from the table: neox (halves) or gpt-j (interleaved pairs), over
    the first `cache.shape[-1]` dims of x [T, H, D] (the rest pass through: partial rotary).
    cos/sin are rounded to x's dtype first, as `apply_rotary_ref` does."""
    rot_dim = cache.shape[-1]
    half = rot_dim // 2
    cs = cache.index_select(0, positions)
    cos = cs[:, None, :half].to(x.dtype)
    sin = cs[:, None, half:].to(x.dtype)
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    if is_neox:
        x1, x2 = rot[..., :half], rot[..., half:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    out = torch.cat([o1, o2], dim=-1) if is_neox else torch.stack([o1, o2], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def rotary_embedding_reference(
    positions: Tensor,
    q: Tensor,
    k: Tensor,
    cos_sin_cache: Tensor,
    is_neox: bool = True,
    cos_sin: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """The torch reference of `rotary_embedding`, out of place. Neox over the full head dim runs
    `apply_rotary_ref` on `cos_sin` (what `gather_cos_sin` gives for these positions, gathered
    once a step for every layer; gathered here when None); gpt-j and partial rotary run
    `rotate_table_ref`."""
    if is_neox and cos_sin_cache.shape[-1] == q.shape[-1]:
        if cos_sin is None:
            cos_sin = gather_cos_sin(cos_sin_cache, positions, q.dtype)
        return apply_rotary_ref(q, k, *cos_sin)
    return (
        rotate_table_ref(positions, q, cos_sin_cache, is_neox),
        rotate_table_ref(positions, k, cos_sin_cache, is_neox),
    )


# -- Triton kernel ---------------------------------------------------------------------------


@jit
def _rotate_heads(
    x_ptr,
    stride_h,
    num_heads,
    cos,
    sin,
    half,
    IS_NEOX: tl.constexpr,
    H_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    heads = tl.arange(0, H_PAD)[:, None]
    idx = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (idx < half)
    if IS_NEOX:
        off1 = idx
        off2 = idx + half
    else:
        off1 = 2 * idx
        off2 = 2 * idx + 1
    p1 = x_ptr + heads * stride_h + off1
    p2 = x_ptr + heads * stride_h + off2
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p2, mask=mask, other=0.0)
    c = cos.to(x1.dtype).to(tl.float32)
    s = sin.to(x1.dtype).to(tl.float32)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(p1, (a * c - b * s).to(x1.dtype), mask=mask)
    tl.store(p2, (b * c + a * s).to(x1.dtype), mask=mask)


@jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    num_q_heads,
    num_k_heads,
    half,
    IS_NEOX: tl.constexpr,
    QH_PAD: tl.constexpr,
    KH_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    idx = tl.arange(0, HALF_PAD)[None, :]
    cmask = idx < half
    cos = tl.load(cache_ptr + pos * stride_cache + idx, mask=cmask, other=1.0)
    sin = tl.load(cache_ptr + pos * stride_cache + half + idx, mask=cmask, other=0.0)
    _rotate_heads(
        q_ptr + tok * stride_qt, stride_qh, num_q_heads, cos, sin, half, IS_NEOX, QH_PAD, HALF_PAD
    )
    _rotate_heads(
        k_ptr + tok * stride_kt, stride_kh, num_k_heads, cos, sin, half, IS_NEOX, KH_PAD, HALF_PAD
    )


def rotary_embedding(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, is_neox: bool = True
) -> tuple[Tensor, Tensor]:
    """Rotates q [T, H, D] and k [T, KVH, D] in place (views into a fused QKV output are fine:
    only the last dim must have unit stride); returns them for call-site symmetry."""
    T = q.shape[0]
    rot_dim = cos_sin_cache.shape[-1]
    if rot_dim % 2 or rot_dim > q.shape[-1]:
        raise ValueError(f"rotary table width {rot_dim} does not fit head_dim {q.shape[-1]}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary_embedding needs unit stride on head_dim")
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    if T == 0:
        return q, k
    half = rot_dim // 2
    qh, kh = q.shape[1], k.shape[1]
    qh_pad, kh_pad = next_power_of_2(qh), next_power_of_2(kh)
    half_pad = next_power_of_2(half)
    _rotary_kernel[(T,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        qh,
        kh,
        half,
        IS_NEOX=is_neox,
        QH_PAD=qh_pad,
        KH_PAD=kh_pad,
        HALF_PAD=half_pad,
        num_warps=max(1, min(8, qh_pad * half_pad // 256)),
    )
    return q, k

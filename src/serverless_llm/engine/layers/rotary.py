"""Rotary position embedding: cos/sin tables (with the scaling types Llama checkpoints use) and
their application to query and key heads.

Tables are computed once in float32 for every position up to the model's length and indexed by
position each step, so a token's rotation depends only on its position, never on the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels.dispatch import use_triton

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic")


class RopeConfigError(ValueError):
    pass


def rope_parameters(config) -> dict:
    """The rope settings of a transformers config as one dict (transformers 5 keeps them in
    `rope_parameters`; older configs in `rope_theta` + `rope_scaling`)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    for k, v in scaling.items():
        params.setdefault(k, v)
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def inv_frequencies(params: dict, head_dim: int, max_position: int) -> torch.Tensor:
    base = float(params["rope_theta"])
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise RopeConfigError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if rope_type == "dynamic":
        # NTK-aware scaling at the longest length this engine serves (a fixed table, as vLLM
        # does; transformers recomputes per forward past the original length).
        factor = float(params["factor"])
        orig = int(params.get("original_max_position_embeddings") or max_position)
        if max_position > orig:
            base = base * ((factor * max_position / orig) - (factor - 1)) ** (
                head_dim / (head_dim - 2)
            )
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        factor = float(params["factor"])
        low = float(params["low_freq_factor"])
        high = float(params["high_freq_factor"])
        orig = float(params["original_max_position_embeddings"])
        low_wavelen = orig / low
        high_wavelen = orig / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def cos_sin_cache(inv_freq: torch.Tensor, max_position: int) -> torch.Tensor:
    """[max_position, head_dim] float32: cos in the first half, sin in the second."""
    pos = torch.arange(max_position, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def gather_cos_sin(
    cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for each token, [T, 1, head_dim] in `dtype`; once a step, shared by layers."""
    cs = cache.index_select(0, positions)
    half = cs.shape[-1] // 2
    cos = cs[:, :half].to(dtype).repeat(1, 2).unsqueeze(1)
    sin = cs[:, half:].to(dtype).repeat(1, 2).unsqueeze(1)
    return cos, sin


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox layout (rotate halves), as Llama/Mistral/Qwen2 use. q: [T, H, D], k: [T, KVH, D]."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rotate_table_ref(
    positions: torch.Tensor,
    x: torch.Tensor,
    cache: torch.Tensor,
    is_neox: bool = True,
) -> torch.Tensor:
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


@dataclass
class RotaryStep:
    """What every layer's rotary needs in one step, computed once: the positions and table for
    the Triton kernel (which looks rows up itself), or the gathered cos/sin for the torch path."""

    positions: torch.Tensor  # [T]
    cache: torch.Tensor  # [max_position, rot_dim] float32
    cos: torch.Tensor | None = None  # [T, 1, D] in the model dtype; None on the Triton path
    sin: torch.Tensor | None = None


def rotary_step(cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> RotaryStep:
    if use_triton(positions):
        return RotaryStep(positions, cache)
    cos, sin = gather_cos_sin(cache, positions, dtype)
    return RotaryStep(positions, cache, cos, sin)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, step: RotaryStep, is_neox: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, H, D] and k [T, KVH, D]. The Triton path rotates in place (q and k are
    views into the fresh QKV projection, so nobody else sees them); the torch path returns new
    tensors, exactly as `apply_rotary_ref`."""
    if step.cos is None:
        from ..kernels.rotary import rotary_embedding  # Triton is imported only on this path

        return rotary_embedding(step.positions, q, k, step.cache, is_neox)
    if is_neox and step.cos.shape[-1] == q.shape[-1]:
        return apply_rotary_ref(q, k, step.cos, step.sin)
    return (
        rotate_table_ref(step.positions, q, step.cache, is_neox),
        rotate_table_ref(step.positions, k, step.cache, is_neox),
    )

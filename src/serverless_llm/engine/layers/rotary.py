"""Rotary position embedding: cos/sin tables (with the scaling types Llama checkpoints use) and
their application to query and key heads, by the Triton kernel or its torch reference as the
model was built (see kernels/rotary.py).

Tables are computed once in float32 for every position up to the model's length and indexed by
position each step, so a token's rotation depends only on its position, never on the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels.rotary import gather_cos_sin, rotary_embedding, rotary_embedding_reference

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


@dataclass
class RotaryStep:
    """What every layer's rotary needs in one step, computed once: the positions and table for
    the Triton kernel (which looks rows up itself), or the gathered cos/sin for the torch path."""

    positions: torch.Tensor  # [T]
    cache: torch.Tensor  # [max_position, rot_dim] float32
    cos: torch.Tensor | None = None  # [T, 1, D] in the model dtype; None on the Triton path
    sin: torch.Tensor | None = None


def rotary_step(
    cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, use_kernels: bool = False
) -> RotaryStep:
    """The step's rotary inputs, for the Triton kernel when `use_kernels`, else for the torch
    reference."""
    if use_kernels:
        return RotaryStep(positions, cache)
    cos, sin = gather_cos_sin(cache, positions, dtype)
    return RotaryStep(positions, cache, cos, sin)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, step: RotaryStep, is_neox: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, H, D] and k [T, KVH, D]. The Triton path rotates in place (q and k are
    views into the fresh QKV projection, so nobody else sees them); the torch path returns new
    tensors."""
    if step.cos is None:
        return rotary_embedding(step.positions, q, k, step.cache, is_neox)
    return rotary_embedding_reference(
        step.positions, q, k, step.cache, is_neox, cos_sin=(step.cos, step.sin)
    )

"""Rotary position embedding: cos/sin tables (with the scaling types Llama checkpoints use) and
their application to query and key heads.

Tables are computed once in float32 for every position up to the model's length and indexed by
position each step, so a token's rotation depends only on its position, never on the batch.
"""

from __future__ import annotations

import math

import torch

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

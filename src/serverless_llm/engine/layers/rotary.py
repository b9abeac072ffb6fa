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

from ..kernels.rotary import (
    gather_cos_sin,
    rotary_embedding,
    rotary_embedding_reference,
    rotate_neox_ref,
)

SUPPORTED_ROPE_TYPES = (
    "default",
    "linear",
    "llama3",
    "dynamic",
    "longrope",
    "su",
    "proportional",
    "yarn",
)


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


def rope_table(params: dict, rot_dim: int, max_position: int, max_position_embeddings: int):
    """The cos/sin table of one rope configuration over the first `rot_dim` dims of a head:
    [max_position, rot_dim] float32.

    LongRoPE (Phi-3) rescales each frequency by a short factor within the original context and
    a long factor past it, and scales cos and sin by an attention factor. transformers picks the
    factor set per forward pass from the whole sequence's length; a paged cache keeps keys once
    computed, so here the choice is per position: short below `original_max_position_embeddings`,
    long from there on (what transformers' own incremental decoding gives for a sequence that
    starts short and grows past it)."""
    rope_type = params["rope_type"]
    if rope_type == "yarn":
        inv_freq, attention_factor = yarn_frequencies(params, rot_dim, max_position_embeddings)
        return cos_sin_cache(inv_freq, max_position) * attention_factor
    if rope_type not in ("longrope", "su"):
        return cos_sin_cache(inv_frequencies(params, rot_dim, max_position), max_position)
    base = float(params["rope_theta"])
    orig = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or max_position_embeddings / orig
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        )
    shape = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    tables = [
        cos_sin_cache(
            1.0 / (torch.tensor(params[key], dtype=torch.float32) * base**shape), max_position
        )
        for key in ("short_factor", "long_factor")
    ]
    table = torch.cat([tables[0][:orig], tables[1][orig:]]) if max_position > orig else tables[0]
    return table * attention_factor


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times: 1 + 0.1 * mscale *
    ln(factor) (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(
    params: dict, rot_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al.), as transformers computes it: each frequency blends its interpolated
    value (divided by `factor`) and its original one, by a linear ramp over the frequency pairs
    between the dims that turn `beta_fast` and `beta_slow` times over the original context
    (the ramp's ends rounded outwards unless `truncate` is False: gpt-oss). Returns the
    frequencies and the attention factor that scales cos and sin: `attention_factor` when
    given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set
    (DeepSeek), else mscale(factor). A config without `factor` stretches
    max_position_embeddings / original_max_position_embeddings."""
    base = float(params["rope_theta"])
    orig = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / orig
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def dim_turning(turns: float) -> float:  # the dim whose wavelength fits `turns` times
        return rot_dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def inv_frequencies(params: dict, head_dim: int, max_position: int) -> torch.Tensor:
    base = float(params["rope_theta"])
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise RopeConfigError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if rope_type == "proportional":
        # LFM3, Gemma 4: the first partial_rotary_factor of the head's frequency pairs rotate at
        # the frequencies of the whole head; the other pairs do not rotate (frequency 0). The
        # table spans the whole head (rot_dim = head_dim), halves paired as neox pairs them.
        angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        inv_freq = 1.0 / (base ** exponents[:angles])
        inv_freq = torch.cat([inv_freq, torch.zeros(head_dim // 2 - angles)])
        return inv_freq / float(params.get("factor", 1.0))
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
    use_kernels: bool = False
    cos: torch.Tensor | None = None  # [T, 1, D] in the model dtype, for a full-width neox
    sin: torch.Tensor | None = None  # rotation on the torch path; else None


def rotary_step(
    cache: torch.Tensor,
    positions: torch.Tensor,
    dtype: torch.dtype,
    use_kernels: bool = False,
    gather: bool = True,
) -> RotaryStep:
    """The step's rotary inputs, for the Triton kernel when `use_kernels`, else for the torch
    reference. `gather`: the cos/sin rows the torch path of a full-width neox rotation uses
    (other layouts read the table in each layer)."""
    if use_kernels or not gather:
        return RotaryStep(positions, cache, use_kernels)
    cos, sin = gather_cos_sin(cache, positions, dtype)
    return RotaryStep(positions, cache, False, cos, sin)


def mrope_table(
    cache: torch.Tensor, positions: torch.Tensor, section, interleaved: bool = False
) -> torch.Tensor:
    """Multimodal rotary (Qwen2-VL and after): each frequency of the table rotates by one of
    three position streams (temporal, height, width). `positions` [3, T]; `section`: how many
    of the rot_dim / 2 frequencies each stream takes, in order (contiguous runs), or, when
    `interleaved` (Qwen3-VL), frequency j takes height when j % 3 == 1 and j < 3 * section[1],
    width when j % 3 == 2 and j < 3 * section[2], else temporal. Returns the step's rows
    [T, rot_dim] (cos half, sin half), which index by row like a table."""
    half = cache.shape[1] // 2
    stream = torch.zeros(half, dtype=torch.int64)
    if interleaved:
        j = torch.arange(half)
        stream[(j % 3 == 1) & (j < 3 * section[1])] = 1
        stream[(j % 3 == 2) & (j < 3 * section[2])] = 2
    else:
        bounds = [0, section[0], section[0] + section[1], half]
        for k in (1, 2):
            stream[bounds[k] : bounds[k + 1]] = k
    rows = cache[positions.reshape(-1)].view(3, positions.shape[1], -1)  # [3, T, rot_dim]
    pick = torch.cat([stream, stream]).to(cache.device)
    return rows.gather(0, pick.view(1, 1, -1).expand(1, rows.shape[1], -1)).squeeze(0)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, step: RotaryStep, is_neox: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, H, D] and k [T, KVH, D]. The Triton path rotates in place (q and k are
    views into the fresh QKV projection, so nobody else sees them); the torch path returns new
    tensors."""
    if step.use_kernels:
        return rotary_embedding(step.positions, q, k, step.cache, is_neox)
    cos_sin = None if step.cos is None else (step.cos, step.sin)
    return rotary_embedding_reference(step.positions, q, k, step.cache, is_neox, cos_sin=cos_sin)


def rotate_gathered(x: torch.Tensor, step: RotaryStep) -> torch.Tensor:
    """x [T, heads, D] rotated with the step's gathered cos/sin (the torch path of a full-width
    neox rotation: `step.cos` is set). One call can rotate q and k together when they are
    neighbours in one tensor."""
    return rotate_neox_ref(x, step.cos, step.sin)

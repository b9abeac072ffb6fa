"""MXFP4 weights (the OCP Microscaling format's FP4 type), as gpt-oss checkpoints store their
experts, decoded in torch.

A weight [rows, K] is cut along K into blocks of 32 values. Each value is an E2M1 float in 4 bits
(a sign bit, two exponent bits of bias 1, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
negatives), two to a byte, the even element of a pair in the low nibble; each block has one
E8M0 scale byte s, the power of two 2^(s - 127). A checkpoint writes a projection of E experts
as `<name>_blocks` [E, rows, K / 32, 16] (uint8) and `<name>_scales` [E, rows, K / 32] (uint8);
the gpt-oss family maps them to its stacked expert weights (families_gpt_oss.py) and the loader
dequantizes them once, expert by expert (models/weights.py).
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale
SCALE_BIAS = 127  # E8M0: the byte s means 2^(s - 127)


def e2m1_values() -> torch.Tensor:
    """The 16 codes' values, float32: bit 3 the sign, bits 2-1 the exponent (bias 1; 0 makes the
    subnormal 0.5 * mantissa), bit 0 the mantissa."""
    values = []
    for code in range(16):
        exponent, mantissa = (code >> 1) & 3, code & 1
        if exponent == 0:
            magnitude = 0.5 * mantissa
        else:
            magnitude = (1.0 + 0.5 * mantissa) * 2.0 ** (exponent - 1)
        values.append(-magnitude if code & 8 else magnitude)
    return torch.tensor(values, dtype=torch.float32)


def mxfp4_dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> [..., G * 32] in `dtype` (exact:
    every value is a float32 E2M1 value times a power of two)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype}/{scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: expected "
            f"[..., G, {BLOCK // 2}] and [..., G]"
        )
    table = e2m1_values().to(blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1)  # [..., G, 16, 2]: low first
    values = table[codes.long()].flatten(-3)  # [..., G * 32]
    exponents = (scales.to(torch.int32) - SCALE_BIAS).repeat_interleave(BLOCK, dim=-1)
    return torch.ldexp(values, exponents).to(dtype)

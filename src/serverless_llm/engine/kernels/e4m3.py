"""FP8 e4m3 (torch.float8_e4m3fn) bytes encoded and decoded with integer operations inside
Triton kernels, for GPUs whose Triton code generation refuses the e4m3 type (before sm89: the
A100, A10 and T4 generations); their reference is torch's own conversion to and from
float8_e4m3fn, which the tests compare them with exactly, code by code.

The format: a sign bit, 4 exponent bits (bias 7) and 3 mantissa bits. Code e > 0 is
2^(e - 7) x (1 + m / 8), code e = 0 is m x 2^-9 (subnormals and zero), and 0x7F / 0xFF are NaN
(never produced here: callers clamp to the largest finite value, 448; never decoded as NaN).

- `e4m3_decode`: the 7 exponent-and-mantissa bits placed under a float32 exponent rebiased by
  120 (so e4m3's exponent e becomes float32's e + 120), the sign on top; subnormals as the
  mantissa times 2^-9.
- `e4m3_encode`: round to nearest, ties to even, as torch converts: from |x| >= 2^-6 the float32
  pattern loses its 20 low mantissa bits (rounded) and its exponent is rebiased by 120; below,
  |x| x 512 (exact) rounded to an integer is the code (8, where rounding reaches 2^-6, is
  exactly the smallest normal code).

Triton is imported at the first launch of a kernel calling these (see `triton_lazy`).
"""

from __future__ import annotations

import functools

import torch

from .triton_lazy import jit

tl = None  # triton.language, bound at the first launch (see triton_lazy)


@functools.cache
def _cuda_lacks_e4m3(index: int) -> bool:
    return torch.cuda.get_device_capability(index) < (8, 9)


def e4m3_as_bytes(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether kernels must treat a `dtype` tensor on `device` as e4m3 bytes (this module's
    codec): an e4m3 tensor on a GPU before sm89. Elsewhere (Triton's interpreter included)
    Triton's own e4m3 type serves; kernel tests ask for the codec explicitly."""
    if dtype != torch.float8_e4m3fn or device.type != "cuda":
        return False
    return _cuda_lacks_e4m3(device.index if device.index is not None else 0)


@jit
def e4m3_decode(byte):
    """int32 codes 0..255 (NaN codes excluded) to their float32 values."""
    em = byte & 0x7F
    normal = (((em + 960) << 20) | ((byte & 0x80) << 24)).to(tl.float32, bitcast=True)
    tiny = em.to(tl.float32) * 0.001953125
    tiny = tl.where(byte >= 0x80, -tiny, tiny)
    return tl.where(em < 8, tiny, normal)


@jit
def e4m3_encode(x):
    """float32 x with |x| <= 448 to its e4m3fn code (int32 0..255), round to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960
    y = tl.abs(x) * 512.0
    whole = y.to(tl.int32)
    frac = y - whole.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    tiny = whole + up.to(tl.int32)
    return tl.where(mag < (121 << 23), tiny, normal) | sign

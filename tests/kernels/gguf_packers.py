"""GGUF K-quant packers for tests, written from the published block layouts (the `gguf` package
quantizes Q4_0..Q8_0 but only dequantizes the K-quants). Each takes a float32 [rows, K] weight,
K a multiple of 256, and returns the file's bytes uint8 [rows, K / 256 * block bytes], ready
for `gguf.quants.dequantize` and GGUFWriter.add_tensor(raw_dtype=...). The quantization is a
plain min/max one (not llama.cpp's search): the tests need valid blocks, not the best ones."""

from __future__ import annotations

import numpy as np

QK = 256


def weight(n: int, k: int, seed: int) -> np.ndarray:
    """A random float32 [n, k] weight with a per-row offset (so blocks' mins matter)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.01
    return w.astype(np.float32)


def gguf_dequantize(raw: np.ndarray, type_name: str):
    """The `gguf` package's own dequantization of a tensor's file bytes, as a torch tensor."""
    import gguf
    import torch
    from gguf import quants

    return torch.from_numpy(quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]))


def _f16(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, np.float32).astype(np.float16)


def _bytes(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate([np.ascontiguousarray(p).view(np.uint8) for p in parts], axis=-1)


def _safe_div(a, b):
    return np.where(b == 0, 0.0, a / np.where(b == 0, 1.0, b))


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [..., 8] as a K-quant's 12 bytes: bytes 0-3 and 4-7 hold
    sub-blocks 0-3's scale and min in their low 6 bits and the top two bits of sub-blocks 4-7's
    above; bytes 8-11 hold sub-blocks 4-7's low four bits, scale low and min high."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    a = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    b = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    c = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return np.concatenate([a, b, c], axis=-1).astype(np.uint8)


def _k_minmax(x: np.ndarray, levels: int):
    """Per sub-block of 32: 6-bit scale and min codes under f16 super-scales, and the codes."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    step = (sub.max(-1) - lo) / levels
    d = _f16(step.max(-1) / 63)
    dmin = _f16((-lo).max(-1) / 63)
    sc = np.clip(np.round(_safe_div(step, d.astype(np.float32)[:, None])), 0, 63)
    mn = np.clip(np.round(_safe_div(-lo, dmin.astype(np.float32)[:, None])), 0, 63)
    scale = (d.astype(np.float32)[:, None] * sc)[..., None]
    offset = (dmin.astype(np.float32)[:, None] * mn)[..., None]
    q = np.clip(np.round(_safe_div(sub + offset, scale)), 0, levels).astype(np.uint8)
    return d, dmin, _k_scale_bytes(sc, mn), q  # q [blocks, 8, 32]


def _k_low_nibbles(q: np.ndarray) -> np.ndarray:
    """Codes [blocks, 8, 32]: per 64 inputs 32 bytes, sub-block 2i low, 2i + 1 high."""
    q = (q & 15).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    d, dmin, scales, q = _k_minmax(w.astype(np.float32), 15)
    out = _bytes(d[:, None], dmin[:, None], scales, _k_low_nibbles(q))
    return out.reshape(rows, -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    d, dmin, scales, q = _k_minmax(w.astype(np.float32), 31)
    # 32 bytes of high bits: bit i of byte l is the fifth bit of sub-block i's input l
    high = ((q >> 4) & 1).transpose(0, 2, 1)  # [blocks, 32, 8]
    qh = np.packbits(high, axis=-1, bitorder="little").reshape(-1, 32)
    out = _bytes(d[:, None], dmin[:, None], scales, qh, _k_low_nibbles(q))
    return out.reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    sub = w.astype(np.float32).reshape(-1, 16, 16)
    step = np.abs(sub).max(-1) / 31
    d = _f16(step.max(-1) / 127)
    sc = np.clip(np.round(_safe_div(step, d.astype(np.float32)[:, None])), -128, 127)
    scale = (d.astype(np.float32)[:, None] * sc)[..., None]
    q = np.clip(np.round(_safe_div(sub, scale)), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [half of 128, quarter, input]
    # ql: per half, 64 bytes; quarters 0 and 1 in the low nibbles, 2 and 3 in the high ones
    ql = ((q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)).reshape(-1, 128)
    # qh: per half, 32 bytes; quarter r's top two bits at bits 2r
    qh = np.zeros((q.shape[0], 2, 32), np.uint8)
    for r in range(4):
        qh |= (q[:, :, r] >> 4) << (2 * r)
    out = _bytes(ql, qh.reshape(-1, 64), sc.astype(np.int8), d[:, None])
    return out.reshape(rows, -1)


def quantize_q2_k(w: np.ndarray) -> np.ndarray:
    """Q2_K: 16 bytes of (4-bit scale | 4-bit min << 4) per 16 inputs, 64 bytes of 2-bit codes
    (per 128 inputs 32 bytes, inputs 32s + l at bits 2s of byte l), d and dmin float16."""
    rows = w.shape[0]
    sub = w.astype(np.float32).reshape(-1, 16, 16)
    lo = np.minimum(sub.min(-1), 0.0)
    step = (sub.max(-1) - lo) / 3
    d, dmin = _f16(step.max(-1) / 15), _f16((-lo).max(-1) / 15)
    sc = np.clip(np.round(_safe_div(step, d.astype(np.float32)[:, None])), 0, 15)
    mn = np.clip(np.round(_safe_div(-lo, dmin.astype(np.float32)[:, None])), 0, 15)
    scale = (d.astype(np.float32)[:, None] * sc)[..., None]
    offset = (dmin.astype(np.float32)[:, None] * mn)[..., None]
    q = np.clip(np.round(_safe_div(sub + offset, scale)), 0, 3).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)
    qs = np.zeros((q.shape[0], 2, 32), np.uint8)
    for s in range(4):
        qs |= q[:, :, s] << (2 * s)
    scales = (sc.astype(np.uint8) | (mn.astype(np.uint8) << 4)).astype(np.uint8)
    out = _bytes(scales, qs.reshape(-1, 64), d[:, None], dmin[:, None])
    return out.reshape(rows, -1)


PACKERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k,
           "Q2_K": quantize_q2_k}  # fmt: skip


def quantize(w: np.ndarray, type_name: str) -> np.ndarray:
    """`w` in GGUF type `type_name`: the `gguf` package's quantizer where it has one, else ours."""
    import gguf

    if type_name in PACKERS:
        return PACKERS[type_name](w)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])

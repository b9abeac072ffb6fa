"""GGUF block-quantized weights kept quantized on CPU: our layout, its repack from the file's
blocks, the native linear on it (gguf_blocks.c) and the torch references it is tested against.

The layout (`QB32`, described in docs/quantization.md and gguf_blocks.c): a weight [N, K] in
blocks of 32 inputs of one output row, each value w = d * u + c with u an unsigned code (4
bits, two a byte; 5, 6 or 8 bits, one a byte) and d, c per group of 32 inputs (16 for Q6_K),
float16 where every value is exact in it, else float32. Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K and Q6_K map onto it exactly (`from_gguf_blocks`; e.g. Q4_0: c = -8d; Q8_0: u = q + 128,
c = -128d; Q4_K: d = super-scale * 6-bit sub-scale, c = -(super-min * 6-bit sub-min), both
exact in float32), so one kernel serves all of them. Other types are read as floats
(`tensor_to_float`).

The native linear quantizes each row of x per block of 32 (scale max|x| / L, round half to
even) and sums integer products: L = 127 for int8 inputs, as the Q8 formats intend, or
FLOAT_LEVELS = 127 * 2^14 for "float" inputs (21 bits and a sign a block, each input moved by at
most max|x| * 2^-22: float32's own precision to a few units in the last place, at nearly the
int8 path's speed). `reference_linear(..., quantize_x=True, levels=L)` is that computation in
float64 (what the kernel must equal up to float32 rounding), `quantize_x=False` the plain
dequantize-then-matmul (what it approximates).

The build is cpu_native's (same compiler, flags and cache directory, its own key), once per
machine; `load()` returns None with a warning line where it cannot build or its self-check
fails.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import cpu_native

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gguf_blocks.c")
BLOCK = 32

# GGUF type name -> (bytes per block in the file, bits of our codes). A block is 32 inputs for
# Q4_0..Q8_0 and a super-block of 256 for the K-quants (QK_K).
FILE_TYPES = {
    "Q4_0": (18, 4), "Q4_1": (20, 4), "Q5_0": (22, 5), "Q5_1": (24, 5), "Q8_0": (34, 8),
    "Q4_K": (144, 4), "Q5_K": (176, 5), "Q6_K": (210, 6),
}  # fmt: skip
SUPER = 256  # inputs of a K-quant super-block
FLOAT_TYPES = ("F32", "F16", "BF16")  # read as float tensors, exactly


@dataclass
class QB32:
    """A [N, K] weight in our blocked layout: qs uint8 [N, K/32, 16] (4-bit codes, two a byte)
    or [N, K/32, 32] (5-, 6- and 8-bit codes, one a byte); d and c [N, K/group], float16 where
    every value is exact in it, else float32. `group`: inputs per (d, c), 32 or 16 (Q6_K)."""

    qs: torch.Tensor
    d: torch.Tensor
    c: torch.Tensor
    bits: int
    group: int = BLOCK

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * BLOCK

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.c))

    def rows(self, index: torch.Tensor) -> QB32:
        """The weight's rows in the order `index` gives."""
        return QB32(self.qs[index].contiguous(), self.d[index].contiguous(),
                    self.c[index].contiguous(), self.bits, self.group)  # fmt: skip

    @staticmethod
    def cat(parts: list[QB32]) -> QB32:
        """Weights stacked along N (all of one K). Parts of different layouts (a Q4_K q with a
        Q6_K v) are first widened to a common one, exactly: codes to one a byte, scales to
        float32 and to groups of 16 (a 32-input scale repeated)."""
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError("stacking qb32 weights of different inputs")
        kinds = {(p.bits, p.group, p.d.dtype) for p in parts}
        if len(kinds) > 1:
            bits = max(p.bits for p in parts)
            group = min(p.group for p in parts)
            parts = [widen(p, bits, group) for p in parts]
        return QB32(*(torch.cat([getattr(p, f) for p in parts]) for f in ("qs", "d", "c")),
                    parts[0].bits, parts[0].group)  # fmt: skip


def widen(w: QB32, bits: int, group: int) -> QB32:
    """The same values in a wider layout, exactly: codes one a byte where `bits` is 5, 6 or 8
    (4 keeps the nibbles; the codes and c stay as they are, the kernels take any c), float32
    scales, `group` inputs per scale (<= w.group, each scale repeated)."""
    n, k = w.shape
    u = codes(w)
    d, c = w.d.float(), w.c.float()
    if group != w.group:
        rep = w.group // group
        d, c = d.repeat_interleave(rep, dim=1), c.repeat_interleave(rep, dim=1)
    qs = w.qs if bits == 4 else u.to(torch.uint8).reshape(n, k // BLOCK, BLOCK)
    return QB32(qs.contiguous(), d.contiguous(), c.contiguous(), bits, group)


def _compact(d: np.ndarray, c: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """d, c (float32 arrays) as float16 tensors where every value of both survives float16
    exactly, else as float32 ones."""
    d, c = np.ascontiguousarray(d, np.float32), np.ascontiguousarray(c, np.float32)
    dh, ch = d.astype(np.float16), c.astype(np.float16)
    if np.array_equal(dh.astype(np.float32), d) and np.array_equal(ch.astype(np.float32), c):
        d, c = dh, ch
    return torch.from_numpy(d), torch.from_numpy(c)


def _nibbles(u: np.ndarray) -> np.ndarray:
    """Codes [..., 32] (0..15) as our 4-bit bytes [..., 16]: input j low, input j + 16 high."""
    return (u[..., :16] | (u[..., 16:] << 4)).astype(np.uint8)


def _bits_of(packed: np.ndarray, count: int) -> np.ndarray:
    """Bit i of little-endian bytes `packed` [..., count / 8], as [..., count] 0/1 uint8."""
    return np.unpackbits(packed, axis=-1, bitorder="little")[..., :count]


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant super-block's 12 bytes of 6-bit sub-scales and sub-mins (Q4_K, Q5_K) as two
    [..., 8] arrays. Sub-blocks 0-3: the low 6 bits of bytes 0-3 (scale) and 4-7 (min);
    sub-blocks 4-7: the low and high nibbles of bytes 8-11, with the top two bits of bytes 0-3
    (scale) and 4-7 (min) above them."""
    s = s.astype(np.uint8)
    lo, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scale = np.concatenate([lo & 63, (top & 15) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scale, mins


def _half(b: np.ndarray) -> np.ndarray:
    """Two bytes [..., 2] little-endian as float16 -> float32 [...]."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def from_gguf_blocks(raw: np.ndarray, type_name: str, k: int) -> QB32:
    """Our layout from a GGUF tensor's raw blocks: `raw` uint8 [N, row bytes] (the `gguf`
    package's GGUFReader `.data` of a quantized tensor), `type_name` its type, `k` its inputs.
    Exact: `dequantize` of the result equals the `gguf` package's dequantization bit for bit."""
    if type_name not in FILE_TYPES:
        raise ValueError(f"GGUF type {type_name} has no qb32 layout")
    size, bits = FILE_TYPES[type_name]
    per = SUPER if type_name.endswith("_K") else BLOCK
    if k % per:
        raise ValueError(f"{k} inputs are not whole blocks of {per}")
    nb = k // BLOCK
    if type_name in ("Q4_0", "Q4_1", "Q8_0"):
        fields = {"Q4_0": [("d", "<f2"), ("qs", "u1", 16)],
                  "Q4_1": [("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)],
                  "Q8_0": [("d", "<f2"), ("qs", "i1", 32)]}[type_name]  # fmt: skip
        blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1).view(np.dtype(fields))
        blocks = blocks.reshape(-1, nb)
        d = torch.from_numpy(np.ascontiguousarray(blocks["d"]))
        if type_name == "Q4_1":
            c = torch.from_numpy(np.ascontiguousarray(blocks["m"]))
        else:  # -8d or -128d: a power-of-two multiple, exact unless it leaves float16's range
            d32 = blocks["d"].astype(np.float32)
            d, c = _compact(d32, d32 * (-8 if type_name == "Q4_0" else -128))
        if type_name == "Q8_0":
            qs = torch.from_numpy((blocks["qs"].astype(np.int16) + 128).astype(np.uint8))
        else:
            qs = torch.from_numpy(np.ascontiguousarray(blocks["qs"]))
        return QB32(qs.contiguous(), d.contiguous(), c.contiguous(), bits)
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, size)  # one file block a row
    n = b.shape[0] // (k // per)
    if type_name in ("Q5_0", "Q5_1"):
        at = 2 if type_name == "Q5_0" else 4
        d = _half(b[:, 0:2])
        c = -16.0 * d if type_name == "Q5_0" else _half(b[:, 2:4])
        high = _bits_of(b[:, at : at + 4], 32)  # the fifth bit of code j: bit j of a uint32
        low = b[:, at + 4 : at + 20]
        u = np.concatenate([low & 15, low >> 4], axis=-1) | (high << 4)
        group = BLOCK
    elif type_name in ("Q4_K", "Q5_K"):
        d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
        scale, mins = _k_scales(b[:, 4:16])
        # the sub-block scale and min are d * scale and dmin * min: 11 x 6 bits, exact
        d = d[:, None] * scale.astype(np.float32)
        c = -(dmin[:, None] * mins.astype(np.float32))
        low = b[:, -128:].reshape(-1, 4, 32)  # per 64 inputs: 32 bytes, two sub-blocks
        u = np.stack([low & 15, low >> 4], axis=2).reshape(-1, 8, 32)
        if type_name == "Q5_K":  # bit i of high byte l: the fifth bit of sub-block i's input l
            high = _bits_of(b[:, 16:48].reshape(-1, 32, 1), 8)  # [blocks, 32 inputs, 8 subs]
            u = u | (high.transpose(0, 2, 1) << 4)
        group = BLOCK
    else:  # Q6_K: 128 low-nibble bytes, 64 high-bit-pair bytes, 16 int8 scales, d
        low = b[:, 0:128].reshape(-1, 2, 2, 32)  # [half, 32-byte run, input]
        low = np.stack([low & 15, low >> 4], axis=2).reshape(-1, 2, 4, 32)  # [half, quarter, l]
        high = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        u = (low | ((high & 3) << 4)).reshape(-1, 8, 32)  # codes q + 32, 0..63
        scale = b[:, 192:208].view(np.int8).astype(np.float32)
        d = _half(b[:, 208:210])[:, None] * scale  # 11 x 8 bits: exact
        c = -32.0 * d
        group = 16
    u = u.reshape(n, nb, BLOCK).astype(np.uint8)
    qs = _nibbles(u) if bits == 4 else u
    d, c = np.reshape(d, (n, k // group)), np.reshape(c, (n, k // group))
    if type_name.endswith("_K"):  # sub-block scales: float32 always (rarely exact in float16)
        d, c = (torch.from_numpy(np.ascontiguousarray(v, np.float32)) for v in (d, c))
    else:
        d, c = _compact(d, c)
    return QB32(torch.from_numpy(np.ascontiguousarray(qs)), d, c, bits, group)


def dequantized_types_line(tensors: dict[str, FileTensor]) -> str | None:
    """The start-up line naming the file's quantized types that have no qb32 layout (Q2_K,
    Q3_K, IQ*, TQ*, ...: their tensors are dequantized to float at load), or None."""
    other: dict[str, int] = {}
    for t in tensors.values():
        if t.type_name not in FILE_TYPES and t.type_name not in FLOAT_TYPES:
            other[t.type_name] = other.get(t.type_name, 0) + 1
    if not other:
        return None
    named = ", ".join(f"{name} ({count} tensors)" for name, count in sorted(other.items()))
    return f"GGUF types without a block layout, dequantized to float at load: {named}"


def tensor_to_float(t: FileTensor) -> torch.Tensor:
    """A file tensor as float32 [rows, inputs]: F32, F16 and BF16 read as they are (exact),
    every other type through the `gguf` package's dequantization (for the types without a qb32
    layout: Q2_K, Q3_K, IQ*, TQ*, ...). Raises ValueError for a type the package cannot read."""
    import gguf

    k = t.shape[0]
    data = np.ascontiguousarray(t.data).view(np.uint8)
    if t.type_name == "F32":
        out = torch.from_numpy(data.view("<f4").copy())
    elif t.type_name == "F16":
        out = torch.from_numpy(data.view("<f2").astype(np.float32))
    elif t.type_name == "BF16":  # the top half of a float32
        out = torch.from_numpy((data.view("<u2").astype(np.uint32) << 16).view(np.float32))
    else:
        try:
            qtype = gguf.GGMLQuantizationType[t.type_name]
            out = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype), np.float32))
        except (KeyError, NotImplementedError) as e:
            raise ValueError(f"GGUF type {t.type_name} cannot be read: {e}") from e
    return out.reshape(-1, k)


def codes(w: QB32) -> torch.Tensor:
    """The unsigned codes u [N, K] as int16."""
    n, k = w.shape
    if w.bits != 4:
        return w.qs.reshape(n, k).to(torch.int16)
    lo, hi = (w.qs & 15).to(torch.int16), (w.qs >> 4).to(torch.int16)
    return torch.cat([lo, hi], dim=-1).reshape(n, k)


def dequantize(w: QB32, dtype=torch.float32) -> torch.Tensor:
    """The weight as floats: d * u + c per group, in float32 arithmetic as the `gguf` package
    computes (d * u is exact in float32 for every layout, so one rounding at most), then
    `dtype`."""
    n, k = w.shape
    u = codes(w).to(torch.float32).view(n, k // w.group, w.group)
    full = u * w.d.float()[..., None] + w.c.float()[..., None]
    return full.reshape(n, k).to(dtype)


INT8_LEVELS = 127  # int8 inputs
FLOAT_LEVELS = 127 * 2**14  # "float" inputs: 22-bit codes, three bytes each in the kernel
GEMM16_LEVELS = 32767  # the many-row GEMM's 16-bit inputs (VPDPWSSD)
# BlockKernels.gemm's paths: "float" (x as it is), "int16" (16-bit inputs: VNNI, else the
# portable loop), "int16-portable" (tests)
GEMM_PATHS = {"float": 0, "int16": 1, "int16-portable": 2}
GEMM16 = 64  # in QB32Desc.path: the GEMM's 16-bit inputs (gguf_blocks.c QB32_GEMM16)


def quantize_rows_reference(
    x: torch.Tensor, levels: int = INT8_LEVELS
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 per block of 32 as the kernel quantizes it, codes in [-levels, levels]:
    (codes [M, K] float64, scales [M, K/32] float32)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    scale = xb.abs().amax(-1) / float(levels)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(xb * inv[..., None]).clamp(-levels, levels)
    return q.reshape(m, k).double(), scale


def levels_of(path: str) -> int:
    """The input codes' levels of a kernel path (PATHS): FLOAT_LEVELS for the float ones."""
    return FLOAT_LEVELS if path.startswith("float") else INT8_LEVELS


def reference_linear(
    x, w: QB32, bias=None, quantize_x: bool = True, levels: int = INT8_LEVELS
) -> torch.Tensor:
    """The native linear's contract in float64: x [M, K] times dequantize(w)^T (+ bias), x
    quantized per block first when `quantize_x` (to `levels`, as the kernel does)."""
    if quantize_x:
        q, scale = quantize_rows_reference(x, levels)
        m, k = x.shape
        xd = (q.view(m, k // BLOCK, BLOCK) * scale.double()[..., None]).reshape(m, k)
    else:
        xd = x.double()
    out = xd @ dequantize(w, torch.float64).T
    return out if bias is None else out + bias.double()


# -- build and load ----------------------------------------------------------------------------


def build(out_dir: Path | None = None) -> Path:
    """The compiled library for this machine, built and cached as cpu_native's (its key: the
    source, compiler, CPU flags and build flags)."""
    return cpu_native.build(out_dir, SOURCE)


_P, _I = ctypes.c_void_p, ctypes.c_int64


class QB32Desc(ctypes.Structure):
    """A QB32 weight as gguf_blocks.c's qb32_t (its tensors must outlive it)."""

    _fields_ = [("qs", _P), ("d", _P), ("c", _P), ("N", _I), ("K", _I), ("bits", _I)]
    _fields_ += [("path", _I), ("group", _I), ("scale_bytes", _I)]

    @staticmethod
    def of(w: QB32, path: str = "best", gemm: str = "float") -> QB32Desc:
        """`path`: the few-row kernel's (PATHS); `gemm`: the many-row GEMM's inputs through
        qb32_gemm_desc ("float": x as it is; "int16": 16-bit codes, VNNI else portable)."""
        n, k = w.shape
        if w.group not in (BLOCK, 16) or (w.group == 16 and w.bits == 4):
            raise ValueError(f"no kernel for groups of {w.group} with {w.bits}-bit codes")
        if w.d.dtype != w.c.dtype or w.d.dtype not in (torch.float16, torch.float32):
            raise ValueError(f"scales of {w.d.dtype} and {w.c.dtype}: expected one of float16/32")
        for t in (w.qs, w.d, w.c):
            if not t.is_contiguous():
                raise ValueError("qb32 tensors must be contiguous")
        code = PATHS[path] | (GEMM16 if gemm == "int16" else 0)
        return QB32Desc(w.qs.data_ptr(), w.d.data_ptr(), w.c.data_ptr(), n, k, w.bits, code,
                        w.group, w.d.element_size())  # fmt: skip


class QB32StepsDesc(ctypes.Structure):
    """A QB32Desc with its few-row/GEMM threshold (gguf_blocks.c's qb32_steps_t)."""

    _fields_ = [("w", QB32Desc), ("few_rows", _I)]


# BlockKernels.linear's paths: "best" (int8 inputs: AVX-512 VNNI, else AVX2, else portable),
# "portable", "avx2" (int8 inputs, tests); "float" (22-bit inputs, FLOAT_LEVELS: the best path
# this build has), "float-portable", "float-avx2" (tests).
PATHS = {"best": 0, "portable": 1, "avx2": 2, "float": 3, "float-portable": 4, "float-avx2": 5}


class BlockKernels:
    """The loaded library, its functions typed."""

    def __init__(self, path: Path) -> None:
        torch.get_num_threads()  # torch's libgomp first, as cpu_native does
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.vnni = bool(self.lib.qb32_has_vnni())
        self.avx2 = bool(self.lib.qb32_has_avx2())
        self.has_float = bool(self.lib.qb32_has_float())  # every build today
        f = self.lib.qb32_linear_desc
        f.argtypes = [_P, _I, _I, _P, _P, _P, _I]
        f.restype = None
        self._linear = f
        # the address cpu_native's whole-layer decode calls (decoder_layer_t.qlinear)
        self.linear_desc_address = ctypes.cast(self.lib.qb32_linear_desc, ctypes.c_void_p).value
        self.gemm16 = bool(self.lib.qb32_has_gemm16())  # the 16-bit GEMM on VNNI
        g = self.lib.qb32_gemm_path_desc  # the many-row GEMM (prefill), one of GEMM_PATHS
        g.argtypes = [_P, _I, _I, _P, _P, _P, _I, _I]
        g.restype = None
        self._gemm = g
        # the whole-layer decode's linear when steps may be larger than the few-row kernel's
        # (QB32StepsDesc: few-row up to its threshold, the GEMM past it)
        self.steps_desc_address = ctypes.cast(self.lib.qb32_steps_desc, ctypes.c_void_p).value
        r = self.lib.qb32_rows_desc  # dequantized rows (the embedding lookup)
        r.argtypes = [_P, _P, _I, _P]
        r.restype = None
        self._rows = r

    def linear(self, x: torch.Tensor, w: QB32, bias=None, path: str = "best") -> torch.Tensor:
        """x [M, K] float32 (last dim contiguous) times w^T (+ bias): [M, N] float32. `path`:
        one of PATHS, `reference_linear(..., levels=levels_of(path))` to float32 rounding."""
        m, k = x.shape
        n, wk = w.shape
        if wk != k:
            raise ValueError(f"x has {k} inputs, the weight {wk}")
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            x = x.float().contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        desc = QB32Desc.of(w, path)
        self._linear(x.data_ptr(), x.stride(0), m, ctypes.byref(desc),
                     None if bias is None else bias.data_ptr(), out.data_ptr(), n)  # fmt: skip
        return out

    def gemm(self, x: torch.Tensor, w: QB32, bias=None, path: str = "float") -> torch.Tensor:
        """The many-row GEMM (prefill): x [M, K] float32 times w^T (+ bias). `path` (GEMM_PATHS):
        "float" takes x as it is, equal to `reference_linear(..., quantize_x=False)` up to
        float32 summation order; "int16" quantizes x per block of 32 to 16-bit codes (integer
        dots), equal to `reference_linear(..., levels=GEMM16_LEVELS)` up to float32 rounding."""
        m, k = x.shape
        n, wk = w.shape
        if wk != k:
            raise ValueError(f"x has {k} inputs, the weight {wk}")
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            x = x.float().contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        desc = QB32Desc.of(w)
        self._gemm(x.data_ptr(), x.stride(0), m, ctypes.byref(desc),
                   None if bias is None else bias.data_ptr(), out.data_ptr(), n,
                   GEMM_PATHS[path])  # fmt: skip
        return out

    def rows(self, w: QB32, index: torch.Tensor) -> torch.Tensor:
        """The dequantized rows `index` of w (an embedding lookup): [*index.shape, K] float32,
        each equal to `dequantize(w)`'s row. Raises IndexError for an index outside w."""
        n, k = w.shape
        flat = index.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
            raise IndexError(f"row index out of range for a weight of {n} rows")
        out = torch.empty(flat.numel(), k, dtype=torch.float32)
        desc = QB32Desc.of(w)
        self._rows(ctypes.byref(desc), flat.data_ptr(), flat.numel(), out.data_ptr())
        return out.view(*index.shape, k)


# where each type's float16 fields sit in its file block (the probes set them to sane values)
_HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
                "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # fmt: skip


def probe_blocks(type_name: str, n: int, k: int, g: torch.Generator) -> QB32:
    """A random weight of `type_name` in our layout: random file bytes, float16 fields small."""
    size, _ = FILE_TYPES[type_name]
    per = SUPER if type_name.endswith("_K") else BLOCK
    raw = torch.randint(0, 256, (n, k // per, size), generator=g, dtype=torch.uint8)
    for at in _HALF_FIELDS[type_name]:
        half = (torch.rand(n, k // per, generator=g) * 0.1).half()
        raw[..., at : at + 2] = half.view(torch.uint8).view(n, k // per, 2)
    return from_gguf_blocks(raw.reshape(n, -1).numpy(), type_name, k)


def self_check(kernels: BlockKernels) -> str | None:
    """The linear against `reference_linear` on probes of each file type (an odd block count
    where the type allows, rows off the kernel's tiles), on the paths the engine runs ("best"
    and "float"; the tests run every path): None, or what disagreed. ~0.25 s of a start."""
    g = torch.Generator().manual_seed(0)
    for name in FILE_TYPES:
        n, k = 19, (SUPER if name.endswith("_K") else 3 * BLOCK)
        w = probe_blocks(name, n, k, g)
        b = torch.randn(n, generator=g)
        for m in (1, 5):
            x = torch.randn(m, k, generator=g)
            for path in ("best", "float"):
                want = reference_linear(x, w, b, levels=levels_of(path)).float()
                got = kernels.linear(x, w, b, path=path)
                err = (got - want).abs().max().item()
                if not err <= 1e-3 * (1 + want.abs().max().item()):
                    return f"qb32 linear ({name}, {m} rows, {path}): differs by {err:.3g}"
        if kernels.gemm16:  # the 16-bit GEMM, where the engine may run it
            x = torch.randn(21, k, generator=g)
            want = reference_linear(x, w, b, levels=GEMM16_LEVELS).float()
            err = (kernels.gemm(x, w, b, path="int16") - want).abs().max().item()
            if not err <= 1e-3 * (1 + want.abs().max().item()):
                return f"qb32 GEMM ({name}, 21 rows, 16-bit inputs): differs by {err:.3g}"
    return None


_lock = threading.Lock()
_loaded: dict[str, BlockKernels | None] = {}


def load() -> BlockKernels | None:
    """The block kernels, built, loaded and self-checked once per process; None (with a
    warning line saying why) where they cannot be."""
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]
        kernels = None
        try:
            kernels = BlockKernels(build())
            problem = self_check(kernels)
            if problem:
                logger.warning("GGUF block kernels off: self-check failed: %s", problem)
                kernels = None
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            logger.warning("GGUF block kernels off: could not build %s: %s", SOURCE.name,
                           detail.strip()[-500:])  # fmt: skip
        _loaded["lib"] = kernels
        return kernels


# -- the file's tensor table -------------------------------------------------------------------


@dataclass
class FileTensor:
    """One tensor of a .gguf file: its type's name and its raw rows (uint8 [rows, row bytes],
    a view of the mapped file), as `from_gguf_blocks` takes them."""

    name: str
    type_name: str
    shape: tuple[int, ...]  # the file's order: inputs first
    data: np.ndarray


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


def read_tensors(path: str) -> dict[str, FileTensor]:
    """The tensors of a GGUF file (version 2 or 3) by name, their data mapped, not read.

    The `gguf` package's GGUFReader builds every metadata value as numpy views, ~3.5 s for a
    tokenizer's 100,000 strings; a start needs only the tensor table, so this walks the header
    itself (the published layout: magic, version, tensor and key counts, the key/value pairs,
    the tensor infos, then the data at the alignment) and takes the types' block sizes from the
    `gguf` package. Raises ValueError for a file it cannot read."""
    import struct

    import gguf

    with open(path, "rb") as f:
        head = f.read(1 << 20)
        pos = 0

        def need(n: int) -> None:
            nonlocal head
            while pos + n > len(head):
                more = f.read(max(1 << 20, n))
                if not more:
                    raise ValueError(f"{path}: the GGUF header ends early")
                head += more

        def take(fmt: str):
            nonlocal pos
            size = struct.calcsize(fmt)
            need(size)
            got = struct.unpack_from(fmt, head, pos)
            pos += size
            return got if len(got) > 1 else got[0]

        def string() -> str:
            nonlocal pos
            n = take("<Q")
            need(n)
            s = bytes(head[pos : pos + n]).decode("utf-8", "replace")
            pos += n
            return s

        def skip_value(kind: int):
            nonlocal pos
            if kind == _STRING:
                return string()
            if kind == _ARRAY:
                inner, count = take("<IQ")
                if inner in _SCALAR_BYTES:
                    need(count * _SCALAR_BYTES[inner])
                    pos += count * _SCALAR_BYTES[inner]
                else:
                    for _ in range(count):
                        skip_value(inner)
                return None
            if kind not in _SCALAR_BYTES:
                raise ValueError(f"{path}: unknown GGUF value type {kind}")
            size = _SCALAR_BYTES[kind]
            need(size)
            value = int.from_bytes(head[pos : pos + size], "little") if kind == _UINT32 else None
            pos += size
            return value

        if take("<I") != 0x46554747:  # b"GGUF" read little-endian
            raise ValueError(f"{path} is not a GGUF file")
        version = take("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not read here")
        n_tensors, n_kv = take("<QQ")
        alignment = 32
        for _ in range(n_kv):
            key = string()
            value = skip_value(take("<I"))
            if key == "general.alignment" and isinstance(value, int):
                alignment = value
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = take("<I")
            shape = tuple(take("<" + "Q" * dims)) if dims > 1 else (take("<Q"),)
            kind, offset = take("<IQ")
            infos.append((name, shape, kind, offset))
        start = -(-pos // alignment) * alignment
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, shape, kind, offset in infos:
        qtype = gguf.GGMLQuantizationType(kind)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        row_bytes = shape[0] // block * size
        at = start + offset
        data = mapped[at : at + rows * row_bytes].reshape(rows, row_bytes)
        out[name] = FileTensor(name, qtype.name, shape, data)
    return out

"""GGUF K-quant weights (Q4_K, Q5_K, Q6_K) kept in a dense layout close to the file's bytes on
CPU: the layout (`KQ`), its repack from the file's super-blocks, the few-row linear on it
(gguf_kquants.c), and the torch references it is tested against.

gguf_blocks.py's qb32 layout widens the K-quants (float32 scale and offset per 32 inputs, Q6_K a
byte a code with float32 scales per 16: 1.33x and 1.83x the file), and a decode reads every byte
of weight once, so they decode slower than the file allows. Here a row is a run of records, one
per super-block of 256 inputs (layout in gguf_kquants.c's header and docs/quantization.md):
Q4_K 148 bytes (4-bit codes, 8-bit sub-scales and sub-mins, float16 d and dmin; the file's 144),
Q5_K 180 bytes (Q4_K's fields for the low four bits, then the fifth bits packed; the file's 176),
Q6_K 210 bytes (the file's: 4-bit low codes, packed top bit pairs, int8 scales, float16 d), the
codes reordered so a 512-bit integer dot's lanes each hold one scale group. Values are the
file's exactly (`dequantize` equals the `gguf` package's dequantization).

The few-row linear quantizes x per block of 32 as gguf_blocks.c's does (int8 or 22-bit "float"
inputs: gguf_blocks.reference_linear is its contract here too, on `dequantize`'s weight); steps
of more rows run gguf_blocks.c's many-row GEMM on chunks of rows repacked to qb32 on the way.
`kq_multi_desc` runs a linear stacked from parts of different types, each part in its own layout.
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
from . import gguf_blocks as gb

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gguf_kquants.c")
SUPER = 256
# name -> (code, record bytes, file bytes)
TYPES = {"Q4_K": (0, 148, 144), "Q6_K": (1, 210, 210), "Q5_K": (2, 180, 176)}
# Steps of more rows go to the many-row GEMM (unless GGUF_BLOCK_ROWS says). Measured on one
# thread (float inputs, the ~0.5B file's 7168x1280 Q4_K and 1280x3584 Q6_K): the repack to qb32
# costs the GEMM ~4-6 ms a call, so the few-row kernel wins up to 32 rows (4.8 against 7.0 ms),
# ties at 64 and loses from 128 (19.4 against 15.5 ms).
FEW_ROWS = 64
# The few-row kernel's paths: gguf_blocks' (int8 and 22-bit "float" inputs) and 15-bit inputs
# ("i15": codes in [-127 * 2^7, 127 * 2^7] per block of 32, two bytes each, two byte dots per
# code byte where "float" takes three; each input moved by at most 2^-15 of its block's largest
# |x|, ~256x less than int8's and ~128x more than float's: docs/quantization.md).
I15_LEVELS = 127 * 2**7
PATHS = {**gb.PATHS, "i15": 6, "i15-portable": 7, "i15-avx2": 8}


def levels_of(path: str) -> int:
    """The input codes' levels of a kernel path (PATHS)."""
    return I15_LEVELS if path.startswith("i15") else gb.levels_of(path)


@dataclass
class KQ:
    """A [N, K] K-quant weight in our records: data uint8 [N, K / 256 * record bytes], row
    after row, or `tiled` (rows in tiles of TILE, see `tiled()`: what the layers serve)."""

    data: torch.Tensor
    type_name: str
    k: int
    tiled: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.k

    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, index: torch.Tensor) -> KQ:
        return KQ(untiled(self).data[index].contiguous(), self.type_name, self.k)

    @staticmethod
    def cat(parts: list[KQ]) -> KQ:
        if len({(p.type_name, p.k) for p in parts}) != 1:
            raise ValueError("stacking K-quant weights of different types or inputs")
        data = torch.cat([untiled(p).data for p in parts]).contiguous()
        return KQ(data, parts[0].type_name, parts[0].k)


def _step_order(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes [S, 256] -> (low-nibble codes, high-nibble codes), each [S, 2, 64] in the record's
    byte order: step s, byte 4t + i holds input 16t + 8s + i (low) and 16t + 8s + 4 + i (high),
    so int32 lane t of a dot sees group t (16 inputs) alone."""
    v = u.reshape(-1, 16, 2, 2, 4).transpose(0, 2, 3, 1, 4)  # [S, step, half, t, i]
    return v[:, :, 0].reshape(-1, 2, 64), v[:, :, 1].reshape(-1, 2, 64)


def from_file_blocks(raw: np.ndarray, type_name: str, k: int, kernels=None) -> KQ:
    """Our records from a GGUF tensor's raw blocks (uint8 [N, row bytes]) of `type_name` (Q4_K,
    Q5_K or Q6_K) with `k` inputs. Exact. With `kernels` (KQuantKernels) the repack runs in C
    (kq_from_file, the same bytes), else in numpy."""
    if type_name not in TYPES:
        raise ValueError(f"GGUF type {type_name} has no kq layout")
    code, rec, size = TYPES[type_name]
    if k % SUPER:
        raise ValueError(f"{k} inputs are not whole super-blocks of {SUPER}")
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, size)
    n = b.shape[0] // (k // SUPER)
    if kernels is not None:
        out = torch.empty(n, k // SUPER * rec, dtype=torch.uint8)
        kernels.lib.kq_from_file(b.ctypes.data, b.shape[0], code, out.data_ptr())
        return KQ(out, type_name, k)
    if type_name in ("Q4_K", "Q5_K"):
        scale, mins = gb._k_scales(b[:, 4:16])
        low = b[:, -128:].reshape(-1, 4, 32)  # per 64 inputs: 32 bytes, two sub-blocks
        u = np.stack([low & 15, low >> 4], axis=2).reshape(-1, SUPER)
        if type_name == "Q5_K":  # bit i of high byte l: the fifth bit of sub-block i's input l
            high = np.unpackbits(b[:, 16:48, None], axis=-1, bitorder="little")  # [S, 32, 8]
            u = u | (high.transpose(0, 2, 1).reshape(-1, SUPER) << 4)
        lo, hi = _step_order(u)
        fields = [((lo & 15) | ((hi & 15) << 4)).reshape(-1, 128), scale, mins, b[:, 0:4]]
        if type_name == "Q5_K":  # per step 8 bytes of low-nibble fifth bits, 8 of high ones
            bits = np.stack([lo >> 4, hi >> 4], axis=2)  # [S, step, nibble, 64]
            fields.append(np.packbits(bits, axis=-1, bitorder="little").reshape(-1, 32))
        out = np.concatenate(fields, axis=1)
    else:
        low = b[:, 0:128].reshape(-1, 2, 2, 32)
        low = np.stack([low & 15, low >> 4], axis=2).reshape(-1, 2, 4, 32)
        high = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        u = (low | ((high & 3) << 4)).reshape(-1, SUPER)
        lo, hi = _step_order(u)
        nib = ((lo & 15) | ((hi & 15) << 4)).reshape(-1, 128)
        pl, ph = lo >> 4, hi >> 4  # top pairs, [S, 2, 64]
        pairs = (pl[..., :32] << 4) | (pl[..., 32:] << 6) | ph[..., :32] | (ph[..., 32:] << 2)
        out = np.concatenate([nib, pairs.reshape(-1, 64), b[:, 192:210]], axis=1)
    data = out.astype(np.uint8).reshape(n, k // SUPER * rec)
    return KQ(torch.from_numpy(np.ascontiguousarray(data)), type_name, k)


TILE = 16  # gguf_kquants.c's KQ_TILE


def _tile_order(data: torch.Tensor, rec: int, tiled: bool) -> torch.Tensor:
    """Row-major records [N, nsb * rec] to the tiled order (rows in tiles of TILE, a tile's
    records super-block by super-block with its rows side by side; the last tile N % TILE rows
    wide), or back when `tiled` says the data is tiled. The same shape, its bytes moved."""
    n, width = data.shape
    nsb = width // rec
    full = n - n % TILE
    out = torch.empty_like(data)
    for t0, w, rows in ((0, full, TILE), (full, n - full, n - full)):
        if w == 0:
            continue
        if tiled:
            src = data[t0 : t0 + w].reshape(-1, nsb, rows, rec).transpose(1, 2)
        else:
            src = data[t0 : t0 + w].reshape(-1, rows, nsb, rec).transpose(1, 2)
        out[t0 : t0 + w].view(-1, rows if tiled else nsb, nsb if tiled else rows, rec).copy_(src)
    return out


def tiled(w: KQ) -> KQ:
    """w with its records in the tiled order the few-row kernel streams (the same values)."""
    if w.tiled:
        return w
    return KQ(_tile_order(w.data, TYPES[w.type_name][1], False), w.type_name, w.k, True)


def untiled(w: KQ) -> KQ:
    """w with its records row after row (the order from_file_blocks makes)."""
    if not w.tiled:
        return w
    return KQ(_tile_order(w.data, TYPES[w.type_name][1], True), w.type_name, w.k, False)


def _records(w: KQ) -> np.ndarray:
    w = untiled(w)
    _, rec, _ = TYPES[w.type_name]
    return w.data.numpy().reshape(-1, rec)


def codes(w: KQ) -> torch.Tensor:
    """The unsigned codes u [N, K] (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63) as int16."""
    r = _records(w)
    nib = r[:, :128].reshape(-1, 2, 64)
    lo, hi = nib & 15, nib >> 4
    if w.type_name == "Q5_K":
        bits = np.unpackbits(r[:, 148:180].reshape(-1, 2, 2, 8), axis=-1, bitorder="little")
        lo, hi = lo | (bits[:, :, 0] << 4), hi | (bits[:, :, 1] << 4)
    if w.type_name == "Q6_K":
        p = r[:, 128:192].reshape(-1, 2, 32)
        lo = lo | (np.concatenate([(p >> 4) & 3, (p >> 6) & 3], axis=-1) << 4)
        hi = hi | (np.concatenate([p & 3, (p >> 2) & 3], axis=-1) << 4)
    u = np.stack([lo.reshape(-1, 2, 16, 4), hi.reshape(-1, 2, 16, 4)], axis=2)  # [S, s, h, t, i]
    n, k = w.shape
    return torch.from_numpy(u.transpose(0, 3, 1, 2, 4).reshape(n, k).astype(np.int16))


def _half(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def scales(w: KQ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(d, c, group): float32 [N, K / group] with value = d * u + c per group of 32 (Q4_K: d *
    sc, -(dmin * m); Q5_K the same) or 16 (Q6_K: d * scale, -32 * (d * scale)). Exact in
    float32."""
    r = _records(w)
    n, k = w.shape
    if w.type_name != "Q6_K":
        d = _half(r[:, 144:146])[:, None] * r[:, 128:136].astype(np.float32)
        c = -(_half(r[:, 146:148])[:, None] * r[:, 136:144].astype(np.float32))
        group = 32
    else:
        d = _half(r[:, 208:210])[:, None] * r[:, 192:208].view(np.int8).astype(np.float32)
        c = np.float32(-32.0) * d
        group = 16
    shape = (n, k // group)
    return torch.from_numpy(d.reshape(shape)), torch.from_numpy(c.reshape(shape)), group


def dequantize(w: KQ, dtype=torch.float32) -> torch.Tensor:
    """The weight as floats, d * u + c in float32 (d * u exact: one rounding, as the `gguf`
    package computes), then `dtype`."""
    n, k = w.shape
    d, c, group = scales(w)
    u = codes(w).to(torch.float32).view(n, k // group, group)
    return (u * d[..., None] + c[..., None]).reshape(n, k).to(dtype)


def to_qb32(w: KQ) -> gb.QB32:
    """The same values in gguf_blocks.py's qb32 layout (what from_gguf_blocks makes of the
    file's blocks), exactly."""
    n, k = w.shape
    d, c, group = scales(w)
    u = codes(w).to(torch.uint8).numpy().reshape(n, k // 32, 32)
    qs = gb._nibbles(u) if w.type_name == "Q4_K" else u
    bits = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}[w.type_name]
    return gb.QB32(torch.from_numpy(np.ascontiguousarray(qs)), d.contiguous(), c.contiguous(),
                   bits, group)  # fmt: skip


# -- build and load ----------------------------------------------------------------------------


def build(out_dir: Path | None = None) -> Path:
    """The compiled library, built and cached as cpu_native's (its own key)."""
    return cpu_native.build(out_dir, SOURCE)


_P, _I = ctypes.c_void_p, ctypes.c_int64


class KQDesc(ctypes.Structure):
    """A KQ weight as gguf_kquants.c's kq_t (its tensor must outlive it)."""

    _fields_ = [("data", _P), ("N", _I), ("K", _I), ("type", _I), ("path", _I)]
    _fields_ += [("few_rows", _I), ("gemm", _P), ("tiled", _I)]

    @staticmethod
    def of(w: KQ, path: str = "best", few_rows: int = FEW_ROWS, gemm: int | None = None) -> KQDesc:
        if not w.data.is_contiguous():
            raise ValueError("kq data must be contiguous")
        n, k = w.shape
        return KQDesc(w.data.data_ptr(), n, k, TYPES[w.type_name][0], PATHS[path], few_rows,
                      gemm, int(w.tiled))  # fmt: skip


class KQPart(ctypes.Structure):
    """One part of a stacked linear (kq_part_t): its function, its descriptor, its first output."""

    _fields_ = [("fn", _P), ("desc", _P), ("n0", _I)]


class KQMulti(ctypes.Structure):
    """A linear of parts (kq_multi_t); holds references to what its pointers point at."""

    _fields_ = [("count", _I), ("parts", ctypes.POINTER(KQPart))]

    @staticmethod
    def of(parts: list[tuple[int, ctypes.Structure, int]]) -> KQMulti:
        """parts: (function address, descriptor, first output) each."""
        arr = (KQPart * len(parts))(*(KQPart(fn, ctypes.addressof(d), n0) for fn, d, n0 in parts))
        m = KQMulti(len(parts), arr)
        m._keep = (arr, [d for _, d, _ in parts])
        return m


class KQuantKernels:
    """The loaded library, its functions typed."""

    def __init__(self, path: Path, blocks: gb.BlockKernels | None) -> None:
        torch.get_num_threads()  # torch's libgomp first, as cpu_native does
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.vnni = bool(self.lib.kq_has_vnni())
        self.avx2 = bool(self.lib.kq_has_avx2())
        self.blocks = blocks
        for name in ("kq_linear_desc", "kq_steps_desc", "kq_multi_desc"):
            f = getattr(self.lib, name)
            f.argtypes = [_P, _I, _I, _P, _P, _P, _I]
            f.restype = None
        r = self.lib.kq_rows_desc
        r.argtypes = [_P, _P, _I, _P]
        r.restype = None
        f = self.lib.kq_from_file
        f.argtypes = [_P, _I, _I, _P]
        f.restype = None
        self.steps_address = ctypes.cast(self.lib.kq_steps_desc, ctypes.c_void_p).value
        self.multi_address = ctypes.cast(self.lib.kq_multi_desc, ctypes.c_void_p).value
        # gguf_blocks.c's GEMM (steps of many rows) and its few-row/GEMM switch for qb32 parts
        self.gemm_address = None
        self.qb32_steps_address = None
        if blocks is not None:
            self.gemm_address = ctypes.cast(blocks.lib.qb32_gemm_desc, ctypes.c_void_p).value
            self.qb32_steps_address = blocks.steps_desc_address

    def desc(self, w: KQ, path: str = "best", few_rows: int = FEW_ROWS) -> KQDesc:
        return KQDesc.of(w, path, few_rows, self.gemm_address)

    def _run(self, fn, x: torch.Tensor, n: int, desc, bias) -> torch.Tensor:
        m = x.shape[0]
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            x = x.float().contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        fn(x.data_ptr(), x.stride(0), m, ctypes.byref(desc),
           None if bias is None else bias.data_ptr(), out.data_ptr(), n)  # fmt: skip
        return out

    def linear(self, x: torch.Tensor, w: KQ, bias=None, path: str = "best") -> torch.Tensor:
        """The few-row kernel, any row count: x [M, K] times w^T (+ bias), equal to
        `gb.reference_linear(x, <dequantize(w)>, levels=levels_of(path))` to float32
        rounding. `path`: "best" (int8 inputs: VNNI, else AVX2, else portable), "portable",
        "avx2" (where built), "float", "float-portable", "float-avx2" (22-bit inputs), and
        "i15", "i15-portable", "i15-avx2" (15-bit inputs)."""
        if x.shape[1] != w.k:
            raise ValueError(f"x has {x.shape[1]} inputs, the weight {w.k}")
        return self._run(self.lib.kq_linear_desc, x, w.shape[0], self.desc(w, path), bias)

    def steps(self, x: torch.Tensor, w: KQ, bias=None, path: str = "best",
              few_rows: int = FEW_ROWS) -> torch.Tensor:  # fmt: skip
        """The few-row kernel up to `few_rows` rows, the many-row GEMM (x as it is) past it."""
        if x.shape[1] != w.k:
            raise ValueError(f"x has {x.shape[1]} inputs, the weight {w.k}")
        desc = self.desc(w, path, few_rows)
        return self._run(self.lib.kq_steps_desc, x, w.shape[0], desc, bias)

    def multi(self, x: torch.Tensor, multi: KQMulti, n: int, bias=None) -> torch.Tensor:
        """A stacked linear of `n` outputs (KQMulti), each part by its own function."""
        return self._run(self.lib.kq_multi_desc, x, n, multi, bias)

    def rows(self, w: KQ, index: torch.Tensor) -> torch.Tensor:
        """The dequantized rows `index` of w (an embedding lookup), each equal to dequantize's."""
        n, k = w.shape
        flat = index.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
            raise IndexError(f"row index out of range for a weight of {n} rows")
        out = torch.empty(flat.numel(), k, dtype=torch.float32)
        desc = self.desc(w)
        self.lib.kq_rows_desc(ctypes.byref(desc), flat.data_ptr(), flat.numel(), out.data_ptr())
        return out.view(*index.shape, k)


def probe(type_name: str, n: int, k: int, g: torch.Generator) -> KQ:
    """A random weight of `type_name` in our records: random file bytes, float16 fields small."""
    _, _, size = TYPES[type_name]
    raw = torch.randint(0, 256, (n, k // SUPER, size), generator=g, dtype=torch.uint8)
    for at in gb._HALF_FIELDS[type_name]:
        half = (torch.rand(n, k // SUPER, generator=g) * 0.1).half()
        raw[..., at : at + 2] = half.view(torch.uint8).view(n, k // SUPER, 2)
    return from_file_blocks(raw.reshape(n, -1).numpy(), type_name, k)


def self_check(kernels: KQuantKernels) -> str | None:
    """The few-row linear (the paths the engine runs), the GEMM switch and the row lookup against
    their references on probes of each type: None, or what disagreed."""
    g = torch.Generator().manual_seed(0)
    for name in TYPES:
        n, k = 19, 2 * SUPER
        w = probe(name, n, k, g)
        raw = torch.randint(0, 256, (3, 2 * TYPES[name][2]), generator=g, dtype=torch.uint8)
        if not torch.equal(from_file_blocks(raw.numpy(), name, k, kernels).data,
                           from_file_blocks(raw.numpy(), name, k).data):  # fmt: skip
            return f"kq repack ({name}): C and numpy differ"
        ref_w = to_qb32(w)
        b = torch.randn(n, generator=g)
        for m in (1, 5):
            x = torch.randn(m, k, generator=g)
            for path in ("best", "float", "i15"):
                want = gb.reference_linear(x, ref_w, b, levels=levels_of(path)).float()
                got = kernels.linear(x, tiled(w), b, path=path)  # the layers' layout
                err = (got - want).abs().max().item()
                if not err <= 1e-3 * (1 + want.abs().max().item()):
                    return f"kq linear ({name}, {m} rows, {path}): differs by {err:.3g}"
        if kernels.gemm_address is not None:
            x = torch.randn(9, k, generator=g)
            want = gb.reference_linear(x, ref_w, b, quantize_x=False).float()
            got = kernels.steps(x, tiled(w), b, few_rows=2)
            err = (got - want).abs().max().item()
            if not err <= 1e-3 * (1 + want.abs().max().item()):
                return f"kq GEMM ({name}): differs by {err:.3g}"
        ids = torch.tensor([0, n - 1, 3])
        if not torch.equal(kernels.rows(tiled(w), ids), dequantize(w)[ids]):
            return f"kq rows ({name}): differ from dequantize"
    return None


_lock = threading.Lock()
_loaded: dict[str, KQuantKernels | None] = {}


def load() -> KQuantKernels | None:
    """The K-quant kernels, built, loaded and self-checked once per process (with gguf_blocks'
    for the GEMM); None (with a warning line saying why) where they cannot be."""
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]
        kernels = None
        try:
            kernels = KQuantKernels(build(), gb.load())
            problem = self_check(kernels)
            if problem:
                logger.warning("GGUF K-quant kernels off: self-check failed: %s", problem)
                kernels = None
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            logger.warning("GGUF K-quant kernels off: could not build %s: %s", SOURCE.name,
                           detail.strip()[-500:])  # fmt: skip
        _loaded["lib"] = kernels
        return kernels

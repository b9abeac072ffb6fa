"""GGUF block-quantized weights kept quantized on CPU: our layout, its repack from the file's
blocks, the native linear on it (gguf_blocks.c) and the torch references it is tested against.

The layout (`QB32`, described in docs/quantization.md and gguf_blocks.c): a weight [N, K] in
blocks of 32 inputs of one output row, each block's values w = d * u + c with u an unsigned
code (4 bits, two a byte, or 8 bits) and d, c float16 per block. Q4_0, Q4_1 and Q8_0 map onto
it exactly (Q4_0: c = -8d; Q8_0: u = q + 128, c = -128d), so one kernel serves all three.

The native linear quantizes each row of x per block of 32 to int8 (scale max|x| / 127,
round half to even) and sums integer products, as the Q8 formats intend:
`reference_linear(..., quantize_x=True)` is that computation in float64 (what the kernel must
equal up to float32 rounding), `quantize_x=False` the plain dequantize-then-matmul (what it
approximates).

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

# GGUF type name -> (bytes per block in the file, bits of our codes)
FILE_TYPES = {"Q4_0": (18, 4), "Q4_1": (20, 4), "Q8_0": (34, 8)}


@dataclass
class QB32:
    """A [N, K] weight in our blocked layout: qs uint8 [N, K/32, 16 or 32], d and c float16
    [N, K/32]."""

    qs: torch.Tensor
    d: torch.Tensor
    c: torch.Tensor
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * BLOCK

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.c))

    def rows(self, index: torch.Tensor) -> QB32:
        """The weight's rows in the order `index` gives."""
        return QB32(self.qs[index].contiguous(), self.d[index].contiguous(),
                    self.c[index].contiguous(), self.bits)  # fmt: skip

    @staticmethod
    def cat(parts: list[QB32]) -> QB32:
        """Weights stacked along N (all of one bit width and K)."""
        if len({p.bits for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("stacking qb32 weights of different bit widths or inputs")
        return QB32(*(torch.cat([getattr(p, f) for p in parts]) for f in ("qs", "d", "c")),
                    parts[0].bits)  # fmt: skip


def from_gguf_blocks(raw: np.ndarray, type_name: str, k: int) -> QB32:
    """Our layout from a GGUF tensor's raw blocks: `raw` uint8 [N, K/32 * block bytes] (the
    `gguf` package's GGUFReader `.data` of a quantized tensor), `type_name` its type."""
    if type_name not in FILE_TYPES:
        raise ValueError(f"GGUF type {type_name} has no qb32 layout")
    if k % BLOCK:
        raise ValueError(f"{k} inputs are not whole blocks of {BLOCK}")
    size, bits = FILE_TYPES[type_name]
    nb = k // BLOCK
    fields = {"Q4_0": [("d", "<f2"), ("qs", "u1", 16)],
              "Q4_1": [("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)],
              "Q8_0": [("d", "<f2"), ("qs", "i1", 32)]}[type_name]  # fmt: skip
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1).view(np.dtype(fields))
    blocks = blocks.reshape(-1, nb)
    d = torch.from_numpy(np.ascontiguousarray(blocks["d"]))
    if type_name == "Q4_1":
        c = torch.from_numpy(np.ascontiguousarray(blocks["m"]))
    else:  # -8d or -128d: exact, a power-of-two multiple of a float16
        c = d * (-8 if type_name == "Q4_0" else -128)
    if type_name == "Q8_0":
        qs = torch.from_numpy((blocks["qs"].astype(np.int16) + 128).astype(np.uint8))
    else:
        qs = torch.from_numpy(np.ascontiguousarray(blocks["qs"]))
    return QB32(qs.contiguous(), d.contiguous(), c.contiguous(), bits)


def codes(w: QB32) -> torch.Tensor:
    """The unsigned codes u [N, K] as int16."""
    n, k = w.shape
    if w.bits == 8:
        return w.qs.reshape(n, k).to(torch.int16)
    lo, hi = (w.qs & 15).to(torch.int16), (w.qs >> 4).to(torch.int16)
    return torch.cat([lo, hi], dim=-1).reshape(n, k)


def dequantize(w: QB32, dtype=torch.float32) -> torch.Tensor:
    """The weight as floats: d * u + c per block (float64 arithmetic, then `dtype`)."""
    n, k = w.shape
    u = codes(w).to(torch.float64).view(n, k // BLOCK, BLOCK)
    full = u * w.d.double()[..., None] + w.c.double()[..., None]
    return full.reshape(n, k).to(dtype)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 per block of 32 as the kernel quantizes it: (codes [M, K] float64,
    scales [M, K/32] float32)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    scale = xb.abs().amax(-1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)
    return q.reshape(m, k).double(), scale


def reference_linear(x, w: QB32, bias=None, quantize_x: bool = True) -> torch.Tensor:
    """The native linear's contract in float64: x [M, K] times dequantize(w)^T (+ bias), x
    quantized per block to int8 first when `quantize_x` (as the kernel does)."""
    if quantize_x:
        q, scale = quantize_rows_reference(x)
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
    _fields_ += [("path", _I)]

    @staticmethod
    def of(w: QB32, path: str = "best") -> QB32Desc:
        n, k = w.shape
        return QB32Desc(w.qs.data_ptr(), w.d.data_ptr(), w.c.data_ptr(), n, k, w.bits, PATHS[path])


# BlockKernels.linear's paths: "best" (int8 inputs: AVX-512 VNNI, else AVX2, else portable),
# "portable", "avx2" (int8 inputs, tests), "float" (float inputs, AVX-512 only: `has_float`).
PATHS = {"best": 0, "portable": 1, "avx2": 2, "float": 3}


class BlockKernels:
    """The loaded library, its functions typed."""

    def __init__(self, path: Path) -> None:
        torch.get_num_threads()  # torch's libgomp first, as cpu_native does
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.vnni = bool(self.lib.qb32_has_vnni())
        self.avx2 = bool(self.lib.qb32_has_avx2())
        self.has_float = bool(self.lib.qb32_has_float())
        f = self.lib.qb32_linear
        f.argtypes = [_P, _I, _I, _I, _P, _P, _P, _I, _I, _P, _P, _I, _I]
        f.restype = None
        self._linear = f
        # the address cpu_native's whole-layer decode calls (decoder_layer_t.qlinear)
        self.linear_desc_address = ctypes.cast(self.lib.qb32_linear_desc, ctypes.c_void_p).value

    def linear(self, x: torch.Tensor, w: QB32, bias=None, path: str = "best") -> torch.Tensor:
        """x [M, K] float32 (last dim contiguous) times w^T (+ bias): [M, N] float32. `path`:
        one of PATHS ("float": x unquantized, `reference_linear(..., quantize_x=False)`)."""
        code = PATHS[path]
        m, k = x.shape
        n, wk = w.shape
        if wk != k:
            raise ValueError(f"x has {k} inputs, the weight {wk}")
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            x = x.float().contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        self._linear(
            x.data_ptr(), x.stride(0), m, k, w.qs.data_ptr(), w.d.data_ptr(), w.c.data_ptr(),
            n, w.bits, None if bias is None else bias.data_ptr(), out.data_ptr(), n, code,
        )  # fmt: skip
        return out


def self_check(kernels: BlockKernels) -> str | None:
    """The linear against `reference_linear` on probes of each bit width (an odd block count,
    rows off the kernel's tile of 4), both paths: None, or what disagreed."""
    g = torch.Generator().manual_seed(0)
    for size, name in ((20, "Q4_1"), (34, "Q8_0"), (18, "Q4_0")):
        n, k = 19, 3 * BLOCK
        raw = torch.randint(0, 256, (n, k // BLOCK, size), generator=g, dtype=torch.uint8)
        raw[..., 0:2] = torch.rand(n, k // BLOCK, generator=g).mul(0.1).half().view(
            torch.uint8).view(n, k // BLOCK, 2)  # fmt: skip
        if name == "Q4_1":
            raw[..., 2:4] = (torch.randn(n, k // BLOCK, generator=g) * 0.1).half().view(
                torch.uint8).view(n, k // BLOCK, 2)  # fmt: skip
        w = from_gguf_blocks(raw.reshape(n, -1).numpy(), name, k)
        b = torch.randn(n, generator=g)
        for m in (1, 5):
            x = torch.randn(m, k, generator=g)
            want = reference_linear(x, w, b).float()
            for path in ("best", "portable", "avx2", "float"):
                if path == "float":
                    want = reference_linear(x, w, b, quantize_x=not kernels.has_float).float()
                got = kernels.linear(x, w, b, path=path)
                err = (got - want).abs().max().item()
                if not err <= 1e-3 * (1 + want.abs().max().item()):
                    return f"qb32 linear ({name}, {m} rows, {path}): differs by {err:.3g}"
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

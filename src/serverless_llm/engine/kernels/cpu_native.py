"""The CPU path's native kernels (cpu_native.c), their build, and their torch references.

On a CPU a decode step runs, besides its linears, ~70
small torch ops per layer (norms, rotary, the KV write, a gather-and-matmul attention), and at
one request those cost as much as a third of the step in dispatch alone. cpu_native.c does each
group in one call, float32, reading the paged cache in place:

- `attention_step`: a layer's q/k clip, q/k RMSNorm, rotary (neox or GPT-J, full or partial),
  KV write and the decode rows' attention (soft-cap, ALiBi, sliding window) over the head-major
  cache the torch backend uses (`allocate_kv_cache(head_major=True)`);
- `add_norm`: the residual add and RMSNorm or LayerNorm;
- `linear`: F.linear on a weight in panels (`pack_panels`), for the row counts of decode steps
  where it measures faster than oneDNN (layers/linear.py chooses);
- `activation`: the MLP's activation, plain or gated (silu, gelu and its tanh form, relu);
- `decoder_layer`: a whole pre-norm decoder layer of a decode step, sequential or parallel (its
  MLP gated or plain, of a native activation).

The build: the system C compiler (`CC`, else `cc`), `-O3 -march=native -fopenmp`, once per
machine: the library is cached under `NATIVE_KERNEL_CACHE` (default
`~/.cache/serverless_llm/cpu_native`) by a key of the source, the compiler's version and the
CPU's flags, so a start after the first pays nothing (a build takes ~1 s). It links libgomp,
which torch has already loaded: one OpenMP runtime and team for both. No compiler, a failed
build or a failed self-check (each function against its torch reference on a probe, at load)
leave the torch path in place with a warning line; `ATTENTION_BACKEND=torch` turns it off.

References: the torch code this replaces, in its own kernel modules (`rms_norm_reference`,
`layer_norm_reference`, `rotary_embedding_reference`, `reshape_and_cache_reference`,
`paged_attention_reference`); `attention_step_reference` composes them in this call's order.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .activation import ACT_CODES, act_and_mul_reference, activation_reference
from .layer_norm import layer_norm_reference
from .metadata import AttentionMetadata, AttentionSpec
from .rms_norm import rms_norm_reference
from .rotary import rotate_table_ref

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native.c")
_F = ctypes.c_float
_I = ctypes.c_int64
_P = ctypes.c_void_p

# The activation codes (kernels/activation.py's ACT_CODES) activation_f32 computes: silu, gelu
# (the erf form), its tanh approximation, relu: all of them.
NATIVE_ACT_CODES = (0, 1, 2, 3)

# The q/k norms the native step applies (models/decoder.py's names).
QK_NORMS = {None: 0, "rms_head": 1, "rms_full": 2, "layer_head": 3, "layer_head_shared": 4}


class Step(ctypes.Structure):
    _fields_ = [
        ("num_tokens", _I),
        ("num_decodes", _I),
        ("positions", _P),
        ("slot_mapping", _P),
        ("block_tables", _P),
        ("seq_lens", _P),
        ("bt_stride", _I),
        ("block_size", _I),
    ]


class Layer(ctypes.Structure):
    _fields_ = [
        ("num_heads", _I),
        ("num_kv_heads", _I),
        ("head_dim", _I),
        ("scale", _F),
        ("softcap", _F),
        ("slopes", _P),
        ("window", _I),
        ("k_cache", _P),
        ("v_cache", _P),
        ("rope", _P),
        ("rot_dim", _I),
        ("is_neox", _I),
        ("clip", _F),
        ("qk_norm", _I),
        ("q_norm", _P),
        ("k_norm", _P),
        ("qk_eps", _F),
        ("q_norm_bias", _P),
        ("k_norm_bias", _P),
    ]


class DecoderLayerWeights(ctypes.Structure):
    _fields_ = [
        ("hidden", _I),
        ("q_size", _I),
        ("kv_size", _I),
        ("inter", _I),
        ("norm_kind", _I),
        ("act", _I),
        ("gated", _I),
        ("parallel", _I),
        ("mlp_norm", _I),
        ("eps", _F),
        *((name, _P) for name in ("in_w", "in_b", "mlp_w", "mlp_b")),
        *((name, _P) for name in ("qkv_w", "qkv_b", "o_w", "o_b")),
        *((name, _P) for name in ("up_w", "up_b", "down_w", "down_b")),
    ]


PANEL = 16  # columns of w^T a panel holds (cpu_native.c's PANEL)


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """A float32 [N, K] weight as the native linear reads it: [ceil(N / 16), K, 16], panel p
    holding rows 16p..16p+15 of w transposed (zeros past N)."""
    w = w.detach()
    n, k = w.shape
    full = n // PANEL
    # Written straight into the result (no padded copy of the weight: a load packs one linear
    # at a time, and its peak memory counts every transient copy).
    panels = torch.empty(-(-n // PANEL), k, PANEL, dtype=w.dtype)
    panels[:full].copy_(w[: full * PANEL].view(full, PANEL, k).transpose(1, 2))
    if n > full * PANEL:
        panels[full].zero_()
        panels[full, :, : n - full * PANEL].copy_(w[full * PANEL :].T)
    return panels


# -- build and load ----------------------------------------------------------------------------


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _compiler() -> str:
    return os.environ.get("CC", "").strip() or "cc"


def _build_flags() -> list[str]:
    # -fno-trapping-math: no FP traps are ever enabled, and without it GCC will not if-convert
    # (so not vectorize) a loop with a select, e.g. every loop of exp_nonpositive.
    flags = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp"]
    return flags + ["-fPIC", "-shared"]


def cache_dir() -> Path:
    root = os.environ.get("NATIVE_KERNEL_CACHE", "").strip()
    return Path(root) if root else Path.home() / ".cache" / "serverless_llm" / "cpu_native"


def build(out_dir: Path | None = None) -> Path:
    """The compiled library for this machine, built if its key is not cached yet. Raises
    OSError or subprocess.CalledProcessError when it cannot be built."""
    cc = _compiler()
    version = subprocess.run(
        [cc, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), version, cpu_flags(), *_build_flags()]).encode()
    ).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"cpu_native-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes starting together never load half a
    # file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *_build_flags(), str(SOURCE), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


class NativeKernels:
    """The loaded library, its functions typed."""

    def __init__(self, path: Path) -> None:
        torch.get_num_threads()  # torch (and its libgomp) are loaded before the library
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        f = self.lib.attention_step_f32
        f.argtypes = [ctypes.POINTER(Layer), ctypes.POINTER(Step)] + [_P, _I] * 4
        f.restype = None
        self._attention = f
        f = self.lib.linear_panels_f32
        f.argtypes = [_P, _I, _P, _P, _P, _I, _I, _I]
        f.restype = None
        self._linear = f
        f = self.lib.decoder_layer_f32
        f.argtypes = [ctypes.POINTER(DecoderLayerWeights), ctypes.POINTER(Layer)]
        f.argtypes += [ctypes.POINTER(Step)] + [_P] * 5 + [_I]
        f.restype = None
        self._decoder_layer = f
        f = self.lib.add_norm_f32
        f.argtypes = [_P] * 6 + [_I] * 3 + [_F, _I]
        f.restype = None
        self._add_norm = f
        f = self.lib.activation_f32
        f.argtypes = [_P, _I, _P] + [_I] * 4
        f.restype = None
        self._activation = f

    def activation(self, x, code: int, gated: bool):
        """act(x) of ACT_CODES' `code` (one of NATIVE_ACT_CODES) for x [M, n] (last dim
        contiguous), or act(gate) * up for x [M, gate | up]."""
        M, n = x.shape
        n = n // 2 if gated else n
        out = torch.empty(M, n, dtype=x.dtype)
        self._activation(x.data_ptr(), x.stride(0), out.data_ptr(), M, n, code, int(gated))
        return out

    def attention_step(self, layer: Layer, step: Step, q, k, v, out) -> None:
        """q [T, H, D], k and v [T, KVH, D] (rows strided, heads contiguous) prepared in place
        and written to the cache; out [num_decodes, H * D] gets the decodes' attention."""
        self._attention(
            ctypes.byref(layer),
            ctypes.byref(step),
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            out.data_ptr(),
            out.stride(0),
        )

    def linear(self, x, panels, bias=None, out_features: int | None = None):
        """F.linear(x, w, bias) for x [M, K] (last dim contiguous) and `panels` =
        pack_panels(w) (bias contiguous); out_features: w's rows (default: all the panels'
        columns, padding included)."""
        M, K = x.shape
        N = out_features or panels.shape[0] * PANEL
        out = torch.empty(M, N, dtype=x.dtype)
        self._linear(
            x.data_ptr(),
            x.stride(0),
            panels.data_ptr(),
            ptr_or_null(bias),
            out.data_ptr(),
            M,
            N,
            K,
        )
        return out

    def decoder_layer(self, weights: DecoderLayerWeights, layer: Layer, step: Step, x, residual):
        """A whole pre-norm layer (norm, QKV, attention, O, add and norm, MLP) over
        the step's M decode rows x [M, hidden] (contiguous; residual too, or None): returns
        (the MLP's output, the stream after the attention's add)."""
        M, hd = x.shape
        mlp_out = torch.empty(M, hd, dtype=x.dtype)
        res_out = torch.empty(M, hd, dtype=x.dtype)
        w = weights
        work = torch.empty(M * (4 * hd + 2 * w.q_size + 2 * w.kv_size + 3 * w.inter))
        self._decoder_layer(
            ctypes.byref(weights),
            ctypes.byref(layer),
            ctypes.byref(step),
            x.data_ptr(),
            ptr_or_null(residual),
            mlp_out.data_ptr(),
            res_out.data_ptr(),
            work.data_ptr(),
            M,
        )
        return mlp_out, res_out

    def add_norm(self, x, residual, weight, bias, eps: float, kind: int):
        """out = norm(x + residual), and x + residual (None without `residual`): RMSNorm
        (kind 0) or LayerNorm (kind 1), over the last dim of [rows, n] float32 rows."""
        n = x.shape[-1]
        rows = x.numel() // n
        out = torch.empty(x.shape, dtype=x.dtype)
        res = None if residual is None else torch.empty(x.shape, dtype=x.dtype)
        self._add_norm(
            x.data_ptr(),
            ptr_or_null(residual),
            ptr_or_null(weight),
            ptr_or_null(bias),
            out.data_ptr(),
            ptr_or_null(res),
            rows,
            n,
            x.stride(-2) if x.dim() > 1 else n,
            eps,
            kind,
        )
        return out, res


_lock = threading.Lock()
_loaded: dict[str, NativeKernels | None] = {}


def load() -> NativeKernels | None:
    """The native kernels, built, loaded and self-checked once per process; None (with a
    warning line saying why) where they cannot be."""
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]
        kernels = None
        try:
            kernels = NativeKernels(build())
            problem = self_check(kernels)
            if problem:
                logger.warning("native CPU kernels off: self-check failed: %s", problem)
                kernels = None
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            logger.warning(
                "native CPU kernels off (the torch path runs instead): could not build %s: %s",
                SOURCE.name,
                detail.strip()[-500:],
            )
        _loaded["lib"] = kernels
        return kernels


# -- inputs ------------------------------------------------------------------------------------


def make_step(meta: AttentionMetadata, positions: torch.Tensor, keep: list) -> Step:
    """The step's struct; `keep` holds the tensors it points into for the step's life."""
    tables = meta.block_tables
    if tables.dtype != torch.int32 or tables.stride(-1) != 1:
        tables = tables.to(torch.int32).contiguous()
    lens = meta.seq_lens.to(torch.int32).contiguous()
    pos = positions.to(torch.int64).contiguous()
    slots = meta.slot_mapping.to(torch.int64).contiguous()
    keep.extend((tables, lens, pos, slots))
    return Step(
        num_tokens=pos.shape[0],
        num_decodes=meta.num_decodes,
        positions=pos.data_ptr(),
        slot_mapping=slots.data_ptr(),
        block_tables=tables.data_ptr(),
        seq_lens=lens.data_ptr(),
        bt_stride=tables.stride(0),
        block_size=meta.block_size,
    )


@dataclass
class LayerPrep:
    """What a layer's q, k, v need before the cache write, when the native step does it: the
    rope table and layout, the clip, the q/k RMSNorm weights. None/0 fields: not applied."""

    rope: torch.Tensor | None = None  # [max_position, rot_dim] float32
    is_neox: bool = True
    clip: float | None = None
    qk_norm: str | None = None  # a key of QK_NORMS
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_eps: float = 1e-6
    q_norm_bias: torch.Tensor | None = None  # layer_head_shared only
    k_norm_bias: torch.Tensor | None = None


def make_layer(spec: AttentionSpec, kv_cache: torch.Tensor, prep: LayerPrep | None) -> Layer:
    """A layer's struct over its cache (head-major, float32) and its prep's tensors (which must
    outlive it: the model holds them)."""
    prep = prep or LayerPrep()
    slopes = spec.alibi_slopes
    return Layer(
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        scale=spec.scale,
        softcap=spec.logit_softcap or 0.0,
        slopes=ptr_or_null(slopes),
        window=spec.sliding_window or 0,
        k_cache=kv_cache[0].data_ptr(),
        v_cache=kv_cache[1].data_ptr(),
        rope=ptr_or_null(prep.rope),
        rot_dim=0 if prep.rope is None else prep.rope.shape[-1],
        is_neox=int(prep.is_neox),
        clip=prep.clip or 0.0,
        qk_norm=QK_NORMS[prep.qk_norm],
        q_norm=ptr_or_null(prep.q_norm),
        k_norm=ptr_or_null(prep.k_norm),
        qk_eps=prep.qk_eps,
        q_norm_bias=ptr_or_null(prep.q_norm_bias),
        k_norm_bias=ptr_or_null(prep.k_norm_bias),
    )


def ptr_or_null(t: torch.Tensor | None) -> int | None:
    """A tensor's address for a struct field or argument, None (NULL) for no tensor."""
    return None if t is None else t.data_ptr()


def native_cache_ok(kv_cache: torch.Tensor) -> bool:
    """Whether the native step reads this cache: float32 and head-major, contiguous."""
    return kv_cache.dtype == torch.float32 and kv_cache[0].transpose(1, 2).is_contiguous()


# -- torch references --------------------------------------------------------------------------


def prepare_reference(q, k, v, positions, prep: LayerPrep):
    """What `attention_step` does to q, k, v before the write, in torch (out of place)."""
    if prep.clip:
        q, k, v = (t.clamp(-prep.clip, prep.clip) for t in (q, k, v))
    if prep.qk_norm == "rms_head":
        q = rms_norm_reference(q, prep.q_norm, prep.qk_eps)
        k = rms_norm_reference(k, prep.k_norm, prep.qk_eps)
    elif prep.qk_norm == "rms_full":
        T = q.shape[0]
        q = rms_norm_reference(q.reshape(T, -1), prep.q_norm, prep.qk_eps).view(q.shape)
        k = rms_norm_reference(k.reshape(T, -1), prep.k_norm, prep.qk_eps).view(k.shape)
    elif prep.qk_norm == "layer_head":  # HeadLayerNorm: a weight per head, no bias
        q = layer_norm_reference(q, None, None, prep.qk_eps) * prep.q_norm
        k = layer_norm_reference(k, None, None, prep.qk_eps) * prep.k_norm
    elif prep.qk_norm == "layer_head_shared":
        q = layer_norm_reference(q, prep.q_norm, prep.q_norm_bias, prep.qk_eps)
        k = layer_norm_reference(k, prep.k_norm, prep.k_norm_bias, prep.qk_eps)
    if prep.rope is not None:
        q = rotate_table_ref(positions, q, prep.rope, prep.is_neox)
        k = rotate_table_ref(positions, k, prep.rope, prep.is_neox)
    return q, k, v


def add_norm_reference(x, residual, weight, bias, eps: float, kind: int):
    """`add_norm`'s contract by the torch references: (out, x + residual or None)."""
    if kind == 0:
        got = rms_norm_reference(x, weight, eps, residual)
    else:
        got = layer_norm_reference(x, weight, bias, eps, residual)
    return got if residual is not None else (got, None)


# -- self-check --------------------------------------------------------------------------------


def self_check(kernels: NativeKernels) -> str | None:
    """Each function against its torch reference on a small probe (GQA, partial GPT-J rotary,
    q/k norm, soft-cap, ALiBi, a window, a prefill row; linears and norms): None, or what
    disagreed."""
    from .kv_write import reshape_and_cache_reference
    from .paged_attention import paged_attention_reference

    g = torch.Generator().manual_seed(0)
    H, KVH, D, bs, nb = 4, 2, 16, 4, 12
    for name, prep, spec_kw in (
        ("plain", LayerPrep(rope=_probe_rope(D, g)), {}),
        (
            "options",
            LayerPrep(
                rope=_probe_rope(D // 2, g),
                is_neox=False,
                clip=2.0,
                qk_norm="rms_head",
                q_norm=torch.rand(D, generator=g) + 0.5,
                k_norm=torch.rand(D, generator=g) + 0.5,
            ),
            {
                "logit_softcap": 3.0,
                "alibi_slopes": torch.rand(H, generator=g),
                "sliding_window": 5,
            },
        ),
    ):
        spec = AttentionSpec(H, KVH, D, D**-0.5, **spec_kw)
        lens, qlens = [9, 3, 7], [1, 1, 3]
        T = sum(qlens)
        tables = torch.tensor([[3, 7, 1], [5, 0, 0], [2, 9, 0]], dtype=torch.int32)
        slots, positions = [], []
        for i, (n, ql) in enumerate(zip(lens, qlens)):
            for p in range(n - ql, n):
                slots.append(int(tables[i, p // bs]) * bs + p % bs)
                positions.append(p)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, 1, 2, T], dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            context_lens=torch.tensor([n - q for n, q in zip(lens, qlens)], dtype=torch.int32),
            block_tables=tables,
            slot_mapping=torch.tensor(slots),
            num_decodes=2,
            max_query_len=3,
            max_seq_len=9,
            query_lens_host=qlens,
            seq_lens_host=lens,
            block_size=bs,
        )
        pos = torch.tensor(positions)
        qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g) * 2
        cache = torch.randn(2, nb, KVH, bs, D, generator=g).transpose(2, 3)  # head-major
        ref_cache = cache.clone()
        q, k, v = qkv.view(T, -1, D).split([H, KVH, KVH], dim=1)
        rq, rk, rv = prepare_reference(q, k, v, pos, prep)
        reshape_and_cache_reference(rk, rv, ref_cache, meta.slot_mapping)
        want = paged_attention_reference(rq, ref_cache, meta, spec)[:2]
        keep: list = []
        out = torch.empty(2, H * D)
        kernels.attention_step(
            make_layer(spec, cache, prep), make_step(meta, pos, keep), q, k, v, out
        )
        for what, a, b in (
            ("q", q, rq),
            ("k", k, rk),
            ("cache", cache, ref_cache),
            ("attention", out, want),
        ):
            err = (a - b).abs().max().item()
            if not err <= 1e-4:
                return f"attention_step ({name}): {what} differs by {err:.3g}"
    # Columns off the panels (21 = 16 + 5), K past one block (130 = 128 + 2), rows off the
    # micro-kernel's 6.
    for n, k in ((21, 37), (32, 130)):
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        panels = pack_panels(w)
        for m in (1, 3, 8, 13):
            x = torch.randn(m, k, generator=g)
            got = kernels.linear(x, panels, b, n)
            err = (got - torch.nn.functional.linear(x, w, b)).abs().max().item()
            if not err <= 1e-4:
                return f"linear ({m} x {k} -> {n}): differs by {err:.3g}"
    x = torch.randn(3, 2 * 40, generator=g) * 4
    for code in NATIVE_ACT_CODES:
        for gated in (False, True):
            err = kernels.activation(x, code, gated) - activation_code_reference(x, code, gated)
            if not err.abs().max().item() <= 1e-5:
                return f"activation {code} (gated {gated}): differs by {err.abs().max():.3g}"
    x, res = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g)
    w, b = torch.randn(40, generator=g), torch.randn(40, generator=g)
    for kind, bias in ((0, None), (1, b), (1, None)):
        for r in (None, res):
            got = kernels.add_norm(x, r, w, bias, 1e-5, kind)
            want = add_norm_reference(x, r, w, bias, 1e-5, kind)
            for a, b2 in zip(got, want):
                err = 0.0 if a is None else (a - b2).abs().max().item()
                if not err <= 1e-4:
                    return f"add_norm (kind {kind}): differs by {err:.3g}"
    return None


def activation_code_reference(x: torch.Tensor, code: int, gated: bool) -> torch.Tensor:
    """`activation`'s torch reference (kernels/activation.py's, by code)."""
    act = next(name for name, c in ACT_CODES.items() if c == code)
    return act_and_mul_reference(x, act) if gated else activation_reference(x, act)


def _probe_rope(rot_dim: int, g: torch.Generator) -> torch.Tensor:
    """A rotary table of 16 positions with random angles."""
    angles = torch.rand(16, rot_dim // 2, generator=g) * 6
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def main() -> int:
    """Builds, loads and checks the library (`make install` runs it ahead of the first start)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    loaded = load()
    print(f"native CPU kernels: {loaded.path if loaded else 'off (see the warning above)'}")
    return 0 if loaded else 1

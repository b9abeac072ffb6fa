"""The CPU path's native kernels (cpu_native.c), their build, and their torch references.

On a CPU a decode step runs, besides its linears, ~70
small torch ops per layer (norms, rotary, the KV write, a gather-and-matmul attention), and at
one request those cost as much as a third of the step in dispatch alone. cpu_native.c does each
group in one call, float32, reading the paged cache in place:

- `attention_step`: a layer's q/k clip, q/k RMSNorm, rotary (neox or GPT-J, full or partial),
  KV write and the decode rows' attention (soft-cap, ALiBi, sliding window, chunked local
  attention, sinks) over the head-major cache the torch backend uses
  (`allocate_kv_cache(head_major=True)`), read at the layer's strides (so a layer's view of
  narrower entries in a wider layer's tensor, Gemma 4's, runs here too);
- `latent_step`: a multi-head latent attention (MLA) layer's row write and its decodes'
  absorbed attention over the latent cache (one row of latent | rotary key a token, read once
  for all heads), `mla_attention.latent_decode_reference`'s contract;
- `encoder_attention`: an encoder step's bidirectional attention, every request and head in one
  call, reading q, k, v in place (views into the QKV output), with a two-sided window or none
  (`paged_attention.encoder_attention_reference`'s contract);
- `add_norm`: the residual add and RMSNorm or LayerNorm;
- `linear`: F.linear on a weight in panels (`pack_panels`), for the row counts of decode steps
  where it measures faster than oneDNN (layers/linear.py chooses);
- `activation`: the MLP's activation, plain or gated (silu, gelu and its tanh form, relu);
- `decoder_layer`: a whole pre-norm decoder layer of a decode step, sequential or parallel (its
  MLP gated or plain, of a native activation);
- `conv_layer`: a whole short-convolution layer (LFM2, LFM3) of a decode step: norm, in_proj,
  the gated convolution's one-token update of each request's window in its state slot,
  out_proj, LFM3's post norms, the MLP (models/decoder.NativeConvLayer);
- the recurrent layers' decode steps, `gated_delta_decode`, `ssd_decode`,
  `selective_scan_decode`, `conv1d_decode`: each request's state read from its slot once and
  written back once, in place, parallel over (request, head) — the torch references gather the
  states by slot, update them in a few passes and scatter them back, and on a CPU a decode step
  of these layers is bound by that traffic. The references' decode branches call them
  (`recurrent_kernels()`) when a `load()` has succeeded and the tensors are float32 on the CPU.

The build: the system C compiler (`CC`, else `cc`), `-O3 -march=native -fopenmp`, once per
machine: the library is cached under `NATIVE_KERNEL_CACHE` (default
`~/.cache/serverless_llm/cpu_native`) by a key of the source, the compiler's version and the
CPU's flags, so a start after the first pays nothing (a build takes ~1 s). It links libgomp,
which torch has already loaded: one OpenMP runtime and team for both. No compiler, a failed
build or a failed self-check (each function against its torch reference on a probe, at load)
leave the torch path in place with a warning line; `ATTENTION_BACKEND=torch` turns it off.

References: the torch code this replaces, in its own kernel modules (`rms_norm_reference`,
`layer_norm_reference`, `rotary_embedding_reference`, `reshape_and_cache_reference`,
`paged_attention_reference`, `write_latents_reference`, `latent_decode_reference`);
`prepare_reference` is the step's q/k preparation in this call's order. The
recurrent decodes' references are the torch decode branches of `gated_delta_rule_ref`,
`ssd_scan_ref`, `selective_scan_ref` and `causal_conv1d_ref` (run inside `torch_decodes()`).
"""

from __future__ import annotations

import contextlib
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
        ("sinks", _P),
        ("chunk", _I),
        ("block_stride", _I),
        ("head_stride", _I),
        ("token_stride", _I),
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
        # another layout's linear (gguf_blocks' qb32_linear_desc) and each linear's descriptor
        # for it; NULL: the panels above
        *((name, _P) for name in ("qlinear", "qkv_q", "o_q", "up_q", "down_q")),
        # LFM3's per-head gate (panels of [heads, hidden]) and post norms; NULL: none
        ("gate_w", _P),
        ("gate_heads", _I),
        ("post_w", _P),
        ("post_mlp_w", _P),
    ]


class ConvLayerWeights(ctypes.Structure):
    """cpu_native.c's conv_layer_t: a short-convolution layer (LFM2, LFM3) for `conv_layer`."""

    _fields_ = [
        ("hidden", _I),
        ("channels", _I),
        ("kernel", _I),
        ("inter", _I),
        ("act", _I),
        ("gated", _I),
        ("eps", _F),
        *((name, _P) for name in ("in_w", "post_w", "mlp_w", "post_mlp_w")),
        *((name, _P) for name in ("in_proj_w", "in_proj_b", "conv_w", "conv_b", "out_w", "out_b")),
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


def pack_panels_in_place(w: torch.Tensor) -> torch.Tensor:
    """`pack_panels` of a contiguous float32 [N, K] weight whose N is a multiple of PANEL,
    written over w's own memory (one copy of w held meanwhile): the panels are a view of w's
    storage, so a model's stacked experts become panels with no second copy of a projection.
    Other weights: `pack_panels`."""
    n, k = w.shape
    if n % PANEL or not w.is_contiguous():
        return pack_panels(w)
    w = w.detach()
    rows = w.clone()
    panels = w.view(n // PANEL, k, PANEL)
    panels.copy_(rows.view(n // PANEL, PANEL, k).transpose(1, 2))
    return panels


MOE_WORK_BYTES = 256 << 20  # `moe_experts`' scratch at most (one chunk of tokens' intermediates)


class PanelPointers:
    """The addresses of several weights in panels (one per expert), as one C array for
    `NativeKernels.moe_experts`; it keeps the panels alive. `in_features`: their K."""

    def __init__(self, panels: list[torch.Tensor]) -> None:
        self.panels = panels
        self.in_features = panels[0].shape[1]
        self.ptrs = (ctypes.c_void_p * len(panels))(*[p.data_ptr() for p in panels])


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


def build(out_dir: Path | None = None, source: Path = SOURCE) -> Path:
    """The compiled library of `source` (this module's C file, or another kernel module's, such
    as gguf_blocks.c) for this machine, built if its key (source, compiler, CPU flags, build
    flags) is not cached yet. Raises OSError or subprocess.CalledProcessError when it cannot be
    built."""
    cc = _compiler()
    version = subprocess.run(
        [cc, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    key = hashlib.sha256(
        "\0".join([source.read_text(), version, cpu_flags(), *_build_flags()]).encode()
    ).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"{source.stem}-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes starting together never load half a
    # file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *_build_flags(), str(source), "-o", tmp, "-lm"],
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
        # decoder_layer's scratch, reused from call to call (per thread: two engines of one
        # process may step at once)
        self._scratch = threading.local()
        self.lib = ctypes.CDLL(str(path))
        f = self.lib.attention_step_f32
        f.argtypes = [ctypes.POINTER(Layer), ctypes.POINTER(Step)] + [_P, _I] * 4
        f.restype = None
        self._attention = f
        f = self.lib.mla_decode_f32
        f.argtypes = [ctypes.POINTER(Step), _P, _I, _P, _I, _P, _I, _I, _I, _F, _P, _I]
        f.restype = None
        self._mla = f
        f = self.lib.linear_panels_f32
        f.argtypes = [_P, _I, _P, _P, _P, _I, _I, _I]
        f.restype = None
        self._linear = f
        f = self.lib.decoder_layer_f32
        f.argtypes = [ctypes.POINTER(DecoderLayerWeights), ctypes.POINTER(Layer)]
        f.argtypes += [ctypes.POINTER(Step)] + [_P] * 5 + [_I]
        f.restype = None
        self._decoder_layer = f
        f = self.lib.conv_layer_f32
        f.argtypes = [ctypes.POINTER(ConvLayerWeights)] + [_P] * 8 + [_I]
        f.restype = None
        self._conv_layer = f
        f = self.lib.add_norm_f32
        f.argtypes = [_P] * 6 + [_I] * 3 + [_F, _I]
        f.restype = None
        self._add_norm = f
        f = self.lib.activation_f32
        f.argtypes = [_P, _I, _P] + [_I] * 4
        f.restype = None
        self._activation = f
        f = self.lib.encoder_attention_f32
        f.argtypes = [_P, _I] * 4 + [_P] + [_I] * 4 + [_F, _I]
        f.restype = None
        self._encoder_attention = f
        f = self.lib.gated_delta_decode_f32
        f.argtypes = [_P, _I, _I] * 3 + [_P, _I, _I, _I, _P, _I, _I] + [_P] * 4 + [_I] * 5
        f.argtypes += [_F, _I]
        f.restype = None
        self._gated_delta = f
        f = self.lib.gated_delta_prefill_f32
        f.argtypes = [_P, _I, _I] * 3 + [_P, _I, _I, _I, _P, _I, _I] + [_P] * 5 + [_I] * 5
        f.argtypes += [_F, _I]
        f.restype = None
        self._gated_delta_prefill = f
        f = self.lib.ssd_decode_f32
        f.argtypes = [_P, _I, _I, _P, _I, _P, _P, _I, _I, _P, _I, _I] + [_P] * 5 + [_I] * 5
        f.restype = None
        self._ssd = f
        f = self.lib.selective_scan_decode_f32
        f.argtypes = [_P, _I, _P, _I, _P, _P, _I, _P, _I, _P, _P, _I] + [_P] * 4 + [_I] * 4
        f.restype = None
        self._selective_scan = f
        f = self.lib.conv1d_decode_f32
        f.argtypes = [_P, _I, _P, _P, _P, _P, _P, _P] + [_I] * 5
        f.restype = None
        self._conv1d = f
        f = self.lib.conv1d_prefill_f32
        f.argtypes = [_P, _I] + [_P] * 7 + [_I] * 4
        f.restype = None
        self._conv1d_prefill = f
        f = self.lib.gated_rms_norm_f32
        f.argtypes = [_P, _I, _I, _P, _I, _I, _P, _P] + [_I] * 4 + [_F, _I]
        f.restype = None
        self._gated_rms_norm = f
        f = self.lib.selective_scan_prefill_f32
        f.argtypes = [_P, _I, _P, _I, _P, _P, _I, _P, _I, _P, _P, _I] + [_P] * 5 + [_I] * 4
        f.restype = None
        self._selective_scan_prefill = f
        f = self.lib.moe_experts_f32
        f.argtypes = [_P, _I] + [_P] * 5 + [_I] * 7 + [_P, _P]
        f.restype = None
        self._moe_experts = f

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

    def encoder_attention(self, q, k, v, starts, spec: AttentionSpec):
        """Bidirectional attention of each request over its own rows (encoders: no cache), as
        paged_attention.encoder_attention_torch: q [T, H, D], k and v [T, KVH, D] float32 (rows
        strided, heads contiguous, each head's values contiguous), `starts` the requests'
        first rows and T (int64, contiguous); a two-sided window from spec.sliding_window.
        Returns [T, H * D]."""
        T, H, D = q.shape
        out = torch.empty(T, H * D, dtype=torch.float32)
        self._encoder_attention(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            out.data_ptr(),
            H * D,
            starts.data_ptr(),
            starts.shape[0] - 1,
            H,
            k.shape[1],
            D,
            spec.scale,
            spec.sliding_window or 0,
        )
        return out

    def latent_step(self, step: Step, rows, q, cache, scale: float, rank: int):
        """A latent (MLA) layer's step, float32: each row of `rows` [T, W] (the latent after its
        norm, then the rotated key; rows strided, values contiguous; or None: nothing written) at
        its slot of `cache` ([1, blocks, block_size, 1, W], contiguous), then the absorbed decode
        of q [num_decodes, H, W] (q_lat | q_pe) over each decode's cached rows: returns the
        softmax(scale * q . row)-weighted latents [num_decodes, H, rank]
        (mla_attention.latent_decode_reference's contract)."""
        W = cache.shape[-1]
        if not cache[0].is_contiguous():
            raise ValueError("the native latent step reads a contiguous cache only")
        if rows is not None and rows.stride(-1) != 1:
            rows = rows.contiguous()
        nd, H = (0, 0) if q is None else q.shape[:2]
        if q is not None and nd != step.num_decodes:
            raise ValueError(f"{nd} decode queries for a step of {step.num_decodes} decodes")
        if q is not None and (q.stride(2) != 1 or q.stride(1) != W):
            q = q.contiguous()
        out = torch.empty(nd, H, rank, dtype=torch.float32)
        self._mla(
            ctypes.byref(step),
            ptr_or_null(rows),
            0 if rows is None else rows.stride(0),
            cache.data_ptr(),
            W,
            ptr_or_null(q),
            0 if q is None else q.stride(0),
            H,
            rank,
            scale,
            out.data_ptr(),
            H * rank,
        )
        return out

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

    def moe_experts(
        self, x, ids, weights, w13: PanelPointers, w2: PanelPointers, act: int, gated: bool
    ):
        """A sparse block's experts in one call: for x [T, H] float32 (last dim contiguous),
        ids [T, k] and router weights [T, k], each token's sum over its experts of weight *
        w2 act(w13 x), with each expert's weights in panels (`w13`, `w2`: `panel_pointers` of
        their [gate | up] (gated) or up rows, and of their down projections); act: an
        ACT_CODES code of 0-3. Rounded as kernels/fused_moe.py's fused_moe_reference with the
        native GEMM and activation."""
        T, H = x.shape
        k = ids.shape[1]
        E, inter = len(w13.ptrs), w2.in_features
        ids = ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty(T, H, dtype=x.dtype)
        # Every chosen row's intermediates are held at once: a long prompt goes in chunks of
        # tokens whose scratch fits MOE_WORK_BYTES (each token's result is its own, so the
        # chunks change no bit; a decode step or the bench's prompts are one chunk).
        per_token = k * (2 * H + (3 if gated else 2) * inter)
        step = max(1, MOE_WORK_BYTES // (4 * per_token))
        work = torch.empty(min(T, step) * per_token, dtype=x.dtype)
        idx = torch.empty(2 * min(T, step) * k + 2 * E + 1, dtype=torch.int64)
        for t0 in range(0, T, step):
            t = min(step, T - t0)
            self._moe_experts(
                x[t0].data_ptr(), x.stride(0), ids[t0].data_ptr(), weights[t0].data_ptr(),
                w13.ptrs, w2.ptrs, out[t0].data_ptr(), t, k, E, H, inter, act, int(gated),
                work.data_ptr(), idx.data_ptr(),
            )  # fmt: skip
        return out

    def decoder_layer(self, weights: DecoderLayerWeights, layer: Layer, step: Step, x, residual):
        """A whole pre-norm layer (norm, QKV, attention, O, add and norm, MLP) over
        the step's M decode rows x [M, hidden] (contiguous; residual too, or None): returns
        (the MLP's output, the stream after the attention's add)."""
        M, hd = x.shape
        mlp_out = torch.empty(M, hd, dtype=x.dtype)
        res_out = torch.empty(M, hd, dtype=x.dtype)
        w = weights
        need = M * (5 * hd + 2 * w.q_size + 2 * w.kv_size + 3 * w.inter + w.gate_heads)
        work = getattr(self._scratch, "work", None)
        if work is None or work.numel() < need:
            work = self._scratch.work = torch.empty(need)
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

    def conv_layer(self, weights: ConvLayerWeights, conv_state, slots, has_init, x, residual):
        """A whole short-convolution layer (norm, in_proj, the gated convolution's one-token
        update of each request's window, out_proj, the optional post norm, add and norm, MLP,
        the optional post-MLP norm) over the step's M decode rows x [M, hidden] (contiguous;
        residual too, or None): conv_state [slots, channels, kernel - 1] float32 contiguous,
        updated in place; slots [>= M] int32 and has_init [>= M] bool, contiguous. Returns (the
        MLP's output, the stream after the mixer's add)."""
        M, hd = x.shape
        mlp_out = torch.empty(M, hd, dtype=x.dtype)
        res_out = torch.empty(M, hd, dtype=x.dtype)
        w = weights
        need = M * (4 * hd + 5 * w.channels + 3 * w.inter)
        work = getattr(self._scratch, "work", None)
        if work is None or work.numel() < need:
            work = self._scratch.work = torch.empty(need)
        self._conv_layer(
            ctypes.byref(weights),
            conv_state.data_ptr(),
            slots.data_ptr(),
            has_init.data_ptr(),
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

    # -- the recurrent layers' decode steps (each returns False, doing nothing, where the
    # tensors do not qualify: the caller's torch code runs instead) --

    def gated_delta_decode(
        self, q, k, v, g, beta, state, slots, has_init, scale: float, l2norm: bool, out, n: int
    ) -> bool:
        """kernels/gated_delta.py's decode branch for requests 0..n-1 (rows 0..n-1): q, k
        [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv] or [T, Hv, Dk], beta [T, Hv] float32 (any row and
        head strides, last dims contiguous), state [slots, Hv, Dk, Dv] updated in place,
        out [>= n, Hv, Dv] contiguous float32 gets o (q scaled by `scale`, l2-normalised with
        q and k when `l2norm`)."""
        per_channel = g.dim() == 3
        if not _gated_delta_fits(q, k, v, g, beta, state, out):
            return False
        slots, has_init = _slots_flags(slots, has_init, n)
        _, Hk, Dk = q.shape
        Hv, Dv = v.shape[1:]
        self._gated_delta(
            q.data_ptr(), q.stride(0), q.stride(1),
            k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1),
            g.data_ptr(), g.stride(0), g.stride(1), int(per_channel),
            beta.data_ptr(), beta.stride(0), beta.stride(1),
            state.data_ptr(), slots.data_ptr(), has_init.data_ptr(), out.data_ptr(),
            n, Hk, Hv, Dk, Dv, scale, int(l2norm),
        )  # fmt: skip
        return True

    def gated_delta_prefill(
        self, q, k, v, g, beta, state, starts, slots, has_init, scale: float, l2norm: bool, out
    ) -> bool:
        """kernels/gated_delta.py's prompt chunks, token after token in their slots: requests
        b = 0..len(slots)-1 with rows starts[b]..starts[b+1]-1 (`starts`: the chunks' part of
        query_start_loc, len(slots) + 1 entries), tensors as `gated_delta_decode`'s, out
        [T, Hv, Dv] contiguous float32."""
        per_channel = g.dim() == 3
        if not _gated_delta_fits(q, k, v, g, beta, state, out):
            return False
        n = slots.shape[0]
        slots, has_init = _slots_flags(slots, has_init, n)
        starts = starts.to(torch.int32).contiguous()
        _, Hk, Dk = q.shape
        Hv, Dv = v.shape[1:]
        self._gated_delta_prefill(
            q.data_ptr(), q.stride(0), q.stride(1),
            k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1),
            g.data_ptr(), g.stride(0), g.stride(1), int(per_channel),
            beta.data_ptr(), beta.stride(0), beta.stride(1),
            state.data_ptr(), slots.data_ptr(), has_init.data_ptr(), starts.data_ptr(),
            out.data_ptr(), n, Hk, Hv, Dk, Dv, scale, int(l2norm),
        )  # fmt: skip
        return True

    def ssd_decode(self, x, dt, A, B, C, D, state, slots, has_init, y, n: int) -> bool:
        """kernels/ssd.py's decode step (`_decode_ref`, the D skip included) for rows 0..n-1:
        x [T, H, P] (any row and head strides, P contiguous), dt [T, H] processed (time_steps),
        A [H], B, C [T, G, N] (N contiguous), D [H] or None, all float32; state
        [slots, H, P, N] updated in place; y [>= n, H, P] contiguous float32 gets y."""
        if not (_f32_cpu(x, dt, A, B, C, state, y) and state.is_contiguous()):
            return False
        if D is not None and not (_f32_cpu(D) and D.is_contiguous()):
            return False
        if x.stride(2) != 1 or dt.stride(1) != 1 or B.stride(2) != 1 or C.stride(2) != 1:
            return False
        if not (A.is_contiguous() and y.is_contiguous()):
            return False
        slots, has_init = _slots_flags(slots, has_init, n)
        _, H, P = x.shape
        G, N = B.shape[1:]
        self._ssd(
            x.data_ptr(), x.stride(0), x.stride(1), dt.data_ptr(), dt.stride(0), A.data_ptr(),
            B.data_ptr(), B.stride(0), B.stride(1), C.data_ptr(), C.stride(0), C.stride(1),
            ptr_or_null(D), state.data_ptr(), slots.data_ptr(), has_init.data_ptr(),
            y.data_ptr(), n, H, G, P, N,
        )  # fmt: skip
        return True

    def selective_scan_decode(self, u, dt, A, B, C, D, z, state, slots, has_init, y, n) -> bool:
        """kernels/selective_scan.py's decode step (the D skip and the z gate included) for rows
        0..n-1: u, dt (processed: bias and softplus applied), z [T, Dn], B, C [T, N] (any row
        strides, last dims contiguous), A [Dn, N], D [Dn] or None, z or None, all float32;
        state [slots, Dn, N] updated in place; y [>= n, Dn] (last dim contiguous) gets y."""
        if not _selective_scan_fits(u, dt, A, B, C, D, z, state, y):
            return False
        slots, has_init = _slots_flags(slots, has_init, n)
        Dn, N = A.shape
        self._selective_scan(
            u.data_ptr(), u.stride(0), dt.data_ptr(), dt.stride(0), A.data_ptr(),
            B.data_ptr(), B.stride(0), C.data_ptr(), C.stride(0), ptr_or_null(D),
            ptr_or_null(z), 0 if z is None else z.stride(0), state.data_ptr(), slots.data_ptr(),
            has_init.data_ptr(), y.data_ptr(), y.stride(0), n, Dn, N,
        )  # fmt: skip
        return True

    def selective_scan_prefill(
        self, u, dt, A, B, C, D, z, state, starts, slots, has_init, y
    ) -> bool:
        """kernels/selective_scan.py's prompt chunks, token after token in their slots (the D
        skip and the z gate included): requests b = 0..len(slots)-1 with rows
        starts[b]..starts[b+1]-1 (`starts`: the chunks' part of query_start_loc, len(slots) + 1
        entries); tensors as `selective_scan_decode`'s."""
        if not _selective_scan_fits(u, dt, A, B, C, D, z, state, y):
            return False
        n = slots.shape[0]
        slots, has_init = _slots_flags(slots, has_init, n)
        starts = starts.to(torch.int32).contiguous()
        Dn, N = A.shape
        self._selective_scan_prefill(
            u.data_ptr(), u.stride(0), dt.data_ptr(), dt.stride(0), A.data_ptr(),
            B.data_ptr(), B.stride(0), C.data_ptr(), C.stride(0), ptr_or_null(D),
            ptr_or_null(z), 0 if z is None else z.stride(0), state.data_ptr(), slots.data_ptr(),
            has_init.data_ptr(), starts.data_ptr(), y.data_ptr(), y.stride(0), n, Dn, N,
        )  # fmt: skip
        return True

    def conv1d_decode(self, x, weight, bias, conv_state, slots, has_init, silu, out, n) -> bool:
        """kernels/causal_conv1d.py's decode branch for rows 0..n-1: x [T, C] (any row stride,
        channels contiguous), weight [C, K], bias [C] or None, conv_state [slots, C, K-1] (updated
        in place), all float32; out [>= n, C] (channels contiguous) gets act(conv) (SiLU when
        `silu`)."""
        if not _conv1d_fits(x, weight, bias, conv_state, out):
            return False
        slots, has_init = _slots_flags(slots, has_init, n)
        C, K = weight.shape
        self._conv1d(
            x.data_ptr(), x.stride(0), weight.data_ptr(), ptr_or_null(bias),
            conv_state.data_ptr(), slots.data_ptr(), has_init.data_ptr(), out.data_ptr(),
            out.stride(0), n, C, K, int(silu),
        )  # fmt: skip
        return True

    def conv1d_prefill(self, x, weight, bias, conv_state, starts, slots, has_init, silu, out):
        """kernels/causal_conv1d.py's prompt chunks, token after token through each request's
        window: requests b = 0..len(slots)-1 with rows starts[b]..starts[b+1]-1 (`starts`: the
        chunks' part of query_start_loc, len(slots) + 1 entries); tensors as
        `conv1d_decode`'s."""
        if not _conv1d_fits(x, weight, bias, conv_state, out):
            return False
        n = slots.shape[0]
        slots, has_init = _slots_flags(slots, has_init, n)
        starts = starts.to(torch.int32).contiguous()
        C, K = weight.shape
        self._conv1d_prefill(
            x.data_ptr(), x.stride(0), weight.data_ptr(), ptr_or_null(bias),
            conv_state.data_ptr(), slots.data_ptr(), has_init.data_ptr(), starts.data_ptr(),
            out.data_ptr(), out.stride(0), n, C, K, int(silu),
        )  # fmt: skip
        return True

    def gated_rms_norm(self, x, z, weight, eps: float, group_size: int, norm_before_gate: bool):
        """kernels/causal_conv1d.py's `gated_rms_norm_ref` for float32 x, z [..., D] (two or
        three dims, D contiguous, any other strides) and weight [D]: the result [..., D]
        contiguous, or None where the tensors do not qualify (the torch code runs)."""
        if x.shape != z.shape or x.dim() not in (2, 3) or not _f32_cpu(x, z, weight):
            return None
        D = x.shape[-1]
        if x.stride(-1) != 1 or z.stride(-1) != 1 or weight.shape != (D,) or D % group_size:
            return None
        weight = weight.contiguous()
        x3, z3 = (x, z) if x.dim() == 3 else (x.unsqueeze(1), z.unsqueeze(1))
        n0, n1 = x3.shape[:2]
        y = torch.empty(x.shape, dtype=torch.float32)
        self._gated_rms_norm(
            x3.data_ptr(), x3.stride(0), x3.stride(1), z3.data_ptr(), z3.stride(0), z3.stride(1),
            weight.data_ptr(), y.data_ptr(), n0, n1, D, group_size, eps, int(norm_before_gate),
        )  # fmt: skip
        return y


def _f32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


# What the recurrent layers' native calls read (one check for a layer's decode and prompt
# forms): float32 on the CPU, the strides the C loops assume.


def _gated_delta_fits(q, k, v, g, beta, state, out) -> bool:
    if not (_f32_cpu(q, k, v, g, beta, state, out) and state.is_contiguous()):
        return False
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or not out.is_contiguous():
        return False
    return g.dim() != 3 or g.stride(2) == 1


def _selective_scan_fits(u, dt, A, B, C, D, z, state, y) -> bool:
    if not (_f32_cpu(u, dt, A, B, C, state, y) and state.is_contiguous()):
        return False
    if D is not None and not (_f32_cpu(D) and D.is_contiguous()):
        return False
    if z is not None and not (_f32_cpu(z) and z.stride(1) == 1):
        return False
    return all(t.stride(1) == 1 for t in (u, dt, B, C, y)) and A.is_contiguous()


def _conv1d_fits(x, weight, bias, conv_state, out) -> bool:
    if not (_f32_cpu(x, weight, conv_state, out) and conv_state.is_contiguous()):
        return False
    if bias is not None and not (_f32_cpu(bias) and bias.is_contiguous()):
        return False
    return x.stride(1) == 1 and out.stride(1) == 1 and weight.is_contiguous()


def _slots_flags(slots: torch.Tensor, has_init: torch.Tensor, n: int):
    """state_slots[:n] as contiguous int32 and has_initial_state[:n] as contiguous bool (one
    byte each), as the native decodes read them."""
    slots, has_init = slots[:n], has_init[:n]
    if slots.dtype != torch.int32 or not slots.is_contiguous():
        slots = slots.to(torch.int32).contiguous()
    if has_init.dtype != torch.bool or not has_init.is_contiguous():
        has_init = has_init.to(torch.bool).contiguous()
    return slots, has_init


_lock = threading.Lock()
_torch_decodes = 0  # > 0: inside torch_decodes(), the references' decodes run their torch code
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


def recurrent_kernels() -> NativeKernels | None:
    """The library for the recurrent layers' decode steps, which the torch references of
    gated_delta, ssd, selective_scan and causal_conv1d call when it is there: the kernels of an
    earlier `load()` in this process (the engine's CPU backend loads them, unless
    ATTENTION_BACKEND=torch), None before one, where it failed, or inside `torch_decodes()`. It
    never builds or loads anything itself."""
    return None if _torch_decodes else _loaded.get("lib")


@contextlib.contextmanager
def torch_decodes():
    """Within it the recurrent references' decodes run their torch code (tests, the
    self-check's other side)."""
    global _torch_decodes
    _torch_decodes += 1
    try:
        yield
    finally:
        _torch_decodes -= 1


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
    """A layer's struct over its cache (float32, `native_cache_ok`) and its prep's tensors (which must
    outlive it: the model holds them)."""
    prep = prep or LayerPrep()
    slopes = spec.alibi_slopes
    sinks = spec.sinks
    if sinks is not None and not (sinks.dtype == torch.float32 and sinks.is_contiguous()):
        raise ValueError("the native step reads float32 sinks only")
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
        sinks=ptr_or_null(sinks),
        chunk=spec.chunk_size or 0,
        **cache_strides(kv_cache),
    )


def ptr_or_null(t: torch.Tensor | None) -> int | None:
    """A tensor's address for a struct field or argument, None (NULL) for no tensor."""
    return None if t is None else t.data_ptr()


def native_cache_ok(kv_cache: torch.Tensor) -> bool:
    """Whether the native step reads this cache: float32, each entry's head_dim values
    contiguous, K and V alike; blocks, heads and tokens at any strides (`cache_strides`), so a
    layer's view of narrower entries in a wider layer's tensor (`kv_cache.layer_view`, Gemma 4)
    is read in place as the tensor's own layers are."""
    if kv_cache.dtype != torch.float32:
        return False
    k, v = kv_cache[0], kv_cache[1] if kv_cache.shape[0] > 1 else kv_cache[0]
    return (k.stride(-1) == 1 or k.shape[-1] == 1) and k.stride() == v.stride()


def cache_strides(kv_cache: torch.Tensor) -> dict[str, int]:
    """The layer struct's strides (in floats) of a cache of logical shape [2, num_blocks,
    block_size, KVH, D]: between blocks, heads and tokens (head-major and contiguous: KVH *
    block_size * D, block_size * D, D)."""
    sb, st, sh, _ = kv_cache[0].stride()
    return {"block_stride": sb, "head_stride": sh, "token_stride": st}


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
    q/k norm, soft-cap, ALiBi, a window, sinks, a chunk, a prefill row, a cache that is a view
    of narrower entries in a wider tensor; the latent step; linears and norms; the recurrent
    decodes): None, or what disagreed."""
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
                "sinks": torch.randn(H, generator=g) * 2,
            },
        ),
        ("chunked", LayerPrep(rope=_probe_rope(D, g)), {"chunk_size": 3}),
        ("view", LayerPrep(rope=_probe_rope(D, g)), {"sliding_window": 5}),
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
        if name == "view":  # Gemma 4's narrower layers: their heads inside 3 x D wide ones
            cache = torch.randn(2, nb, KVH, bs, 3 * D, generator=g)[..., :D].transpose(2, 3)
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
        if name == "plain":
            problem = _check_latent(kernels, meta, pos, g)
            if problem:
                return problem
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
    problem = _check_encoder(kernels, g)
    if problem:
        return problem
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
    return _check_recurrent(kernels, g)


def _check_encoder(kernels: NativeKernels, g: torch.Generator) -> str | None:
    """`encoder_attention` against paged_attention's reference: q, k, v as views into one QKV
    row, requests crossing the key blocks (1, 5, 37 and 70 rows), a head width off the vector
    width (20), grouped KV heads, with and without a two-sided window: None, or what disagreed."""
    from .paged_attention import encoder_attention_reference

    H, KVH, D = 4, 2, 20
    lens = [5, 37, 1, 70]
    T = sum(lens)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    meta = AttentionMetadata(
        query_start_loc=starts.to(torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        context_lens=torch.zeros(len(lens), dtype=torch.int32),
        block_tables=torch.zeros(len(lens), 1, dtype=torch.int32),
        slot_mapping=torch.zeros(T, dtype=torch.int64),
        num_decodes=0,
        max_query_len=max(lens),
        max_seq_len=max(lens),
        query_lens_host=lens,
        seq_lens_host=lens,
        block_size=16,
    )
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g) * 2
    q, k, v = qkv.view(T, -1, D).split([H, KVH, KVH], dim=1)
    for window in (None, 6):
        spec = AttentionSpec(H, KVH, D, D**-0.5, sliding_window=window)
        got = kernels.encoder_attention(q, k, v, starts, spec)
        err = (got - encoder_attention_reference(q, k, v, meta, spec)).abs().max().item()
        if not err <= 1e-4:
            return f"encoder_attention (window {window}): differs by {err:.3g}"
    return None


def _check_latent(kernels: NativeKernels, meta: AttentionMetadata, pos, g) -> str | None:
    """`latent_step` (the row write, then the absorbed decode of 3 heads over the rows) against
    mla_attention's references on the attention probe's step: None, or what disagreed."""
    from .mla_attention import latent_decode_reference, write_latents_reference

    W, rank = 20, 16
    cache = torch.randn(1, 12, meta.block_size, 1, W, generator=g)
    ref_cache = cache.clone()
    rows = torch.randn(pos.shape[0], W, generator=g)
    q = torch.randn(meta.num_decodes, 3, W, generator=g)
    got = kernels.latent_step(make_step(meta, pos, []), rows, q, cache, 0.3, rank)
    write_latents_reference(rows, ref_cache, meta)
    want = latent_decode_reference(q, ref_cache, meta, 0.3, rank)
    for what, a, b in (("cache", cache, ref_cache), ("attention", got, want)):
        err = (a - b).abs().max().item()
        if not err <= 1e-4:
            return f"latent_step: {what} differs by {err:.3g}"
    return None


def _check_recurrent(kernels: NativeKernels, g: torch.Generator) -> str | None:
    """The recurrent decodes against the references' torch decodes on a probe of 3 requests
    (one fresh, its slot holding NaN; odd sizes; GQA; per-channel decay): None, or what
    disagreed."""
    from .causal_conv1d import causal_conv1d_ref
    from .gated_delta import gated_delta_rule_ref
    from .selective_scan import _time_steps, selective_scan_ref
    from .ssd import ssd_scan_ref, time_steps

    n = 3
    qsl = torch.arange(n + 1, dtype=torch.int32)
    slots = torch.tensor([2, 4, 1], dtype=torch.int32)
    init = torch.tensor([True, False, True])

    def states(*shape):
        s = torch.randn(5, *shape, generator=g)
        s[4] = float("nan")  # the fresh request's slot: never read
        return s, s.clone()

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    problems = []

    def compare(name, got, want, state, ref_state):
        for what, a, b in (("output", got, want), ("state", state, ref_state)):
            if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                problems.append(f"{name}: {what} differs by {(a - b).abs().max():.3g}")

    with torch_decodes():
        for gdim in ((n, 4), (n, 4, 5)):
            q, k, v = rnd(n, 2, 5), rnd(n, 2, 5), rnd(n, 4, 7)
            gl, beta = -torch.rand(*gdim, generator=g), torch.rand(n, 4, generator=g)
            state, ref_state = states(4, 5, 7)
            out = torch.empty(n, 4, 7)
            want = gated_delta_rule_ref(
                q, k, v, gl, beta, ref_state, qsl, slots, init, 0.3, True, num_decodes=n
            )
            kernels.gated_delta_decode(q, k, v, gl, beta, state, slots, init, 0.3, True, out, n)
            compare(f"gated_delta_decode (g {len(gdim)}-d)", out, want, state, ref_state)
        x, dt, A = rnd(n, 4, 3), rnd(n, 4), -torch.rand(4, generator=g)
        B, C, D, bias = rnd(n, 2, 5), rnd(n, 2, 5), rnd(4), rnd(4)
        state, ref_state = states(4, 3, 5)
        want = ssd_scan_ref(
            x, dt, A, B, C, D, bias, True, (0.0, 9.0), ref_state, qsl, slots, init, n
        )
        y = torch.empty(n, 4, 3)
        d = time_steps(dt, bias, True, (0.0, 9.0))
        kernels.ssd_decode(x, d, A, B, C, D, state, slots, init, y, n)
        compare("ssd_decode", y, want, state, ref_state)
        u, delta, z, A = rnd(n, 6), rnd(n, 6), rnd(n, 6), -torch.rand(6, 5, generator=g)
        B, C, D, bias = rnd(n, 5), rnd(n, 5), rnd(6), rnd(6)
        state, ref_state = states(6, 5)
        want = selective_scan_ref(
            u, delta, A, B, C, D, z, bias, True, ref_state, qsl, slots, init, n
        )
        y = torch.empty(n, 6)
        dt = _time_steps(delta, bias, True)
        kernels.selective_scan_decode(u, dt, A, B, C, D, z, state, slots, init, y, n)
        compare("selective_scan_decode", y, want, state, ref_state)
        x, w, bias = rnd(n, 6), rnd(6, 4), rnd(6)
        state, ref_state = states(6, 3)
        want = causal_conv1d_ref(x, w, bias, ref_state, qsl, slots, init, "silu", num_decodes=n)
        out = torch.empty(n, 6)
        kernels.conv1d_decode(x, w, bias, state, slots, init, True, out, n)
        compare("conv1d_decode", out, want, state, ref_state)
    return problems[0] if problems else None


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

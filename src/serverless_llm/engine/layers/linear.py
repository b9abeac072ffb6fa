"""Linear layers on CPU through oneDNN with pre-packed weights.

ATen's float32 matmul on CPU goes to MKL, which on AMD processors runs a slow generic path and
re-packs the weight on every call; for the small-M matmuls of decoding that costs 3-4x. oneDNN
with the weight packed once at load time does not. The packed op is an internal one of torch
(the one Inductor's CPU freezing uses), so it is probed at start-up and any failure, or any
difference from F.linear beyond float32 rounding, falls back to F.linear.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu_tuning import cpu_times
from ..kernels.cpu_native import cache_dir, cpu_flags, pack_panels

logger = logging.getLogger(__name__)

_PACK_BATCH_HINT = 32  # oneDNN chooses a layout for this M; any M works with it


def _packed_ops_work(dtype: torch.dtype) -> bool:
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 40, generator=g).to(dtype)
        b = torch.randn(48, generator=g).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
        # bfloat16: both sides round each output once from a float32 sum (oneDNN's and ATen's
        # orders differ), so one bfloat16 step (2^-8 relative) is the tolerance
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        for m in (1, 5, 64):
            x = torch.randn(m, 40, generator=g).to(dtype)
            out = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
            want = F.linear(x.float(), w.float(), b.float())
            if out.dtype != dtype or not torch.allclose(out.float(), want, rtol=tol, atol=tol):
                return False
        return True
    except Exception:  # op missing in this torch build, or no oneDNN
        return False


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 dot products in hardware (AVX512_BF16 or AMX-BF16),
    where oneDNN's bfloat16 GEMM runs at about twice its float32 rate; elsewhere it converts
    to float32 and gains nothing."""
    flags = set(cpu_flags().split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """A float32 [out, in] weight in oneDNN's packed layout, for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), _PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear(x, w, bias) for w packed by `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Activations oneDNN applies to a packed linear's output as it writes it (a post-op): the
# name's (attr, algorithm) for `_linear_pointwise`. One pass over the output fewer than the
# linear and then the activation (an encoder's up projection: 1,536 values a token in
# all-MiniLM-L6-v2, ~7% of its step before).
POST_OPS = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}
_POST_OP_REFERENCES = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
_POST_OPS_OK: dict[str, bool] = {}


def packed_act_works(act: str) -> bool:
    """Whether this torch build's oneDNN applies `act` (a POST_OPS name) after a float32 packed
    linear as the torch op does (probed once per process and activation)."""
    if act not in POST_OPS:
        return False
    if act not in _POST_OPS_OK:
        ok = packed_ops_work(torch.float32)
        if ok:
            try:
                g = torch.Generator().manual_seed(1)
                w, b = torch.randn(48, 40, generator=g), torch.randn(48, generator=g)
                x = torch.randn(37, 40, generator=g)
                attr, algorithm = POST_OPS[act]
                out = torch.ops.mkldnn._linear_pointwise(x, pack_weight(w), b, attr, [], algorithm)
                want = _POST_OP_REFERENCES[act](F.linear(x, w, b))
                ok = torch.allclose(out, want, rtol=1e-4, atol=1e-4)
            except Exception:  # the post-op is missing from this build
                ok = False
        _POST_OPS_OK[act] = ok
    return _POST_OPS_OK[act]


def linear_act(linear: nn.Module, x: torch.Tensor, act: str | None, fallback) -> torch.Tensor:
    """fallback(linear(x)), in one oneDNN call where `act` (a POST_OPS name that
    `packed_act_works`) can be fused into a float32 PackedLinear on its oneDNN path."""
    if (
        act is not None
        and isinstance(linear, PackedLinear)
        and x.dtype == torch.float32
        and not (linear.native_rows and x.dim() == 2 and x.shape[0] <= linear.native_rows)
    ):
        attr, algorithm = POST_OPS[act]
        return torch.ops.mkldnn._linear_pointwise(
            x, linear.packed, linear.bias, attr, [], algorithm
        )
    return fallback(linear(x))


def packed_ops_work(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build has oneDNN's packed linear for `dtype` (float32, or bfloat16)
    and it agrees with F.linear (probed once per process and dtype)."""
    if dtype not in _PACKED_OK:
        _PACKED_OK[dtype] = _packed_ops_work(dtype)
        if not _PACKED_OK[dtype]:
            logger.info("oneDNN packed linear unavailable for %s; using F.linear", dtype)
    return _PACKED_OK[dtype]


_PACKED_OK: dict[torch.dtype, bool] = {}


def packable_dtype(dtype: torch.dtype) -> bool:
    """The weight dtypes the CPU path packs for oneDNN: float32 always (where the op works),
    bfloat16 where the CPU has bfloat16 arithmetic (`cpu_has_bf16`)."""
    if dtype == torch.bfloat16 and not cpu_has_bf16():
        return False
    return dtype in (torch.float32, torch.bfloat16) and packed_ops_work(dtype)


class PackedLinear(nn.Module):
    """Inference-only replacement for nn.Linear holding a oneDNN-packed weight; with the
    native CPU kernels (`use_native_rows`), steps of `native_min_rows` to `native_rows` rows run
    the native GEMM on the weight in panels (`pack_panels`) instead."""

    native_min_rows = 1  # `use_native_rows`: fewer rows go to oneDNN

    def __init__(
        self,
        linear: nn.Linear | None,
        weight: torch.Tensor | None = None,
        keep_panels: bool = False,
    ) -> None:
        super().__init__()
        w = (linear.weight if linear is not None else weight).detach()
        self.out_features, self.in_features = w.shape
        self.packed = pack_weight(w)
        self.bias = (
            None if linear is None or linear.bias is None else linear.bias.detach().contiguous()
        )
        # The weight in the native GEMM's panels, made (`keep_panels`) while the native path
        # may use it, dropped by `use_native_rows(..., 0)` where it does not win.
        self.panels: torch.Tensor | None = pack_panels(w) if keep_panels else None
        self.native = None
        self.native_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.native_rows
            and x.dim() == 2
            and self.native_min_rows <= x.shape[0] <= self.native_rows
            and x.dtype == torch.float32
            and x.stride(-1) == 1
        ):
            return self.native.linear(x, self.panels, self.bias, self.out_features)
        return packed_linear(x, self.packed, self.bias)

    def use_native_rows(self, native, rows: int, min_rows: int = 1) -> None:
        """Steps of min_rows to rows rows through the native kernel; rows 0 drops the
        panels."""
        self.native, self.native_rows = (native, rows) if rows else (None, 0)
        self.native_min_rows = min_rows if rows else 1
        if not rows:
            self.panels = None


def pack_linears_for_cpu(
    model: nn.Module, keep_panels: bool = False, dtype: torch.dtype = torch.float32
) -> bool:
    """Swaps every nn.Linear of `model` whose weight is `dtype` (float32, or bfloat16 where
    `packable_dtype` says so) for a PackedLinear (with float32 weights in the native GEMM's
    panels too with `keep_panels`, for `use_native_linears` to choose); True if it did."""
    if not packable_dtype(dtype):
        return False
    keep_panels = keep_panels and dtype == torch.float32
    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype == dtype
    ]
    # One layer at a time, dropping each plain weight as soon as its packed copies exist: the
    # freed memory is reused by the next layer's instead of faulting in fresh pages.
    for parent, name in targets:
        setattr(parent, name, PackedLinear(getattr(parent, name), keep_panels=keep_panels))
    return True


# Up to 64: measuring 128 too doubled a first start's measurement (SmolLM2: ~2.2 s -> ~4.4 s, on
# every fresh serverless worker) for a ~20% gain on steps of 65-128 rows, which oneDNN takes.
NATIVE_ROW_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
NATIVE_WIN = 0.95  # the native kernel must take at most this share of oneDNN's time
# Candidates up to this many rows may lose (before the first win, or inside the span): a step of
# so few rows is bound by streaming the weight, which oneDNN does as well or better, while from
# 8 rows on the native AVX-512 GEMM computes faster (Zen 5, one thread, CPU time, weights
# streamed from memory: native/oneDNN 0.95-1.2 at 1 row, 0.86-1.2 at 2 and 4, 0.66-0.89 at 8,
# 0.74-0.80 at 32). A CPU where the native kernel loses at 1, 2 and 4 rows stops at the first
# confirmed loss past them.
NATIVE_LEADING_LOSSES = 4


def native_rows_setting() -> int | str | None:
    """NATIVE_LINEAR_ROWS: unset (or "auto"): the choice cached for this machine and model
    shape, else measured and cached; "measure": measured again; 0: off; N: the native kernel for
    steps of at most N rows, unmeasured."""
    raw = os.environ.get("NATIVE_LINEAR_ROWS", "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw == "measure":
        return raw
    if not raw.isdigit():
        raise ValueError(
            f"NATIVE_LINEAR_ROWS={raw!r}: expected auto, measure, 0 (off) or a row count"
        )
    return int(raw)


def cpu_model_name() -> str:
    """The CPU's model name (/proc/cpuinfo): two CPUs with the same flags (e.g. two generations
    of one vendor's server parts) can still time the two kernels differently."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_identity() -> tuple:
    """What a measured row choice depends on besides the model: the CPU (model name, flags), its
    cores (the machine's, the process's affinity) and torch's thread count. A cache shared by
    workers on several machines (a network volume, an image baked on a build machine) is read
    only by a process whose every one of these matches the measuring one's."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return (cpu_model_name(), cpu_flags(), os.cpu_count(), usable, torch.get_num_threads())


CHOICE_RULE = 3  # `choose_native_rows`' rule: a choice made by an earlier one is measured again


def choice_file(native, shapes: dict) -> Path:
    """Where the measured choice for these shapes is kept: the native kernels' cache
    (NATIVE_KERNEL_CACHE, which the worker places on a network volume or in a baked image:
    worker/native_cache.py), under a key of `cpu_identity`, the library and the shapes with
    their counts."""
    what = (*cpu_identity(), Path(native.path).name, CHOICE_RULE)
    what += tuple(sorted((n, k, len(group)) for (n, k), group in shapes.items()))
    key = hashlib.sha256(repr(what).encode()).hexdigest()[:16]
    return cache_dir() / f"linear-rows-{key}.json"


def linear_shapes(model: nn.Module) -> dict[tuple[int, int], list[PackedLinear]]:
    """The model's packed linears that hold native panels, by weight shape (out, in)."""
    shapes: dict[tuple[int, int], list[PackedLinear]] = {}
    for m in model.modules():
        if isinstance(m, PackedLinear) and m.panels is not None:
            shapes.setdefault((m.out_features, m.in_features), []).append(m)
    return shapes


def _read_choice(path: Path, shapes: dict) -> dict | None:
    """shape -> (min rows, rows) as `use_native_linears` saved them, or None."""
    try:
        saved = json.loads(path.read_text())
        out = {}
        for shape in shapes:
            lo, hi = saved[f"{shape[0]}x{shape[1]}"]
            out[shape] = (int(lo), int(hi))
        return out
    except (OSError, ValueError, KeyError, TypeError):
        return None


def time_pass(linears: list[PackedLinear], x: dict, native: bool, repeats: int = 3) -> float:
    """Best of `repeats` passes over every linear, as a forward streams them."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for lin in linears:
            xi = x[lin.in_features]
            if native:
                lin.native.linear(xi, lin.panels, lin.bias, lin.out_features)
            else:
                packed_linear(xi, lin.packed, lin.bias)
        best = min(best, time.perf_counter() - t)
    return best


MEASURE_BYTES = 64 << 20  # weights timed per shape: past the caches, bounded on a large model
# A choice measured while other processes kept more cores than this busy is used for that start
# only, not cached: on a shared machine the wall-clock timings picked oneDNN for 32-row steps
# (768x2048: [0, 0]) where one thread of the native kernel takes 0.74-0.80x oneDNN's time, and
# every later start read that choice.
BUSY_CORES_LIMIT = 0.25


def load_sample() -> tuple[float, tuple[float, float] | None]:
    """(monotonic seconds, `cpu_times()`): two of these give others' busy cores between them."""
    return time.monotonic(), cpu_times()


def others_busy_cores(before, after) -> float | None:
    """The cores other processes kept busy between two `load_sample`s (None: not known)."""
    (t0, c0), (t1, c1) = before, after
    if c0 is None or c1 is None or t1 <= t0:
        return None
    return max(0.0, (c1[0] - c0[0]) - (c1[1] - c0[1])) / (t1 - t0)


def timed_instances(group: list[PackedLinear], budget: int = MEASURE_BYTES) -> list:
    """The first of a shape's linears whose weights add up to `budget` bytes (at least one):
    enough to stream from memory as a forward does, without timing every layer of a large
    model at every candidate row count (a first start of a 123M model measured for ~5 s with
    all 12 layers; a 7B one would take minutes)."""
    lin = group[0]
    each = lin.out_features * lin.in_features * 4
    return group[: max(1, -(-budget // each))]


def choose_native_rows(
    linears: list[PackedLinear], native, timer=time_pass
) -> tuple[tuple[int, int], list]:
    """The span of rows (of NATIVE_ROW_CANDIDATES) at which the native kernel streams
    `linears` (one shape's, all of the model's instances in turn) faster than oneDNN, each
    candidate timed both ways: from the first win to the last win before a loss past
    NATIVE_LEADING_LOSSES rows. Up to that many rows a step is bound by streaming the weight
    and the two come out even, so a loss there is a coin flip: before the first win it is
    skipped, after it it stays inside the span (one stray loss at 4 rows had sent every step
    of 4-64 rows to oneDNN, where the native kernel is 13-25% faster: lfm2, session 23).
    Past it, a loss is timed again and ends the search only if it holds (an LM head that
    streams evenly up to 4 rows and computes faster natively from 8 gets 8-64 rows). Returns ((min rows,
    rows), [(rows, native s, oneDNN s)...]); (0, 0): no win."""
    for lin in linears:
        lin.native = native
    lo = hi = 0
    timings = []
    for m in NATIVE_ROW_CANDIDATES:
        x = {k: torch.randn(m, k) for k in {lin.in_features for lin in linears}}
        timer(linears, x, True, 1)  # warm: oneDNN's kernel for this size, pages
        timer(linears, x, False, 1)
        t_native, t_packed = timer(linears, x, True), timer(linears, x, False)
        if t_native > NATIVE_WIN * t_packed and m > NATIVE_LEADING_LOSSES:
            t_native = min(t_native, timer(linears, x, True))  # confirmed, or a busy moment
            t_packed = min(t_packed, timer(linears, x, False))
        timings.append((m, t_native, t_packed))
        if t_native > NATIVE_WIN * t_packed:
            if m > NATIVE_LEADING_LOSSES:
                break
            continue
        lo, hi = lo or m, m
    return (lo, hi), timings


def use_native_linears(model: nn.Module, native) -> str:
    """Hands the model's packed linears the native kernel for the step sizes where it wins,
    chosen per weight shape: measured once per machine and model shape and cached
    (`choice_file`), or NATIVE_LINEAR_ROWS (one choice for all, unmeasured); the panels
    are dropped where it never wins. Returns the start-up line for the choice."""
    shapes = linear_shapes(model)
    linears = [lin for group in shapes.values() for lin in group]
    if not linears:
        return "CPU linears: no packed linears"
    setting = native_rows_setting()
    if isinstance(setting, int):
        for lin in linears:
            lin.use_native_rows(native, setting)
        return f"CPU linears: native for steps of <= {setting} rows (NATIVE_LINEAR_ROWS)"
    path = choice_file(native, shapes)
    rows = _read_choice(path, shapes) if setting is None else None
    how = f"cached in {path}"
    if rows is None:
        rows, ratios = {}, {}
        before = load_sample()
        for shape, group in shapes.items():
            rows[shape], timings = choose_native_rows(timed_instances(group), native)
            ratios[shape] = "/".join(f"{tn / tp:.2f}" for _, tn, tp in timings)
        busy = others_busy_cores(before, load_sample())
        how = "measured (native/oneDNN time at " + "/".join(map(str, NATIVE_ROW_CANDIDATES))
        how += " rows: " + "; ".join(f"{k}->{n} {r}" for (n, k), r in ratios.items()) + ")"
        if busy is not None and busy > BUSY_CORES_LIMIT:
            how += f"; not cached: other processes kept {busy:.2f} cores busy while it measured"
        else:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps({f"{n}x{k}": list(r) for (n, k), r in rows.items()}))
            except OSError:
                pass  # measured again at the next start
    for shape, group in shapes.items():
        lo, hi = rows[shape]
        for lin in group:
            lin.use_native_rows(native, hi, lo)

    def span(lo: int, hi: int) -> str:
        return f"{lo}-{hi}" if hi and lo > 1 else f"<= {hi}"

    chosen = ", ".join(f"{k}->{n} x{len(g)}: {span(*rows[(n, k)])}" for (n, k), g in shapes.items())
    return f"CPU linears: native kernel rows by weight shape {chosen}; {how}"

"""CPU linear layers: the oneDNN-packed linear (`layers/linear.PackedLinear`), `F.linear`, and
the native CPU kernels' GEMM on the weight in panels (`kernels/cpu_native.c`,
`linear_panels_f32`), per weight shape and batch rows, in one run.

Issue 13 item 1 asks for the linear path to be chosen by measurement per shape class; this is
the measurement (the engine repeats it at load, per model: `layers/linear.use_native_linears`).
Prints the CPU's flags, one row per weight shape with the time of each path at M = 1, 8, 32,
64, 256 rows, and oneDNN's time over the native one's (above 1: native wins).

    .venv/bin/python bench/linears.py                     # SmolLM2-135M's and 2048-wide shapes
    .venv/bin/python bench/linears.py --shapes 4096x4096 4096x14336
    .venv/bin/python bench/linears.py --cold 12 --shapes 768x2304 768x768 768x3072 3072x768
    .venv/bin/python bench/linears.py --cold 30   # 30 copies of each weight, as in a model

With `--cold N` each timing runs over N distinct copies of the weight, one after the other, as
a decoder's layers do, with a 64 MiB buffer written between timings: the weights stream from
memory as in a model larger than the cache, instead of staying cache-resident as one weight
timed in a loop does (which flatters the path with less per-call work on small shapes).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import cpu_count, cpu_flags, cpu_model_name  # noqa: E402

SHAPES = ["576x576", "576x192", "576x1536", "1536x576", "576x49152", "2048x2048", "2048x8192"]
ROWS = (1, 8, 32, 64, 256)


def time_us(fn: Callable[[], torch.Tensor], budget_s: float = 0.2) -> float:
    for _ in range(3):
        fn()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < budget_s or reps < 3:
        fn()
        reps += 1
    return (time.perf_counter() - t0) / reps * 1e6


def time_cold_us(calls: list[Callable[[], torch.Tensor]], rounds: int = 4) -> float:
    """Microseconds per call of `calls` run in order (one per weight copy), best of `rounds`,
    each round after writing a buffer larger than the caches."""
    flush = torch.empty(16 << 20)  # 64 MiB of float32
    best = float("inf")
    for r in range(rounds):
        flush.fill_(float(r))
        t0 = time.perf_counter()
        for call in calls:
            call()
        best = min(best, (time.perf_counter() - t0) / len(calls))
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    from serverless_llm.engine.kernels import cpu_native
    from serverless_llm.engine.layers.linear import PackedLinear

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=SHAPES, help="INxOUT weight shapes")
    p.add_argument(
        "--cold", type=int, default=0, metavar="N", help="time over N copies of each weight"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(cpu_count())
    native = cpu_native.load()
    print(f"{cpu_model_name()}, {cpu_count()} cores, flags {' '.join(cpu_flags()) or '-'}")
    where = f"{args.cold} weight copies, caches flushed" if args.cold else "one weight, warm"
    what = "packed / F.linear / native (packed / native)" if native else "packed / F.linear"
    print(f"torch {torch.__version__}, float32, {where}; microseconds: {what}")
    print()
    print("| weight | " + " | ".join(f"M={m}" for m in ROWS) + " |")
    print("|---|" + "---|" * len(ROWS))
    wins = total = native_wins = 0
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        lins = [torch.nn.Linear(k, n, bias=False) for _ in range(max(1, args.cold))]
        packs = [PackedLinear(lin) for lin in lins]
        ws = [lin.weight.detach().contiguous() for lin in lins]
        panels = [cpu_native.pack_panels(w) for w in ws] if native else []
        cells = []
        for m in ROWS:
            x = torch.randn(m, k)
            runs = [
                [lambda x=x, f=f: f(x) for f in packs],
                [lambda x=x, w=w: torch.nn.functional.linear(x, w) for w in ws],
                [lambda x=x, p=p, n=n: native.linear(x, p, None, n) for p in panels],
            ]
            if args.cold:
                a, b, c = (time_cold_us(calls) if calls else 0.0 for calls in runs)
            else:
                a, b, c = (time_us(calls[0]) if calls else 0.0 for calls in runs)
            wins += a <= b
            total += 1
            if native:
                native_wins += c < a
                cells.append(f"{a:.0f} / {b:.0f} / {c:.0f} ({a / c:.2f}x)")
            else:
                cells.append(f"{a:.0f} / {b:.0f}")
        print(f"| {shape} | " + " | ".join(cells) + " |", flush=True)
    print()
    summary = f"SUMMARY packed_faster_than_f_linear={wins}/{total}"
    if native:
        summary += f" native_faster_than_packed={native_wins}/{total}"
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""CPU linear layers: the oneDNN-packed linear (`layers/linear.PackedLinear`, what the engine
uses today) against `F.linear`, per weight shape and batch rows, in one run.

Issue 13 item 1 asks for the linear path to be chosen by measurement per shape class; this is
the measurement. Prints the CPU's flags, one row per weight shape with the time of each path
at M = 1, 4, 32, 256 rows, and F.linear's time over the packed one's (above 1: packed wins).

    .venv/bin/python bench/linears.py                     # SmolLM2-135M's and 2048-wide shapes
    .venv/bin/python bench/linears.py --shapes 4096x4096 4096x14336
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
ROWS = (1, 4, 32, 256)


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
    from serverless_llm.engine.layers.linear import PackedLinear

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=SHAPES, help="INxOUT weight shapes")
    p.add_argument(
        "--cold", type=int, default=0, metavar="N", help="time over N copies of each weight"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(cpu_count())
    print(f"{cpu_model_name()}, {cpu_count()} cores, flags {' '.join(cpu_flags()) or '-'}")
    where = f"{args.cold} weight copies, caches flushed" if args.cold else "one weight, warm"
    print(f"torch {torch.__version__}, float32, {where}; microseconds (packed / F.linear)")
    print()
    print("| weight | " + " | ".join(f"M={m}" for m in ROWS) + " |")
    print("|---|" + "---|" * len(ROWS))
    wins = total = 0
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        lins = [torch.nn.Linear(k, n, bias=False) for _ in range(max(1, args.cold))]
        packs = [PackedLinear(lin) for lin in lins]
        ws = [lin.weight.detach().contiguous() for lin in lins]
        cells = []
        for m in ROWS:
            x = torch.randn(m, k)
            if args.cold:
                a = time_cold_us([lambda x=x, f=f: f(x) for f in packs])
                b = time_cold_us([lambda x=x, w=w: torch.nn.functional.linear(x, w) for w in ws])
            else:
                a = time_us(lambda x=x, f=packs[0]: f(x))
                b = time_us(lambda x=x, w=ws[0]: torch.nn.functional.linear(x, w))
            wins += a <= b
            total += 1
            cells.append(f"{a:.0f} / {b:.0f} ({b / a:.2f}x)")
        print(f"| {shape} | " + " | ".join(cells) + " |", flush=True)
    print()
    print(f"SUMMARY packed_faster={wins}/{total}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The recurrent layers' kernels at a long prefill (issue 35): the Triton chunked gated delta
rule (Qwen3-Next's shape) and the Triton SSD scan (Mamba-2 2.7B's shape) on one 4k-token prompt,
against their torch references on the same device and against the physical limit.

The limit of one call is the larger of two times: reading the inputs and writing the output and
the state once at the device's measured copy bandwidth, and the call's matmul FLOPs at the
device's measured matmul rate in the same dtype (the chunked algorithms are matmuls; the issue's
goal is within 2x of the limit). Also one decode step of 64 requests (the state read and written
once dominates it).

    python bench/recurrent_kernels.py              # CUDA: Triton, references, limits
    python bench/recurrent_kernels.py --tokens 512 # a shorter prompt
    python bench/recurrent_kernels.py --json out.json

Without CUDA it times the torch references alone (the CPU path) at the same shapes, with no
limit. Prints one table and a final SUMMARY line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import cpu_model_name, format_table  # noqa: E402

GOAL = 2.0  # x the physical limit


def _time_ms(fn, cuda: bool) -> float:
    if cuda:
        from bench.common import gpu_time_ms

        return gpu_time_ms(fn)
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _matmul_tflops(dtype: torch.dtype, cuda: bool) -> float | None:
    if not cuda:
        return None
    from bench.common import gpu_time_ms

    a = torch.randn(8192, 8192, dtype=dtype, device="cuda")
    return 2 * 8192**3 / gpu_time_ms(lambda: a @ a) / 1e9


def gated_delta_case(tokens: int, decodes: int, device: str, dtype: torch.dtype):
    """Qwen3-Next's Gated DeltaNet: 16 q/k heads and 32 value heads of 128."""
    from serverless_llm.engine.kernels import gated_delta as gd

    hk, hv, d = 16, 32, 128
    g = torch.Generator(device="cpu").manual_seed(0)

    def batch(lengths):
        t = sum(lengths)
        q = torch.randn(t, hk, d, generator=g).to(device, dtype)
        k = torch.randn(t, hk, d, generator=g).to(device, dtype)
        v = torch.randn(t, hv, d, generator=g).to(device, dtype)
        decay = -torch.rand(t, hv, generator=g).to(device) * 0.1
        beta = torch.rand(t, hv, generator=g).to(device)
        n = len(lengths)
        state = torch.zeros(n + 1, hv, d, d, device=device)
        qsl = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
        slots = torch.arange(1, n + 1, dtype=torch.int32, device=device)
        init = torch.zeros(n, dtype=torch.bool, device=device)
        nd = n if all(x == 1 for x in lengths) else 0
        args = (q, k, v, decay, beta, state, qsl.to(device), slots, init)
        io = sum(x.numel() * x.element_size() for x in (q, k, v, decay, beta))
        io += v.numel() * v.element_size() + 2 * n * hv * d * d * 4  # output, state r + w
        return args, nd, io, t

    def run(fn, args, nd):
        return lambda: fn(*args, num_decodes=nd)

    prefill, nd, io, t = batch([tokens])
    # per token and value head: the state read (q S), its update (k^T S, k (.)^T) ~ 4 d^2, plus
    # the chunk's triangular work ~ 4 C d (C = 64): matmul FLOPs of the chunked form
    flops = 2 * t * hv * (4 * d * d + 4 * 64 * d)
    dec, dnd, dio, _ = batch([1] * decodes)
    return [
        ("gated delta rule", f"prefill {tokens}", run, gd.gated_delta_rule, gd.gated_delta_rule_ref,
         prefill, nd, io, flops),
        ("gated delta rule", f"decode x{decodes}", run, gd.gated_delta_rule,
         gd.gated_delta_rule_ref, dec, dnd, dio, 2 * decodes * hv * 4 * d * d),
    ]  # fmt: skip


def ssd_case(tokens: int, decodes: int, device: str, dtype: torch.dtype):
    """Mamba-2 2.7B's SSD: 80 heads of 64, state 128, one group."""
    from serverless_llm.engine.kernels import ssd

    h, p, n_state = 80, 64, 128
    g = torch.Generator(device="cpu").manual_seed(0)

    def batch(lengths):
        t = sum(lengths)
        x = torch.randn(t, h, p, generator=g).to(device, dtype)
        dt = torch.randn(t, h, generator=g).to(device, dtype)
        A = -torch.rand(h, generator=g).to(device) - 0.5
        B = torch.randn(t, 1, n_state, generator=g).to(device, dtype)
        C = torch.randn(t, 1, n_state, generator=g).to(device, dtype)
        D = torch.ones(h, device=device)
        bias = torch.zeros(h, device=device)
        n = len(lengths)
        state = torch.zeros(n + 1, h, p, n_state, device=device)
        qsl = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
        slots = torch.arange(1, n + 1, dtype=torch.int32, device=device)
        init = torch.zeros(n, dtype=torch.bool, device=device)
        nd = n if all(x == 1 for x in lengths) else 0
        args = (x, dt, A, B, C, D, bias, True, (0.0, float("inf")), state, qsl.to(device),
                slots, init)  # fmt: skip
        io = sum(a.numel() * a.element_size() for a in (x, dt, B, C))
        io += x.numel() * x.element_size() + 2 * n * h * p * n_state * 4
        return args, nd, io, t

    def run(fn, args, nd):
        return lambda: fn(*args, num_decodes=nd)

    prefill, nd, io, t = batch([tokens])
    # per chunk of C tokens and head: C B^T (C^2 N), its use (C^2 P), the state in and out
    # (2 C P N): matmul FLOPs of the chunked form (C = 64)
    c = 64
    flops = 2 * (t // c) * h * (c * c * n_state + c * c * p + 2 * c * p * n_state)
    dec, dnd, dio, _ = batch([1] * decodes)
    return [
        ("SSD scan", f"prefill {tokens}", run, ssd.ssd_scan, ssd.ssd_scan_ref, prefill, nd, io,
         flops),
        ("SSD scan", f"decode x{decodes}", run, ssd.ssd_scan, ssd.ssd_scan_ref, dec, dnd, dio,
         2 * decodes * h * 2 * p * n_state),
    ]  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--decodes", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, args.dtype) if cuda else torch.float32
    bandwidth = None
    peak = _matmul_tflops(dtype, cuda)
    if cuda:
        from bench.common import gpu_copy_bandwidth

        bandwidth = gpu_copy_bandwidth()
    cases = gated_delta_case(args.tokens, args.decodes, device, dtype)
    cases += ssd_case(args.tokens, args.decodes, device, dtype)
    rows, results = [], []
    for kernel, step, run, triton_fn, ref_fn, kargs, nd, io, flops in cases:
        ref_ms = _time_ms(run(ref_fn, kargs, nd), cuda)
        tri_ms = _time_ms(run(triton_fn, kargs, nd), cuda) if cuda else None
        limit_ms = None
        if cuda:
            limit_ms = max(io / (bandwidth * 1e9) * 1e3, flops / (peak * 1e12) * 1e3)
        r = {
            "kernel": kernel,
            "step": step,
            "reference_ms": ref_ms,
            "triton_ms": tri_ms,
            "limit_ms": limit_ms,
            "io_mb": io / 1e6,
            "gflop": flops / 1e9,
        }
        results.append(r)
        rows.append(
            [
                kernel,
                step,
                f"{ref_ms:.3f}",
                "-" if tri_ms is None else f"{tri_ms:.3f}",
                "-" if tri_ms is None else f"{ref_ms / tri_ms:.1f}x",
                f"{io / 1e6:.1f}",
                f"{flops / 1e9:.1f}",
                "-" if limit_ms is None else f"{limit_ms:.3f}",
                "-" if limit_ms is None else f"{tri_ms / limit_ms:.2f}",
            ]
        )
    where = torch.cuda.get_device_name() if cuda else cpu_model_name()
    extra = f", copy {bandwidth:.0f} GB/s, matmul {peak:.0f} TFLOP/s" if cuda else ""
    print(f"{where}, {args.dtype if cuda else 'float32'}{extra}")
    print(
        format_table(
            ["kernel", "step", "torch ms", "triton ms", "speed-up", "MB moved", "GFLOP",
             "limit ms", "x limit"],
            rows,
        )
    )  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if cuda:
        worst = max(results, key=lambda r: r["triton_ms"] / r["limit_ms"])
        x = worst["triton_ms"] / worst["limit_ms"]
        print(
            f"SUMMARY worst {worst['kernel']} {worst['step']}: {x:.2f}x the limit "
            f"(goal <= {GOAL}x): " + ("meets" if x <= GOAL else "misses")
        )
    else:
        print("SUMMARY references only (no CUDA): " + " ".join(
            f"{r['kernel']}/{r['step']}={r['reference_ms']:.1f}ms" for r in results))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

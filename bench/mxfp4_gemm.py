"""The MXFP4 expert GEMM (kernels/fused_moe_mxfp4.py: E2M1 values decoded in the K loop) against
bfloat16 `torch.matmul` on the same GPU (issue 37: at M = 1, 16, 256), at gpt-oss-20b's expert
shapes: gate/up 2880 -> 5760 and down 2880 -> 2880. All M rows go to one expert, so the grouped
GEMM is one plain W4A16-style GEMM with its MoE alignment; the matmul is the same product with
the expert's weight in bfloat16 (what the dequantized form computes).

    python bench/mxfp4_gemm.py          # needs a CUDA device
    TRITON_INTERPRET=1 python bench/mxfp4_gemm.py --tiny   # the CPU smoke run (interpreted)

Times are medians of `triton.testing.do_bench` (CPU: one timed call). Prints one row per shape
and M with both times, the ratio bf16 / mxfp4 (above 1: the 4-bit kernel is faster) and the
kernel's weight bandwidth (bytes of blocks and scales) against the device's copy bandwidth
measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import format_table  # noqa: E402

SHAPES = [(2880, 5760), (2880, 2880)]  # (in, out): gpt-oss-20b's gate/up and down
ROWS = [1, 16, 256]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU (interpreted)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("bench/mxfp4_gemm.py needs a CUDA device (or --tiny)", file=sys.stderr)
        return 2
    from serverless_llm.engine.kernels.fused_moe import moe_align, moe_tiles
    from serverless_llm.engine.kernels.fused_moe_mxfp4 import Mxfp4Experts, mxfp4_gemm

    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter gets bf16 wrong
    shapes, rows = (SHAPES, ROWS) if cuda else ([(64, 96)], [1, 16])
    if cuda:
        from bench.common import gpu_copy_bandwidth, gpu_time_ms

        copy_gbs, timed = gpu_copy_bandwidth(), gpu_time_ms
    else:
        copy_gbs = None

        def timed(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3

    table = []
    for k, n in shapes:
        blocks = torch.randint(0, 256, (1, n, k // 32, 16), dtype=torch.uint8, device=device)
        scales = torch.full((1, n, k // 32), 127 - 4, dtype=torch.uint8, device=device)
        experts = Mxfp4Experts.from_checkpoint(blocks, scales)
        dense = experts.dequantize(0, dtype)  # [n, k]
        weight_bytes = experts.blocks.numel() + experts.scales.numel()
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dtype)
            ids = torch.zeros(m, 1, dtype=torch.long, device=device)
            tiles = moe_tiles(m, 1, dtype)
            aligned, block_expert = moe_align(ids, 1, tiles[0])
            run = partial(mxfp4_gemm, x, experts, aligned, block_expert, None, m, 1, tiles)
            got = run()
            want = torch.matmul(x, dense.t())
            err = (got.float() - want.float()).abs().max().item()
            scale = want.float().abs().max().item()
            if not err <= 2e-2 * scale + 1e-3:
                raise SystemExit(f"{k}x{n} M={m}: mxfp4 GEMM off by {err:.3g} (scale {scale:.3g})")
            t4 = timed(run)
            t16 = timed(partial(torch.matmul, x, dense.t()))
            bw = weight_bytes / t4 / 1e6
            table.append(
                [
                    f"{k}x{n}",
                    m,
                    f"{t16 * 1e3:.1f} us",
                    f"{t4 * 1e3:.1f} us",
                    f"{t16 / t4:.2f}",
                    "-" if copy_gbs is None else f"{bw / copy_gbs:.0%}",
                ]
            )
    name = torch.cuda.get_device_name() if cuda else "CPU (interpreted)"
    print(name, "" if copy_gbs is None else f"copy bandwidth {copy_gbs:.0f} GB/s")
    header = ["weight", "M", f"{str(dtype)[6:]} matmul", "mxfp4", "matmul/mxfp4", "mxfp4 bw"]
    print(format_table(header, table))
    small = [float(r[4]) for r in table if r[1] <= 16]
    print(f"SUMMARY mxfp4_vs_matmul_min_small_m={min(small):.2f} rows={len(table)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

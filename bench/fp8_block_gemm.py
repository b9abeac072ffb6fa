"""The block-scaled FP8 GEMM (kernels/fp8_block.py: e4m3 weights with a scale per 128 x 128
block, the W8A16 form) against bfloat16 `torch.matmul` on the same GPU (issue 37: at M = 1, 16,
256), at DeepSeek-V3's dense MLP shapes (gate or up 7168 -> 18432, down 18432 -> 7168) and a
4096 x 4096 projection (Qwen3-8B-FP8's q and o); the matmul multiplies the same weight
dequantized to bfloat16 (what the dequantized form computes).

    python bench/fp8_block_gemm.py          # needs a CUDA device
    TRITON_INTERPRET=1 python bench/fp8_block_gemm.py --tiny   # the CPU smoke run (interpreted)

Times are medians of `triton.testing.do_bench` (CPU: one timed call). Prints one row per shape
and M with both times, the ratio bf16 / fp8 (above 1: the 8-bit kernel is faster) and the
kernel's weight bandwidth (bytes of the e4m3 weight and its scales) against the device's copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    print_weight_gemm_table,
    weight_gemm_row,
    weight_gemm_timer,
)

SHAPES = [(7168, 18432), (18432, 7168), (4096, 4096)]  # (in, out)
ROWS = [1, 16, 256]
BLOCK = (128, 128)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU (interpreted)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("bench/fp8_block_gemm.py needs a CUDA device (or --tiny)", file=sys.stderr)
        return 2
    from serverless_llm.engine.kernels.fp8_block import (
        FP8,
        block_rows,
        fp8_block_dequantize,
        fp8_block_linear,
    )

    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter gets bf16 wrong
    shapes, rows = (SHAPES, ROWS) if cuda else ([(200, 136)], [1, 16])
    copy_gbs, timed = weight_gemm_timer(cuda)
    table = []
    g = torch.Generator(device=device).manual_seed(0)
    for k, n in shapes:
        # codes of magnitude up to about 2 (no NaN), scales near a 0.02-std float weight's
        codes = torch.randint(0, 0x40, (n, k), dtype=torch.uint8, device=device, generator=g)
        codes |= torch.randint(0, 2, (n, k), dtype=torch.uint8, device=device, generator=g) << 7
        weight = codes.view(FP8)
        grid = (-(-n // BLOCK[0]), -(-k // BLOCK[1]))
        scale = torch.rand(grid, device=device, generator=g) * 0.02 + 0.01
        row_block = block_rows(n, BLOCK[0], device)
        dense = fp8_block_dequantize(weight, scale, row_block, BLOCK[1], dtype)  # [n, k]
        weight_bytes = weight.numel() + scale.numel() * 4 + row_block.numel() * 4
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dtype)
            run = partial(fp8_block_linear, x, weight, scale, row_block, BLOCK[1])
            table.append(
                weight_gemm_row("fp8 block", k, n, m, run, x, dense, weight_bytes, copy_gbs, timed)
            )
    print_weight_gemm_table("fp8 block", "fp8_block", table, dtype, copy_gbs, cuda)
    return 0


if __name__ == "__main__":
    sys.exit(main())

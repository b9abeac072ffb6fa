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
    copy_gbs, timed = weight_gemm_timer(cuda)
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
            table.append(
                weight_gemm_row("mxfp4", k, n, m, run, x, dense, weight_bytes, copy_gbs, timed)
            )
    print_weight_gemm_table("mxfp4", "mxfp4", table, dtype, copy_gbs, cuda)
    return 0


if __name__ == "__main__":
    sys.exit(main())

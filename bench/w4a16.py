"""The W4A16 Triton GEMM against float16 `torch.matmul` on the same GPU (issue 16's kernel
bar: faster than fp16 at M <= 16), for 4096x4096 and 4096x14336 weights at M = 1, 16, 256 and
4096, 4-bit GPTQ layout with group 128 (act-order off: the permutation is one gather of x).

    python bench/w4a16.py            # needs a CUDA device

Times are medians of `triton.testing.do_bench`. Prints one row per shape and M with both
times, the ratio fp16 / w4a16 (above 1: the 4-bit kernel is faster) and the 4-bit kernel's
weight bandwidth against the device's copy bandwidth measured in the same run. Also the FP8
weight-only GEMM (`fp8_w8a16_linear`, the FP8 path of GPUs without FP8 arithmetic) on the same
shapes, with its ratio to fp16 (informational: no bar names it).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import format_table, gpu_copy_bandwidth, gpu_time_ms  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336)]
ROWS = [1, 16, 256, 4096]


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/w4a16.py needs a CUDA device", file=sys.stderr)
        return 2
    from serverless_llm.engine.kernels.fp8 import FP8, fp8_w8a16_linear
    from serverless_llm.engine.kernels.w4a16 import pack_int32, w4a16_linear

    timed = gpu_time_ms
    copy_gbs = gpu_copy_bandwidth()
    rows = []
    for k, n in SHAPES:
        q = torch.randint(0, 16, (k, n), device="cuda")
        qweight = pack_int32(q, 4, 0)
        scales = torch.rand(k // 128, n, device="cuda", dtype=torch.float16) * 0.01
        zeros = torch.full((k // 128, n), 8.0, device="cuda", dtype=torch.float16)
        g_idx = (torch.arange(k, device="cuda") // 128).int()
        w16 = torch.randn(k, n, device="cuda", dtype=torch.float16)
        w8 = (torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(FP8)
        s8 = torch.rand(n, device="cuda") * 0.01
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            t4 = timed(partial(w4a16_linear, x, qweight, scales, zeros, g_idx, None, 4))
            t16 = timed(partial(torch.matmul, x, w16))
            t8 = timed(partial(fp8_w8a16_linear, x, w8, s8))
            weight_bytes = qweight.numel() * 4 + scales.numel() * 4
            bw = weight_bytes / t4 / 1e6
            rows.append(
                [
                    f"{k}x{n}",
                    m,
                    f"{t16 * 1e3:.1f} us",
                    f"{t4 * 1e3:.1f} us",
                    t16 / t4,
                    f"{bw / copy_gbs:.0%}",
                    f"{t8 * 1e3:.1f} us",
                    t16 / t8,
                ]
            )
    print(torch.cuda.get_device_name(), f"copy bandwidth {copy_gbs:.0f} GB/s")
    print(
        format_table(
            ["weight", "M", "fp16 matmul", "w4a16", "fp16/w4a16", "w4 bw", "fp8 w8a16", "fp16/fp8"],
            rows,
        )
    )
    small = [r[4] for r in rows if r[1] <= 16]
    print(
        f"M <= 16: w4a16 faster than fp16 in {sum(r > 1 for r in small)} of {len(small)} "
        f"(bar: all); worst {min(small):.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

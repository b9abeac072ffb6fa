"""The fused MoE Triton kernels against a per-expert loop of torch matmuls on the same GPU
(issue 17's GPU check), bfloat16, Mixtral-8x7B's layer (8 experts, top-2, hidden 4096, expert
width 14336) and Qwen3-30B-A3B's (128 experts, top-8, hidden 2048, width 768), at 1, 32 and 256
tokens with random routing.

    python bench/moe_kernel.py            # needs a CUDA device

Times are medians of `triton.testing.do_bench`. The loop is what a plain PyTorch MoE does
(transformers' eager experts: per expert with tokens, gather, two matmuls, scatter-add); it is
`fused_moe_reference` on the GPU. Prints both times, the ratio loop / kernel (above 1: the
kernel is faster) and the kernel's expert-weight bandwidth (bytes of the experts the step
touches) against the device's copy bandwidth measured in the same run.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import format_table, gpu_copy_bandwidth, gpu_time_ms  # noqa: E402

# name: (experts, top_k, hidden, expert width)
SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}
TOKENS = [1, 32, 256]


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/moe_kernel.py needs a CUDA device", file=sys.stderr)
        return 2
    from serverless_llm.engine.kernels.fused_moe import fused_moe, fused_moe_reference

    timed = gpu_time_ms
    copy_gbs = gpu_copy_bandwidth()
    rows = []
    dt = torch.bfloat16
    for name, (experts, top_k, hidden, inter) in SHAPES.items():
        w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=dt) * 0.02
        w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=dt) * 0.02
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, device="cuda", dtype=dt)
            logits = torch.randn(tokens, experts, device="cuda")
            weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
            t_kernel = timed(partial(fused_moe, x, w13, w2, weights, ids))
            t_loop = timed(partial(fused_moe_reference, x, w13, w2, weights, ids))
            touched = ids.unique().numel()
            weight_bytes = touched * 3 * hidden * inter * 2
            rows.append(
                [
                    name,
                    tokens,
                    touched,
                    f"{t_loop * 1e3:.1f} us",
                    f"{t_kernel * 1e3:.1f} us",
                    t_loop / t_kernel,
                    f"{weight_bytes / t_kernel / 1e6 / copy_gbs:.0%}",
                ]
            )
    print(torch.cuda.get_device_name(), f"copy bandwidth {copy_gbs:.0f} GB/s")
    headers = ["layer", "tokens", "experts hit", "torch loop", "fused", "loop/fused", "fused bw"]
    print(format_table(headers, rows))
    worst = min(r[5] for r in rows)
    print(
        f"fused faster than the loop in {sum(r[5] > 1 for r in rows)} of {len(rows)}; worst {worst:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

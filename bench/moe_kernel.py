"""The fused MoE Triton kernels against a per-expert loop of torch matmuls on the same GPU
(issue 17's GPU check), bfloat16, Mixtral-8x7B's layer (8 experts, top-2, hidden 4096, expert
width 14336) and Qwen3-30B-A3B's (128 experts, top-8, hidden 2048, width 768), at 1, 32 and 256
tokens with random routing.

    python bench/moe_kernel.py            # needs a CUDA device

Times are medians of `triton.testing.do_bench`. The loop is what a plain PyTorch MoE does
(transformers' eager experts: per expert with tokens, gather, two matmuls, scatter-add); it is
`fused_moe_reference` on the GPU. Prints both times, the ratio loop / kernel (above 1: the
kernel is faster) and the kernel's expert-weight bandwidth (bytes of the experts the step
touches) against the device's copy bandwidth measured in the same run; then the packed-expert
kernel (4-bit experts, kernels/fused_moe_w4a16.py) against the bfloat16 fused kernel.
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
    from serverless_llm.engine.kernels.fused_moe_w4a16 import fused_moe_w4a16, pack_experts

    timed = gpu_time_ms
    copy_gbs = gpu_copy_bandwidth()
    rows, packed_rows = [], []
    dt = torch.bfloat16
    for name, (experts, top_k, hidden, inter) in SHAPES.items():
        w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=dt) * 0.02
        w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=dt) * 0.02
        q13, q2 = (_random_packed(e_out, e_in, experts) for e_out, e_in in
                   ((2 * inter, hidden), (hidden, inter)))  # fmt: skip
        q13, q2 = pack_experts(q13, 4).to("cuda"), pack_experts(q2, 4).to("cuda")
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, device="cuda", dtype=dt)
            logits = torch.randn(tokens, experts, device="cuda")
            weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
            t_kernel = timed(partial(fused_moe, x, w13, w2, weights, ids))
            t_loop = timed(partial(fused_moe_reference, x, w13, w2, weights, ids))
            t_packed = timed(partial(fused_moe_w4a16, x, q13, q2, weights, ids))
            touched = ids.unique().numel()
            weight_bytes = touched * 3 * hidden * inter * 2
            packed_rows.append(
                [name, tokens, f"{t_kernel * 1e3:.1f} us", f"{t_packed * 1e3:.1f} us",
                 t_kernel / t_packed]
            )  # fmt: skip
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
    print("4-bit packed experts (GPTQ layout, group 128) against the bfloat16 fused kernel:")
    print(
        format_table(["layer", "tokens", "bf16 fused", "4-bit packed", "bf16/4-bit"], packed_rows)
    )
    return 0


def _random_packed(out: int, k: int, experts: int, group: int = 128) -> list[tuple]:
    """Random 4-bit experts in the unpacked form `pack_experts` takes."""
    groups = -(-k // group)
    forms = []
    for _ in range(experts):
        q = torch.randint(0, 16, (out, k), dtype=torch.uint8)
        zeros = torch.full((out, groups), 8, dtype=torch.int32)
        scales = torch.full((out, groups), 0.002, dtype=torch.float16)
        forms.append((q, zeros, scales, torch.arange(k) // group))
    return forms


if __name__ == "__main__":
    sys.exit(main())

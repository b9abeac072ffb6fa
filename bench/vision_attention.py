"""The vision towers' attention kernel (kernels/vision_attention.py) against torch's
scaled_dot_product_attention at the same shapes, in one run.

Shapes: Qwen2.5-VL's tower heads (16 x head_dim 80), bfloat16:
- images: 8 images of 1024 patches (448 x 448) packed in one launch, against SDPA over the same
  images as one equal-length batch (the flash backend: the best torch does);
- windows: the same patches as Qwen2.5-VL's 64-patch windows (128 of them), against SDPA over
  the windows as one batch;
- mixed: images of 4096, 2304, 1024 and 777 patches, against the padded, masked SDPA batch the
  towers' torch path runs for segments of different lengths (qwen_vl_tower.segment_attention).
Each row: TFLOP/s of the useful work (4 * L^2 * head_dim per head and sequence) and the ratio to
torch's. Informational (no bar). Prints one table and a final `SUMMARY` line; without CUDA it
says it needs a GPU and exits 0.

    .venv/bin/python bench/vision_attention.py
    TRITON_INTERPRET=1 .venv/bin/python bench/vision_attention.py --cpu-smoke   # code paths only
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import format_table  # noqa: E402
from bench.kernels import bench_ms  # noqa: E402

HEADS, HEAD_DIM = 16, 80
CASES = {  # name -> sequence lengths
    "images": [1024] * 8,
    "windows": [64] * 128,
    "mixed": [4096, 2304, 1024, 777],
}
SMOKE = {"images": [40] * 2, "windows": [16] * 4, "mixed": [40, 17, 5]}


def _torch_attention(q, k, v, lengths):
    """What torch does best for these segments: one equal-length SDPA batch, else the towers'
    padded, masked batch."""
    from serverless_llm.engine.models.vision.qwen_vl_tower import segment_attention

    if len(set(lengths)) == 1:
        s, n = len(lengths), lengths[0]

        def batched(x):
            return x.view(s, n, HEADS, -1).transpose(1, 2)

        return lambda: F.scaled_dot_product_attention(batched(q), batched(k), batched(v))
    return lambda: segment_attention(q, k, v, lengths)


def run(cases: dict[str, list[int]], dtype: torch.dtype, device: torch.device, heads: int):
    from serverless_llm.engine.kernels.vision_attention import cu_seqlens_of, vision_attention

    rows = []
    g = torch.Generator().manual_seed(0)
    for name, lengths in cases.items():
        total = sum(lengths)
        q, k, v = (
            torch.randn(total, heads, HEAD_DIM, generator=g).to(device, dtype) for _ in range(3)
        )
        cu = cu_seqlens_of(lengths, device)
        longest = max(lengths)
        ms = bench_ms(
            lambda q=q, k=k, v=v, cu=cu, longest=longest: vision_attention(
                q, k, v, cu, use_kernel=True, max_seqlen=longest
            ),
            device,
        )
        ref_ms = bench_ms(_torch_attention(q, k, v, lengths), device)
        flops = sum(4 * n * n * HEAD_DIM * heads for n in lengths)
        rows.append(
            [
                name,
                f"{len(lengths)} x {longest if len(set(lengths)) == 1 else lengths}",
                ms * 1e3,
                flops / (ms * 1e-3) / 1e12,
                flops / (ref_ms * 1e-3) / 1e12,
                ref_ms / ms,
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, interpreter")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--cpu-smoke needs TRITON_INTERPRET=1 in the environment")
            return 2
        device, dtype, cases, heads = torch.device("cpu"), torch.float32, SMOKE, 2
    elif not torch.cuda.is_available():
        print("bench/vision_attention.py needs a CUDA GPU; none here, nothing measured.")
        return 0
    else:
        device, dtype, cases, heads = torch.device("cuda"), torch.bfloat16, CASES, HEADS
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"device: {name}; {heads} heads x {HEAD_DIM}, {str(dtype).replace('torch.', '')}")
    rows = run(cases, dtype, device, heads)
    header = ["case", "sequences", "time us", "kernel TFLOP/s", "SDPA TFLOP/s", "ratio"]
    print(format_table(header, rows))
    parts = [f"device={name.replace(' ', '_')}"]
    parts += [f"{r[0]}_vs_sdpa={r[5]:.3f}" for r in rows]
    print("SUMMARY " + " ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

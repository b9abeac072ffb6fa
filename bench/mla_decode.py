"""MLA decode attention (kernels/mla_attention.py's absorbed decode kernel) against the memory
bandwidth its latents need (issue 37's bar: at least 70%).

Shapes: DeepSeek-V3's attention on one GPU (128 heads, kv_lora_rank 512, qk_rope_head_dim 64,
bfloat16 cache, block size 16): batches of 1 to 64 decodes at contexts of 1k to 32k tokens.
A call must read every cached row of its decodes once, (512 + 64) x 2 bytes a token, plus the
queries and outputs; the time that takes at the device's copy bandwidth (read + written bytes a
second of a device-to-device copy, measured in the same run) over the kernel's median time is
the row's share of the bandwidth. The torch twin (gather + matmul) is timed beside it.

    .venv/bin/python -m bench.mla_decode
    TRITON_INTERPRET=1 .venv/bin/python -m bench.mla_decode --cpu-smoke   # code paths only

Without CUDA (and without --cpu-smoke) it says it needs a GPU and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import format_table  # noqa: E402
from bench.kernels import bench_ms, copy_bandwidth  # noqa: E402

HEADS, RANK, ROPE, BLOCK = 128, 512, 64, 16
CASES = [(1, 8192), (1, 32768), (8, 4096), (16, 8192), (32, 4096), (64, 2048), (64, 8192)]
SMOKE = [(1, 40), (3, 70)]


def make_step(batch: int, context: int, heads: int, rank: int, rope: int, dtype, device):
    """A decode step over a latent cache whose blocks are shuffled (no request's contiguous)."""
    from serverless_llm.engine.kernels.metadata import AttentionMetadata

    g = torch.Generator().manual_seed(0)
    per = -(-(context + 1) // BLOCK)
    num_blocks = batch * per + 1
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = perm[: batch * per].view(batch, per).to(torch.int32)
    cache = torch.randn(1, num_blocks, BLOCK, 1, rank + rope, generator=g).to(dtype)
    q = torch.randn(batch, heads, rank + rope, generator=g).to(dtype)
    seq = [context + 1] * batch
    slots = [int(tables[i, context // BLOCK]) * BLOCK + context % BLOCK for i in range(batch)]
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        context_lens=torch.tensor([context] * batch, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decodes=batch,
        max_query_len=1,
        max_seq_len=context + 1,
        query_lens_host=[1] * batch,
        seq_lens_host=seq,
        block_size=BLOCK,
    )
    for name in ("query_start_loc", "seq_lens", "context_lens", "block_tables", "slot_mapping"):
        setattr(meta, name, getattr(meta, name).to(device))
    return q.to(device), cache.to(device), meta


def run(cases, heads, rank, rope, dtype, device, bandwidth):
    from serverless_llm.engine.kernels.mla_attention import latent_decode, latent_decode_torch

    rows = []
    elem = torch.empty((), dtype=dtype).element_size()
    scale = (128 + rope) ** -0.5
    for batch, context in cases:
        q, cache, meta = make_step(batch, context, heads, rank, rope, dtype, device)
        args = (q, cache, meta, scale, rank)
        ms = bench_ms(lambda args=args: latent_decode(*args), device)
        meta.backend_state.clear()
        torch_ms = bench_ms(lambda args=args: latent_decode_torch(*args), device)
        need = batch * (context + 1) * (rank + rope) * elem  # the latents, once
        need += q.numel() * elem + batch * heads * rank * elem  # queries in, latents out
        share = need / bandwidth / (ms * 1e-3) if bandwidth else float("nan")
        rows.append([batch, context, ms * 1e3, need / (ms * 1e-3) / 1e9, share, torch_ms / ms])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, interpreter")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.cpu_smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--cpu-smoke needs TRITON_INTERPRET=1 in the environment")
            return 2
        device, dtype, cases, heads, rank, rope = (
            torch.device("cpu"),
            torch.float32,
            SMOKE,
            4,
            32,
            16,
        )
        bandwidth = None
    elif not torch.cuda.is_available():
        print("bench/mla_decode.py needs a CUDA GPU; none here, nothing measured.")
        return 0
    else:
        device, dtype, cases = torch.device("cuda"), torch.bfloat16, CASES
        heads, rank, rope = HEADS, RANK, ROPE
        bandwidth = copy_bandwidth(1 << 30, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    bw = f"{bandwidth / 1e9:.0f} GB/s copy" if bandwidth else "no bandwidth (smoke)"
    print(f"device: {name}; {heads} heads, latent {rank} + rope {rope}, {bw}")
    rows = run(cases, heads, rank, rope, dtype, device, bandwidth)
    header = ["decodes", "context", "time us", "GB/s", "of copy bw", "torch / kernel"]
    print(format_table(header, rows))
    worst = min(r[4] for r in rows) if bandwidth else float("nan")
    print(
        f"SUMMARY device={name.replace(' ', '_')} mla_decode_worst_of_bandwidth={worst:.3f} "
        f"bar=0.70 {'PASS' if worst >= 0.7 else 'FAIL' if bandwidth else 'SMOKE'}",
        flush=True,
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

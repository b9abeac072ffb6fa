"""Kernel benchmarks: the Triton kernels against the GPU's own limits, measured in one run.

- decode attention: batch 64 x context 2048, Llama-3-8B attention (32 query heads, 8 KV heads,
  head dim 128), bfloat16, block size 16, shuffled blocks: bytes of K and V read per second
  against the device-to-device copy bandwidth (bytes read + written per second) of the same run.
  Bar: >= 0.70.
- prefill attention: 4 x 2048 new tokens, no context, causal, same heads: TFLOP/s against
  `scaled_dot_product_attention` with the flash backend at the same shapes (its K/V expanded to
  32 heads beforehand, untimed, since the flash path wants equal head counts). Bar: >= 0.70.
- RMSNorm with the fused residual add (8192 x 4096) and SiLU-and-mul (8192 x 2 x 14336): bytes
  moved per second against copy bandwidth. Bar: >= 0.80.
- KV cache write and rotary (8192 tokens): bytes per second against copy, informational.

Times are medians of `triton.testing.do_bench` (which clears the L2 cache between calls).
Prints one table and a final `SUMMARY` line; exits 0 whether or not a bar is met, and without
CUDA prints that it needs a GPU and exits 0.

    .venv/bin/python bench/kernels.py                # the sizes above
    .venv/bin/python bench/kernels.py --quick        # smaller, for a smoke run
    TRITON_INTERPRET=1 .venv/bin/python bench/kernels.py --cpu-smoke   # code path check only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import format_table  # noqa: E402

BAR_DECODE_VS_COPY = 0.70
BAR_PREFILL_VS_FLASH = 0.70
BAR_ELEMENTWISE_VS_COPY = 0.80


@dataclass(frozen=True)
class Shapes:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    decode_batch: int = 64
    decode_context: int = 2048
    prefill_batch: int = 4
    prefill_len: int = 2048
    tokens: int = 8192  # rows for RMSNorm, SiLU, KV write, rotary
    hidden: int = 4096
    intermediate: int = 14336
    copy_bytes: int = 1 << 30


QUICK = Shapes(
    decode_batch=16, decode_context=1024, prefill_batch=1, tokens=2048, copy_bytes=1 << 28
)
CPU_SMOKE = Shapes(
    num_heads=4,
    num_kv_heads=1,
    head_dim=64,
    decode_batch=2,
    decode_context=70,
    prefill_batch=1,
    prefill_len=40,
    tokens=8,
    hidden=64,
    intermediate=96,
    copy_bytes=1 << 20,
)


@dataclass
class Row:
    kernel: str
    shape: str
    time_us: float
    achieved: float
    unit: str
    reference: float
    reference_name: str
    bar: float | None

    @property
    def ratio(self) -> float:
        return self.achieved / self.reference

    @property
    def met(self) -> bool | None:
        return None if self.bar is None else self.ratio >= self.bar


def bench_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Median milliseconds per call. On CPU (the interpreter smoke run) one timed call."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def copy_bandwidth(nbytes: int, device: torch.device) -> float:
    """Bytes/s of a device-to-device tensor copy, counting what is read plus what is written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / (ms * 1e-3)


def paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    s: Shapes,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
):
    """A step's q, KV cache and metadata, every request's blocks at shuffled ids (as a cache
    that has served for a while looks)."""
    from serverless_llm.engine.kernels.metadata import AttentionMetadata, AttentionSpec

    bs = s.block_size
    per_req = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(per_req) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(seq_lens), max(per_req), dtype=torch.int32)
    slots: list[int] = []
    used = 0
    for r, (q_len, seq_len, nb) in enumerate(zip(query_lens, seq_lens, per_req)):
        ids = perm[used : used + nb]
        used += nb
        table[r, :nb] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[p // bs] * bs + p % bs for p in range(seq_len - q_len, seq_len)]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=seq_t.to(device),
        context_lens=(seq_t - torch.tensor(query_lens, dtype=torch.int32)).to(device),
        block_tables=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_decodes=sum(1 for n in query_lens if n == 1),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
        block_size=bs,
    )
    spec = AttentionSpec(s.num_heads, s.num_kv_heads, s.head_dim, s.head_dim**-0.5)
    shape = (2, num_blocks, bs, s.num_kv_heads, s.head_dim)
    kv_cache = torch.randn(shape, generator=gen).to(device, dtype)
    q = torch.randn(qsl[-1], s.num_heads, s.head_dim, generator=gen).to(device, dtype)
    return q, kv_cache, meta, spec


def bench_decode(s: Shapes, dtype: torch.dtype, device: torch.device, copy_bw: float) -> Row:
    from serverless_llm.engine.kernels.paged_attention import paged_attention

    gen = torch.Generator().manual_seed(0)
    b, ctx = s.decode_batch, s.decode_context
    q, kv_cache, meta, spec = paged_batch([1] * b, [ctx] * b, s, dtype, device, gen)
    out = torch.empty(q.shape[0], s.num_heads * s.head_dim, dtype=dtype, device=device)
    ms = bench_ms(lambda: paged_attention(q, kv_cache, meta, spec, out=out), device)
    kv_bytes = 2 * b * ctx * s.num_kv_heads * s.head_dim * kv_cache.element_size()
    return Row(
        "decode attention",
        f"{b} x ctx {ctx}, {s.num_heads}/{s.num_kv_heads} heads x {s.head_dim}",
        ms * 1e3,
        kv_bytes / (ms * 1e-3) / 1e9,
        "GB/s K+V",
        copy_bw / 1e9,
        "copy GB/s",
        BAR_DECODE_VS_COPY,
    )


def bench_prefill(s: Shapes, dtype: torch.dtype, device: torch.device) -> Row:
    import torch.nn.functional as F

    from serverless_llm.engine.kernels.paged_attention import paged_attention

    gen = torch.Generator().manual_seed(1)
    b, n = s.prefill_batch, s.prefill_len
    q, kv_cache, meta, spec = paged_batch([n] * b, [n] * b, s, dtype, device, gen)
    out = torch.empty(q.shape[0], s.num_heads * s.head_dim, dtype=dtype, device=device)
    ms = bench_ms(lambda: paged_attention(q, kv_cache, meta, spec, out=out), device)
    # Causal: n(n+1)/2 query-key pairs a head, 2*d FLOPs for QK^T and 2*d for PV each.
    flops = b * s.num_heads * (n * (n + 1) / 2) * 4 * s.head_dim
    qs = torch.randn(b, s.num_heads, n, s.head_dim, generator=gen).to(device, dtype)
    ks = torch.randn(b, s.num_heads, n, s.head_dim, generator=gen).to(device, dtype)
    vs = torch.randn(b, s.num_heads, n, s.head_dim, generator=gen).to(device, dtype)
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            ref_ms = bench_ms(
                lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True), device
            )
        ref_name = "SDPA flash TFLOP/s"
    else:
        ref_ms = bench_ms(
            lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True), device
        )
        ref_name = "SDPA (cpu) TFLOP/s"
    return Row(
        "prefill attention",
        f"{b} x {n}, no context, causal",
        ms * 1e3,
        flops / (ms * 1e-3) / 1e12,
        "TFLOP/s",
        flops / (ref_ms * 1e-3) / 1e12,
        ref_name,
        BAR_PREFILL_VS_FLASH,
    )


def bench_elementwise(
    s: Shapes, dtype: torch.dtype, device: torch.device, copy_bw: float
) -> list[Row]:
    from serverless_llm.engine.kernels.activation import silu_and_mul
    from serverless_llm.engine.kernels.kv_write import reshape_and_cache
    from serverless_llm.engine.kernels.rms_norm import rms_norm
    from serverless_llm.engine.kernels.rotary import rotary_embedding
    from serverless_llm.engine.layers.rotary import cos_sin_cache, inv_frequencies

    gen = torch.Generator().manual_seed(2)
    t, h, inter = s.tokens, s.hidden, s.intermediate

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    size = torch.tensor([], dtype=dtype).element_size()
    rows = []
    x, res, w = rand(t, h), rand(t, h), rand(h)
    ms = bench_ms(lambda: rms_norm(x, w, 1e-5, res), device)
    moved = 4 * t * h * size + h * size  # read x, residual; write out, residual; the weight
    rows.append(
        Row(
            "rms_norm + residual",
            f"{t} x {h}",
            ms * 1e3,
            moved / (ms * 1e-3) / 1e9,
            "GB/s",
            copy_bw / 1e9,
            "copy GB/s",
            BAR_ELEMENTWISE_VS_COPY,
        )
    )
    gate_up = rand(t, 2 * inter)
    ms = bench_ms(lambda: silu_and_mul(gate_up), device)
    moved = 3 * t * inter * size
    rows.append(
        Row(
            "silu_and_mul",
            f"{t} x 2*{inter}",
            ms * 1e3,
            moved / (ms * 1e-3) / 1e9,
            "GB/s",
            copy_bw / 1e9,
            "copy GB/s",
            BAR_ELEMENTWISE_VS_COPY,
        )
    )
    kvh, d = s.num_kv_heads, s.head_dim
    k, v = rand(t, kvh, d), rand(t, kvh, d)
    num_blocks = -(-t // s.block_size)
    cache = torch.empty(2, num_blocks, s.block_size, kvh, d, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * s.block_size, generator=gen)[:t].to(device)
    ms = bench_ms(lambda: reshape_and_cache(k, v, cache, slots), device)
    moved = 4 * t * kvh * d * size
    rows.append(
        Row(
            "kv write",
            f"{t} tokens x {kvh} x {d}",
            ms * 1e3,
            moved / (ms * 1e-3) / 1e9,
            "GB/s",
            copy_bw / 1e9,
            "copy GB/s",
            None,
        )
    )
    max_pos = 8192
    params = {"rope_type": "default", "rope_theta": 500000.0}
    table = cos_sin_cache(inv_frequencies(params, d, max_pos), max_pos).to(device)
    positions = torch.randint(0, max_pos, (t,), generator=gen).to(device)
    nh = s.num_heads
    qkv = rand(t, (nh + 2 * kvh) * d)
    q = qkv[:, : nh * d].view(t, nh, d)
    kk = qkv[:, nh * d : (nh + kvh) * d].view(t, kvh, d)
    ms = bench_ms(lambda: rotary_embedding(positions, q, kk, table), device)
    moved = 2 * t * (nh + kvh) * d * size
    rows.append(
        Row(
            "rotary (in place)",
            f"{t} tokens x {nh}+{kvh} heads",
            ms * 1e3,
            moved / (ms * 1e-3) / 1e9,
            "GB/s",
            copy_bw / 1e9,
            "copy GB/s",
            None,
        )
    )
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller shapes (smoke run on a GPU)")
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny shapes on CPU under TRITON_INTERPRET=1: checks the code paths, times nothing",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--cpu-smoke needs TRITON_INTERPRET=1 in the environment")
            return 2
        device, shapes, dtype = torch.device("cpu"), CPU_SMOKE, torch.float32
    elif not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU; none here, nothing measured.")
        return 0
    else:
        device = torch.device("cuda")
        shapes = QUICK if args.quick else Shapes()
        dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"device: {name}; dtype {str(dtype).replace('torch.', '')}", flush=True)

    copy_bw = copy_bandwidth(shapes.copy_bytes, device)
    rows = [bench_decode(shapes, dtype, device, copy_bw), bench_prefill(shapes, dtype, device)]
    rows += bench_elementwise(shapes, dtype, device, copy_bw)

    print(
        format_table(
            ["kernel", "shape", "time us", "achieved", "unit", "reference", "ratio", "bar", "met"],
            [
                [
                    r.kernel,
                    r.shape,
                    r.time_us,
                    r.achieved,
                    r.unit,
                    f"{r.reference:,.1f} {r.reference_name}",
                    f"{r.ratio:.3f}",
                    r.bar,
                    {None: "-", True: "yes", False: "NO"}[r.met],
                ]
                for r in rows
            ],
        )
    )
    barred = [r for r in rows if r.bar is not None]
    met = sum(1 for r in barred if r.met)
    keys = {
        "decode attention": "decode_vs_copy",
        "prefill attention": "prefill_vs_flash",
        "rms_norm + residual": "rmsnorm_vs_copy",
        "silu_and_mul": "silu_vs_copy",
    }
    parts = [f"device={name.replace(' ', '_')}", f"copy={copy_bw / 1e9:.0f}GB/s"]
    parts += [f"{keys[r.kernel]}={r.ratio:.3f}" for r in barred]
    parts.append(f"bars_met={met}/{len(barred)}")
    print("SUMMARY " + " ".join(parts), flush=True)
    if args.json:
        report = {
            "device": name,
            "dtype": str(dtype),
            "date": time.strftime("%Y-%m-%d"),
            "copy_bytes_per_s": copy_bw,
            "rows": [dict(vars(r), ratio=r.ratio, met=r.met) for r in rows],
        }
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The K-quant few-row kernel (kernels/gguf_kquants.c) at one input row on the ~0.5B Q4_K_M file's
shapes (and Q5_K on the same shapes, as a Q5_K_M file holds them), for each input kind (int8,
15-bit "i15", 22-bit "float") and ISA path, in CPU time on one thread: the weights streamed from
memory (enough random copies to pass the L3), the paths interleaved, best of --repeats. With
--qb32, the same weights in gguf_blocks' qb32 form on its own paths beside them, with its own
bytes (issue 39: which layout wins on AVX2; Q5_K's records against qb32's widening).

    .venv/bin/python bench/gguf_kquant_inputs.py
    .venv/bin/python bench/gguf_kquant_inputs.py --paths float-avx2,i15-avx2,avx2 --qb32
    .venv/bin/python bench/gguf_kquant_inputs.py --types Q5_K --paths best,float --qb32
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

SHAPES = [("Q4_K", 7168, 1280), ("Q4_K", 1280, 3584), ("Q4_K", 1280, 1280),
          ("Q6_K", 1280, 3584), ("Q6_K", 49152, 1280),
          ("Q5_K", 7168, 1280), ("Q5_K", 1280, 3584), ("Q5_K", 1280, 1280)]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default="best,i15,float")
    ap.add_argument("--shapes", default="", help="indices into SHAPES, e.g. 0,3 (default all)")
    ap.add_argument("--types", default="", help="only these types, e.g. Q5_K (default all)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--stream-mb", type=int, default=96, help="bytes of copies per shape")
    ap.add_argument("--rows", action="store_true", help="also the records row after row")
    ap.add_argument("--qb32", action="store_true", help="also the qb32 form on its own paths")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from bench.llamacpp import cpu_flags_line
    from serverless_llm.engine.kernels import gguf_blocks as gb
    from serverless_llm.engine.kernels import gguf_kquants as gk

    kernels = gk.load()
    if kernels is None:
        print("no K-quant kernels on this machine")
        return 1
    blocks = kernels.blocks
    paths = a.paths.split(",")
    print(f"CPU flags: {cpu_flags_line()}; one thread; load average {os.getloadavg()[0]:.2f}; "
          f"vnni={kernels.vnni}", flush=True)  # fmt: skip
    picks = [SHAPES[int(i)] for i in a.shapes.split(",")] if a.shapes else SHAPES
    if a.types:
        picks = [s for s in picks if s[0] in a.types.split(",")]
    g = torch.Generator().manual_seed(0)
    for name, n, k in picks:
        w0 = gk.probe(name, n, k, g)
        copies = max(1, a.stream_mb * 2**20 // w0.nbytes())
        ws = [w0] + [gk.KQ(w0.data[torch.randperm(n, generator=g)].contiguous(), name, k)
                     for _ in range(copies - 1)]  # fmt: skip
        x = torch.randn(1, k, generator=g)
        runs, sizes = {}, {}  # the bytes each run reads a call
        tiles = [gk.tiled(w) for w in ws]
        for p in paths:
            runs[f"kq {p}"] = (kernels.lib.kq_linear_desc, [kernels.desc(w, p) for w in tiles])
            sizes[f"kq {p}"] = w0.nbytes()
            if a.rows:
                descs = [kernels.desc(w, p) for w in ws]
                runs[f"kq {p} row-major"] = (kernels.lib.kq_linear_desc, descs)
                sizes[f"kq {p} row-major"] = w0.nbytes()
        if a.qb32 and blocks is not None:
            qs = [gk.to_qb32(w) for w in ws]
            for p in paths:
                if p.startswith("i15"):
                    continue
                descs = [gb.QB32Desc.of(q, p) for q in qs]
                runs[f"qb32 {p}"] = (blocks.lib.qb32_linear_desc, descs, qs)
                sizes[f"qb32 {p}"] = qs[0].nbytes()
        out = torch.empty(1, n)
        # the machine's streaming read over the same bytes (a float32 sum), interleaved too
        flat = torch.ones(copies * w0.nbytes() // 4)
        runs["read (torch sum)"] = (None, [None] * copies, flat)
        sizes["read (torch sum)"] = w0.nbytes()
        best = {key: float("inf") for key in runs}
        for _ in range(a.repeats):
            for key, (fn, descs, *held) in runs.items():
                t = time.process_time()
                if fn is None:
                    held[0].sum()
                for d in descs if fn is not None else ():
                    fn(x.data_ptr(), k, 1, ctypes.byref(d), None, out.data_ptr(), n)
                best[key] = min(best[key], (time.process_time() - t) / len(descs))
        base = best[f"kq {paths[0]}"]
        line = [f"{name} {n}x{k} ({w0.nbytes() / 1e6:.2f} MB kq, {copies} copies):"]
        for key, t in best.items():
            line.append(f"{key} {t * 1e3:.3f} ms ({sizes[key] / 1e6:.2f} MB read, "
                        f"{sizes[key] / t / 1e9:.1f} GB/s, {base / t:.2f}x)")  # fmt: skip
        print("\n  ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

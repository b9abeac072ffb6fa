"""A batch of decodes served from GGUF blocks (QUANTIZED_WEIGHTS=packed), in CPU time on one
thread: the engine's 32 x 64 batched step on the embedded SmolLM2 Q4_1 and the many-row GEMM
alone on its shapes, for the current kernels/gguf_blocks.c and, with --base REF, the same file
at a git commit, alternating (issue 39's batched bar; docs/benchmarks.md "Issue 39 batched,
session 22"). CPU time on one thread, so a loaded machine moves it little; llama.cpp's side is
bench/llamacpp.py --threads 1.

    .venv/bin/python bench/gguf_batched.py --rounds 3                  # the engine step
    .venv/bin/python bench/gguf_batched.py --base 0b6ef6c --rounds 3   # before/after, one run
    .venv/bin/python bench/gguf_batched.py --gemm --rows 16 --base HEAD~1
    .venv/bin/python bench/gguf_batched.py --inputs float,int16 --rounds 3  # the GEMM's inputs

(--base needs a gguf_blocks.c with this tree's exports: session 23's or later.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SOURCE = "src/serverless_llm/engine/kernels/gguf_blocks.c"
# SmolLM2-135M's linears (30 layers each) and its tied Q8_0 LM head (once a step)
SHAPES = (("Q4_1", 960, 576, 30), ("Q4_1", 576, 576, 30), ("Q4_1", 3072, 576, 30),
          ("Q4_1", 576, 1536, 30), ("Q8_0", 49152, 576, 1))  # fmt: skip


def step_child(a) -> dict:
    """The engine's batched decode: CPU seconds a step ((64 tokens - 1 token) / 63) and the
    prefill with its first token, best of --repeats."""
    import torch

    from bench.llamacpp import prompt_ids
    from serverless_llm import LLM, SamplingParams
    from serverless_llm.engine.kernels import gguf_blocks

    torch.set_num_threads(1)
    if a.source:
        gguf_blocks.SOURCE = Path(a.source)
    if a.inputs:
        os.environ["GGUF_GEMM_INPUTS"] = a.inputs
    llm = LLM(None, dtype="float32", max_model_len=1024, quantized_weights="packed")
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids(None, a.batch)]

    def run(m: int) -> None:
        llm.generate(prompts, SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0))

    run(4)  # warm
    best = {1: float("inf"), a.tokens: float("inf")}
    for _ in range(a.repeats):
        for m in best:
            c = time.process_time()
            run(m)
            best[m] = min(best[m], time.process_time() - c)
    step = (best[a.tokens] - best[1]) / (a.tokens - 1)
    return {"step_ms": step * 1e3, "tok_s": a.batch / step, "prefill_s": best[1]}


def gemm_child(a) -> dict:
    """The many-row GEMM on SmolLM2's shapes at --rows rows, weights streamed from memory
    (copies past the L3, as a decode step streams them): ms per call and a step's sum."""
    import torch

    from serverless_llm.engine.kernels import cpu_native
    from serverless_llm.engine.kernels import gguf_blocks as gb

    torch.set_num_threads(1)
    lib = gb.BlockKernels(cpu_native.build(None, Path(a.source) if a.source else gb.SOURCE))
    g = torch.Generator().manual_seed(0)
    out, total = {}, 0.0
    for name, n, k, per_step in SHAPES:
        copies = max(2, (48 << 20) // (n * k // 2))
        ws = [gb.probe_blocks(name, n, k, g) for _ in range(copies)]
        x = torch.randn(a.rows, k, generator=g)
        best = float("inf")
        for _ in range(a.repeats + 2):
            c = time.process_time()
            for w in ws:
                lib.gemm(x, w, None, a.inputs or "float")
            best = min(best, (time.process_time() - c) / copies)
        out[f"{n}x{k} {name}"] = best * 1e3
        total += best * per_step
    out["step"] = total * 1e3
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=None, help="a git commit: its gguf_blocks.c as well")
    ap.add_argument("--gemm", action="store_true", help="the GEMM alone, not the engine step")
    ap.add_argument("--rows", type=int, default=32, help="--gemm: rows of x")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--inputs", default=None,
                    help="comma-separated GEMM inputs to compare (float, int16: "
                    "GGUF_GEMM_INPUTS), each a variant of the current source")  # fmt: skip
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--source", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(step_child(a) if a.child == "step" else gemm_child(a)))
        return 0
    variants = {"current": (None, None)}
    if a.inputs and not a.child:
        variants = {f"GEMM {i}": (None, i) for i in a.inputs.split(",")}
    tmp = tempfile.TemporaryDirectory()
    if a.base:
        text = subprocess.run(["git", "show", f"{a.base}:{SOURCE}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout  # fmt: skip
        path = Path(tmp.name) / "gguf_blocks.c"
        path.write_text(text)
        variants = {a.base: (str(path), None), "current": (None, None)}
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    for r in range(a.rounds):
        for name, (source, inputs) in variants.items():
            cmd = [sys.executable, __file__, "--child", "gemm" if a.gemm else "step",
                   "--rows", str(a.rows), "--batch", str(a.batch), "--tokens", str(a.tokens),
                   "--repeats", str(a.repeats)]  # fmt: skip
            if source:
                cmd += ["--source", source]
            if inputs:
                cmd += ["--inputs", inputs]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                print(res.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{name} child failed (exit {res.returncode})")
            got = json.loads(res.stdout.strip().splitlines()[-1])
            shown = "  ".join(f"{k} {v:.3f}" for k, v in got.items())
            print(f"round {r + 1} {name:10s} {shown}  load {os.getloadavg()[0]:.2f}", flush=True)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPTQ 4-bit on CPU three ways (issue 39 item 2): the float32 original, the 4-bit checkpoint
dequantized at load (QUANTIZED_WEIGHTS=dequantize, the CPU default) and held on qb32 blocks
(QUANTIZED_WEIGHTS=packed: layers/quant_blocks.py). One request's and 32 requests' greedy tokens
(64 each, EOS ignored; whole generate calls), each mode in its own process, on one thread in
CPU seconds (a measure of work that other processes' load does not move; not the parallel
speed-up, and not the memory bandwidth a second thread adds).

    .venv/bin/python bench/gptq_blocks.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODES = ("float32", "dequantize", "packed")


def child(mode: str, qdir: str) -> dict:
    import torch

    from bench.common import chat_prompt_ids, default_model_dir
    from serverless_llm import LLM, SamplingParams

    torch.set_num_threads(1)
    extra = {} if mode == "float32" else {"quantized_weights": mode}
    src = default_model_dir() if mode == "float32" else qdir
    llm = LLM(src, dtype="float32", num_kv_blocks=512, show_progress=False, **extra)
    prompts = chat_prompt_ids(llm.get_tokenizer(), 32)

    def params(n):
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)

    llm.generate(prompts[:4], params(8))
    out = {"mode": mode}
    for n in (1, 32):
        best = float("inf")
        for _ in range(2):
            t0 = time.process_time()
            llm.generate(prompts[:n], params(64))
            best = min(best, time.process_time() - t0)
        out[n] = n * 64 / best
    return out


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
        return 0
    from bench.common import child_result, cpu_flags, default_model_dir, load_average
    from bench.quant_throughput import quantize_dir

    print("flags:", " ".join(f for f in cpu_flags() if f.startswith(("avx", "amx"))))
    print("load before:", load_average())
    with tempfile.TemporaryDirectory() as tmp:
        qdir = os.path.join(tmp, "gptq4")
        quantize_dir(default_model_dir(), qdir)
        rows = []
        for mode in MODES:
            cmd = [sys.executable, __file__, "--child", mode, qdir]
            rows.append(child_result(cmd, mode))
    base = rows[0]
    print("| mode | 1 request, tok/s | vs float32 | 32 requests, tok/s | vs float32 |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['1']:.1f} | {r['1'] / base['1']:.2f}x "
            f"| {r['32']:.1f} | {r['32'] / base['32']:.2f}x |"
        )
    print("load after:", load_average())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""bfloat16 on CPU (issue 39 item 3): DTYPE=bfloat16 with the linears packed for oneDNN's
bfloat16 GEMM (what the engine does where the CPU has AVX512_BF16 or AMX-BF16), against the same
bfloat16 model on plain F.linear (what it did before, and still does on other CPUs) and against
float32 (the CPU default), in one run, each in its own process, alternating, best of --rounds.

Per model: one greedy request's tokens/s and 32 requests' (32 x --tokens, EOS ignored), whole
generate calls timed (prefill included). --cpu-time times each process's own CPU seconds with one
thread instead of wall time with every core: on a machine shared with other work that is the
figure that does not move with the others' load (it measures work, not the parallel speed-up).

    .venv/bin/python bench/cpu_bf16.py                        # the embedded SmolLM2-135M
    .venv/bin/python bench/cpu_bf16.py --model /path/to/model --rounds 3 --cpu-time
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("float32", "bfloat16-packed", "bfloat16-plain")


def child(mode: str, model: str | None, tokens: int, cpu_time: bool) -> dict:
    import torch

    from bench.common import chat_prompt_ids, set_threads
    from serverless_llm import LLM, SamplingParams
    from serverless_llm.engine.layers import linear

    set_threads(1 if cpu_time else None)
    clock = time.process_time if cpu_time else time.perf_counter
    if mode == "bfloat16-plain":
        linear.cpu_has_bf16 = lambda: False  # the path of a CPU without bfloat16 arithmetic
    elif mode == "bfloat16-packed":
        linear.cpu_has_bf16 = lambda: True
    dtype = "float32" if mode == "float32" else "bfloat16"
    llm = LLM(model, dtype=dtype, max_model_len=512, max_num_batched_tokens=2048)
    prompts = chat_prompt_ids(llm.get_tokenizer(), 32)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
    result = {"mode": mode, "threads": torch.get_num_threads()}
    for n in (1, 32):
        t0 = clock()
        llm.generate(prompts[:n], params)
        result[f"tok_s_{n}"] = n * tokens / (clock() - t0)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cpu-time", action="store_true", help="one thread, CPU seconds")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.model, a.tokens, a.cpu_time)))
        return 0
    from bench.common import child_result, load_average
    from serverless_llm.engine.kernels.cpu_native import cpu_flags

    flags = set(cpu_flags().split())
    want = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
    print("CPU flags:", " ".join(f for f in want if f in flags), "| load", load_average())
    best: dict[str, dict] = {}
    for rnd in range(a.rounds):
        for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
            cmd = [sys.executable, __file__, "--child", mode, "--tokens", str(a.tokens)]
            cmd += (["--model", a.model] if a.model else []) + (
                ["--cpu-time"] if a.cpu_time else []
            )
            r = child_result(cmd, mode)
            prev = best.setdefault(mode, r)
            for k in ("tok_s_1", "tok_s_32"):
                prev[k] = max(prev[k], r[k])
    base = best["float32"]
    unit = "CPU-time tok/s, 1 thread" if a.cpu_time else "tok/s"
    print(f"| mode | 1 request ({unit}) | vs float32 | 32 requests | vs float32 |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        r = best[mode]
        print(
            f"| {mode} | {r['tok_s_1']:.1f} | {r['tok_s_1'] / base['tok_s_1']:.2f}x "
            f"| {r['tok_s_32']:.1f} | {r['tok_s_32'] / base['tok_s_32']:.2f}x |"
        )
    print("load after:", load_average())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One stream's decode on the embedded SmolLM2 Q4_1 GGUF: its GGUF blocks (QUANTIZED_WEIGHTS=packed;
`gguf-blocks` with float inputs, `gguf-int8` with GGUF_BLOCK_INPUTS=int8) against today's float32
copy (QUANTIZED_WEIGHTS=auto), in one run, each in its own process, alternating, best of --rounds.

Decode tokens/s = (M - 1) / (time of M tokens - time of 1 token), one greedy request alone
(EOS ignored). Also prints the CPU flags that matter, each mode's resident memory after load,
and whether the modes' greedy tokens agree on a few chat prompts (and how many tokens do).
No llama.cpp here: bench/llamacpp.py runs it, bench/gguf_agreement.py measures greedy agreement
with llama.cpp's and teacher-forced agreement too.

    .venv/bin/python bench/gguf_one_stream.py                 # 64 tokens, 3 rounds
    .venv/bin/python bench/gguf_one_stream.py --tokens 128 --rounds 5 --json out.json
    .venv/bin/python bench/gguf_one_stream.py --agreement 32 --tokens 64   # greedy agreement
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
]
MODES = {"float32": "dequantize", "gguf-blocks": "packed", "gguf-int8": "packed"}
INPUTS = {"gguf-blocks": "float", "gguf-int8": "int8"}  # GGUF_BLOCK_INPUTS of each mode


def agreement_child(mode: str, n_prompts: int, tokens: int) -> dict:
    """Greedy tokens of bench/common.py's chat prompts, each generated alone (so a decode is
    one row: the block path), EOS ignored."""
    from serverless_llm import LLM, SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.common import chat_prompt_ids

    if mode in INPUTS:
        os.environ["GGUF_BLOCK_INPUTS"] = INPUTS[mode]
    llm = LLM(None, dtype="float32", quantized_weights=MODES[mode], max_model_len=1024)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    out = []
    for ids in chat_prompt_ids(llm.get_tokenizer(), n_prompts):
        got = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
        out.append(list(got))
    return {"mode": mode, "greedy": out}


def child(mode: str, tokens: int, repeats: int) -> dict:
    from serverless_llm import LLM, SamplingParams
    from serverless_llm.engine import resident_bytes

    if mode in INPUTS:
        os.environ["GGUF_BLOCK_INPUTS"] = INPUTS[mode]
    llm = LLM(None, dtype="float32", quantized_weights=MODES[mode], max_model_len=1024)
    tok = llm.get_tokenizer()
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]

    def params(n):
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)

    llm.generate(prompts[:1], params(8))  # warm
    best1 = bestm = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        llm.generate(prompts[:1], params(1))
        best1 = min(best1, time.perf_counter() - t)
        t = time.perf_counter()
        llm.generate(prompts[:1], params(tokens))
        bestm = min(bestm, time.perf_counter() - t)
    greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, params(32))]
    return {
        "mode": mode,
        "decode_tok_s": (tokens - 1) / (bestm - best1),
        "first_token_s": best1,
        "resident_mib": resident_bytes() / 2**20,
        "greedy": [list(g) for g in greedy],
    }


def cpu_flags_line() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                want = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni",
                        "avx512_bf16", "amx_tile")  # fmt: skip
                return " ".join(f for f in want if f in have)
    except OSError:
        pass
    return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="timed generations per round")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--agreement",
        type=int,
        default=0,
        metavar="N",
        help="instead of timing: greedy agreement over N chat prompts x --tokens, each alone",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        if a.agreement:
            print(json.dumps(agreement_child(a.child, a.agreement, a.tokens)))
        else:
            print(json.dumps(child(a.child, a.tokens, a.repeats)))
        return 0
    if a.agreement:
        return agreement(a)
    print(f"CPU flags: {cpu_flags_line()}; cores: {os.cpu_count()}", flush=True)
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(a.rounds):
        for mode in MODES:
            cmd = [sys.executable, __file__, "--child", mode, "--tokens", str(a.tokens),
                   "--repeats", str(a.repeats)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            results[mode].append(res)
            print(f"round {r + 1} {mode:12s} decode {res['decode_tok_s']:7.1f} tok/s  "
                  f"first token {res['first_token_s'] * 1e3:6.1f} ms  "
                  f"resident {res['resident_mib']:6.0f} MiB", flush=True)  # fmt: skip
    best = {m: max(rs, key=lambda x: x["decode_tok_s"]) for m, rs in results.items()}
    fl = best["float32"]
    for mode in MODES:
        b = best[mode]
        same = sum(x == y for x, y in zip(fl["greedy"], b["greedy"]))
        toks = sum(len(x) for x in fl["greedy"])
        agree = sum(p == q for x, y in zip(fl["greedy"], b["greedy"]) for p, q in zip(x, y))
        print(f"best {mode:12s} decode {b['decode_tok_s']:7.1f} tok/s "
              f"({b['decode_tok_s'] / fl['decode_tok_s']:.2f}x float32), resident "
              f"{b['resident_mib']:.0f} MiB, greedy vs float32 ({len(PROMPTS)} prompts x 32): "
              f"{same} prompts, {agree}/{toks} positions equal")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu_flags": cpu_flags_line(), "runs": results}))
    return 0


def agreement(a) -> int:
    got = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--child", mode, "--agreement", str(a.agreement),
               "--tokens", str(a.tokens)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        got[mode] = json.loads(out.stdout.strip().splitlines()[-1])["greedy"]
    fl = got["float32"]
    total = sum(map(len, fl))
    for mode in INPUTS:
        gb = got[mode]
        equal = sum(x == y for f, g in zip(fl, gb) for x, y in zip(f, g))
        prefix = [
            next((i for i, (x, y) in enumerate(zip(f, g)) if x != y), len(f))
            for f, g in zip(fl, gb)
        ]
        print(f"{mode}: greedy agreement with float32, {len(fl)} prompts x {a.tokens} tokens, "
              f"each alone: {sum(f == g for f, g in zip(fl, gb))} prompts equal; {equal}/{total} "
              f"positions equal ({100 * equal / total:.1f}%); tokens before the first "
              f"difference: {sum(prefix)}/{total} ({100 * sum(prefix) / total:.1f}%)")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(got))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

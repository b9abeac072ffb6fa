"""Where speculation stops paying as the batch grows (issue 40 item 3: the off rule): N copies of
bench/speculative.py's copy and chat tasks decoded together (greedy, EOS ignored), with ngram
speculation with the engine's rules (off past DISABLE_BY_BATCH_SIZE running requests; a backoff
for a request whose drafts are mostly rejected), with the batch rule lifted
(`disable_by_batch_size: null`), and none, for N = 1, 2, 4, 8, 16, 32; each mode in its own
process. The engine's DISABLE_BY_BATCH_SIZE (speculative.py) is the
largest N at which speculation still wins on the copy task.

    .venv/bin/python bench/speculative_batch.py              # wall time, every core
    .venv/bin/python bench/speculative_batch.py --cpu-time   # one thread, CPU seconds

--cpu-time measures each process's own CPU seconds on one thread: work, which other processes'
load does not move; wall time at every core is the figure users see (the verification's extra
rows are nearly free while a step is bound by reading the weights, less so once it computes).
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

SIZES = (1, 2, 4, 8, 16, 32)
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
# "ngram": the engine's rules (off past DISABLE_BY_BATCH_SIZE running requests, backoff after
# poor drafts); "ngram-always": the batch rule lifted (the backoff stays)
MODES = {"plain": None, "ngram": SPEC, "ngram-always": dict(SPEC, disable_by_batch_size=None)}


def child(mode: str, tokens: int, cpu_time: bool) -> dict:
    from bench.common import set_threads
    from bench.speculative import TASKS, prompt_ids
    from serverless_llm import LLM, SamplingParams

    set_threads(1 if cpu_time else None)
    clock = time.process_time if cpu_time else time.perf_counter
    extra = {"speculative_config": MODES[mode]} if MODES[mode] else {}
    llm = LLM(None, dtype="float32", max_model_len=1024, **extra)
    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    llm.generate([prompt_ids(tok, TASKS["chat"])], SamplingParams(max_tokens=8))
    out: dict = {"mode": mode}
    for task, text in TASKS.items():
        for n in SIZES:
            # a different first line each, so no request reuses another's cached prompt
            prompts = [prompt_ids(tok, f"(Request {i + 1}.) {text}") for i in range(n)]
            t0 = clock()
            llm.generate(prompts, params)
            out[f"{task}:{n}"] = n * tokens / (clock() - t0)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--cpu-time", action="store_true")
    p.add_argument("--child", choices=tuple(MODES), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.tokens, a.cpu_time)))
        return 0
    from bench.common import child_result, cpu_flags, load_average

    print("flags:", " ".join(f for f in cpu_flags() if f.startswith(("avx", "amx"))))
    print("load before:", load_average())
    best: dict[str, dict] = {}
    for rnd in range(a.rounds):
        for mode in MODES if rnd % 2 == 0 else reversed(MODES):
            cmd = [sys.executable, __file__, "--child", mode, "--tokens", str(a.tokens)]
            cmd += ["--cpu-time"] if a.cpu_time else []
            r = child_result(cmd, mode)
            prev = best.setdefault(mode, r)
            for k, v in r.items():
                if k != "mode":
                    prev[k] = max(prev[k], v)
    unit = "CPU-time tok/s, 1 thread" if a.cpu_time else "tok/s"
    print(f"| task | requests | plain ({unit}) | ngram, rules on | vs plain | ngram, batch rule off "
          "| vs plain |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for task in ("copy", "chat"):
        for n in SIZES:
            key = f"{task}:{n}"
            plain, spec, always = (best[m][key] for m in MODES)
            print(f"| {task} | {n} | {plain:.1f} | {spec:.1f} | {spec / plain:.2f}x "
                  f"| {always:.1f} | {always / plain:.2f}x |")  # fmt: skip
    print("load after:", load_average())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The engine against llama.cpp (through `llama-cpp-python`, requirements-bench.txt) on the same
GGUF file: one request's decode tokens/s and 32 x 64 batched decode, each system in its own
process, alternating, best of --rounds (issue 39's bars: one request >= 1.2x llama.cpp, batched
>= 3x).

Both systems get the same prompt token ids (bench/common.py's chat prompts, tokenized by the
engine's tokenizer: the GGUF's own vocabulary), greedy, EOS ignored, and the same thread count
(--threads, 2 by default). Decode tokens/s = N * (M - 1) / (time of N prompts x M tokens - time
of N prompts x 1 token): the prefill and first token cancel out. llama.cpp runs through its low-
level API: one `llama_batch` holding every sequence's next token per step (its `batched`
example's loop), logits of the step's rows read back and the argmax taken in numpy (the engine
samples its rows too). The engine runs as served by default (QUANTIZED_WEIGHTS unset: its CPU
default for a GGUF), or --engine-mode packed|dequantize|auto.

    .venv/bin/pip install -r requirements-bench.txt     # builds llama.cpp from source if no wheel
    .venv/bin/python bench/llamacpp.py                    # the embedded SmolLM2 Q4_1, 3 rounds
    .venv/bin/python bench/llamacpp.py --model some.Q8_0.gguf --rounds 3 --json out.json
    .venv/bin/python bench/llamacpp.py --systems engine:packed,engine:dequantize  # no llama.cpp
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16",
         "amx_tile")  # fmt: skip
BARS = {"one": 1.2, "batched": 3.0}


def cpu_flags_line() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return " ".join(f for f in FLAGS if f in have)
    except OSError:
        pass
    return "unknown"


def prompt_ids(model: str | None, n: int) -> list[list[int]]:
    """bench/common.py's chat prompts as token ids of the GGUF's tokenizer (the engine's)."""
    import transformers

    from bench.common import chat_prompt_ids
    from serverless_llm.engine.loader.gguf import gguf_metadata_dir

    path = model or resolve_gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_metadata_dir(path))
    return chat_prompt_ids(tokenizer, n)


def timed_pair(run, prompts, tokens: int, repeats: int) -> tuple[float, list, float]:
    """Decode tokens/s of `run(prompts, m) -> token lists` as the module doc says; the greedy
    tokens of the M-token run; and the same rate in the process's CPU time (every thread's:
    with --threads 1 a figure a loaded machine barely moves)."""
    best1 = bestm = cpu1 = cpum = float("inf")
    out = None
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        run(prompts, 1)
        best1 = min(best1, time.perf_counter() - t)
        cpu1 = min(cpu1, time.process_time() - c)
        t, c = time.perf_counter(), time.process_time()
        out = run(prompts, tokens)
        bestm = min(bestm, time.perf_counter() - t)
        cpum = min(cpum, time.process_time() - c)
    n = len(prompts) * (tokens - 1)
    # nan where the M-token run took no more CPU than the 1-token one (threads spinning at a
    # barrier on a loaded machine can do that), not an absurd rate
    cpu_rate = n / (cpum - cpu1) if cpum > cpu1 else float("nan")
    return n / (bestm - best1), out, cpu_rate


def engine_child(a) -> dict:
    from bench.common import set_threads
    from serverless_llm import LLM, SamplingParams
    from serverless_llm.engine import resident_bytes

    set_threads(a.threads)
    kw = {} if a.engine_mode == "default" else {"quantized_weights": a.engine_mode}
    llm = LLM(a.model, dtype="float32", max_model_len=1024, **kw)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids(a.model, a.batch)]

    def run(ps, m):
        params = SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0)
        return [list(o.outputs[0].token_ids) for o in llm.generate(ps, params)]

    run(prompts[:2], 4)  # warm
    one, one_out, one_cpu = timed_pair(run, prompts[:1], a.tokens, a.repeats)
    batched, _, batched_cpu = timed_pair(run, prompts, a.tokens, max(1, a.repeats - 1))
    return {"one": one, "batched": batched, "one_cpu": one_cpu, "batched_cpu": batched_cpu,
            "greedy": one_out[0], "resident_mib": resident_bytes() / 2**20}  # fmt: skip


def llamacpp_child(a) -> dict:
    import llama_cpp
    import numpy as np

    from serverless_llm.engine import resident_bytes

    prompts = prompt_ids(a.model, a.batch)
    path = a.model or resolve_gguf()
    longest = max(len(p) for p in prompts) + a.tokens
    # the model through the high-level class; our own context, since that class gives one
    # sequence (n_seq_max 1) to a generating context: a unified KV cache for every sequence
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=a.threads,
                          n_threads_batch=a.threads, verbose=False)  # fmt: skip
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = longest * a.batch + 64
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = a.batch
    params.n_threads = params.n_threads_batch = a.threads
    params.kv_unified = True
    ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not make a context")
    n_vocab = llm.n_vocab()
    batch = llama_cpp.llama_batch_init(max(512, a.batch), 0, a.batch)

    def clear():
        if hasattr(llama_cpp, "llama_memory_clear"):
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        elif hasattr(llama_cpp, "llama_kv_self_clear"):
            llama_cpp.llama_kv_self_clear(ctx)
        else:
            llama_cpp.llama_kv_cache_clear(ctx)

    def add(token, pos, seq, logits):
        i = batch.n_tokens
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens += 1

    def decode():
        rc = llama_cpp.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax_rows(rows):
        out = []
        for i in rows:
            ptr = llama_cpp.llama_get_logits_ith(ctx, i)
            out.append(int(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).argmax()))
        return out

    def run(ps, m):
        clear()
        nxt, pos = [], []
        for s, ids in enumerate(ps):  # prefill, one sequence at a time, in n_batch chunks
            for c in range(0, len(ids), 512):
                batch.n_tokens = 0
                chunk = ids[c : c + 512]
                for j, t in enumerate(chunk):
                    add(t, c + j, s, c + j == len(ids) - 1)
                decode()
            nxt += argmax_rows([batch.n_tokens - 1])
            pos.append(len(ids))
        outs = [[t] for t in nxt]
        for _ in range(m - 1):  # every sequence's next token in one batch a step
            batch.n_tokens = 0
            for s, t in enumerate(nxt):
                add(t, pos[s], s, True)
                pos[s] += 1
            decode()
            nxt = argmax_rows(range(len(ps)))
            for s, t in enumerate(nxt):
                outs[s].append(t)
        return outs

    run(prompts[:2], 4)  # warm
    one, one_out, one_cpu = timed_pair(run, prompts[:1], a.tokens, a.repeats)
    batched, _, batched_cpu = timed_pair(run, prompts, a.tokens, max(1, a.repeats - 1))
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    return {"one": one, "batched": batched, "one_cpu": one_cpu, "batched_cpu": batched_cpu,
            "greedy": one_out[0], "resident_mib": resident_bytes() / 2**20,
            "llama_cpp_python": llama_cpp.__version__}  # fmt: skip


def resolve_gguf() -> str:
    from serverless_llm.engine.loader.gguf import embedded_model_path

    return embedded_model_path()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per round, best taken")
    ap.add_argument("--engine-mode", default="default",
                    choices=("default", "packed", "dequantize", "auto"))  # fmt: skip
    ap.add_argument("--systems", default="engine,llama.cpp",
                    help="comma-separated: engine, engine:<QUANTIZED_WEIGHTS mode>, llama.cpp; "
                    "ratios against llama.cpp (else the last)")  # fmt: skip
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        res = engine_child(a) if a.child == "engine" else llamacpp_child(a)
        print(json.dumps(res))
        return 0
    if a.model:
        a.model = str(Path(a.model).resolve())
    load = os.getloadavg()
    print(f"CPU flags: {cpu_flags_line()}; cores: {os.cpu_count()}; threads: {a.threads}; "
          f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)  # fmt: skip
    systems = [x.strip() for x in a.systems.split(",") if x.strip()]
    results: dict[str, list[dict]] = {x: [] for x in systems}
    for r in range(a.rounds):
        for system in systems:
            kind, _, mode = system.partition(":")
            cmd = [sys.executable, __file__, "--child", "engine" if kind == "engine" else "llama",
                   "--tokens", str(a.tokens), "--batch", str(a.batch), "--threads", str(a.threads),
                   "--repeats", str(a.repeats), "--engine-mode", mode or a.engine_mode]  # fmt: skip
            if a.model:
                cmd += ["--model", a.model]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{system} child failed (exit {out.returncode})")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            results[system].append(res)
            print(f"round {r + 1} {system:14s} one request {res['one']:7.1f} tok/s  "
                  f"{a.batch} x {a.tokens} batched {res['batched']:7.1f} tok/s  "
                  f"resident {res['resident_mib']:6.0f} MiB  load {os.getloadavg()[0]:.2f}  "
                  f"(CPU time: one {res['one_cpu']:.1f}, batched {res['batched_cpu']:.1f} tok/s)",
                  flush=True)  # fmt: skip
    keys = ("one", "batched", "one_cpu", "batched_cpu")
    best = {s: {k: max(r[k] for r in rs) for k in keys} for s, rs in results.items()}
    peer = "llama.cpp" if "llama.cpp" in best else systems[-1]
    ratios = {}
    for system in systems:
        if system == peer:
            continue
        e, ll = best[system], best[peer]
        same = sum(x == y for x, y in zip(results[system][-1]["greedy"],
                                          results[peer][-1]["greedy"]))  # fmt: skip
        ratios[system] = {k: e[k] / ll[k] for k in ("one", "batched")}
        bars = f", bars {BARS['one']}x / {BARS['batched']}x" if peer == "llama.cpp" else ""
        print(f"SUMMARY {system} vs {peer}: one request {e['one']:.1f} vs {ll['one']:.1f} tok/s "
              f"({ratios[system]['one']:.2f}x); batched {a.batch}x{a.tokens} {e['batched']:.1f} "
              f"vs {ll['batched']:.1f} tok/s ({ratios[system]['batched']:.2f}x{bars}); greedy "
              f"tokens of the one request equal at {same}/{a.tokens} positions")  # fmt: skip
        print(f"SUMMARY {system} vs {peer}, CPU time: one request {e['one_cpu']:.1f} vs "
              f"{ll['one_cpu']:.1f} tok/s ({e['one_cpu'] / ll['one_cpu']:.2f}x); batched "
              f"{e['batched_cpu']:.1f} vs {ll['batched_cpu']:.1f} tok/s "
              f"({e['batched_cpu'] / ll['batched_cpu']:.2f}x)")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu_flags": cpu_flags_line(), "runs": results,
                                            "ratios": ratios}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

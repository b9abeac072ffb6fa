"""One request's decode on a GGUF's blocks against the machine's read bandwidth (issue 39: >= 70%),
on one thread, in CPU time (a loaded machine moves it less than wall time).

- read bandwidth: a float32 tensor the size of the bytes a token reads, summed by torch on one
  thread (a streaming read), best of --repeats; also one 4x that size (past the caches).
- bytes a token reads: every block linear's blocks (decoder linears and the LM head: each read
  once per token) plus one embedding row.
- kernels alone: the block linears' few-row kernel in model order on one input row, back to
  back (one ctypes call each, descriptors built beforehand), best of --repeats: bytes / CPU
  time.
- decode: the engine (QUANTIZED_WEIGHTS=packed) generating --tokens greedy tokens for one chat
  prompt, CPU time per token = (t(M tokens) - t(1 token)) / (M - 1), best of --repeats.
- where a decode token's time goes: the same runs with every native call (the whole-layer
  decode, the block linears, the norms) timed in thread CPU time; the rest is the engine's step
  around them (Python, scheduling, metadata, sampling, output), best of --repeats (the timers
  add about 1 us a call to the rest).

    .venv/bin/python bench/gguf_bandwidth.py                  # the embedded SmolLM2 Q4_1
    GGUF_BLOCK_INPUTS=int8 .venv/bin/python bench/gguf_bandwidth.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def best_cpu(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def read_gbs(nbytes: int, repeats: int) -> float:
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    return nbytes / best_cpu(x.sum, repeats) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from bench.common import chat_prompt_ids
    from bench.llamacpp import cpu_flags_line
    from serverless_llm import LLM, SamplingParams
    from serverless_llm.engine.layers.gguf_linear import GGUFBlockEmbedding, GGUFBlockLinear

    llm = LLM(a.model, dtype="float32", quantized_weights="packed", max_model_len=1024)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, GGUFBlockLinear)]
    head = getattr(model, "packed_lm_head", None)
    if isinstance(head, GGUFBlockLinear) and head not in linears:
        linears.append(head)
    per_token = sum(lin.blocks.nbytes() for lin in linears)
    emb = model.embed_tokens
    if isinstance(emb, GGUFBlockEmbedding):
        per_token += emb.blocks.nbytes() // emb.num_embeddings
    inputs = "float" if linears[0].path == "float" else "int8"
    print(f"CPU flags: {cpu_flags_line()}; one thread; load average {os.getloadavg()[0]:.2f}; "
          f"{inputs} inputs; bytes a token reads: {per_token / 1e6:.1f} MB "
          f"({len(linears)} block linears)", flush=True)  # fmt: skip
    near, far = read_gbs(per_token, a.repeats), read_gbs(4 * per_token, a.repeats)
    print(f"read bandwidth (torch sum, one thread): {near:.1f} GB/s over {per_token / 1e6:.0f} MB, "
          f"{far:.1f} GB/s over {4 * per_token / 1e6:.0f} MB", flush=True)  # fmt: skip
    import ctypes

    xs = {lin.in_features: torch.randn(1, lin.in_features) for lin in linears}
    calls = []
    for lin in linears:
        out = torch.empty(1, lin.out_features)
        x = xs[lin.in_features]
        calls.append((x.data_ptr(), lin.in_features, ctypes.byref(lin.desc), out.data_ptr(),
                      lin.out_features, out))  # fmt: skip
    run = linears[0].kernels._linear

    def all_linears():
        for xp, k, desc, op, n, _ in calls:
            run(xp, k, 1, desc, None, op, n)

    all_linears()
    t = best_cpu(all_linears, a.repeats)
    print(f"kernels alone: {t * 1e3:.2f} ms a token, {per_token / t / 1e9:.1f} GB/s "
          f"({100 * per_token / t / 1e9 / near:.0f}% of the read bandwidth)", flush=True)  # fmt: skip
    ids = chat_prompt_ids(llm.get_tokenizer(), 1)[0]

    def gen(n):
        params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        return lambda: llm.generate([{"prompt_token_ids": ids}], params)

    gen(8)()
    t1, tm = best_cpu(gen(1), a.repeats), best_cpu(gen(a.tokens), a.repeats)
    step = (tm - t1) / (a.tokens - 1)
    print(f"decode: {step * 1e3:.2f} ms a token ({1 / step:.1f} tok/s), {per_token / step / 1e9:.1f} "
          f"GB/s over the bytes it reads ({100 * per_token / step / 1e9 / near:.0f}% of the read "
          "bandwidth; issue 39's bar: 70%)", flush=True)  # fmt: skip
    native, rest = split_native(model, linears, gen, a.tokens, a.repeats)
    print(f"decode, split: native calls {native * 1e3:.2f} ms a token, the engine's step around "
          f"them {rest * 1e3:.2f} ms ({100 * rest / (native + rest):.0f}%)")  # fmt: skip
    return 0


def split_native(model, linears, gen, tokens: int, repeats: int) -> tuple[float, float]:
    """(native calls, the rest) of a decode token's CPU time, best of `repeats` by the rest:
    every ctypes function of the model's native kernels and block kernels timed in thread CPU
    time while the engine generates, (t(M) - t(1)) / (M - 1) of each."""
    import ctypes

    spent = [0.0]

    def timed(fn):
        def call(*args):
            t = time.thread_time()
            try:
                return fn(*args)
            finally:
                spent[0] += time.thread_time() - t

        return call

    owners = {id(o): o for o in (getattr(model, "native", None), linears[0].kernels) if o}
    patched = []
    for owner in owners.values():
        for name, value in list(vars(owner).items()):
            if isinstance(value, ctypes._CFuncPtr):
                setattr(owner, name, timed(value))
                patched.append((owner, name, value))
    best = None
    try:
        for _ in range(repeats):
            parts = []
            for n in (1, tokens):
                spent[0] = 0.0
                t = time.process_time()
                gen(n)()
                parts.append((time.process_time() - t, spent[0]))
            (t1, n1), (tm, nm) = parts
            native = (nm - n1) / (tokens - 1)
            rest = (tm - t1) / (tokens - 1) - native
            if best is None or rest < best[1]:
                best = (native, rest)
    finally:
        for owner, name, value in patched:
            setattr(owner, name, value)
    return best


if __name__ == "__main__":
    raise SystemExit(main())

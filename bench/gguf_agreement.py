"""Greedy agreement with the float reference on a GGUF file: the engine's block kernels (float and
int8 inputs) and llama.cpp, each against the same file dequantized to float32 and run by the
engine (QUANTIZED_WEIGHTS=dequantize), on bench/common.py's chat prompts, each request alone.

Two figures per system (issue 39 item 5 asks for the first; the second says how often the
system's own argmax differs when it is given the reference's text):

- free-running: the system generates --tokens greedy tokens (EOS ignored) from each prompt; the
  share of positions equal to the reference's, the prompts equal throughout, and the tokens
  before each prompt's first difference. One flipped near tie changes the rest of the text, so
  this figure compounds every earlier flip.
- teacher-forced: the system reads the prompt followed by the reference's tokens, and at every
  position its argmax is compared with the reference's next token: each position is judged
  under the reference's own prefix, so flips do not compound. The engine computes it through
  prompt_logprobs with GGUF_BLOCK_ROWS set past the prompt's length, so every position runs the
  few-row kernel the decode runs (int8 or float inputs: the inputs of the mode), attention by the
  prefill's path; llama.cpp evaluates the same ids in one batch with logits for every position
  (its CPU matmuls quantize the activations of these types to 8 bits at any batch size). The
  reference's own teacher-forced figure (its prefill against its decode) is the floor float32
  rounding alone sets.

    .venv/bin/python bench/gguf_agreement.py                    # 32 prompts x 64 tokens
    .venv/bin/python bench/gguf_agreement.py --prompts 8 --tokens 32 --systems int8,llama.cpp
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# system -> (QUANTIZED_WEIGHTS, GGUF_BLOCK_INPUTS, GGUF_GEMM_INPUTS) for the engine's modes:
# "float" and "int8" name the few-row kernel's inputs (the GEMM with x as it is), "int16" the
# default since session 23 (float few-row inputs, the many-row GEMM's 16-bit inputs on VNNI)
ENGINE_MODES = {"float32": ("dequantize", None, None), "float": ("packed", "float", "float"),
                "int8": ("packed", "int8", "float"),
                "int16": ("packed", "float", "int16")}  # fmt: skip


def engine_child(a) -> dict:
    mode, inputs, gemm = ENGINE_MODES[a.child]
    if inputs:
        os.environ["GGUF_BLOCK_INPUTS"] = inputs
    if gemm:
        os.environ["GGUF_GEMM_INPUTS"] = gemm
    if a.ref and gemm != "int16":
        # teacher forcing reads whole sequences as prompts: every row by the few-row kernel
        # (the int16 system's by the GEMM: its teacher-forced figure is the GEMM's)
        os.environ["GGUF_BLOCK_ROWS"] = "100000"
    from bench.llamacpp import prompt_ids
    from serverless_llm import LLM, SamplingParams

    torch_threads(a.threads)
    llm = LLM(a.model, dtype="float32", quantized_weights=mode, max_model_len=2048)
    prompts = prompt_ids(a.model, a.prompts)
    free = []  # as served (a prompt's prefill by the many-row GEMM): not with a.ref
    params = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=0.0)
    if a.batched and not a.ref:  # all prompts in one call: decode steps of many rows
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
        free = [list(o.outputs[0].token_ids) for o in outs]
    for ids in prompts if not (a.ref or a.batched) else []:
        out = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
        free.append(list(out.token_ids))
    forced = []
    if a.ref:
        ref = json.loads(Path(a.ref).read_text())
        one = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        for ids, want in zip(prompts, ref):
            seq = ids + want[:-1]
            got = llm.generate([{"prompt_token_ids": seq}], one)[0]
            # entry i holds position i's token and the argmax (rank 1) given tokens < i
            tops = [next(t for t, lp in e.items() if lp.rank == 1)
                    for e in got.prompt_logprobs[len(ids):]]  # fmt: skip
            first = got.outputs[0].token_ids[0]  # the argmax after the whole sequence
            forced.append(tops + [first])
            # tops[j] predicts seq[len(ids) + j] = want[j]; `first` predicts past want[-1]
    return {"free": free, "forced": [f[: a.tokens] for f in forced]}


def llamacpp_child(a) -> dict:
    import llama_cpp
    import numpy as np

    from bench.llamacpp import prompt_ids, resolve_gguf

    prompts = prompt_ids(a.model, a.prompts)
    longest = max(len(p) for p in prompts) + a.tokens + 8
    llm = llama_cpp.Llama(model_path=a.model or resolve_gguf(), n_ctx=longest,
                          n_batch=longest, n_threads=a.threads, n_threads_batch=a.threads,
                          logits_all=True, verbose=False)  # fmt: skip
    free = []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        toks = []
        for _ in range(a.tokens):
            t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            toks.append(t)
            llm.eval([t])
        free.append(toks)
    forced = []
    if a.ref:
        ref = json.loads(Path(a.ref).read_text())
        for ids, want in zip(prompts, ref):
            llm.reset()
            llm.eval(ids + want[:-1])
            n = len(ids)
            forced.append([int(np.argmax(llm.scores[n - 1 + j])) for j in range(len(want))])
    return {"free": free, "forced": forced, "llama_cpp_python": llama_cpp.__version__}


def torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def run_system(a, system: str, ref: str) -> dict:
    """Free-running and teacher-forced results of a system (the engine's in two processes:
    teacher forcing changes the few-row threshold)."""
    if system == "llama.cpp":
        return run_child(a, system, ref)
    return {"free": run_child(a, system, None)["free"],
            "forced": run_child(a, system, ref)["forced"]}  # fmt: skip


def run_child(a, system: str, ref: str | None) -> dict:
    cmd = [sys.executable, __file__, "--child", system, "--prompts", str(a.prompts),
           "--tokens", str(a.tokens), "--threads", str(a.threads)]  # fmt: skip
    if a.model:
        cmd += ["--model", a.model]
    if ref:
        cmd += ["--ref", ref]
    if a.batched and system != "float32":
        cmd += ["--batched"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{system} child failed (exit {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def free_line(ref: list[list[int]], got: list[list[int]]) -> str:
    total = sum(map(len, ref))
    equal = sum(x == y for r, g in zip(ref, got) for x, y in zip(r, g))
    prefix = sum(
        next((i for i, (x, y) in enumerate(zip(r, g)) if x != y), len(r)) for r, g in zip(ref, got)
    )
    whole = sum(r == g for r, g in zip(ref, got))
    return (f"free-running {equal}/{total} positions ({100 * equal / total:.1f}%), {whole}/"
            f"{len(ref)} prompts equal, {prefix}/{total} tokens before the first difference "
            f"({100 * prefix / total:.1f}%)")  # fmt: skip


def forced_line(ref: list[list[int]], got: list[list[int]]) -> str:
    total = sum(map(len, ref))
    equal = sum(x == y for r, g in zip(ref, got) for x, y in zip(r, g))
    first = sum(r[0] == g[0] for r, g in zip(ref, got))
    return (f"teacher-forced {equal}/{total} positions ({100 * equal / total:.1f}%; first token "
            f"{first}/{len(ref)})")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--systems", default="float,int8,llama.cpp",
                    help="comma-separated, each against float32: float, int8, int16 (the "
                    "engine's block kernels with those inputs: ENGINE_MODES), llama.cpp")  # fmt: skip
    ap.add_argument("--batched", action="store_true",
                    help="the systems' free-running texts from all prompts in one call (decode "
                    "steps of --prompts rows: the many-row GEMM), against the float32 reference "
                    "run one prompt at a time")  # fmt: skip
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ref", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        res = llamacpp_child(a) if a.child == "llama.cpp" else engine_child(a)
        print(json.dumps(res))
        return 0
    if a.model:
        a.model = str(Path(a.model).resolve())
    base = run_child(a, "float32", None)
    ref = base["free"]
    results = {"float32": base}
    with tempfile.TemporaryDirectory() as tmp:
        ref_path = str(Path(tmp) / "ref.json")
        Path(ref_path).write_text(json.dumps(ref))
        results["float32"] = {"free": ref, "forced": run_child(a, "float32", ref_path)["forced"]}
        print(f"float32 (the reference): {forced_line(ref, results['float32']['forced'])} "
              "(its prefill against its own decode)", flush=True)  # fmt: skip
        for system in [s.strip() for s in a.systems.split(",") if s.strip()]:
            res = run_system(a, system, ref_path)
            results[system] = res
            print(f"{system}: {free_line(ref, res['free'])}; {forced_line(ref, res['forced'])}",
                  flush=True)  # fmt: skip
    if "int8" in results and "llama.cpp" in results:
        both = free_line(results["llama.cpp"]["free"], results["int8"]["free"])
        print(f"int8 against llama.cpp: {both}")
    if a.json:
        Path(a.json).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

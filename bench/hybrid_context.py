"""Decode cost as the context grows (issue 35): one request's decode speed at 512, 2k and 8k
tokens of context, for the hybrid shapes and, beside them, the Llama shape of the same width.

A recurrent layer's decode step reads a fixed-size state whatever the context; an attention
layer's reads every key so far. So a model of recurrent layers alone decodes as fast at 8k as at
512, a hybrid slows only by its attention layers' share, and the Llama shape slows the most. The
shapes are bench/families.py's (dummy weights, about 100M parameters: hidden 768, 12 layers),
each in its own process; per context, one request's prompt is computed first, untimed, then
its decode tokens/s is timed over `--tokens` decode steps (the prefill is not in the figure).

    .venv/bin/python bench/hybrid_context.py                       # every shape, 512/2k/8k
    .venv/bin/python bench/hybrid_context.py --shapes llama,lfm2 --contexts 512,2048
    .venv/bin/python bench/hybrid_context.py --tiny                # CI smoke size

Prints one table (tokens/s per context, and the 8k / 512 ratio) and a final SUMMARY line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    cpu_flags,
    cpu_model_name,
    default_model_dir,
    format_table,
    load_average,
    set_threads,
)

DEFAULT_SHAPES = ("llama", "lfm2", "qwen3_next", "granitemoehybrid", "jamba", "mamba2")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure(model_dir: str, contexts: list[int], tokens: int) -> dict[str, float]:
    """Decode tokens/s of one request at each context, in this process: the engine steps the
    request through its prompt (and first token) untimed, then `tokens` decode steps are
    timed."""
    from serverless_llm import LLM, SamplingParams

    set_threads()
    longest = max(contexts) + tokens + 16
    llm = LLM(model_dir, dtype="float32", max_model_len=longest, max_num_seqs=1)
    engine = llm.engine
    vocab = engine.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True, temperature=0.0)

    def decode_seconds(ctx: int) -> float:
        req = engine.add_request([rng.randrange(5, vocab) for _ in range(ctx)], params)
        while not req.output_token_ids:  # the prompt, in as many steps as its chunks need
            engine.step()
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        elapsed = time.perf_counter() - t0
        assert len(req.output_token_ids) == tokens + 1
        return elapsed

    decode_seconds(64)  # warm-up
    result = {}
    for ctx in contexts:
        result[str(ctx)] = tokens / decode_seconds(ctx)
        log(f"{model_dir}: context {ctx}: {result[str(ctx)]:.1f} tok/s")
    return result


def shape_configs(tokenizer_dir: str, tiny: bool) -> dict:
    from bench.families import family_configs
    from serverless_llm.engine.tokenizer import load_tokenizer

    return family_configs(load_tokenizer(tokenizer_dir), tiny)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", help="comma-separated bench/families.py shapes")
    p.add_argument("--contexts", default="512,2048,8192")
    p.add_argument("--tokens", type=int, default=32, help="decode tokens timed per context")
    p.add_argument("--tiny", action="store_true", help="CI smoke size: tiny models, short contexts")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.contexts, args.tokens = "32,64", 4
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.model_dir:  # one shape, in its own process
        print(json.dumps(measure(args.model_dir, contexts, args.tokens)))
        return 0
    from bench.families import build_model
    from serverless_llm.engine.models import MODEL_REGISTRY

    tok_dir = default_model_dir()
    configs = shape_configs(tok_dir, args.tiny)
    names = args.shapes.split(",") if args.shapes else list(DEFAULT_SHAPES)
    load_before = load_average()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-context-") as root:
        for name in names:
            path = os.path.join(root, name)
            log(f"{name}: building the model")
            config = configs[name]
            config.max_position_embeddings = max(contexts) + args.tokens + 64
            build_model(config, tok_dir, path)
            arch = json.loads(Path(path, "config.json").read_text())["architectures"][0]
            if arch not in MODEL_REGISTRY:
                log(f"{name}: {arch} is not served by the engine; skipped")
                continue
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--model-dir",
                path,
                "--contexts",
                args.contexts,
                "--tokens",
                str(args.tokens),
            ]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
            results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    lo, hi = str(contexts[0]), str(contexts[-1])
    rows = [
        [name] + [f"{r[str(c)]:.1f}" for c in contexts] + [f"{r[hi] / r[lo]:.2f}"]
        for name, r in results.items()
    ]
    simd = " ".join(f for f in cpu_flags() if f in ("avx2", "avx512f", "avx512_vnni", "amx_tile"))
    print(
        f"{cpu_model_name()}, SIMD: {simd}; one request, {args.tokens} decode tokens per context; "
        f"load before {load_before}, after {load_average()}"
    )
    print(
        format_table(
            ["shape"] + [f"tok/s at {c}" for c in contexts] + [f"{hi} / {lo}"],
            rows,
        )
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    summary = " ".join(f"{n}={r[hi] / r[lo]:.2f}" for n, r in results.items())
    print(f"SUMMARY decode tok/s at {hi} / at {lo}: {summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

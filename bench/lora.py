"""LoRA on CPU (issue 18's bar): the embedded SmolLM2-135M, 32 concurrent chat requests x 64
greedy tokens spread over 4 rank-16 adapters on all seven projections, against the same batch
without adapters on the same engine, in one run: at least 0.75x.

The adapters are random, written in PEFT's format by this script (the speed does not depend on
the values). One engine with ENABLE_LORA and four slots serves both batches, in alternating
rounds; each keeps its best.

    .venv/bin/python bench/lora.py
    .venv/bin/python bench/lora.py --rounds 3 --json out.json
    .venv/bin/python bench/lora.py --tiny      # CI smoke size
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    chat_prompt_ids,
    cpu_flags,
    cpu_model_name,
    default_model_dir,
    format_table,
    set_threads,
)

BAR = 0.75
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model_dir: str, out: str, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter of `model_dir` (a Llama-shaped checkpoint) on every projection."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        for name in f.keys():
            module, _, kind = name.rpartition(".")
            if kind != "weight" or module.rpartition(".")[2] not in TARGETS:
                continue
            out_f, in_f = f.get_slice(name).get_shape()
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.01
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the embedded SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="CI smoke size: 4 x 8, one round")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.tiny:
        args.num_prompts, args.max_tokens, args.rounds = 4, 8, 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from serverless_llm import LLM, LoRARequest, SamplingParams

    set_threads()
    model_dir = args.model or default_model_dir()
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as root:
        loras = []
        for i in range(args.adapters):
            path = os.path.join(root, f"adapter{i}")
            write_adapter(model_dir, path, args.rank, seed=i)
            loras.append(LoRARequest(f"adapter{i}", i + 1, path))
        llm = LLM(
            model_dir,
            dtype="float32",
            enable_lora=True,
            max_loras=args.adapters,
            max_lora_rank=args.rank,
            max_model_len=256 if args.tiny else 1024,
            kv_cache_space_gib=0.5,
        )
        tok = llm.get_tokenizer()
        prompts = chat_prompt_ids(tok, args.num_prompts)
        warmup = chat_prompt_ids(tok, args.num_prompts, lead="Warm-up. ")
        spread = [loras[i % len(loras)] for i in range(args.num_prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate(warmup, warm)
        llm.generate(warmup, warm, lora_request=spread)
        best = {"base": 0.0, "lora": 0.0}
        for _ in range(args.rounds):
            for key, lora in (("base", None), ("lora", spread)):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, lora_request=lora)
                seconds = time.perf_counter() - t0
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                assert tokens == args.num_prompts * args.max_tokens
                best[key] = max(best[key], tokens / seconds)
    ratio = best["lora"] / best["base"]
    flags = [f for f in cpu_flags() if f.startswith("avx") or f in ("fma", "amx_tile")]
    print(f"{cpu_model_name()}, SIMD: {' '.join(flags)}; {args.num_prompts} prompts x "
          f"{args.max_tokens} tokens, {args.adapters} adapters of rank {args.rank} on "
          f"{len(TARGETS)} projections, best of {args.rounds}")  # fmt: skip
    print(
        format_table(
            ["batch", "tok/s"],
            [["no adapter", f"{best['base']:.1f}"], ["4 adapters", f"{best['lora']:.1f}"]],
        )
    )
    meets = ratio >= BAR
    print(f"adapters vs none {ratio:.2f}x (bar >= {BAR}x): " + ("meets" if meets else "misses"))
    print(f"SUMMARY lora_vs_base={ratio:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"tok_s": best, "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

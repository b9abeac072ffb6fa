"""Mixture-of-experts on CPU (issue 17): a dummy-weight Qwen3-MoE-shaped model of about 280M
parameters (about 64M active per token), N chat prompts x M greedy tokens (EOS ignored), this
engine (`LLM.generate`, all at once) against transformers' `generate_batch`, each system in its
own process; then the engine on a dense Qwen3 twin with the same active parameters (the MLP as
wide as top_k experts together), whose time is what a MoE step would ideally cost.

Bars: engine >= 3x generate_batch on the MoE model; the MoE/dense time ratio is reported (the
ideal is 1.0).

    .venv/bin/python bench/moe.py                 # 32 x 64 tokens
    .venv/bin/python bench/moe.py --rounds 2      # best of two
    .venv/bin/python bench/moe.py --tiny          # CI smoke size
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    cpu_model_name,
    default_model_dir,
    format_table,
    load_average,
    machine_info,
)
from bench.families import _best, _param_count, build_model, cpu_simd_flags, in_process, log  # noqa: E402

BAR_VS_GENERATE_BATCH = 3.0

# Qwen3-30B-A3B's proportions scaled down: 32 experts, top-4, experts narrower than hidden.
SHAPE = dict(hidden_size=512, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2)
EXPERTS = dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=416)
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TINY_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def configs(tokenizer, tiny: bool):
    """(the MoE config, its dense twin with the same active parameters)."""
    import transformers as t

    shape, experts = (TINY_SHAPE, TINY_EXPERTS) if tiny else (SHAPE, EXPERTS)
    common = dict(
        **shape,
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    moe = t.Qwen3MoeConfig(**common, **experts, norm_topk_prob=True, intermediate_size=0)
    active = experts["num_experts_per_tok"] * experts["moe_intermediate_size"]
    dense = t.Qwen3Config(**common, intermediate_size=active)
    return moe, dense


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", help="the tokenizer's model directory (default: the embedded SmolLM2)"
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="each system keeps its best round")
    p.add_argument("--tiny", action="store_true", help="CI smoke size: tiny models, 4 x 8")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.tiny:
        args.num_prompts, args.max_tokens = 4, 8
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from serverless_llm.engine.tokenizer import load_tokenizer

    tok_dir = args.model or default_model_dir()
    moe_cfg, dense_cfg = configs(load_tokenizer(tok_dir), args.tiny)
    load_before = load_average()
    best: dict[str, dict | None] = {"engine": None, "generate_batch": None, "dense": None}
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as root:
        moe_dir, dense_dir = os.path.join(root, "moe"), os.path.join(root, "dense")
        log("building the models")
        build_model(moe_cfg, tok_dir, moe_dir)
        build_model(dense_cfg, tok_dir, dense_dir)
        params = {
            d: sum(_param_count(p).values()) for d, p in (("moe", moe_dir), ("dense", dense_dir))
        }
        for rnd in range(1, args.rounds + 1):
            for key, system, path in (
                ("engine", "engine", moe_dir),
                ("generate_batch", "generate_batch", moe_dir),
                ("dense", "engine", dense_dir),
            ):
                log(f"round {rnd}/{args.rounds}: {key}")
                got = in_process(system, path, args)
                log(f"{key}: {got['tok_s']:.1f} tok/s")
                best[key] = _best(best[key], got)
    engine, hf, dense = best["engine"], best["generate_batch"], best["dense"]
    ratio = engine["tok_s"] / hf["tok_s"]
    vs_dense = dense["tok_s"] / engine["tok_s"]  # MoE time / dense time
    info = machine_info()
    experts = TINY_EXPERTS if args.tiny else EXPERTS
    print(
        f"{cpu_model_name()}, {info.get('cores')} cores, SIMD: {cpu_simd_flags()}; "
        f"{args.num_prompts} prompts x {args.max_tokens} tokens; load before {load_before}, "
        f"after {load_average()}"
    )
    print(
        f"MoE: {params['moe'] / 1e6:.0f}M parameters, {experts['num_experts']} experts, "
        f"top-{experts['num_experts_per_tok']}; dense twin: {params['dense'] / 1e6:.0f}M"
    )
    print(
        format_table(
            ["system", "model", "tok/s", "others' cores"],
            [
                ["engine", "MoE", f"{engine['tok_s']:.1f}", f"{engine['other_cores']:.2f}"],
                [
                    "transformers generate_batch",
                    "MoE",
                    f"{hf['tok_s']:.1f}",
                    f"{hf['other_cores']:.2f}",
                ],
                ["engine", "dense twin", f"{dense['tok_s']:.1f}", f"{dense['other_cores']:.2f}"],
            ],
        )
    )
    meets = ratio >= BAR_VS_GENERATE_BATCH
    print(
        f"engine vs generate_batch {ratio:.2f}x (bar >= {BAR_VS_GENERATE_BATCH}x): "
        + ("meets" if meets else "misses")
        + f"; MoE time / dense twin's {vs_dense:.2f} (ideal 1.0)"
    )
    print(f"SUMMARY moe_vs_generate_batch={ratio:.2f} moe_time_vs_dense={vs_dense:.2f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": info, "params": params, "results": best}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

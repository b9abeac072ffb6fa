"""4-bit against float32 on CPU (issue 16's CPU bar: a 4-bit SmolLM2-shaped checkpoint serves at
least 0.8x the float32 engine's batch-32 throughput).

The embedded SmolLM2-135M is quantized here to a GPTQ checkpoint (4 bits, group 64, min/max per
group: the speed does not depend on how well the values were chosen), written as AutoGPTQ
writes one; then the float32 engine serves the original and the 4-bit one the same 32 chat
prompts x 64 tokens (greedy, EOS ignored), in alternating rounds, best of each.

    .venv/bin/python bench/quant_throughput.py
    .venv/bin/python bench/quant_throughput.py --packed     # also the packed form (qb32 blocks)

Prints the CPU's flags, one row per engine and a last line against the bar.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    chat_prompt_ids,
    cpu_flags,
    cpu_model_name,
    default_model_dir,
    format_table,
)

LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
BAR = 0.8


def quantize_dir(src: str, dst: str, group: int = 64, bits: int = 4) -> None:
    """src's float checkpoint as a GPTQ (v1) one in dst."""
    from safetensors.torch import load_file, save_file

    from serverless_llm.engine.kernels.w4a16 import pack_int32

    top = (1 << bits) - 1
    state = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, w in state.items():
        if not LINEAR.match(name):
            out[name] = w
            continue
        w = w.float()
        n, k = w.shape
        grouped = w.reshape(n, k // group, group)
        lo = grouped.amin(-1).clamp(max=0)
        hi = grouped.amax(-1).clamp(min=0)
        scale = ((hi - lo) / top).clamp(min=1e-6).half()
        zero = (-lo / scale.float()).round().clamp(1, top)
        q = (grouped / scale.float()[..., None]).round() + zero[..., None]
        q = q.clamp(0, top).to(torch.int32).reshape(n, k)
        base = name[: -len(".weight")]
        out[base + ".qweight"] = pack_int32(q.t(), bits, 0)
        out[base + ".qzeros"] = pack_int32((zero.t() - 1).to(torch.int32), bits, 1)
        out[base + ".scales"] = scale.t().contiguous()
        out[base + ".g_idx"] = (torch.arange(k) // group).int()
    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, "model.safetensors"))
    save_file(out, os.path.join(dst, "model.safetensors"))
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "desc_act": False,
        "sym": False,
    }
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--packed", action="store_true", help="also time quantized_weights=packed")
    args = p.parse_args(argv)
    from serverless_llm import LLM, SamplingParams

    src = default_model_dir()
    tmp = tempfile.mkdtemp()
    try:
        qdir = os.path.join(tmp, "gptq4")
        quantize_dir(src, qdir)
        engines = {
            "float32": LLM(src, dtype="float32", num_kv_blocks=512, show_progress=False),
            "4-bit (dequantized at load)": LLM(
                qdir, dtype="float32", num_kv_blocks=512, show_progress=False
            ),
        }
        if args.packed:
            engines["4-bit (packed: qb32 blocks on CPU)"] = LLM(
                qdir,
                dtype="float32",
                num_kv_blocks=512,
                quantized_weights="packed",
                show_progress=False,
            )
        tok = engines["float32"].get_tokenizer()
        prompts = chat_prompt_ids(tok, args.num_prompts)
        warm = chat_prompt_ids(tok, 4, lead="Briefly: ")
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
        best: dict[str, float] = {}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                llm.engine.block_pool.reset_prefix_cache()
                llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True))
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params)
                seconds = time.perf_counter() - t0
                assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
                rate = args.num_prompts * args.max_tokens / seconds
                best[name] = max(best.get(name, 0.0), rate)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(cpu_model_name(), "flags:", " ".join(f for f in cpu_flags() if f.startswith("avx")))
    print(f"threads {torch.get_num_threads()}; {args.num_prompts} prompts x {args.max_tokens}")
    base = best["float32"]
    rows = [[name, f"{rate:.1f} tok/s", rate / base] for name, rate in best.items()]
    print(format_table(["engine", "throughput", "vs float32"], rows))
    r = best["4-bit (dequantized at load)"] / base
    print(
        f"4-bit vs float32 batch-{args.num_prompts}: {r:.2f}x (bar {BAR}x: "
        f"{'meets' if r >= BAR else 'MISSES'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

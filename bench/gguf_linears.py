"""Where one request's decode time goes on a GGUF served from its blocks (issue 39), on one
thread in CPU time: each kind of block linear (qb32 GGUFBlockLinear or KQuantLinear, grouped by
the layouts of its parts and its shape) at one input row, CPU time per token and GB/s of the
bytes it holds; the bytes a token reads (every block linear once, plus an embedding row) against
the file's size; and the engine's whole decode (CPU time per token, best of --repeats).

    .venv/bin/python bench/gguf_dummy.py --type Q4_K_M --out /tmp/dummy.Q4_K_M.gguf
    .venv/bin/python bench/gguf_linears.py --model /tmp/dummy.Q4_K_M.gguf
    GGUF_BLOCK_INPUTS=int8 .venv/bin/python bench/gguf_linears.py --model /tmp/dummy.Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.gguf_bandwidth import best_cpu  # noqa: E402


def kind_of(lin) -> str:
    parts = getattr(lin, "parts", None)
    if parts is None:
        b = lin.blocks
        name = f"qb32 {b.bits}-bit/{b.group}"
    else:
        name = "+".join(
            f"{p.type_name}[{p.shape[0]}]" if hasattr(p, "type_name") else f"qb32 {p.bits}-bit"
            for p in parts
        )
    return f"{name} {lin.out_features}x{lin.in_features}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2)")
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from bench.common import chat_prompt_ids
    from bench.llamacpp import cpu_flags_line
    from serverless_llm import LLM, SamplingParams
    from serverless_llm.engine.layers.gguf_kquant_linear import KQuantLinear
    from serverless_llm.engine.layers.gguf_linear import GGUFBlockLinear
    from serverless_llm.engine.loader.gguf import embedded_model_path

    path = a.model or embedded_model_path()
    llm = LLM(path, dtype="float32", quantized_weights="packed", max_model_len=1024)
    model = llm.engine.runner.model
    kinds = (GGUFBlockLinear, KQuantLinear)
    linears = [m for m in model.modules() if isinstance(m, kinds)]
    head = getattr(model, "packed_lm_head", None)
    if isinstance(head, kinds) and head not in linears:
        linears.append(head)
    emb = model.embed_tokens
    row = emb.blocks.nbytes() // emb.num_embeddings if hasattr(emb, "blocks") else 0
    per_token = sum(lin.blocks.nbytes() for lin in linears) + row
    file_bytes = os.path.getsize(path)
    inputs = os.environ.get("GGUF_BLOCK_INPUTS", "") or "float"
    print(f"CPU flags: {cpu_flags_line()}; one thread; load average {os.getloadavg()[0]:.2f}; "
          f"{inputs} inputs; bytes a token reads {per_token / 1e6:.1f} MB, the file "
          f"{file_bytes / 1e6:.1f} MB ({per_token / file_bytes:.2f}x)", flush=True)  # fmt: skip
    groups: dict[str, list] = {}
    for lin in linears:
        groups.setdefault(kind_of(lin), []).append(lin)
    total = 0.0
    for kind, group in groups.items():
        x = torch.randn(1, group[0].in_features)

        def run(group=group, x=x):
            for lin in group:
                lin(x)

        run()
        t = best_cpu(run, a.repeats)
        held = sum(lin.blocks.nbytes() for lin in group)
        total += t
        print(f"  {kind} x{len(group)}: {t * 1e3:.3f} ms a token, {held / t / 1e9:.1f} GB/s")
    print(f"all block linears (one Python call each): {total * 1e3:.2f} ms a token, "
          f"{(per_token - row) / total / 1e9:.1f} GB/s", flush=True)  # fmt: skip
    ids = chat_prompt_ids(llm.get_tokenizer(), 1)[0]

    def gen(n):
        params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        return lambda: llm.generate([{"prompt_token_ids": ids}], params)

    gen(4)()
    t1, tm = best_cpu(gen(1), a.repeats), best_cpu(gen(a.tokens), a.repeats)
    step = (tm - t1) / (a.tokens - 1)
    print(f"decode: {step * 1e3:.2f} ms a token ({1 / step:.1f} tok/s), "
          f"{per_token / step / 1e9:.1f} GB/s over the bytes it reads")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

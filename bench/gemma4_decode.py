"""Decode steps of a Gemma-4-shaped model on CPU (bench/families.py's shape: sliding layers of
64-wide heads whose cache entries are strided views inside the global layers' 128-wide ones),
per attention backend: `native` (the default CPU step) and `torch`.

What it times: `requests` prompts of `context` random tokens each, prefilled, then `tokens`
greedy decode steps of the whole batch, each step timed alone (engine.step); the median over
`rounds` such runs (the best beside it), and the median of the process's CPU time a step (all
threads), which other processes' load on a shared machine disturbs less than wall time. Prefix
caching off, so each round prefills again.

    .venv/bin/python bench/gemma4_decode.py                        # 8 x 1024, 32 steps, 3 rounds
    .venv/bin/python bench/gemma4_decode.py --requests 4 --context 2048 --backends native
    .venv/bin/python bench/gemma4_decode.py --attention               # one layer's step only

`--attention` times what changed for these layers alone, without a model: one decode step's
attention (KV write included) of a sliding layer whose cache is a view (1 KV head of 64 inside
the global layers' 1 x 128 entries, window 64, 8 query heads) and of a global layer on the
tensor itself, `requests` decodes of `context` keys each, through each backend's `forward`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cpu_model_name, default_model_dir  # noqa: E402
from bench.families import DIMS, build_model, family_configs  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backends", default="native,torch")
    p.add_argument("--attention", action="store_true", help="one layer's attention step only")
    p.add_argument("--repeats", type=int, default=50, help="--attention: steps timed")
    args = p.parse_args(argv)
    if args.attention:
        return attention_only(args)

    import torch

    from serverless_llm import LLM, SamplingParams
    from serverless_llm.engine.tokenizer import load_tokenizer

    tok_dir = default_model_dir()
    config = family_configs(load_tokenizer(tok_dir), tiny=False)["gemma4"]
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(10, config.vocab_size, (args.context,), generator=g).tolist()
        for _ in range(args.requests)
    ]
    c = config.to_dict()  # (per-layer attributes are not read off the config itself)
    wide = max(x.get("head_dim", 0) for x in c.get("per_layer_config", {}).values())
    print(
        f"# Gemma 4 shape (hidden {DIMS['hidden_size']}, {c['num_hidden_layers']} layers, "
        f"heads {c['head_dim']} sliding / {wide} global, window "
        f"{c['sliding_window']}); {args.requests} x {args.context} tokens, {args.tokens} "
        f"decode steps; {cpu_model_name()}, {torch.get_num_threads()} threads"
    )
    with tempfile.TemporaryDirectory(prefix="bench-gemma4-") as root:
        path = os.path.join(root, "gemma4")
        build_model(config, tok_dir, path)
        for backend in args.backends.split(","):
            llm = LLM(
                path,
                dtype="float32",
                attention_backend=backend,
                enable_prefix_caching=False,
                max_model_len=args.context + args.tokens + 8,
                max_num_seqs=args.requests,
                kv_cache_space_gib=1.0,
            )
            views = sum(
                1
                for c in llm.engine.runner.kv_caches
                if isinstance(c, torch.Tensor) and not c[0].transpose(1, 2).is_contiguous()
            )

            engine = llm.engine
            times, cpu = [], []
            for _ in range(args.rounds):
                sp = SamplingParams(temperature=0.0, max_tokens=args.tokens + 2, ignore_eos=True)
                reqs = [engine.add_request(list(pr), sp) for pr in prompts]
                while any(len(r.output_token_ids) == 0 for r in reqs):  # the prefills
                    engine.step()
                engine.step()  # every request decoding from here
                for _ in range(args.tokens):
                    t0, c0 = time.perf_counter(), time.process_time()
                    engine.step()
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
                while engine.has_unfinished_requests():
                    engine.step()
            times.sort()
            cpu.sort()
            median = times[len(times) // 2]
            print(
                f"{backend:7s} median {median * 1e3:7.1f} ms/step, best {times[0] * 1e3:7.1f}, "
                f"CPU time median {cpu[len(cpu) // 2] * 1e3:7.1f} ms/step  "
                f"{args.requests / median:7.1f} tok/s  ({views} layer caches are strided views)"
            )
            del llm
    return 0


def attention_only(args) -> int:
    import torch

    from serverless_llm.engine.kernels import cpu_native
    from serverless_llm.engine.kv_cache import allocate_kv_cache, layer_view
    from serverless_llm.engine.layers.attention import (
        AttentionMetadata,
        AttentionSpec,
        NativeCpuBackend,
        TorchAttentionBackend,
    )

    n, ctx, bs = args.requests, args.context, 16
    per = -(-ctx // bs)
    g = torch.Generator().manual_seed(0)
    wide = allocate_kv_cache(1, n * per + 1, bs, 1, 128, torch.float32, torch.device("cpu"), True)[
        0
    ]
    wide.copy_(torch.randn(wide.shape, generator=g))
    view = layer_view(wide, 1, 64)
    tables = (torch.arange(n * per, dtype=torch.int32) + 1).view(n, per)
    lens = [ctx - (i * 7) % 32 for i in range(n)]
    slots = [int(tables[i, (x - 1) // bs]) * bs + (x - 1) % bs for i, x in enumerate(lens)]

    def meta():
        return AttentionMetadata(
            query_start_loc=torch.arange(n + 1, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            context_lens=torch.tensor([x - 1 for x in lens], dtype=torch.int32),
            block_tables=tables,
            slot_mapping=torch.tensor(slots),
            num_decodes=n,
            max_query_len=1,
            max_seq_len=max(lens),
            query_lens_host=[1] * n,
            seq_lens_host=lens,
            block_size=bs,
        )

    kernels = cpu_native.load()
    backends = {"torch": TorchAttentionBackend()}
    if kernels is not None:
        backends["native"] = NativeCpuBackend(kernels)
    layers = {
        "sliding (view)": (AttentionSpec(8, 1, 64, 0.125, sliding_window=64), view),
        "global": (AttentionSpec(8, 1, 128, 0.0884), wide),
    }
    print(
        f"# one layer's decode attention, {n} decodes x {ctx} keys, Gemma 4 shape; "
        f"{cpu_model_name()}, {torch.get_num_threads()} threads"
    )
    for name in args.backends.split(","):
        backend = backends.get(name)
        if backend is None:
            print(f"{name}: not available here (the native kernels did not load)")
            continue
        for layer, (spec, cache) in layers.items():
            d = spec.head_dim
            q = torch.randn(n, 8, d, generator=g)
            k, v = torch.randn(n, 1, d, generator=g), torch.randn(n, 1, d, generator=g)
            times, cpu = [], []
            for r in range(args.repeats + 3):
                m = meta()
                t0, c0 = time.perf_counter(), time.process_time()
                backend.prepare(m)
                backend.forward(q, k, v, cache, m, spec)
                if r >= 3:  # warm-up
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
            times.sort()
            cpu.sort()
            print(
                f"{name:7s} {layer:15s} median {times[len(times) // 2] * 1e3:7.2f} ms, best "
                f"{times[0] * 1e3:7.2f} ms, CPU time median {cpu[len(cpu) // 2] * 1e3:7.2f} ms"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

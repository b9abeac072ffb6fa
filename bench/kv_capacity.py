"""KV capacity: how many 8k-token requests run at once in a fixed KV budget, with sliding-window
layers in cache groups of their own (after) and with every layer keeping every token (before).

The models are described from their transformers configs (Gemma 3 1B's shape: 26 layers, five
local to one global, window 512, 1 KV head of 256; Mistral 7B v0.1's: 32 layers, window 4096,
8 KV heads of 128), so the layer kinds, groups and bytes per block are the engine's own
(`describe_model`, `plan_cache_groups`, `bytes_per_block`). No weight is loaded and no forward
runs: what limits how many requests run at once is the cache, and that is the engine's
scheduler and KV cache manager, driven here step by step as the engine drives them (schedule,
then `Scheduler.update` with one token for each request whose grant reached its end). So the
figure is measured in seconds on any machine, and is the same on a GPU.

For each model and mode: the blocks the budget holds, the blocks one 8k request holds once it
decodes, the most requests decoding at once (after a step that preempted nobody), and the
preemptions on the way. Prints a table and a final `SUMMARY` line with the ratios.

    .venv/bin/python bench/kv_capacity.py                    # 16 GiB bf16 budget, 8192 tokens
    .venv/bin/python bench/kv_capacity.py --budget-gib 4 --tokens 4096 --json out.json
    .venv/bin/python bench/kv_capacity.py --engine     # the same count, the engine stepping

`--engine` cross-checks the simulation with the engine itself: dummy-weight models of the same
layer pattern, KV heads and head size (narrowed to hidden 64 so they step on a CPU), requests of
2,048 tokens with the window scaled alike (Gemma 3: 128, Mistral: 1,024).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers  # noqa: E402

from serverless_llm.engine.kv_cache import BlockPool, bytes_per_block  # noqa: E402
from serverless_llm.engine.kv_cache_manager import (  # noqa: E402
    FullAttentionSpec,
    KVCacheManager,
    SlidingWindowSpec,
    layer_cache_specs,
    plan_cache_groups,
)
from serverless_llm.engine.models import describe_model  # noqa: E402
from serverless_llm.engine.request import Request  # noqa: E402
from serverless_llm.engine.sampling.params import SamplingParams  # noqa: E402
from serverless_llm.engine.scheduler import Sampled, Scheduler  # noqa: E402
from serverless_llm.engine.stop_rule import StopRule  # noqa: E402


def _no_text(req, tok, lp, stop):
    """The output side of a token, with nothing to output: the stop rule's verdict stands."""
    return "", stop


def gemma3_1b() -> transformers.PretrainedConfig:
    return transformers.Gemma3TextConfig(
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=512,
        sliding_window_pattern=6,
        max_position_embeddings=32768,
        query_pre_attn_scalar=256,
        architectures=["Gemma3ForCausalLM"],
    )


def mistral_7b() -> transformers.PretrainedConfig:
    return transformers.MistralConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        sliding_window=4096,
        max_position_embeddings=32768,
        architectures=["MistralForCausalLM"],
    )


MODELS = {"gemma3-1b": gemma3_1b, "mistral-7b": mistral_7b}


def run(config, grouped: bool, budget_bytes: int, tokens: int, new_tokens: int, args) -> dict:
    spec = describe_model(config)
    max_len = args.max_model_len
    specs = layer_cache_specs(spec.windows or (None,) * spec.num_layers, max_len)
    if not grouped:  # before: every layer keeps every token
        specs = [FullAttentionSpec()] * len(specs)
    layout = plan_cache_groups(specs)
    per_block = bytes_per_block(
        layout.layers_per_page, args.block_size, spec.num_kv_heads, spec.head_dim, torch.bfloat16
    )
    num_blocks = budget_bytes // per_block
    kv = KVCacheManager(BlockPool(num_blocks, enable_prefix_caching=False), layout, args.block_size)
    sched = Scheduler(kv, args.block_size, args.max_num_seqs, args.step_tokens)
    rng = random.Random(0)
    prompt_len = tokens - new_tokens
    requests = []
    for i in range(args.requests):
        prompt = [rng.randrange(spec.vocab_size) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        req = Request(f"r{i}", prompt, params, tokens)
        req.stop_rule = StopRule.of(params, (), new_tokens)
        requests.append(req)
        sched.add(req)
    most = 0
    held_decoding = 0
    steps = 0
    while sched.has_unfinished:
        batch = sched.schedule()
        if not batch.requests:
            raise RuntimeError("no progress: one request does not fit the budget")
        steps += 1
        # A request whose grant reaches its last token samples one (token 1), as in the engine.
        sampled = [
            Sampled(req, [1])
            for req, n in zip(batch.requests, batch.num_new_tokens)
            if req.num_computed_tokens + n == req.num_tokens
        ]
        sched.update(batch, sampled, _no_text)
        if not batch.preempted:
            decoding = [r for r in sched.running if r.num_computed_tokens >= prompt_len]
            if len(decoding) > most:
                most = len(decoding)
                held_decoding = max(kv.num_held(r) for r in decoding)
        if args.check:
            kv.check()
    assert kv.pool.num_free == num_blocks, "blocks leaked"
    return {
        "groups": layout.describe(),
        "num_blocks": num_blocks,
        "block_bytes": per_block,
        "blocks_per_request": held_decoding,
        "bytes_per_request": held_decoding * per_block,
        "running_at_once": most,
        "preemptions": sched.num_preemptions,
        "steps": steps,
    }


def engine_run(name: str, grouped: bool, args, num_requests: int | None = None) -> dict:
    """The same count through the engine itself, stepping on this machine: a dummy-weight model
    with the shape's layers, KV heads, head size and layer kinds, narrowed (hidden 64) so it
    runs on a CPU, with requests of --engine-tokens and the window scaled by the same factor
    (so window : request is the model's). The KV budget holds 4.5 full-length requests with
    every layer keeping every token (float32 cache). `num_requests`: None sizes the load at
    twice what the grouped cache holds."""
    import tempfile

    from bench.common import default_model_dir
    from serverless_llm import LLM
    from serverless_llm.engine.sampling.params import SamplingParams as Params

    tokens = args.engine_tokens
    new_tokens = max(1, tokens // 8)
    tok = transformers.AutoTokenizer.from_pretrained(default_model_dir())
    config = MODELS[name]()
    config.sliding_window = max(args.block_size, config.sliding_window * tokens // 8192)
    config.hidden_size, config.intermediate_size = 64, 128
    config.num_attention_heads = config.num_key_value_heads * max(
        1, 4 // config.num_key_value_heads
    )
    config.vocab_size = len(tok)
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    budget_gib = 4.5 * per_token * tokens / 2**30
    with tempfile.TemporaryDirectory() as d:
        config.save_pretrained(d)
        tok.save_pretrained(d)
        llm = LLM(
            d,
            load_format="dummy",
            dtype="float32",
            block_size=args.block_size,
            kv_cache_space_gib=budget_gib,
            max_model_len=tokens,
            max_num_batched_tokens=args.engine_step_tokens,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=False,
            disable_hybrid_kv_cache_manager=not grouped,
        )
        eng = llm.engine
        bs = args.block_size
        if num_requests is None:
            per_request = sum(
                -(-g.spec.window // bs) + 1
                if isinstance(g.spec, SlidingWindowSpec)
                else -(-tokens // bs)
                for g in eng.cache_layout.groups
            )
            num_requests = 2 * (eng.block_pool.num_blocks // per_request) + 2
        rng = random.Random(0)
        prompt_len = tokens - new_tokens
        params = Params(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
        for _ in range(num_requests):
            eng.add_request([rng.randrange(5, len(tok)) for _ in range(prompt_len)], params)
        most = steps = 0
        while eng.has_unfinished_requests():
            before = eng.scheduler.num_preemptions
            eng.step()
            steps += 1
            if eng.scheduler.num_preemptions == before:
                running = eng.scheduler.running
                most = max(most, sum(r.num_computed_tokens >= prompt_len for r in running))
        pool = eng.block_pool
        assert pool.num_free == pool.num_blocks, "blocks leaked"
        return {
            "model": name,
            "mode": "after" if grouped else "before",
            "groups": eng.cache_layout.describe(),
            "num_blocks": pool.num_blocks,
            "requests": num_requests,
            "running_at_once": most,
            "preemptions": eng.scheduler.num_preemptions,
            "steps": steps,
            "tokens": tokens,
            "window": config.sliding_window,
            "budget_gib": budget_gib,
        }


def engine_main(args) -> int:
    rows, summary = [], []
    for name in args.models.split(","):
        after = engine_run(name, True, args)
        before = engine_run(name, False, args, after["requests"])
        rows += [before, after]
        ratio = after["running_at_once"] / max(1, before["running_at_once"])
        summary.append(f"{name} {ratio:.2f}x")
    print(
        f"The engine, dummy weights, {args.engine_tokens}-token requests, float32 cache holding "
        "4.5 full-length requests without groups"
    )
    print(
        f"{'model':<11} {'mode':<7} {'window':>7} {'blocks':>8} {'requests':>9} {'at once':>8} "
        f"{'preempt':>8}  groups"
    )
    for r in rows:
        print(
            f"{r['model']:<11} {r['mode']:<7} {r['window']:>7} {r['num_blocks']:>8} "
            f"{r['requests']:>9} {r['running_at_once']:>8} {r['preemptions']:>8}  {r['groups']}"
        )
    print("SUMMARY engine requests at once, after / before: " + ", ".join(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--budget-gib", type=float, default=16.0, help="KV budget (bf16 cache)")
    p.add_argument("--tokens", type=int, default=8192, help="each request's prompt + output")
    p.add_argument(
        "--new-tokens",
        type=int,
        default=1024,
        help="each request's output: long enough that requests pile up in decode (one prefill a step)",
    )
    p.add_argument("--requests", type=int, default=0, help="0: enough to fill the budget 2x")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--step-tokens", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--check", action="store_true", help="check the manager's books every step")
    p.add_argument(
        "--engine",
        action="store_true",
        help="count through the engine itself (dummy weights, narrowed width; slower)",
    )
    p.add_argument("--engine-tokens", type=int, default=2048, help="--engine's request length")
    p.add_argument("--engine-step-tokens", type=int, default=2048)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.engine:
        return engine_main(args)
    budget = int(args.budget_gib * (1 << 30))
    rows, summary = [], []
    for name in args.models.split(","):
        config = MODELS[name]()
        results = {}
        for mode, grouped in (("before", False), ("after", True)):
            if not args.requests:
                # Enough requests to fill the budget twice at the grouped size (estimated).
                probe = run(config, grouped, budget, args.tokens, args.new_tokens, _one(args))
                fit = probe["num_blocks"] // max(1, probe["blocks_per_request"])
                n = max(4, 2 * fit)
            else:
                n = args.requests
            res = run(config, grouped, budget, args.tokens, args.new_tokens, _with(args, n))
            res.update(model=name, mode=mode, requests=n)
            results[mode] = res
            rows.append(res)
        ratio = results["after"]["running_at_once"] / max(1, results["before"]["running_at_once"])
        summary.append(f"{name} {ratio:.2f}x")
        results["after"]["ratio"] = ratio
    head = (
        f"{'model':<11} {'mode':<7} {'blocks':>8} {'KiB/blk':>8} {'blk/req':>8} "
        f"{'MiB/req':>8} {'at once':>8} {'preempt':>8}  groups"
    )
    print(
        f"KV budget {args.budget_gib:g} GiB bf16, {args.tokens}-token requests "
        f"({args.new_tokens} generated), block {args.block_size}, "
        f"step budget {args.step_tokens} tokens"
    )
    print(head)
    for r in rows:
        print(
            f"{r['model']:<11} {r['mode']:<7} {r['num_blocks']:>8} {r['block_bytes'] / 1024:>8.0f} "
            f"{r['blocks_per_request']:>8} {r['bytes_per_request'] / 2**20:>8.1f} "
            f"{r['running_at_once']:>8} {r['preemptions']:>8}  {r['groups']}"
        )
    print("SUMMARY requests at once, after / before: " + ", ".join(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _one(args):
    return _with(args, 1)


def _with(args, n):
    out = argparse.Namespace(**vars(args))
    out.requests = n
    return out


if __name__ == "__main__":
    raise SystemExit(main())

"""Speculative decoding (issue 40): one greedy request's tokens/s on the embedded SmolLM2-135M
(float32) without speculation, with SPECULATIVE_CONFIG's ngram proposer, and with a draft model
made from SmolLM2's own first --draft-layers layers plus its final norm and head (built offline
from the target's weights into a temporary directory), on a task whose answer copies from the
prompt (repeat a given passage) and on a free-form chat prompt.

The engines live in one process and take turns, best of --rounds; each round times the whole
generate call of --tokens tokens (EOS ignored), prefill included, so the numbers are per
request, end to end. Also prints each proposer's acceptance (accepted / drafted, and the mean
tokens a verification step yields), whether its tokens equal plain decoding's (they must:
greedy speculation is lossless), the CPU flags and the machine's load by others during the run.

    .venv/bin/python bench/speculative.py                       # 128 tokens, 3 rounds, k=4
    .venv/bin/python bench/speculative.py --tokens 256 --rounds 5 --k 4 --draft-k 3
    .venv/bin/python bench/speculative.py --methods draft_model --draft-layers 6
    .venv/bin/python bench/speculative.py --methods ngram --temperature 0.7 --seed 1

With --temperature the request samples (rejection sampling verifies the drafts); with --seed
too its tokens must still equal plain decoding's (a seeded request keeps its draws).
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
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PASSAGE = (
    "The lighthouse keeper kept a logbook of every ship that passed the point. Each morning he "
    "climbed the spiral stairs, wiped the salt from the great lens, and wrote down the wind, "
    "the height of the swell and the colour of the sky. In the afternoons he mended nets for "
    "the fishermen of the village below, who paid him in bread, apples and news from the "
    "town. When storms came in from the west he stayed awake all night beside the lamp, "
    "trimming the wick and listening to the waves break against the rocks. Over forty years "
    "he never once let the light go out, and the logbooks, stacked in a cupboard by the door, "
    "filled three shelves from floor to ceiling. When he finally retired, the harbour master "
    "asked him what he would miss most. He thought about it for a long while, turning his cap "
    "in his hands, and then said that it was not the light, nor the sea, nor even the quiet of "
    "the long nights, but the moment just before dawn when the first boats left the harbour and "
    "their crews, seeing the lamp still burning above them, raised a hand to the tower. He had "
    "never been able to see their faces from so high up, he admitted, but he had always waved "
    "back. The new keeper was a young woman from the town who had studied engineering and "
    "brought with her a radio, a barometer that printed its own readings, and a cat named "
    "Admiral. She kept the logbooks going all the same, in a neater hand, and every spring she "
    "carried a copy of the year's entries down the hill to the old man's cottage, where they "
    "read them together over tea and argued about the weather."
)
TASKS = {
    "copy": "Repeat the following passage exactly, word for word:\n\n" + PASSAGE,
    "chat": "Write a short story about a cat who learns to play the piano.",
}


def prompt_ids(tok, text: str) -> list[int]:
    chat = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(tok.encode(chat, add_special_tokens=False))


def layer_list(spec: str, total: int) -> list[int]:
    """--draft-layers: "6" (the first 6 layers) or explicit layers and ranges ("0-4,29")."""
    if spec.isdigit():
        chosen = list(range(int(spec)))
    else:
        chosen = []
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            chosen.extend(range(int(lo), int(hi or lo) + 1))
    if not chosen or sorted(set(chosen)) != chosen or chosen[-1] >= total:
        raise SystemExit(f"--draft-layers {spec!r}: increasing layers of the target's {total}")
    return chosen


def truncated_checkpoint(src: str, dst: str, layers: str) -> str:
    """A draft checkpoint in `dst`: the model in `src` (a safetensors directory) cut to the
    decoder layers `layers` names (renumbered in order), its embeddings, final norm and head
    kept, its tokenizer files copied. Offline: the target's own weights."""
    import shutil

    from safetensors.torch import save_file

    from serverless_llm.engine.config import EngineConfig
    from serverless_llm.engine.loader import resolve_model
    from serverless_llm.engine.loader.weights import iter_weights

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    chosen = layer_list(layers, config["num_hidden_layers"])
    renumber = {old: new for new, old in enumerate(chosen)}
    config["num_hidden_layers"] = len(chosen)
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    kept = {}
    resolved = resolve_model(EngineConfig(model=src, show_progress=False))
    for name, tensor in iter_weights(resolved, show_progress=False):
        parts = name.split(".")
        if "layers" in parts:
            at = parts.index("layers") + 1
            index = int(parts[at])
            if index not in renumber:
                continue
            parts[at] = str(renumber[index])
        kept[".".join(parts)] = tensor.contiguous()
    save_file(kept, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="ngram's num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--draft-k", type=int, default=3, help="draft_model's num_speculative_tokens")
    ap.add_argument(
        "--draft-layers",
        default="6",
        help='the draft\'s layers of the target: "6" (the first 6) or a list ("0-4,29")',
    )
    ap.add_argument("--methods", default="ngram,draft_model", help="comma-separated")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--seed", type=int, default=None, help="the request's sampling seed")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()

    from bench.common import (
        _machine_busy_seconds,
        _own_cpu_seconds,
        default_model_dir,
        load_average,
        machine_info,
        measure_read_bandwidth,
        model_cost,
    )
    from serverless_llm import LLM, SamplingParams

    methods = [m for m in args.methods.split(",") if m]
    configs = {}
    tmp = tempfile.TemporaryDirectory(prefix="spec-draft-")
    if "ngram" in methods:
        configs["ngram"] = {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min,
        }
    if "draft_model" in methods:
        t0 = time.perf_counter()
        path = truncated_checkpoint(default_model_dir(), tmp.name, args.draft_layers)
        print(
            f"draft: SmolLM2's layers {args.draft_layers} + its norm and head in {path} "
            f"({time.perf_counter() - t0:.1f}s)",
            flush=True,
        )
        configs["draft_model"] = {
            "method": "draft_model",
            "model": path,
            "num_speculative_tokens": args.draft_k,
        }
    info = machine_info()
    print(
        f"cpu: {info['cpu']}, {info['cores']} cores, torch threads {info['torch_threads']}; "
        f"flags: {' '.join(info['flags'])}",
        flush=True,
    )
    kw = dict(dtype="float32", max_model_len=2048, kv_cache_space_gib=0.5)
    engines = {"plain": LLM(None, **kw)}
    for name, config in configs.items():
        engines[name] = LLM(None, speculative_config=config, **kw)
    tok = engines["plain"].get_tokenizer()
    # The memory ceiling of one request's plain decode: every weight read once a token, at the
    # machine's read bandwidth (measured here, between the engines' loads and the timed runs).
    weight_bytes = model_cost(engines["plain"].engine.hf_config).weight_bytes_per_token
    read_bw = measure_read_bandwidth()
    ceiling = read_bw / weight_bytes
    print(
        f"memory ceiling: {weight_bytes / 2**20:.0f} MiB of float32 weights a token at "
        f"{read_bw / 1e9:.1f} GB/s read = {ceiling:.1f} tok/s",
        flush=True,
    )
    params = SamplingParams(
        temperature=args.temperature, seed=args.seed, max_tokens=args.tokens, ignore_eos=True
    )
    results = {}
    busy0, own0, wall0 = _machine_busy_seconds(), _own_cpu_seconds(), time.perf_counter()
    for task, text in TASKS.items():
        ids = prompt_ids(tok, text)
        best = {name: float("inf") for name in engines}
        outs = {}
        counts = {}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                before = llm.engine.stats()
                t0 = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
                best[name] = min(best[name], time.perf_counter() - t0)
                outs[name] = list(out.token_ids)
                after = llm.engine.stats()
                counts[name] = (
                    after.spec_drafts - before.spec_drafts,
                    after.spec_draft_tokens - before.spec_draft_tokens,
                    after.spec_accepted_tokens - before.spec_accepted_tokens,
                )
        tps = {name: args.tokens / t for name, t in best.items()}
        r = results[task] = {
            "prompt_tokens": len(ids),
            "tokens": args.tokens,
            "plain_tok_s": round(tps["plain"], 2),
            "plain_over_ceiling": round(tps["plain"] / ceiling, 2),
        }
        line = (
            f"{task}: prompt {len(ids)} tokens, {args.tokens} generated: plain "
            f"{r['plain_tok_s']} tok/s ({r['plain_over_ceiling']}x the memory ceiling)"
        )
        for name in configs:
            steps, drafted, accepted = counts[name]
            r[name] = {
                "tok_s": round(tps[name], 2),
                "speedup": round(tps[name] / tps["plain"], 2),
                "over_ceiling": round(tps[name] / ceiling, 2),
                "drafted": drafted,
                "accepted": accepted,
                "acceptance": round(accepted / drafted, 3) if drafted else None,
                "tokens_per_verify_step": round((accepted + steps) / steps, 2) if steps else None,
                "identical": outs["plain"] == outs[name],
            }
            m = r[name]
            k = configs[name]["num_speculative_tokens"]
            line += (
                f"; {name} k={k} {m['tok_s']} tok/s ({m['speedup']}x, "
                f"{m['over_ceiling']}x the ceiling), accepted "
                f"{accepted}/{drafted} ({m['acceptance']}), {m['tokens_per_verify_step']} tokens "
                f"a verifying step, identical {m['identical']}"
            )
        print(line, flush=True)
    wall = time.perf_counter() - wall0
    busy1, own1 = _machine_busy_seconds(), _own_cpu_seconds()
    others = None
    if busy0 is not None and busy1 is not None:
        others = round(max(0.0, (busy1 - busy0) - (own1 - own0)) / wall, 2)
    print(
        f"machine: load average {load_average()}, others' CPU during the run {others} cores "
        f"of {info['cores']} (a shared machine)",
        flush=True,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "configs": configs,
                    "results": results,
                    "machine": info,
                    "others_cores": others,
                    "read_bandwidth": read_bw,
                    "weight_bytes_per_token": weight_bytes,
                    "ceiling_tok_s": ceiling,
                },
                f,
                indent=2,
            )
    tmp.cleanup()


if __name__ == "__main__":
    main()

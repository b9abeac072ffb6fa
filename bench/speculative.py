"""Speculative decoding, ngram (issue 40, first slice): one greedy request's tokens/s on the
embedded SmolLM2 (float32) with and without SPECULATIVE_CONFIG's ngram proposer, on a task
whose answer copies from the prompt (repeat a given passage) and on a free-form chat prompt.

Both engines live in one process and take turns, best of --rounds; each round times the whole
generate call of --tokens tokens (EOS ignored), prefill included, so the numbers are per
request, end to end. Also prints the acceptance (accepted / drafted) and whether the two
engines' tokens agree (they must: greedy speculation is lossless).

    .venv/bin/python bench/speculative.py                       # 128 tokens, 3 rounds
    .venv/bin/python bench/speculative.py --tokens 256 --rounds 5 --k 4
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PASSAGE = (
    "The lighthouse keeper kept a logbook of every ship that passed the point. Each morning he "
    "climbed the spiral stairs, wiped the salt from the great lens, and wrote down the wind, "
    "the height of the swell and the colour of the sky. In the afternoons he mended nets for "
    "the fishermen of the village below, who paid him in bread, apples and news from the "
    "town. When storms came in from the west he stayed awake all night beside the lamp, "
    "trimming the wick and listening to the waves break against the rocks. Over forty years "
    "he never once let the light go out, and the logbooks, stacked in a cupboard by the door, "
    "filled three shelves from floor to ceiling."
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()

    from serverless_llm import LLM, SamplingParams

    spec_config = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": args.lookup_max,
        "prompt_lookup_min": args.lookup_min,
    }
    kw = dict(dtype="float32", max_model_len=2048)
    engines = {"plain": LLM(None, **kw), "ngram": LLM(None, speculative_config=spec_config, **kw)}
    tok = engines["plain"].get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    results = {}
    for task, text in TASKS.items():
        ids = prompt_ids(tok, text)
        best = {name: float("inf") for name in engines}
        outs = {}
        accepted = drafted = 0
        for _ in range(args.rounds):
            for name, llm in engines.items():
                before = llm.engine.stats()
                t0 = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
                best[name] = min(best[name], time.perf_counter() - t0)
                outs[name] = list(out.token_ids)
                after = llm.engine.stats()
                if name == "ngram":
                    drafted = after.spec_draft_tokens - before.spec_draft_tokens
                    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
        tps = {name: args.tokens / t for name, t in best.items()}
        results[task] = {
            "prompt_tokens": len(ids),
            "tokens": args.tokens,
            "plain_tok_s": round(tps["plain"], 2),
            "ngram_tok_s": round(tps["ngram"], 2),
            "speedup": round(tps["ngram"] / tps["plain"], 2),
            "drafted": drafted,
            "accepted": accepted,
            "identical": outs["plain"] == outs["ngram"],
        }
        r = results[task]
        print(
            f"{task}: prompt {r['prompt_tokens']} tokens, {args.tokens} generated: plain "
            f"{r['plain_tok_s']} tok/s, ngram k={args.k} {r['ngram_tok_s']} tok/s "
            f"({r['speedup']}x); accepted {accepted}/{drafted} drafts; identical "
            f"{r['identical']}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": spec_config, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()

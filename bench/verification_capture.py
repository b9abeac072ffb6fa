"""Captured verification steps on models with recurrent layers against eager ones (issue 40's
"CUDA graphs for the verification step", engine/decode_capture.py's verification graphs): per
hybrid shape (bench/families.py's, dummy weights, ~100M parameters), two engines on the same
device, model and prompts with speculation (k = 3, the backoff off): one with `enforce_eager`,
one capturing (CUDA graphs on a GPU; on CPU the eager-replay twin, expected to gain nothing).
Each generates greedy tokens for 1 and for 4 requests whose prompts repeat a motif, alternating
rounds, best of `--rounds`; the tokens of both must be the same. Dummy weights do not copy
their prompt, so prompt lookup would rarely propose: by default (`--drafts oracle`) the drafts
are the tokens a first plain run gave, one spoiled in every third verification of a request
(runs kept whole, cut and rejected, each cut one followed by the kept tokens computed again);
`--drafts ngram` uses prompt lookup itself.

    python bench/verification_capture.py --device cuda --dtype bfloat16
    python bench/verification_capture.py --tiny          # CPU smoke size, the twin

Prints the device, per shape and batch the tokens/s of both engines, how many verification
steps replayed a graph in the timed rounds, and a last SUMMARY line with captured / eager per
shape and batch.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import cpu_flags, cpu_model_name, default_model_dir, format_table  # noqa: E402

SHAPES = ("qwen3_next", "jamba", "lfm2")
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": None,
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--drafts", choices=("oracle", "ngram"), default="oracle")
    p.add_argument("--tiny", action="store_true", help="smoke size: tiny shapes, few tokens")
    return p.parse_args(argv)


def prompts_of(vocab: int, n: int) -> list[list[int]]:
    rng = random.Random(n)
    out = []
    for _ in range(n):
        motif = [rng.randrange(5, vocab) for _ in range(rng.randint(6, 12))]
        out.append(motif * 8)
    return out


def oracle(llm, prompts: list[list[int]], full: list[list[int]]) -> None:
    """`llm` proposes the tokens of `full` (plain decoding's), one spoiled in every third
    verification of a request."""
    known = {tuple(p): out for p, out in zip(prompts, full)}
    engine = llm.engine
    turns: dict[int, int] = {}

    def propose(req, room):
        k = engine.draft_room(req, room)
        n = len(req.output_token_ids)
        drafts = list(known[tuple(req.prompt_token_ids)][n : n + k])
        turn = turns[id(req)] = turns.get(id(req), 0) + 1
        if drafts and turn % 3 == 0:
            bad = (turn // 3) % len(drafts)
            drafts[bad] = (drafts[bad] + 1) % engine.vocab_size
        return drafts

    engine.scheduler.propose = propose


def main(argv=None) -> int:
    args = parse_args(argv)
    from bench.families import build_model, family_configs
    from serverless_llm import LLM, SamplingParams
    from serverless_llm.engine import speculative
    from serverless_llm.engine.tokenizer import load_tokenizer

    speculative.BACKOFF_RATE = 0.0  # verify whatever prompt lookup proposes
    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = "cuda" if on_cuda else "cpu"
    if args.tiny:
        args.max_tokens, args.rounds = 16, 1
    if on_cuda:
        print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    else:
        print(f"device: {cpu_model_name()}, flags {' '.join(cpu_flags()) or 'none'}")
    tok_dir = default_model_dir()
    configs = family_configs(load_tokenizer(tok_dir), args.tiny)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    rows, summary = [], []
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as root:
        for shape in args.shapes.split(","):
            path = os.path.join(root, shape)
            build_model(configs[shape], tok_dir, path)
            kw = dict(device=device, dtype=args.dtype, max_model_len=512, max_num_seqs=16,
                      speculative_config=SPEC)  # fmt: skip
            if not on_cuda:
                kw["num_kv_blocks"] = 256
            engines = {
                "eager": LLM(path, enforce_eager=True, **kw),
                "captured": LLM(path, decode_capture="auto" if on_cuda else "replay", **kw),
            }
            cap = engines["captured"].engine.runner.captured
            if cap is None or not cap.verify_enabled:
                print(f"{shape}: verification capture OFF (see the warnings above)")
            vocab = engines["eager"].engine.vocab_size
            for batch in (1, 4):
                prompts = prompts_of(vocab, batch)
                best, outs = {}, {}
                if args.drafts == "oracle":
                    llm = engines["eager"]
                    propose, llm.engine.scheduler.propose = llm.engine.scheduler.propose, None
                    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
                    llm.engine.scheduler.propose = propose
                    for llm in engines.values():
                        oracle(llm, prompts, plain)
                for llm in engines.values():  # warm-up: kernels compiled, caches touched
                    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
                before = cap.verify_replays if cap is not None else 0
                for _ in range(args.rounds):
                    for name, llm in engines.items():
                        if on_cuda:
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        got = llm.generate(prompts, params)
                        if on_cuda:
                            torch.cuda.synchronize()
                        sec = time.perf_counter() - t0
                        best[name] = min(best.get(name, float("inf")), sec)
                        outs[name] = [o.outputs[0].token_ids for o in got]
                same = outs["eager"] == outs["captured"]
                tokens = batch * args.max_tokens
                ratio = best["eager"] / best["captured"]
                replays = cap.verify_replays - before if cap is not None else 0
                rows.append([shape, batch, f"{tokens / best['eager']:.1f}",
                             f"{tokens / best['captured']:.1f}", f"{ratio:.2f}", replays,
                             "yes" if same else "NO"])  # fmt: skip
                summary.append(f"{shape}/{batch}={ratio:.2f}")
    headers = ["shape", "requests", "eager tok/s", "captured tok/s", "ratio", "verify replays"]
    print(format_table(headers + ["same tokens"], rows))
    what = f"{args.drafts} drafts, k=3, {args.dtype}"
    print(f"SUMMARY captured / eager ({what}): {' '.join(summary)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

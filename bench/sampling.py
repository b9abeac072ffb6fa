"""Sampling cost: what the sampler adds to a decode step, with every sampling parameter on.

A batch of B different chat prompts decodes on this engine; in the same steps the model forward
(`ModelRunner.execute`: inputs, model, LM head) and the sampling (`SamplingBatch.build` plus the
`Sampler`: processors, penalties, truncation, draw, logprobs) are timed separately. Each
configuration runs the same prompts, in several rounds that take turns (so a burst of load from
elsewhere hits every configuration alike); each time is the fastest step seen, the one least
disturbed by other processes:

- greedy: the baseline (an argmax);
- temperature + top_p: the common case;
- all parameters: penalties, logit_bias, allowed_token_ids, min_tokens, stop strings, seed,
  temperature, top_k, top_p, top_a, min_p, tfs, eta, epsilon, typical_p, smoothing;
- all parameters but top_k: the first cut is then top_p, which needs the full normaliser;
- all parameters + logprobs (top 5).

Prints one table and a final `SUMMARY` line with the two bars of issue 5: sampling with
every parameter <= 10% of the decode step's forward, logprobs (top 5) <= 5% more. Exits non-zero
only on errors, never on a missed bar.

    .venv/bin/python bench/sampling.py                    # SmolLM2-135M, batch 64
    .venv/bin/python bench/sampling.py --tiny --model DIR --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    chat_prompt_ids,
    default_model_dir,
    format_table,
    load_average,
    machine_info,
    set_threads,
)

BAR_ALL_PARAMS = 0.10  # sampling / forward, every parameter on
BAR_LOGPROBS = 0.05  # extra sampling cost of top-5 logprobs, relative to the forward


def all_params(vocab_size: int, top_k: bool = True, logprobs: int | None = None) -> dict:
    """Every sampling parameter switched on, at values people use."""
    params: dict[str, Any] = dict(
        temperature=0.8,
        top_p=0.95,
        min_p=0.05,
        top_a=0.1,
        tfs=0.97,
        eta_cutoff=3.0,
        epsilon_cutoff=3.0,
        typical_p=0.97,
        smoothing_factor=0.3,
        smoothing_curve=1.5,
        presence_penalty=0.3,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        logit_bias={11: 2.0, 13: -2.0, 198: 1.0, 30: -5.0},
        # A large allowed set: its cost grows with the set (the lowest ids: the common merges).
        allowed_token_ids=list(range(min(8192, vocab_size))),
        min_tokens=4,
        stop=["<<END>>", "\n\n\n\n"],
        seed=1234,
    )
    if top_k:
        params["top_k"] = 50
    if logprobs is not None:
        params["logprobs"] = logprobs
    return params


@dataclass
class Timings:
    forward: list[float]
    sampling: list[float]
    step: list[float]

    def extend(self, other: Timings) -> None:
        self.forward += other.forward
        self.sampling += other.sampling
        self.step += other.step

    def best(self) -> tuple[float, float, float]:
        return min(self.forward), min(self.sampling), min(self.step)


def instrument(engine) -> dict[str, list[float]]:
    """Wraps the runner, the batch build and the sampler of `engine` with timers."""
    import serverless_llm.engine.llm_engine as engine_module

    record: dict[str, list[float]] = {"forward": [], "build": [], "sampler": []}
    execute = engine.runner.execute
    sampler = engine.sampler
    batch_cls = engine_module.SamplingBatch

    def timed_execute(batch):
        t0 = time.perf_counter()
        out = execute(batch)
        record["forward"].append(time.perf_counter() - t0)
        return out

    class TimedSampler:
        def __call__(self, logits, batch):
            t0 = time.perf_counter()
            out = sampler(logits, batch)
            record["sampler"].append(time.perf_counter() - t0)
            return out

    class TimedBatch:
        @staticmethod
        def build(*args, **kwargs):
            t0 = time.perf_counter()
            out = batch_cls.build(*args, **kwargs)
            record["build"].append(time.perf_counter() - t0)
            return out

    engine.runner.execute = timed_execute
    engine.sampler = TimedSampler()
    engine_module.SamplingBatch = TimedBatch
    return record


def run_config(llm, prompts: list[list[int]], params: dict, steps: int) -> Timings:
    """Prefills the batch, then times `steps` decode steps (every request in every step)."""
    from serverless_llm import SamplingParams

    engine = llm.engine
    sp = SamplingParams(max_tokens=steps + 8, ignore_eos=True, **params)
    reqs = [engine.add_request(p, sp) for p in prompts]
    while any(not r.output_token_ids for r in reqs):
        engine.step()
    record = engine._bench_record
    for key in record:
        record[key].clear()
    step_times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)
    alive = sum(not r.finished for r in reqs)
    for r in reqs:
        engine.abort_request(r.request_id)
    if alive != len(reqs):
        raise RuntimeError(f"only {alive} of {len(reqs)} requests ran every measured step")
    sampling = [b + s for b, s in zip(record["build"], record["sampler"])]
    return Timings(list(record["forward"]), sampling, step_times)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: embedded SmolLM2)")
    p.add_argument("--batch", type=int, default=64, help="requests decoding together")
    p.add_argument("--steps", type=int, default=8, help="measured decode steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds over all configurations")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--tiny", action="store_true", help="CI smoke size: batch 4, 3 steps")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny:
        args.batch, args.steps, args.rounds, args.max_model_len = 4, 3, 1, 256
    threads = set_threads(args.threads)
    from serverless_llm import LLM

    model = args.model or default_model_dir()
    llm = LLM(model, max_model_len=args.max_model_len, max_num_seqs=max(args.batch, 1), seed=0)
    engine = llm.engine
    engine._bench_record = instrument(engine)
    vocab = engine.vocab_size
    prompts = chat_prompt_ids(engine.tokenizer, args.batch)
    configs = [
        ("greedy", dict(temperature=0.0)),
        ("temperature + top_p", dict(temperature=0.8, top_p=0.95)),
        ("all parameters", all_params(vocab)),
        ("all parameters, no top_k", all_params(vocab, top_k=False)),
        ("all parameters + logprobs 5", all_params(vocab, logprobs=5)),
    ]
    run_config(
        llm, chat_prompt_ids(engine.tokenizer, args.batch, lead="Warm-up. "), configs[2][1], 2
    )

    timings = {name: Timings([], [], []) for name, _ in configs}
    for _ in range(args.rounds):
        for name, params in configs:
            timings[name].extend(run_config(llm, prompts, params, args.steps))
    results: dict[str, dict[str, float]] = {}
    rows = []
    for name, _ in configs:
        forward, sampling, step = timings[name].best()
        results[name] = {
            "forward_ms": forward * 1e3,
            "sampling_ms": sampling * 1e3,
            "step_ms": step * 1e3,
            "sampling_vs_forward": sampling / forward,
            "forward_median_ms": statistics.median(timings[name].forward) * 1e3,
            "sampling_median_ms": statistics.median(timings[name].sampling) * 1e3,
        }
        rows.append([name, forward * 1e3, sampling * 1e3, step * 1e3, 100 * sampling / forward])
    print(
        format_table(
            ["configuration", "forward ms", "sampling ms", "whole step ms", "sampling % of fwd"],
            rows,
        )
    )
    print(f"(fastest of {args.rounds} x {args.steps} decode steps each; batch {args.batch})")
    every = results["all parameters"]
    with_lp = results["all parameters + logprobs 5"]
    extra = (with_lp["sampling_ms"] - every["sampling_ms"]) / every["forward_ms"]
    ok_all = every["sampling_vs_forward"] <= BAR_ALL_PARAMS
    ok_lp = extra <= BAR_LOGPROBS
    report = {
        "model": model,
        "batch": args.batch,
        "steps": args.steps,
        "rounds": args.rounds,
        "threads": threads,
        "machine": machine_info(),
        "load_average": load_average(),
        "configs": results,
        "all_params_sampling_vs_forward": every["sampling_vs_forward"],
        "logprobs_extra_vs_forward": extra,
        "bars_met": {"all_params": ok_all, "logprobs": ok_lp},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print(
        f"SUMMARY batch={args.batch} all_params_sampling={100 * every['sampling_vs_forward']:.1f}% "
        f"of forward (bar {100 * BAR_ALL_PARAMS:.0f}%: {'met' if ok_all else 'MISSED'}) "
        f"logprobs_top5_extra={100 * extra:.1f}% (bar {100 * BAR_LOGPROBS:.0f}%: "
        f"{'met' if ok_lp else 'MISSED'}) threads={threads} torch={torch.__version__}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

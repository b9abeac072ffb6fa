"""Throughput: this engine against transformers on the same prompts, in one run.

N different chat prompts, M new tokens each (greedy, EOS ignored), measured in one process:

- this engine, all N prompts at once through the offline `LLM.generate` (end to end, prefill
  included), and one request alone (decode tokens/s);
- transformers `generate`, one request at a time, and one request alone (decode tokens/s);
- transformers `generate_batch`, its own continuous batching (page size 16, warmed up);
- the machine: float32 matmul FLOP/s and copy bandwidth, turned into tokens/s ceilings with the
  model's cost per token (from its config).

Prints one table, the ratios against the bars of issue 2 and a final `SUMMARY` line. Exits
non-zero only on errors (including unequal work between systems), never on a missed bar.

    .venv/bin/python bench/throughput.py                 # SmolLM2-135M, 32 x 64 tokens
    .venv/bin/python bench/throughput.py --tiny --model DIR --json out.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    BusyProcesses,
    CpuCompetition,
    ModelCost,
    best_of,
    chat_prompt_ids,
    cpu_count,
    default_model_dir,
    format_table,
    load_average,
    machine_info,
    measure_clean,
    measure_matmul_flops,
    measure_memory_bandwidth,
    measure_onednn_matmul_flops,
    model_cost,
    set_threads,
)

# The bars: engine vs generate_batch and one request's decode vs generate (issue 13 raised
# issue 2's 2.5x and 1.3x to these), vs generate one at a time (issue 2), one request's decode
# against the memory ceiling and, with a busy process per core beside it, against its idle
# rate (issue 13).
BAR_VS_GENERATE_BATCH = 3.0
BAR_VS_GENERATE = 10.0
BAR_SINGLE_DECODE = 1.5
BAR_SINGLE_MEMORY_SHARE = 0.6
BAR_CONTENDED_DECODE = round(1 / 3, 3)
PAGE_SIZE = 16  # the engine's block size, and transformers' page size for generate_batch
BATCH_TOKENS = 2048  # tokens per step for both schedulers (the engine's CPU default)


T = TypeVar("T")


class BenchError(RuntimeError):
    """The comparison is not valid (a system failed or did different work)."""


@dataclass
class SystemResult:
    name: str
    requests: int
    output_tokens: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)
    other_cores: float | None = None  # cores other processes kept busy meanwhile

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


@dataclass
class SingleResult:
    """One request alone: prefill + 1 token, then prefill + M tokens; decode = the difference."""

    seconds_first: float
    seconds_full: float
    max_tokens: int
    other_cores: float | None = None
    contended: SingleResult | None = None  # the same with busy processes competing

    @property
    def decode_tokens_per_s(self) -> float | None:
        """None when the difference is lost in timing noise (tiny models)."""
        decode = self.seconds_full - self.seconds_first
        return (self.max_tokens - 1) / decode if decode > 0 else None


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def check_lengths(name: str, outputs: list[list[int]], num_prompts: int, max_tokens: int) -> None:
    if len(outputs) != num_prompts:
        raise BenchError(f"{name}: {len(outputs)} results for {num_prompts} prompts")
    short = [i for i, ids in enumerate(outputs) if len(ids) != max_tokens]
    if short:
        lengths = sorted({len(outputs[i]) for i in short})
        raise BenchError(
            f"{name}: prompts {short[:8]} got {lengths} tokens, not {max_tokens}: unequal work"
        )


@dataclass
class Settings:
    """How each measurement is taken (the same for every system)."""

    max_tokens: int
    repeats: int  # best-of for the one-request timings
    retries: int  # re-measure when other processes disturbed a timing
    settle: float  # seconds to wait for a quiet machine before each timing (0: do not wait)
    tensor_parallel_size: int = 1  # the engine's (docs/parallel.md)

    def measure(self, timed: Callable[[], T], prepare: Callable[[], None] | None = None):
        return measure_clean(
            timed, prepare=prepare, retries=self.retries, settle=self.settle, log=log
        )


# -- this engine ------------------------------------------------------------------------------


def engine_llm(model_dir: str, max_model_len: int, num_blocks: int, tensor_parallel_size: int = 1):
    """The engine as the benchmarks compare it (bench/endpoint.py's offline figure too): float32,
    block size PAGE_SIZE, BATCH_TOKENS a step, `num_blocks` KV blocks."""
    from serverless_llm import LLM

    return LLM(
        model_dir,
        dtype="float32",
        max_model_len=max_model_len,
        block_size=PAGE_SIZE,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=BATCH_TOKENS,
        tensor_parallel_size=tensor_parallel_size,
    )


def run_engine(
    model_dir: str,
    prompts: list[list[int]],
    warmup_prompts: list[list[int]],
    max_model_len: int,
    num_blocks: int,
    s: Settings,
) -> tuple[SystemResult, SingleResult, list[list[int]]]:
    from serverless_llm import SamplingParams

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)

    n, m = len(prompts), s.max_tokens
    llm = engine_llm(model_dir, max_model_len, num_blocks, s.tensor_parallel_size)
    pool = llm.engine.block_pool

    def prepare() -> None:
        # Every attempt starts alike: no prefix cached but what the warm-up leaves (the template's
        # system prompt, which the measured prompts also share among themselves).
        reset = getattr(pool, "reset_prefix_cache", None)
        if reset is not None:
            reset()
        log("engine: warm-up")
        llm.generate(warmup_prompts, params(min(8, m)))

    def timed() -> tuple[float, list, int, int]:
        log(f"engine: {n} prompts x {m} tokens, all at once")
        hits, queries = getattr(pool, "hits", 0), getattr(pool, "queries", 0)
        t0 = time.perf_counter()
        results = llm.generate(prompts, params(m))
        seconds = time.perf_counter() - t0
        return (
            seconds,
            results,
            getattr(pool, "hits", 0) - hits,
            getattr(pool, "queries", 0) - queries,
        )

    run = s.measure(timed, prepare)
    seconds, results, hits, queries = run.value
    outputs = [r.outputs[0].token_ids for r in results]
    check_lengths("engine", outputs, n, m)
    extra = {
        "prompt_tokens": sum(map(len, prompts)),
        "prefix_cache_block_hits": hits,
        "prefix_cache_block_queries": queries,
        "attempts": run.attempts,
    }
    batch = SystemResult("engine", n, sum(map(len, outputs)), seconds, extra, run.other_cores)

    def timed_single() -> tuple[float, float, list]:
        log("engine: one request alone")
        t_first, _ = best_of(lambda: llm.generate([prompts[0]], params(1)), s.repeats)
        t_full, out = best_of(lambda: llm.generate([prompts[0]], params(m)), s.repeats)
        return t_first, t_full, out

    run1 = s.measure(timed_single)
    t_first, t_full, out = run1.value
    check_lengths("engine single", [out[0].outputs[0].token_ids], 1, m)
    single = SingleResult(t_first, t_full, m, run1.other_cores)

    # The same request with one busy process per core beside it (issue 13: a shared CPU must
    # cost its share, not collapse the rate). Not retried for quiet: the load is the point.
    log(f"engine: one request alone, {cpu_count()} busy processes competing")
    with BusyProcesses(cpu_count()), CpuCompetition() as competition:
        time.sleep(1.0)  # the competitors are running and the engine has seen them
        t_first, _ = best_of(lambda: llm.generate([prompts[0]], params(1)), s.repeats)
        t_full, out = best_of(lambda: llm.generate([prompts[0]], params(m)), s.repeats)
    check_lengths("engine single, contended", [out[0].outputs[0].token_ids], 1, m)
    single.contended = SingleResult(t_first, t_full, m, competition.other_cores)
    return batch, single, outputs


# -- transformers -----------------------------------------------------------------------------


def load_hf_model(model_dir: str):
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def hf_generation_config(model, max_new_tokens: int):
    """Greedy, exactly `max_new_tokens`: EOS is an id no token has (min_new_tokens would mask
    the real EOS instead, and a None eos_token_id is filled back in from the model defaults)."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = [model.config.vocab_size + 1]
    config.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    config.max_new_tokens = max_new_tokens
    config.min_new_tokens = None
    config.do_sample = False
    config.temperature = None
    config.top_p = None
    config.top_k = None
    return config


def run_hf_generate(
    model, prompts: list[list[int]], warmup_prompts: list[list[int]], s: Settings
) -> tuple[SystemResult, SingleResult, list[list[int]]]:
    def generate(ids: list[int], n: int) -> list[int]:
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                generation_config=hf_generation_config(model, n),
            )
        return out[0, len(ids) :].tolist()

    n, m = len(prompts), s.max_tokens
    log("transformers generate: warm-up")
    generate(warmup_prompts[0], min(8, m))

    def timed() -> tuple[float, list[list[int]]]:
        log(f"transformers generate: {n} prompts x {m} tokens, one at a time")
        t0 = time.perf_counter()
        outputs = [generate(p, m) for p in prompts]
        return time.perf_counter() - t0, outputs

    run = s.measure(timed)
    seconds, outputs = run.value
    check_lengths("transformers generate", outputs, n, m)
    extra = {"attempts": run.attempts}
    batch = SystemResult("generate", n, sum(map(len, outputs)), seconds, extra, run.other_cores)

    def timed_single() -> tuple[float, float]:
        log("transformers generate: one request alone")
        t_first, _ = best_of(lambda: generate(prompts[0], 1), s.repeats)
        t_full, _ = best_of(lambda: generate(prompts[0], m), s.repeats)
        return t_first, t_full

    run1 = s.measure(timed_single)
    return batch, SingleResult(*run1.value, m, run1.other_cores), outputs


def run_hf_generate_batch(
    model,
    prompts: list[list[int]],
    warmup_prompts: list[list[int]],
    num_blocks: int,
    s: Settings,
) -> tuple[SystemResult, list[list[int]]]:
    """transformers' continuous batching, steady state: a first call on other prompts builds
    and warms a persistent manager (KV cache, attention switch), the timed call reuses it.

    The cache and the step budget are the engine's: left to itself, generate_batch sizes both
    from free RAM on CPU (here ~90k cached tokens and 8,192 tokens a step), and preallocates an
    attention mask of step tokens x (cache + step tokens): gigabytes, ~50 s to set up."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # The persistent-manager warning and per-request errors go to this logger; errors are
    # caught below from the results themselves.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    # eos_token_id=-1 is generate_batch's "no EOS"; None would be filled in from the model.
    gen_config = GenerationConfig(
        max_new_tokens=s.max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=pad
    )
    cb_config = ContinuousBatchingConfig(
        page_size=PAGE_SIZE, num_blocks=num_blocks, max_batch_tokens=BATCH_TOKENS
    )

    def generate(inputs: list[list[int]], n: int) -> list:
        results = model.generate_batch(
            inputs=inputs,
            generation_config=gen_config,
            continuous_batching_config=cb_config,
            persistent_manager=True,
            max_new_tokens=n,
        )
        failed = [r.request_id for r in results.values() if r.error is not None]
        if failed:  # generate_batch logs failures and returns what it has; it never raises
            raise BenchError(f"transformers generate_batch: requests {failed[:8]} failed")
        return list(results.values())

    n, m = len(prompts), s.max_tokens
    state: dict[str, Any] = {}

    def prepare() -> None:
        # A fresh manager each attempt (its block sharing would otherwise hit the prompts of the
        # attempt before). It sizes its batch from the first call's request count: warm up with
        # as many prompts, fewer tokens (the generated-length hint only sizes the CUDA flash
        # decode path).
        model.destroy_cached_continuous_batching_manager()
        log("transformers generate_batch: warm-up (builds the persistent manager)")
        t0 = time.perf_counter()
        generate(warmup_prompts, min(8, m))
        state["warmup_s"] = time.perf_counter() - t0

    def timed() -> tuple[float, list]:
        log(f"transformers generate_batch: {n} prompts x {m} tokens")
        t0 = time.perf_counter()
        results = generate(prompts, m)
        return time.perf_counter() - t0, results

    try:
        run = s.measure(timed, prepare)
        manager = getattr(model, "_cached_continuous_batching_manager", None)
        resolved = manager.continuous_batching_config if manager is not None else None
    finally:
        model.destroy_cached_continuous_batching_manager()
    seconds, results = run.value
    outputs = [list(r.generated_tokens) for r in results]
    check_lengths("transformers generate_batch", outputs, n, m)
    # Inside the call: first request started to last finished (excludes start/stop of the loop).
    span = max(r.lifespan[1] for r in results) - min(r.lifespan[0] for r in results)
    extra: dict[str, Any] = {
        "warmup_s": state["warmup_s"],
        "in_loop_s": span,
        "attempts": run.attempts,
    }
    if resolved is not None:
        extra["max_requests_per_batch"] = resolved.max_requests_per_batch
        extra["max_batch_tokens"] = resolved.max_batch_tokens
        extra["num_blocks"] = resolved.num_blocks
        extra["page_size"] = resolved.page_size
    result = SystemResult(
        "generate_batch", n, sum(map(len, outputs)), seconds, extra, run.other_cores
    )
    return result, outputs


# -- report -----------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt_x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def fmt_share(value: float | None, ceiling: float, what: str) -> str:
    share = ratio(value, ceiling)
    return "-" if share is None else f"{100 * share:.1f}% {what}"


def fmt_rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}tok/s"


def build_report(
    args: argparse.Namespace,
    model_dir: str,
    cost: ModelCost,
    flops: float,
    bandwidth: float,
    engine: SystemResult,
    engine_single: SingleResult,
    hf: SystemResult | None,
    hf_single: SingleResult | None,
    cb: SystemResult | None,
    matches: dict[str, int | None],
) -> dict[str, Any]:
    compute_ceiling = flops / cost.flops_per_token
    memory_ceiling = bandwidth / cost.weight_bytes_per_token
    prompt_tokens = engine.extra["prompt_tokens"]
    contended = engine_single.contended
    return {
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "prompt_tokens": prompt_tokens,
        "model": model_dir,
        "model_cost": cost.as_dict(),
        "matmul_flops": flops,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "compute_ceiling_tokens_per_s": compute_ceiling,
        "memory_ceiling_single_tokens_per_s": memory_ceiling,
        "engine": {
            "seconds": engine.seconds,
            "output_tokens_per_s": engine.tokens_per_s,
            "all_tokens_per_s": (engine.output_tokens + prompt_tokens) / engine.seconds,
            "share_of_compute_ceiling": engine.tokens_per_s / compute_ceiling,
            "share_of_compute_ceiling_with_prefill": (engine.output_tokens + prompt_tokens)
            / engine.seconds
            / compute_ceiling,
            "single_first_token_s": engine_single.seconds_first,
            "single_full_s": engine_single.seconds_full,
            "single_decode_tokens_per_s": engine_single.decode_tokens_per_s,
            "single_share_of_memory_ceiling": ratio(
                engine_single.decode_tokens_per_s, memory_ceiling
            ),
            "other_cores": engine.other_cores,
            "single_other_cores": engine_single.other_cores,
            "single_decode_contended_tokens_per_s": contended and contended.decode_tokens_per_s,
            "single_contended_other_cores": contended and contended.other_cores,
            **engine.extra,
        },
        "generate": None
        if hf is None
        else {
            "seconds": hf.seconds,
            "output_tokens_per_s": hf.tokens_per_s,
            "single_first_token_s": hf_single.seconds_first,
            "single_full_s": hf_single.seconds_full,
            "single_decode_tokens_per_s": hf_single.decode_tokens_per_s,
            "other_cores": hf.other_cores,
            "single_other_cores": hf_single.other_cores,
            **hf.extra,
        },
        "generate_batch": None
        if cb is None
        else {
            "seconds": cb.seconds,
            "output_tokens_per_s": cb.tokens_per_s,
            "other_cores": cb.other_cores,
            **cb.extra,
        },
        "ratios": {
            "engine_vs_generate_batch": ratio(engine.tokens_per_s, cb and cb.tokens_per_s),
            "engine_vs_generate": ratio(engine.tokens_per_s, hf and hf.tokens_per_s),
            "engine_single_decode_vs_generate": ratio(
                engine_single.decode_tokens_per_s, hf_single and hf_single.decode_tokens_per_s
            ),
            "engine_single_decode_contended_vs_idle": ratio(
                contended and contended.decode_tokens_per_s, engine_single.decode_tokens_per_s
            ),
            "engine_single_decode_memory_share": ratio(
                engine_single.decode_tokens_per_s, memory_ceiling
            ),
        },
        "bars": {
            "engine_vs_generate_batch": BAR_VS_GENERATE_BATCH,
            "engine_vs_generate": BAR_VS_GENERATE,
            "engine_single_decode_vs_generate": BAR_SINGLE_DECODE,
            "engine_single_decode_contended_vs_idle": BAR_CONTENDED_DECODE,
            "engine_single_decode_memory_share": BAR_SINGLE_MEMORY_SHARE,
        },
        "greedy_matches": matches,
    }


def print_report(report: dict[str, Any]) -> None:
    n, m = report["num_prompts"], report["max_tokens"]
    e, hf, cb = report["engine"], report["generate"], report["generate_batch"]
    compute = report["compute_ceiling_tokens_per_s"]
    memory = report["memory_ceiling_single_tokens_per_s"]
    rows: list[list[Any]] = [
        [
            "engine (LLM.generate, all at once)",
            f"{n} x {m}",
            e["seconds"],
            e["output_tokens_per_s"],
            fmt_share(e["output_tokens_per_s"], compute, "compute"),
            e["other_cores"],
        ]
    ]
    if cb is not None:
        rows.append(
            [
                "transformers generate_batch (page 16)",
                f"{n} x {m}",
                cb["seconds"],
                cb["output_tokens_per_s"],
                fmt_share(cb["output_tokens_per_s"], compute, "compute"),
                cb["other_cores"],
            ]
        )
    if hf is not None:
        rows.append(
            [
                "transformers generate, one at a time",
                f"{n} x {m}",
                hf["seconds"],
                hf["output_tokens_per_s"],
                fmt_share(hf["output_tokens_per_s"], compute, "compute"),
                hf["other_cores"],
            ]
        )
    rows.append(
        [
            "engine, 1 request (decode)",
            f"1 x {m}",
            e["single_full_s"],
            e["single_decode_tokens_per_s"],
            fmt_share(e["single_decode_tokens_per_s"], memory, "memory"),
            e["single_other_cores"],
        ]
    )
    if e.get("single_decode_contended_tokens_per_s") is not None:
        rows.append(
            [
                "engine, 1 request (decode), busy cores",
                f"1 x {m}",
                None,
                e["single_decode_contended_tokens_per_s"],
                fmt_share(e["single_decode_contended_tokens_per_s"], memory, "memory"),
                e["single_contended_other_cores"],
            ]
        )
    if hf is not None:
        rows.append(
            [
                "transformers generate, 1 request (decode)",
                f"1 x {m}",
                hf["single_full_s"],
                hf["single_decode_tokens_per_s"],
                fmt_share(hf["single_decode_tokens_per_s"], memory, "memory"),
                hf["single_other_cores"],
            ]
        )
    rows.append(
        [
            f"ceiling: matmul {report['matmul_flops'] / 1e9:.1f} GFLOP/s "
            f"/ {report['model_cost']['flops_per_token'] / 1e6:.3g} MFLOP per token",
            "compute",
            None,
            compute,
            "100%",
            None,
        ]
    )
    rows.append(
        [
            f"ceiling: copy {report['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
            f"/ {report['model_cost']['weight_bytes_per_token'] / 1e6:.3g} MB weights",
            "1 request",
            None,
            memory,
            "100%",
            None,
        ]
    )
    print()
    headers = ["system", "work", "time s", "output tok/s", "of ceiling", "others' cores"]
    print(format_table(headers, rows))
    print()
    print(
        f"engine end to end (prefill of {report['prompt_tokens']} prompt tokens included): "
        f"{e['seconds']:.2f} s; prompt + output tokens/s {e['all_tokens_per_s']:.1f} = "
        f"{100 * e['share_of_compute_ceiling_with_prefill']:.1f}% of the compute ceiling"
    )
    if cb is not None and "in_loop_s" in cb:
        print(
            f"generate_batch: {cb['in_loop_s']:.2f} s from first request start to last finish "
            f"inside the timed call; first call with manager set-up {cb['warmup_s']:.1f} s"
        )
    print(
        "others' cores: cores other processes kept busy during that timing (near 0: clean; "
        "a disturbed timing is repeated, see --retries and --settle)"
    )
    print()
    ratios, bars = report["ratios"], report["bars"]
    labels = {
        "engine_vs_generate_batch": "engine vs generate_batch",
        "engine_vs_generate": "engine vs generate one at a time",
        "engine_single_decode_vs_generate": "engine 1-request decode vs generate",
        "engine_single_decode_contended_vs_idle": "engine 1-request decode, contended vs idle",
        "engine_single_decode_memory_share": "engine 1-request decode / memory ceiling",
    }
    for key, label in labels.items():
        value, bar = ratios[key], bars[key]
        verdict = "n/a" if value is None else ("meets" if value >= bar else "MISSES")
        print(f"{label:40s} {fmt_x(value):>8s}  (bar >= {bar}x: {verdict})")
    matches = report["greedy_matches"]
    if matches.get("engine_vs_generate") is not None:
        print(
            f"greedy sequences equal to transformers generate: engine "
            f"{matches['engine_vs_generate']}/{report['num_prompts']}, generate_batch "
            f"{matches['generate_batch_vs_generate']}/{report['num_prompts']} (informational)"
        )
    print()
    parts = [
        f"engine={e['output_tokens_per_s']:.1f}tok/s",
        f"generate_batch={fmt_rate(cb and cb['output_tokens_per_s'])}",
        f"generate={fmt_rate(hf and hf['output_tokens_per_s'])}",
        f"ratio_batch={fmt_x(ratios['engine_vs_generate_batch'])}",
        f"ratio_generate={fmt_x(ratios['engine_vs_generate'])}",
        f"single_decode={fmt_rate(e['single_decode_tokens_per_s'])}",
        f"ratio_single={fmt_x(ratios['engine_single_decode_vs_generate'])}",
        f"contended={fmt_x(ratios['engine_single_decode_contended_vs_idle'])}",
        f"ceiling={compute:.0f}tok/s",
        f"share={100 * e['share_of_compute_ceiling']:.1f}%",
    ]
    print("SUMMARY " + " ".join(parts), flush=True)


# -- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=None, help="concurrent prompts (32)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per prompt (64)")
    p.add_argument(
        "--model", default=None, help="safetensors model directory (default: embedded SmolLM2)"
    )
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--tiny", action="store_true", help="CI smoke size: 4 prompts x 8 tokens")
    p.add_argument("--repeats", type=int, default=None, help="best-of for one-request timings (3)")
    p.add_argument(
        "--retries",
        type=int,
        default=None,
        help="measure again, up to this many times, when other processes kept 0.1 cores or "
        "more busy during a timing; the least disturbed attempt counts (2; --tiny: 0)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each timing, wait up to this long for the machine to go quiet (0)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="the engine's ranks (bench/tensor_parallel.py compares sizes on one model)",
    )
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results here")
    args = p.parse_args(argv)
    args.num_prompts = args.num_prompts or (4 if args.tiny else 32)
    args.max_tokens = args.max_tokens or (8 if args.tiny else 64)
    args.repeats = args.repeats or (1 if args.tiny else 3)
    if args.retries is None:
        args.retries = 0 if args.tiny else 2
    if args.num_prompts < 1 or args.max_tokens < 2:
        p.error("--num-prompts must be >= 1 and --max-tokens >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = set_threads()
    load_before = load_average()
    log(f"{threads} torch threads; load average {load_before}")

    model_dir = args.model or default_model_dir()
    import transformers

    from serverless_llm.engine.tokenizer import load_tokenizer

    # The engine's own tokenizer and chat template: every system gets these exact token ids.
    tokenizer = load_tokenizer(model_dir)
    prompts = chat_prompt_ids(tokenizer, args.num_prompts)
    warmup_prompts = chat_prompt_ids(tokenizer, args.num_prompts, lead="Warm-up. ")
    hf_config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    cost = model_cost(hf_config)
    limit = getattr(hf_config, "max_position_embeddings", None) or 4096
    need = max(map(len, prompts + warmup_prompts)) + args.max_tokens
    if need > limit:
        raise BenchError(f"prompt + {args.max_tokens} tokens = {need} > the model's {limit}")
    max_model_len = min(limit, -(-need // PAGE_SIZE) * PAGE_SIZE)
    # KV blocks for every sequence at full length at once (no preemption), same for both engines.
    num_blocks = len(prompts) * (-(-need // PAGE_SIZE)) + 8

    whole_run = CpuCompetition().__enter__()
    settings = Settings(
        args.max_tokens, args.repeats, args.retries, args.settle, args.tensor_parallel_size
    )
    machine = [settings.measure(lambda: measure_machine(args.tiny)).value]
    engine, engine_single, engine_out = run_engine(
        model_dir, prompts, warmup_prompts, max_model_len, num_blocks, settings
    )
    gc.collect()  # the engine and its KV cache are gone before transformers loads
    hf = hf_single = cb = None
    matches: dict[str, int | None] = {
        "engine_vs_generate": None,
        "generate_batch_vs_generate": None,
    }
    if not args.skip_hf:
        model = load_hf_model(model_dir)
        hf, hf_single, hf_out = run_hf_generate(model, prompts, warmup_prompts, settings)
        cb, cb_out = run_hf_generate_batch(model, prompts, warmup_prompts, num_blocks, settings)
        matches["engine_vs_generate"] = sum(a == b for a, b in zip(engine_out, hf_out))
        matches["generate_batch_vs_generate"] = sum(a == b for a, b in zip(cb_out, hf_out))
        del model
        gc.collect()

    # The machine again at the end; each ceiling is the best of both, so neither a busy moment
    # nor MKL's slow path on AMD lowers it.
    machine.append(settings.measure(lambda: measure_machine(args.tiny)).value)
    matmul_best = {
        k: max((m[k] for m in machine if m[k] is not None), default=None)
        for k in ("torch.mm", "onednn")
    }
    flops = max(x for x in matmul_best.values() if x is not None)
    bandwidth = max(m["copy"] for m in machine)
    whole_run.__exit__(None, None, None)
    load_after = load_average()
    log(f"load average {load_after}")

    report = build_report(
        args, model_dir, cost, flops, bandwidth, engine, engine_single, hf, hf_single, cb, matches
    )
    report["machine"] = {**machine_info(), "load_before": load_before, "load_after": load_after}
    report["matmul_flops_by_path"] = matmul_best
    report["other_cores_whole_run"] = whole_run.other_cores  # waits for quiet included
    print(
        f"{report['machine']['cpu']}, {threads} cores, flags "
        f"{' '.join(report['machine']['flags']) or '-'}; torch {torch.__version__}; "
        f"load average before {_load(load_before)}, after {_load(load_after)}"
    )
    print(
        "float32 matmul 2048^3: "
        + ", ".join(
            f"{k} {'n/a' if v is None else f'{v / 1e9:.1f} GFLOP/s'}"
            for k, v in matmul_best.items()
        )
        + " (the ceiling uses the best)"
    )
    print(
        f"model {model_dir}: {cost.non_embedding_params / 1e6:.1f}M non-embedding params, "
        f"{cost.lm_head_params / 1e6:.1f}M LM head"
    )
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


def measure_machine(tiny: bool) -> dict[str, float | None]:
    log("machine: matmul FLOP/s and copy bandwidth")
    repeats = 3 if tiny else 5
    return {
        "torch.mm": measure_matmul_flops(2048, repeats=repeats),
        "onednn": measure_onednn_matmul_flops(2048, repeats=repeats),
        "copy": measure_memory_bandwidth((64 if tiny else 256) << 20),
    }


def _load(load: tuple[float, float, float] | None) -> str:
    return "n/a" if load is None else "/".join(f"{x:.2f}" for x in load)


if __name__ == "__main__":
    sys.exit(main())

"""Captured decode steps against eager ones (issue 13 item 2): two engines on the same model,
device and prompts, one with `enforce_eager`, one capturing its decode steps (CUDA graphs on a
GPU; on CPU the eager-replay twin, which is expected to gain nothing), each timed on one
request's decode and on a batch of requests, alternating rounds.

    python bench/capture.py                          # the embedded SmolLM2, float32 on CPU
    python bench/capture.py --device cuda --dtype bfloat16
    python bench/capture.py --model DIR --device cuda --num-prompts 64

Prints the device (or the CPU's flags), the capture time, one row per engine and measurement,
and a last line with captured / eager for each.
"""

from __future__ import annotations

import argparse
import sys
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
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: embedded SmolLM2)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    return p.parse_args(argv)


def build(model: str, args: argparse.Namespace, captured: bool):
    from serverless_llm import LLM

    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    mode = "auto" if on_cuda else "replay"
    return LLM(
        model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.num_prompts, 1),
        num_kv_blocks=None if on_cuda else 1024,  # CPU: 16k tokens, a 1 GiB cache at most
        enforce_eager=not captured,
        decode_capture=mode,
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(llm, prompts, n: int) -> float:
    from serverless_llm import SamplingParams

    params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
    sync(llm.engine.device)
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    sync(llm.engine.device)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    model = args.model or default_model_dir()
    prompts = chat_prompt_ids(AutoTokenizer.from_pretrained(model), args.num_prompts)
    engines = {"eager": build(model, args, False), "captured": build(model, args, True)}
    cap = engines["captured"].engine.runner.captured
    device = engines["eager"].engine.device
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}")
    else:
        print(f"device: {cpu_model_name()}, flags {' '.join(cpu_flags()) or 'none'}")
    if cap is None:
        print("capture: OFF (see the warning above); both engines run eagerly")
    else:
        print(f"capture: {cap.mode}, buckets {cap.sizes}, {cap.capture_seconds:.1f} s")
    m = args.max_tokens
    best: dict[tuple[str, str], float] = {}
    for llm in engines.values():
        timed(llm, prompts[:2], 4)  # warm-up
    for _ in range(args.rounds):
        for name, llm in engines.items():
            one = (timed(llm, prompts[:1], m) - timed(llm, prompts[:1], 1)) / (m - 1)
            batch = timed(llm, prompts, m) / (len(prompts) * m)
            for what, sec in (("1-request decode", one), (f"{len(prompts)} x {m}", batch)):
                best[(name, what)] = min(best.get((name, what), float("inf")), sec)
    print(f"{'engine':10} {'work':18} {'tok/s':>10}")
    for (name, what), sec in best.items():
        print(f"{name:10} {what:18} {1 / sec:10.1f}")
    whats = sorted({w for _, w in best})
    ratios = ", ".join(f"{w} {best[('eager', w)] / best[('captured', w)]:.2f}x" for w in whats)
    print(f"captured vs eager: {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

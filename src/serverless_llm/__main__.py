"""`python -m serverless_llm`: chat with a model offline, streaming the answer to the terminal.

Until the worker's local endpoint exists, this is what the README's first command runs: it
loads the embedded SmolLM2 (or --model) into the engine and answers a few prompts.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from .engine.config import EngineConfig
from .engine.llm_engine import LLMEngine
from .engine.sampling.params import SamplingParams

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serverless_llm", description=__doc__)
    ap.add_argument("prompts", nargs="*", help="user messages (default: two examples)")
    ap.add_argument(
        "--model", default=None, help="hub id, directory or .gguf (default: embedded SmolLM2)"
    )
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    engine = LLMEngine(
        EngineConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len)
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    tok = engine.tokenizer
    for question in args.prompts or DEFAULT_PROMPTS:
        messages = [{"role": "user", "content": question}]
        if tok.chat_template:
            prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            prompt = question
        print(f"\n>>> {question}\n", flush=True)
        engine.add_request(prompt, params)
        t0, n = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                n += len(out.new_token_ids)
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
        dt = time.perf_counter() - t0
        print(f"\n[{n} tokens in {dt:.2f}s, {n / dt:.1f} tokens/s]", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

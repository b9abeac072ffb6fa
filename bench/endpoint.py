"""Worker overhead: 32 concurrent streamed chats through the local endpoint with the official
OpenAI client, against the engine's own offline figure, measured in one run on the same prompts.

The bar (issue 4): the endpoint's aggregate output tokens/s >= 90% of the offline engine's, so
the worker layers (HTTP, SSE, OpenAI shapes, geometric batching, the job plumbing) cost at most
10%. The offline figure comes from `bench/throughput.py`'s engine run with the same settings;
the endpoint runs in a subprocess (`python -m serverless_llm.devserver`) with those settings as
env vars, after the offline engine has been freed, so the two never compete for the cores.

    .venv/bin/python bench/endpoint.py [--num-prompts 32] [--max-tokens 64] [--model DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    QUESTIONS,
    CpuCompetition,
    chat_prompt_ids,
    default_model_dir,
    format_table,
    machine_info,
    set_threads,
)

BAR = 0.90
PAGE_SIZE = 16  # the engine's block size in both runs
BATCH_TOKENS = 2048  # tokens per step in both runs (the engine's CPU default)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def questions(n: int, lead: str = "") -> list[str]:
    """The same user questions `chat_prompt_ids` renders, so both runs see the same tokens."""
    out = []
    for i in range(n):
        q = lead + QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):
            q = f"Question {i + 1}: {q}"
        out.append(q)
    return out


def start_server(model_dir: str, port: int, env_settings: dict[str, str]) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(env_settings)
    env.update({"MODEL_NAME": model_dir, "HF_HUB_OFFLINE": "1"})
    cmd = [sys.executable, "-m", "serverless_llm.devserver", "--port", str(port)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.time() + 300
    import httpx

    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the endpoint exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the endpoint did not come up within 300 s")


async def stream_chats(port: int, model: str, qs: list[str], max_tokens: int) -> tuple[float, int]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/openai/v1", api_key="unused")

    async def one(q: str) -> int:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": q}],
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        tokens = 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(q) for q in qs))
    seconds = time.perf_counter() - t0
    await client.close()
    if any(c != max_tokens for c in counts):
        raise RuntimeError(f"unequal work: completion tokens {counts}")
    return seconds, sum(counts)


def run_offline(
    model_dir: str,
    prompts: list[list[int]],
    warmup: list[list[int]],
    max_tokens: int,
    max_model_len: int,
    num_blocks: int,
) -> float:
    """Seconds for the offline engine to produce max_tokens for every prompt, all at once."""
    from serverless_llm import LLM, SamplingParams

    llm = LLM(
        model_dir,
        dtype="float32",
        max_model_len=max_model_len,
        block_size=PAGE_SIZE,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=BATCH_TOKENS,
    )
    llm.generate(warmup, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    if any(len(o.outputs[0].token_ids) != max_tokens for o in outs):
        raise RuntimeError("the offline engine produced unequal work")
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="model directory (default: embedded SmolLM2)")
    ap.add_argument("--tiny", action="store_true", help="CI smoke size: 4 prompts x 8 tokens")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.tiny:
        args.num_prompts, args.max_tokens = 4, 8
    set_threads()
    model_dir = args.model or default_model_dir()

    from serverless_llm.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    prompts = chat_prompt_ids(tokenizer, args.num_prompts)
    warmup = chat_prompt_ids(tokenizer, args.num_prompts, lead="Warm-up. ")
    need = max(map(len, prompts + warmup)) + args.max_tokens
    max_model_len = -(-need // PAGE_SIZE) * PAGE_SIZE
    num_blocks = len(prompts) * (max_model_len // PAGE_SIZE) + 8

    whole = CpuCompetition().__enter__()
    log("offline engine")
    offline_seconds = run_offline(
        model_dir, prompts, warmup, args.max_tokens, max_model_len, num_blocks
    )
    offline_rate = args.num_prompts * args.max_tokens / offline_seconds
    gc.collect()

    port = free_port()
    settings = {
        "DTYPE": "float32",
        "MAX_MODEL_LEN": str(max_model_len),
        "BLOCK_SIZE": str(PAGE_SIZE),
        "NUM_GPU_BLOCKS_OVERRIDE": str(num_blocks),
        "MAX_NUM_BATCHED_TOKENS": str(BATCH_TOKENS),
        "MAX_CONCURRENCY": str(max(64, args.num_prompts)),
        "DISABLE_LOG_REQUESTS": "1",
        "DISABLE_LOG_STATS": "1",
    }
    log(f"endpoint on port {port}")
    server = start_server(model_dir, port, settings)
    try:
        from openai import OpenAI

        model = OpenAI(
            base_url=f"http://127.0.0.1:{port}/openai/v1", api_key="unused"
        ).models.list()
        model_id = model.data[0].id
        asyncio.run(stream_chats(port, model_id, questions(args.num_prompts, "Warm-up. "), 8))
        log(f"endpoint: {args.num_prompts} streamed chats x {args.max_tokens} tokens")
        with CpuCompetition() as competition:
            seconds, tokens = asyncio.run(
                stream_chats(port, model_id, questions(args.num_prompts), args.max_tokens)
            )
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    whole.__exit__(None, None, None)

    endpoint_rate = tokens / seconds
    ratio = endpoint_rate / offline_rate
    rows = [
        [
            "engine offline (LLM.generate)",
            f"{offline_seconds:.2f}",
            f"{offline_rate:.1f}",
            "1.00",
        ],
        [
            "endpoint, OpenAI client, streamed",
            f"{seconds:.2f}",
            f"{endpoint_rate:.1f}",
            f"{ratio:.2f}",
        ],
    ]
    info = machine_info()
    print(
        f"{info.get('cpu')}, {info.get('cores')} cores; {args.num_prompts} chats x {args.max_tokens} tokens"
    )
    print(format_table(["system", "time s", "output tok/s", "of offline"], rows))
    print(f"others' cores during the endpoint run: {competition.other_cores}")
    verdict = "meets" if ratio >= BAR else "misses"
    print(f"endpoint vs offline engine   {ratio:.2f}  (bar >= {BAR:.2f}: {verdict})")
    print(
        f"SUMMARY offline={offline_rate:.1f}tok/s endpoint={endpoint_rate:.1f}tok/s "
        f"ratio={ratio:.3f}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "offline_tok_s": offline_rate,
                    "endpoint_tok_s": endpoint_rate,
                    "ratio": ratio,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

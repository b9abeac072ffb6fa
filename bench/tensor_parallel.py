"""Tensor parallelism (issue 19): what crosses the wire per decode step, what it should cost on
NVLink and on PCIe, and, with --measure, decode throughput at tensor_parallel_size 1 and N on
one machine with the all-reduces of a decode step counted.

    python bench/tensor_parallel.py                       # the communication table only
    python bench/tensor_parallel.py --measure --tiny      # CPU smoke: a tiny dummy Llama, TP 1 and 2
    python bench/tensor_parallel.py --measure --shape llama-8b --device cuda --dtype bfloat16 --tp 2

The table is arithmetic from the model's shape (no hardware needed): per decode step at batch
B, 2 all-reduces per layer (attention output, MLP output) plus one for the vocab-parallel
embedding, each B x hidden values; rank 0 gathers B x vocab/N logits from each other rank. A
ring all-reduce of S bytes moves 2 (N-1)/N S over each rank's link; its time is modelled as a
fixed latency plus that traffic over the link's bandwidth. Bandwidths are the published
figures (NVLink 4 on H100: 450 GB/s each way; PCIe 4.0 x16: 32 GB/s, about 25 achieved), the
latencies typical NCCL small-message figures (about 10 us over NVLink, 25 us over PCIe).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import chat_prompt_ids, cpu_flags, cpu_model_name, default_model_dir  # noqa: E402

SHAPES = {
    # hidden, layers, heads, kv heads, intermediate, vocab
    "llama-70b": (8192, 80, 64, 8, 28672, 128256),
    "llama-8b": (4096, 32, 32, 8, 14336, 128256),
    "tiny": (256, 4, 8, 4, 512, 49152),
}
LINKS = {  # name: (bandwidth bytes/s each way, latency s)
    "NVLink 4 (H100)": (450e9, 10e-6),
    "PCIe 4.0 x16": (25e9, 25e-6),
}


def comm_per_step(shape: str, batch: int, n: int, elem: int = 2) -> dict:
    hidden, layers, _, _, _, vocab = SHAPES[shape]
    count = 2 * layers + 1
    size = batch * hidden * elem
    per_rank_wire = 2 * (n - 1) / n * size
    gather = (n - 1) * batch * (-(-vocab // n)) * elem  # into rank 0
    return {"count": count, "bytes": size, "wire": per_rank_wire, "gather": gather}


def table(batch: int, sizes: list[int]) -> None:
    print(f"per decode step at batch {batch}, 16-bit activations")
    head = f"{'model':10} {'N':>2} {'all-reduces':>11} {'each':>9} {'total':>10} {'wire/rank':>10}"
    print(head + f" {'logit gather':>13} " + " ".join(f"{k:>16}" for k in LINKS))
    for shape in ("llama-70b", "llama-8b"):
        for n in sizes:
            c = comm_per_step(shape, batch, n)
            costs = []
            for bw, lat in LINKS.values():
                t = c["count"] * (lat + c["wire"] / bw) + c["gather"] / bw
                costs.append(f"{t * 1e3:13.2f} ms")
            print(
                f"{shape:10} {n:>2} {c['count']:>11} {c['bytes'] / 2**20:7.2f}Mi "
                f"{c['count'] * c['bytes'] / 2**20:8.1f}Mi {c['count'] * c['wire'] / 2**20:8.1f}Mi "
                f"{c['gather'] / 2**20:11.2f}Mi " + " ".join(f"{x:>16}" for x in costs)
            )


def shaped_model(shape: str, tokenizer_dir: str | None) -> str:
    """A config of `shape` beside a tokenizer (the embedded model's by default), for
    load_format=dummy."""
    import transformers

    hidden, layers, heads, kvh, inter, vocab = SHAPES[shape]
    path = tempfile.mkdtemp(prefix=f"tp-{shape}-")
    transformers.LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kvh,
        intermediate_size=inter,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(path)
    src = tokenizer_dir or default_model_dir()
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(src, name), path)
    return path


def measure(args) -> None:
    from serverless_llm import LLM, SamplingParams
    from serverless_llm.engine.parallel.group import TensorParallel

    path = shaped_model(args.shape, args.tokenizer)
    from transformers import AutoTokenizer

    prompts = chat_prompt_ids(AutoTokenizer.from_pretrained(path), args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    calls = {"n": 0}
    original = TensorParallel.all_reduce

    def counted(self, x):
        if self.enabled:
            calls["n"] += 1
        return original(self, x)

    TensorParallel.all_reduce = counted
    rates = {}
    try:
        for n in (1, args.tp):
            llm = LLM(
                path,
                load_format="dummy",
                device=args.device,
                dtype=args.dtype,
                tensor_parallel_size=n,
                max_model_len=1024,
                max_num_seqs=max(args.num_prompts, 1),
                num_kv_blocks=None if args.device == "cuda" else 512,
                enforce_eager=True,
            )
            llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
            calls["n"] = 0
            llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))
            prefill_and_decode = calls["n"]  # one prefill step, one decode step
            if llm.engine.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            if llm.engine.device.type == "cuda":
                torch.cuda.synchronize()
            rates[n] = len(prompts) * args.max_tokens / (time.perf_counter() - t0)
            if n > 1:
                print(f"TP {n}: {prefill_and_decode // 2} all-reduces per step counted on rank 0")
            llm.close()
    finally:
        TensorParallel.all_reduce = original
        shutil.rmtree(path, ignore_errors=True)
    print(f"{'tensor_parallel_size':>20} {'tok/s':>10}")
    for n, r in rates.items():
        print(f"{n:>20} {r:10.1f}")
    print(f"SUMMARY TP{args.tp}/TP1 throughput {rates[args.tp] / rates[1]:.2f}x ({args.shape})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64, help="decode batch of the table (64)")
    p.add_argument("--measure", action="store_true", help="also time TP 1 against TP --tp")
    p.add_argument("--tiny", action="store_true", help="CI smoke size: tiny shape, 4 x 8")
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (embedded SmolLM2's)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.num_prompts, args.max_tokens = "tiny", 4, 8
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}")
    else:
        print(f"device: {cpu_model_name()}, flags {' '.join(cpu_flags()) or 'none'}")
    table(args.batch, [2, 4, 8])
    if args.measure:
        measure(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

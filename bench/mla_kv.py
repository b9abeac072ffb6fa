"""Resident KV bytes a token of a DeepSeek-V3-shaped model (issue 37's bar: at most 1/8 of the
same model caching K and V per head, "GQA-equivalent" caching).

The engine loads a dummy-weight (LOAD_FORMAT=dummy) model with DeepSeek-V3's cache-relevant
shape (transformers' DeepseekV3Config defaults: 61 layers, kv_lora_rank 512, qk_rope_head_dim
64, qk_nope_head_dim 128, v_head_dim 128, bfloat16) and DeepSeek-V3's structure (query LoRA,
YaRN, 3 dense layers then MoE layers with grouped routing and a shared expert), narrowed where
the cache does not look (hidden size, heads, query LoRA rank, experts, vocabulary) so it loads
on a CPU. Its figure is the engine's own: `LLMEngine.kv_bytes_per_token`, what the start-up line
prints, with the engine serving a few tokens to show the cache in use.

The GQA-equivalent figure is the same model (DeepSeek-V3's 128 KV heads, num_key_value_heads
in its config) with keys and values cached per head: layers x heads x (qk_head_dim 192 +
v_head_dim 128) x 2 bytes, the least any per-head cache of those K and V can hold. For
reference the table adds an 8-KV-head cache of 128-wide K and V, a common GQA shape of other
models of this size (not this model's heads).

    .venv/bin/python -m bench.mla_kv             # the DeepSeek-V3 shape, 61 layers
    .venv/bin/python -m bench.mla_kv --layers 4  # quick (the per-layer figures are the same)
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path


def v3_config(layers: int, vocab: int):
    """DeepSeek-V3's config with the cache's dimensions as they are and the rest narrowed."""
    import transformers

    full = transformers.DeepseekV3Config()  # DeepSeek-V3's own dimensions
    return full, transformers.DeepseekV3Config(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=64,
        kv_lora_rank=full.kv_lora_rank,
        qk_rope_head_dim=full.qk_rope_head_dim,
        qk_nope_head_dim=full.qk_nope_head_dim,
        v_head_dim=full.v_head_dim,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=min(full.first_k_dense_replace, layers - 1),
        max_position_embeddings=4096,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        architectures=["DeepseekV3ForCausalLM"],
        dtype="bfloat16",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=61, help="decoder layers (V3: 61)")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the "
                        "embedded SmolLM2's)")  # fmt: skip
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)

    import transformers

    from serverless_llm import LLM, SamplingParams

    if args.tokenizer is None:
        from bench.common import default_model_dir

        args.tokenizer = default_model_dir()
    tok = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    full, config = v3_config(args.layers, len(tok))
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Keep(level=logging.INFO)
    log = logging.getLogger("serverless_llm")
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as d:
            config.save_pretrained(d)
            tok.save_pretrained(d)
            llm = LLM(d, load_format="dummy", dtype="bfloat16", max_model_len=1024,
                      kv_cache_space_gib=0.25, enable_prefix_caching=False)  # fmt: skip
            out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))
            served = len(out[0].outputs[0].token_ids)
            engine = llm.engine
            mla_bytes = engine.kv_bytes_per_token
            groups = engine.cache_layout.describe()
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    ready = next((line for line in lines if "engine ready" in line), "")
    elem = 2  # bfloat16
    layers = args.layers
    gqa_same = layers * full.num_key_value_heads * (full.qk_nope_head_dim
                                                    + full.qk_rope_head_dim
                                                    + full.v_head_dim) * elem  # fmt: skip
    gqa_8 = layers * 8 * 2 * 128 * elem
    ratio = mla_bytes / gqa_same
    rows = [
        ("MLA latents (this engine)", mla_bytes, f"{layers} x (512 + 64) x {elem}"),
        ("GQA-equivalent: 128 KV heads", gqa_same, f"{layers} x 128 x (192 + 128) x {elem}"),
        ("for reference: 8 KV heads of 128", gqa_8, f"{layers} x 8 x (128 + 128) x {elem}"),
    ]
    print(f"DeepSeek-V3-shaped dummy model, {layers} layers, bfloat16 cache; cache: {groups}")
    print(f"start-up line: {ready[ready.find('kv_blocks=') :][:120]}")
    print(f"{'cache':<34} {'bytes/token':>12}  {'MLA / this':>10}  how")
    for name, value, how in rows:
        print(f"{name:<34} {value:>12,}  {mla_bytes / value:>10.4f}  {how}")
    bar = ratio <= 1 / 8
    print(
        f"SUMMARY mla_kv_bytes_per_token={mla_bytes} gqa_equivalent={gqa_same} "
        f"ratio=1/{1 / ratio:.1f} bar=1/8 {'PASS' if bar else 'FAIL'} "
        f"(served {served} tokens, {time.perf_counter() - t0:.0f}s)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "layers": layers,
                    "mla_bytes_per_token": mla_bytes,
                    "gqa_equivalent_bytes_per_token": gqa_same,
                    "gqa8_bytes_per_token": gqa_8,
                    "ratio": ratio,
                    "startup_line": ready,
                },
                indent=2,
            )
        )
    return 0 if bar else 1


if __name__ == "__main__":
    raise SystemExit(main())

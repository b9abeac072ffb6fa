"""Families: no model family falls to a slow path. For each family, a dummy-weight model of about
100M parameters in that family's shape (its own transformers config class, its characteristic
options on), N chat prompts x M greedy tokens (EOS ignored): this engine (`LLM.generate`, all at
once) against transformers' `generate_batch` (its continuous batching), each system in its own
process, one family after the other. The ratio engine / generate_batch of each family is then
compared with the Llama shape's ratio in the same run.

Bars (issue 12): every family's ratio >= 0.9 x the Llama shape's, and >= 2x. Hybrid families
(issue 35; recurrent layers beside attention): engine >= 3x transformers, whose generate_batch
refuses them, so their peer is its `generate` on the left-padded batch (see HYBRIDS). Issue 37's
shapes (DeepSeek-V2-Lite, gpt-oss-20b, Gemma 4): engine >= 3x transformers, the padded
`generate` for those its generate_batch cannot run (see PADDED_PEER).

    .venv/bin/python bench/families.py                       # every family, 32 x 64 tokens
    .venv/bin/python bench/families.py --families llama,gemma2,gpt2 --json out.json
    .venv/bin/python bench/families.py --rounds 3            # best of three sweeps
    .venv/bin/python bench/families.py --tiny                # CI smoke size
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    chat_prompt_ids,
    cpu_model_name,
    default_model_dir,
    format_table,
    load_average,
    machine_info,
    set_threads,
)

BAR_VS_LLAMA = 0.9
BAR_VS_GENERATE_BATCH = 2.0

# The shared shape: ~85M parameters in the layers plus the embedding (vocab of the SmolLM2
# tokenizer): hidden 768, 12 layers, 12 heads of 64. Gated MLPs are 2048 wide, plain ones 3072,
# so both cost the same.
DIMS = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12)
TINY_DIMS = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)


def family_configs(tokenizer, tiny: bool) -> dict[str, Any]:
    """name -> a transformers config in that family's shape, its twists on."""
    import transformers as t

    d = TINY_DIMS if tiny else DIMS
    h, n, heads = d["hidden_size"], d["num_hidden_layers"], d["num_attention_heads"]
    gated, plain = (128, 256) if tiny else (2048, 3072)
    kvh = max(1, heads // 3)
    ids = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    llama = dict(
        hidden_size=h,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kvh,
        intermediate_size=gated,
        max_position_embeddings=2048,
        **ids,
    )
    window = 64
    cfgs = {
        "llama": t.LlamaConfig(**llama),
        "mistral": t.MistralConfig(**llama, sliding_window=window),
        "qwen2": t.Qwen2Config(**llama, tie_word_embeddings=True),
        "qwen3": t.Qwen3Config(**llama, head_dim=h // heads),
        "gemma": t.GemmaConfig(**llama, head_dim=h // heads),
        "gemma2": t.Gemma2Config(
            **llama,
            head_dim=h // heads,
            sliding_window=window,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
        "gemma3": t.Gemma3TextConfig(
            **llama, head_dim=h // heads, sliding_window=window, architectures=["Gemma3ForCausalLM"]
        ),
        "phi3": t.Phi3Config(**llama),
        "olmo": t.OlmoConfig(**llama, clip_qkv=8.0),
        "olmo2": t.Olmo2Config(**llama),
        "granite": t.GraniteConfig(
            **llama,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.015625,
            logits_scaling=8.0,
        ),
        "cohere": t.CohereConfig(**llama, use_qk_norm=True),
        # qk_layernorm off: transformers' generate_batch fails on StableLM's per-head norms (the
        # engine's side is tested against transformers' generate in tests/engine).
        "stablelm": t.StableLmConfig(**llama),
        "starcoder2": t.Starcoder2Config(**{**llama, "intermediate_size": plain}),
        "smollm3": t.SmolLM3Config(**llama),
        "glm4": t.Glm4Config(**llama, head_dim=h // heads),
        "exaone4": t.Exaone4Config(**llama, sliding_window=window, sliding_window_pattern=4),
    }
    gpt = dict(n_embd=h, n_layer=n, n_head=heads, n_inner=plain, n_positions=2048, **ids)
    optional = {
        "gpt2": lambda: t.GPT2Config(**gpt),
        "gpt_bigcode": lambda: t.GPTBigCodeConfig(**gpt, multi_query=True),
        "gptj": lambda: t.GPTJConfig(**gpt, rotary_dim=(h // heads) // 2),
        "gpt_neox": lambda: t.GPTNeoXConfig(
            **{**llama, "intermediate_size": plain}, rotary_pct=0.25
        ),
        "opt": lambda: t.OPTConfig(
            hidden_size=h,
            num_hidden_layers=n,
            num_attention_heads=heads,
            ffn_dim=plain,
            max_position_embeddings=2048,
            word_embed_proj_dim=h,
            **ids,
        ),
        "phi": lambda: t.PhiConfig(**{**llama, "intermediate_size": plain}),
        "bloom": lambda: t.BloomConfig(hidden_size=h, n_layer=n, n_head=heads, **ids),
        "mpt": lambda: t.MptConfig(
            d_model=h, n_layers=n, n_heads=heads, max_seq_len=2048, expansion_ratio=4, **ids
        ),
        "falcon": lambda: t.FalconConfig(
            hidden_size=h,
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_kv_heads=kvh,
            new_decoder_architecture=True,
            **ids,
        ),
        # DeepSeek-V2-Lite's shape (issue 37): MLA without a query LoRA (a latent of a quarter
        # of the width, head dims half of V2-Lite's), the first layer dense, then 64 experts, 6
        # a token, 2 shared, group-free softmax routing; the experts made narrow (32) to stay
        # near the other shapes' size (V2-Lite's are 0.7x its width)
        "deepseek_v2_lite": lambda: t.DeepseekV2Config(
            **{**llama, "num_key_value_heads": heads},  # MLA: one latent for every head
            kv_lora_rank=h // 4,
            q_lora_rank=None,
            qk_nope_head_dim=16 if tiny else 64,
            qk_rope_head_dim=8 if tiny else 32,
            v_head_dim=16 if tiny else 64,
            n_routed_experts=8 if tiny else 64,
            num_experts_per_tok=2 if tiny else 6,
            n_shared_experts=2,
            moe_intermediate_size=16 if tiny else 32,
            first_k_dense_replace=1,
            topk_method="greedy",
        ),
        # gpt-oss-20b's shape (issue 37): sink logits, sliding and full layers alternating,
        # every MLP sparse with 32 experts, 4 a token (a router and experts with biases, the
        # clamped SwiGLU), YaRN; the experts made narrow (64) so a layer holds about a dense
        # shape's MLP parameters (gpt-oss-20b's are as wide as the model)
        "gpt_oss": lambda: t.GptOssConfig(
            **{**llama, "intermediate_size": 32 if tiny else 64},
            head_dim=h // heads,
            sliding_window=window,
            num_local_experts=4 if tiny else 32,
            num_experts_per_tok=2 if tiny else 4,
        ),
        "gemma4": lambda: gemma4_config(llama, tiny),
    }
    for name, make in optional.items():
        cfgs[name] = make()
    cfgs.update(hybrid_configs(llama, tiny))
    return cfgs


# The hybrid families (issue 35). transformers' generate_batch refuses their recurrent layer
# types ("Invalid layer type"), so their peer is transformers' `generate` on the whole batch,
# left-padded, with its own torch code for the recurrent layers (its fallbacks when the CUDA
# kernel packages are absent, as on CPU): the best batch transformers serves them with.
HYBRIDS = (
    "lfm2",
    "lfm3",
    "qwen3_next",
    "qwen3_5",
    "olmo_hybrid",
    "granitemoehybrid",
    "bamba",
    "mamba2",
    "jamba",
)
BAR_HYBRID = 3.0
# Shapes that transformers' generate_batch cannot run for another reason, measured as the hybrids
# are (their own cache size, its `generate` on the padded batch, the 3x bar of issue 37):
# MLA (its paged cache holds one head width for keys and values; MLA's keys are wider), Gemma 4
# (the same cache reads one head width for the model, `find_head_dim`, and Gemma 4's config
# refuses to give one: its global layers' heads are wider, AmbiguousGlobalPerLayerAttributeError).
PADDED_PEER = HYBRIDS + ("deepseek_v2_lite", "gemma4")
# Issue 37's shapes that transformers' generate_batch serves: their bar is 3x it.
BAR_3X = ("gpt_oss",)


def gemma4_config(llama: dict, tiny: bool):
    """Gemma 4's shape (issue 37), gemma-4-E2B's text decoder scaled down: four sliding layers to
    one global (E2B's pattern), 8 query heads over one KV head, the global layers' heads twice
    the sliding ones' (E2B: 256 and 512) with their values the raw keys (`attention_k_eq_v`,
    31B's, on here too), the last half of the layers reading the K/V of the last earlier layer
    of their kind (E2B: 20 of 35) with double-wide MLPs, per-layer input embeddings, the
    proportional rope on global layers, a final soft-cap; 10 layers (two periods) so that the
    shared layers' MLPs leave it near the other shapes' size. Tiny: [S, F, S, F], two shared."""
    import transformers as t

    h = llama["hidden_size"]
    ids = {k: llama[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    kinds = ["sliding_attention"] * 4 + ["full_attention"]
    kinds = ["sliding_attention", "full_attention"] if tiny else kinds
    return t.Gemma4TextConfig(
        hidden_size=h,
        num_hidden_layers=2 * len(kinds),
        layer_types=2 * kinds,
        num_attention_heads=4 if tiny else 8,
        num_key_value_heads=1,
        head_dim=16 if tiny else 64,
        global_head_dim=32 if tiny else 128,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=len(kinds),
        use_double_wide_mlp=True,
        intermediate_size=llama["intermediate_size"],
        hidden_size_per_layer_input=8 if tiny else 64,
        vocab_size_per_layer_input=llama["vocab_size"],
        sliding_window=64,
        final_logit_softcapping=30.0,
        max_position_embeddings=llama["max_position_embeddings"],
        architectures=["Gemma4ForCausalLM"],
        **ids,
    )


def hybrid_configs(llama: dict, tiny: bool) -> dict[str, Any]:
    """The hybrid shapes (issue 35): recurrent layers beside attention in each family's usual
    proportion (one attention layer in three or four), at the shared width and depth; recurrent
    heads sized as the released models size them for their width."""
    import transformers as t

    n, heads = llama["num_hidden_layers"], llama["num_attention_heads"]
    h = llama["hidden_size"]
    head_dim = h // heads
    inter = llama["intermediate_size"]
    ids = {k: llama[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}

    def pattern(attn: str, rec: str, every: int) -> list[str]:
        # one layer in `every` attends, ending each period (layer 1 of a tiny 2-layer model)
        return [attn if i % every == every - 1 or (tiny and i == 1) else rec for i in range(n)]

    gdn = dict(
        layer_types=pattern("full_attention", "linear_attention", 4),
        linear_num_key_heads=max(1, heads // 3),
        linear_num_value_heads=max(2, 2 * (heads // 3)),
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
    )
    mamba = dict(
        mamba_n_heads=2 * h // (32 if tiny else 64),
        mamba_d_head=32 if tiny else 64,
        mamba_d_state=16 if tiny else 64,
        mamba_n_groups=1,
        mamba_expand=2,
        mamba_d_conv=4,
    )
    four = pattern("attention", "mamba", 4)
    return {
        # LFM2: one attention layer in three (LFM2-350M's proportion), 3-tap convolutions
        "lfm2": t.Lfm2Config(
            **llama,
            layer_types=pattern("full_attention", "conv", 3),
            block_auto_adjust_ff_dim=False,
        ),
        # LFM3: its default pattern (conv, sliding and full attention), 7-tap convolutions
        "lfm3": t.Lfm3Config(
            **llama,
            head_dim=head_dim,
            sliding_window=64,
            layer_types=["conv", "full_attention"] if tiny else None,
        ),
        # Gated DeltaNet, three to one (Qwen3-Next's and Qwen3.5's proportion); Qwen3-Next with
        # its MoE (8 experts, top 2, a shared expert)
        "qwen3_next": t.Qwen3NextConfig(
            **llama,
            **gdn,
            head_dim=head_dim,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=inter // 2,
            shared_expert_intermediate_size=inter // 2,
        ),
        "qwen3_5": t.Qwen3_5TextConfig(
            **llama, **gdn, head_dim=head_dim, architectures=["Qwen3_5ForCausalLM"]
        ),
        "olmo_hybrid": t.OlmoHybridConfig(**llama, **gdn),
        # Mamba-2, three to one
        "granitemoehybrid": t.GraniteMoeHybridConfig(
            **llama,
            layer_types=four,
            num_local_experts=0,
            shared_intermediate_size=inter,
            **mamba,
        ),
        "bamba": t.BambaConfig(
            **llama,
            attn_layer_indices=[i for i, k in enumerate(four) if k == "attention"],
            **mamba,
        ),
        # Mamba-2 layers alone, no MLP: twice the layers for about the same size
        "mamba2": t.Mamba2Config(
            hidden_size=h,
            num_hidden_layers=2 * n,
            num_heads=mamba["mamba_n_heads"],
            head_dim=mamba["mamba_d_head"],
            state_size=mamba["mamba_d_state"],
            n_groups=1,
            expand=2,
            conv_kernel=4,
            **ids,
        ),
        # Jamba: one attention layer in four, experts every other layer (8, top 2)
        "jamba": t.JambaConfig(
            **llama,
            attn_layer_period=4,
            attn_layer_offset=3 if not tiny else 1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=8,
            num_experts_per_tok=2,
            mamba_d_state=16,
            mamba_expand=2,
        ),
    }


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_model(config, tokenizer_dir: str, path: str, seed: int = 0) -> None:
    """Random weights in the family's shape (the dummy load of both systems, made once so both
    read the same file), the SmolLM2 tokenizer beside them."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)


# -- one system, in its own process -----------------------------------------------------------


def run_system(
    system: str,
    model_dir: str,
    num_prompts: int,
    max_tokens: int,
    tiny: bool,
    own_cache: bool = False,
) -> dict:
    """One system's run. `own_cache`: the engine sizes its cache as it does by default (the
    hybrids: their peer, a padded `generate`, has no fixed cache either, and a fixed block count
    would starve a model whose layers form several cache groups); else it gets the same
    block count as generate_batch."""
    import torch

    from bench.throughput import (
        BATCH_TOKENS,
        PAGE_SIZE,
        Settings,
        check_lengths,
        load_hf_model,
        run_hf_generate_batch,
    )
    from serverless_llm.engine.tokenizer import load_tokenizer

    set_threads()
    tokenizer = load_tokenizer(model_dir)
    prompts = chat_prompt_ids(tokenizer, num_prompts)
    warmup = chat_prompt_ids(tokenizer, num_prompts, lead="Warm-up. ")
    need = max(map(len, prompts + warmup)) + max_tokens
    blocks = num_prompts * (-(-need // PAGE_SIZE)) + 8
    settings = Settings(max_tokens, repeats=1, retries=0 if tiny else 1, settle=0 if tiny else 30)
    if system == "engine":
        from serverless_llm import LLM, SamplingParams

        llm = LLM(
            model_dir,
            dtype="float32",
            max_model_len=-(-need // PAGE_SIZE) * PAGE_SIZE,
            block_size=PAGE_SIZE,
            num_kv_blocks=None if own_cache else blocks,
            max_num_batched_tokens=BATCH_TOKENS,
        )

        def params(n):
            return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)

        def prepare():
            llm.generate(warmup, params(min(8, max_tokens)))

        def timed():
            t0 = time.perf_counter()
            out = llm.generate(prompts, params(max_tokens))
            return time.perf_counter() - t0, [o.outputs[0].token_ids for o in out]

        run = settings.measure(timed, prepare)
        seconds, outputs = run.value
        check_lengths("engine", outputs, num_prompts, max_tokens)
        other = run.other_cores
    elif system == "generate_padded":
        model = load_hf_model(model_dir)
        run = settings.measure(
            lambda: _padded_generate(model, prompts, max_tokens),
            lambda: _padded_generate(model, warmup, min(8, max_tokens)),
        )
        seconds, outputs = run.value
        check_lengths("transformers generate (padded batch)", outputs, num_prompts, max_tokens)
        other = run.other_cores
    else:
        model = load_hf_model(model_dir)
        result, outputs = run_hf_generate_batch(model, prompts, warmup, blocks, settings)
        seconds, other = result.seconds, result.other_cores
    del torch
    return {
        "seconds": seconds,
        "tokens": sum(map(len, outputs)),
        "tok_s": sum(map(len, outputs)) / seconds,
        "other_cores": other,
    }


def _padded_generate(model, prompts: list[list[int]], max_tokens: int):
    """transformers' `generate` on every prompt at once, left-padded: its batch for the models
    its continuous batching does not serve (the hybrids: generate_batch refuses their recurrent
    layer types). Returns (seconds, each prompt's new tokens)."""
    import torch

    from bench.throughput import hf_generation_config

    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, generation_config=hf_generation_config(model, max_tokens)
        )
    return time.perf_counter() - t0, out[:, width:].tolist()


def in_process(system: str, model_dir: str, args) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--system",
        system,
        "--model-dir",
        model_dir,
        "--num-prompts",
        str(args.num_prompts),
        "--max-tokens",
        str(args.max_tokens),
        *(["--tiny"] if args.tiny else []),
        *(["--own-cache"] if getattr(args, "own_cache", False) else []),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{system} on {model_dir} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the whole run ----------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--families", default=None, help="comma-separated names, or all (default; --tiny: 2)"
    )
    p.add_argument(
        "--model", help="the tokenizer's model directory (default: the embedded SmolLM2)"
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--tiny", action="store_true", help="CI smoke size: tiny models, 4 x 8")
    p.add_argument("--skip-hf", action="store_true", help="the engine only (no ratios)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="sweeps over all the families; each system keeps its best tok/s of all rounds, so "
        "each family is compared with the Llama shape at several points in time",
    )
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--own-cache", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.num_prompts, args.max_tokens = 4, 8
    if args.system:
        return args
    if args.families is None:
        args.families = "llama,gemma2" if args.tiny else "all"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.system:
        print(
            json.dumps(
                run_system(
                    args.system,
                    args.model_dir,
                    args.num_prompts,
                    args.max_tokens,
                    args.tiny,
                    args.own_cache,
                )
            )
        )
        return 0
    from serverless_llm.engine.models import MODEL_REGISTRY
    from serverless_llm.engine.tokenizer import load_tokenizer

    tok_dir = args.model or default_model_dir()
    configs = family_configs(load_tokenizer(tok_dir), args.tiny)
    names = list(configs) if args.families == "all" else args.families.split(",")
    if "llama" not in names:
        names.insert(0, "llama")  # the reference shape of every ratio
    unknown = [n for n in names if n not in configs]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {', '.join(configs)}")
    load_before = load_average()
    rows, results = [], {}
    skipped: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="bench-families-") as root:
        for rnd in range(1, args.rounds + 1):
            for name in names:
                if name in skipped:
                    continue
                tag = f"{name} (round {rnd}/{args.rounds})"
                path = os.path.join(root, name)
                log(f"{tag}: building the model")
                build_model(configs[name], tok_dir, path)  # seeded: the same weights each round
                arch = json.loads(Path(path, "config.json").read_text())["architectures"][0]
                if arch not in MODEL_REGISTRY:
                    log(f"{name}: {arch} is not served by the engine; skipped")
                    skipped.add(name)
                    continue
                params = sum(_param_count(path).values())
                log(f"{tag}: engine")
                args.own_cache = name in PADDED_PEER
                engine = in_process("engine", path, args)
                hf = None
                peer = "generate_padded" if name in PADDED_PEER else "generate_batch"
                if not args.skip_hf:
                    log(f"{tag}: transformers {peer}")
                    try:
                        hf = in_process(peer, path, args)
                    except RuntimeError as e:  # transformers' own failure: no ratio
                        log(f"{name}: generate_batch failed, no ratio: {str(e)[-300:]}")
                log(
                    f"{tag}: engine {engine['tok_s']:.1f} tok/s, generate_batch "
                    + ("failed" if hf is None else f"{hf['tok_s']:.1f} tok/s")
                )
                prev = results.get(name)
                if prev is not None:
                    engine = _best(prev["engine"], engine)
                    hf = _best(prev["generate_batch"], hf)
                rounds = [] if prev is None else prev["rounds"]
                rounds.append({"engine": engine["tok_s"], "generate_batch": hf and hf["tok_s"]})
                results[name] = {
                    "arch": arch,
                    "params": params,
                    "engine": engine,
                    "generate_batch": hf,
                    "rounds": rounds,
                }
                if args.json:  # kept as it goes, so a later failure loses nothing
                    Path(args.json).write_text(json.dumps({"results": results}, indent=2))
                shutil.rmtree(path, ignore_errors=True)
    base = _ratio(results.get("llama"))
    for name, r in results.items():
        ratio = _ratio(r)
        rel = None if ratio is None or base is None else ratio / base
        # another peer (padded generate): not comparable with the Llama ratio
        if name in PADDED_PEER:
            rel = None
        r["ratio"], r["vs_llama"] = ratio, rel
        rows.append(
            [
                name + (" *" if name in PADDED_PEER else ""),
                r["arch"],
                f"{r['params'] / 1e6:.0f}M",
                f"{r['engine']['tok_s']:.1f}",
                "-" if r["generate_batch"] is None else f"{r['generate_batch']['tok_s']:.1f}",
                "-" if ratio is None else f"{ratio:.2f}x",
                "-" if rel is None else f"{rel:.2f}",
                " / ".join(
                    _cores(r[k]["other_cores"])
                    for k in ("engine", "generate_batch")
                    if r[k] is not None
                ),
            ]
        )
    info = machine_info()
    print(
        f"{cpu_model_name()}, {info.get('cores')} cores, SIMD: {cpu_simd_flags()}; "
        f"{args.num_prompts} prompts x {args.max_tokens} tokens; load before {load_before}, "
        f"after {load_average()}"
    )
    print(
        format_table(
            [
                "family",
                "architecture",
                "params",
                "engine tok/s",
                "transformers tok/s",
                "ratio",
                "vs llama",
                "others' cores",
            ],
            rows,
        )
    )
    print(
        "transformers tok/s: its generate_batch; * its generate on the left-padded batch (its "
        "generate_batch refuses recurrent layers, MLA and per-layer head widths)"
    )
    hybrid = {n: r["ratio"] for n, r in results.items() if n in PADDED_PEER and r["ratio"]}
    if hybrid:
        low = min(hybrid, key=hybrid.get)
        print(
            f"hybrids, MLA, Gemma 4: lowest ratio {low} {hybrid[low]:.2f}x (bar >= {BAR_HYBRID}x): "
            + ("meets" if hybrid[low] >= BAR_HYBRID else "misses")
        )
    for name in BAR_3X:
        ratio = results.get(name, {}).get("ratio")
        if ratio is not None:
            verdict = "meets" if ratio >= BAR_HYBRID else "misses"
            print(f"{name}: ratio {ratio:.2f}x (bar >= {BAR_HYBRID}x): {verdict}")
    ratios = {
        n: r["ratio"] for n, r in results.items() if r["ratio"] is not None and n not in PADDED_PEER
    }
    rels = {n: r["vs_llama"] for n, r in results.items() if r["vs_llama"] is not None}
    if ratios:
        worst = min(ratios, key=ratios.get)
        worst_rel = min(rels, key=rels.get)
        meets = ratios[worst] >= BAR_VS_GENERATE_BATCH and rels[worst_rel] >= BAR_VS_LLAMA
        print(
            f"lowest ratio {worst} {ratios[worst]:.2f}x (bar >= {BAR_VS_GENERATE_BATCH}x); "
            f"lowest vs llama {worst_rel} {rels[worst_rel]:.2f} (bar >= {BAR_VS_LLAMA}): "
            + ("meets" if meets else "misses")
        )
        print(
            f"SUMMARY families={len(ratios)} min_ratio={ratios[worst]:.2f} ({worst}) "
            f"min_vs_llama={rels[worst_rel]:.2f} ({worst_rel})"
            + (
                f" hybrids={len(hybrid)} min_hybrid_ratio={hybrid[low]:.2f} ({low})"
                if hybrid
                else ""
            )
        )
    else:
        print(f"SUMMARY families={len(results)} (engine only)")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "results": results}, indent=2))
    return 0


def _param_count(path: str) -> dict[str, int]:
    from safetensors import safe_open

    counts = {}
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            counts[key] = f.get_slice(key).get_shape()
    out = {}
    for key, shape in counts.items():
        n = 1
        for s in shape:
            n *= s
        out[key] = n
    return out


def _cores(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


def cpu_simd_flags() -> str:
    """The vector extensions of this CPU that matter to matmul speed (printed with every run:
    machines differ from session to session)."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return " ".join(w for w in wanted if w in have) or "none of avx2/avx512"
    except OSError:
        pass
    return "unknown"


def _best(a: dict | None, b: dict | None) -> dict | None:
    """The faster of two measurements of one system (None: that round failed)."""
    if a is None or b is None:
        return a or b
    return a if a["tok_s"] >= b["tok_s"] else b


def _ratio(r: dict | None) -> float | None:
    if r is None or r.get("generate_batch") is None:
        return None
    return r["engine"]["tok_s"] / r["generate_batch"]["tok_s"]


if __name__ == "__main__":
    sys.exit(main())

"""Vision-language models: a dummy-weight Qwen2.5-VL, requests with one image each, this engine
(`LLM.generate` with vLLM's `{"prompt": ..., "multi_modal_data": {"image": [...]}}` prompts)
against transformers (`generate` on the processor's left-padded batch), each system in its own
process, in one run.

The model: Qwen2.5-VL's vision tower at full width with 8 layers (hidden 1280, 16 heads, gated
MLP 3420, 14 px patches, merge 2, attention in windows of 112 px but on the last layer, which
attends over the whole image, as every eighth layer of the real one does), its merger to 896,
over a Qwen2.5-0.5B-shaped decoder (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864,
vocab 151936, tied embeddings, M-RoPE sections 8/12/12). Random weights (std 0.02), made once
into a cache directory and reused; the SmolLM2 tokenizer with Qwen's vision tokens and chat
layout, Qwen2.5-VL's processor built from its PIL image processor (no hub).

Measured (bars of issue 36):
- throughput: 16 requests, each one 448x448 noise image (256 image tokens) and a short
  question, 64 greedy tokens each (EOS ignored), all submitted together: generated tokens/s,
  engine >= 2x transformers' `generate` on the 16 prompts as one left-padded batch;
- time to first token of one image request alone (max_tokens=1 wall time after a warm-up
  request, a fresh image each time): engine <= 1.1x transformers' (`generate` with
  max_new_tokens=1).
Both systems' timings include the processor (image resize, patches, tokens). Each is split
into vision tower / the rest of prefill (through the step that gives the last request its first
token) / decode, to say where the time goes.

    .venv/bin/python bench/vision.py                   # the full size (minutes on 2 cores)
    .venv/bin/python bench/vision.py --json out.json
    .venv/bin/python bench/vision.py --smoke           # CI smoke size (tiny model, 4 x 8)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    cpu_model_name,
    default_model_dir,
    format_table,
    load_average,
    machine_info,
    measure_clean,
    set_threads,
)

BAR_THROUGHPUT = 2.0  # engine tok/s over transformers' padded generate, at least
BAR_TTFT = 1.1  # engine's time to first token over transformers', at most

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_PART = "<|vision_start|><|image_pad|><|vision_end|>"
# Qwen's chat layout; an image part is IMAGE_PART.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    + IMAGE_PART
    + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QUESTIONS = (
    "Describe this image.",
    "What is in the picture?",
    "Which colors stand out here?",
    "Is there any text in this image?",
    "How many objects can you count?",
    "What is the mood of this picture?",
    "Where might this photo have been taken?",
    "Describe the texture you see.",
    "Is this image bright or dark?",
    "What would you title this picture?",
    "Is there a person in the image?",
    "What shapes appear in it?",
    "Summarize the image in one sentence.",
    "Is the image in focus?",
    "What is in the top left corner?",
    "Does this look like a painting or a photo?",
)

# name -> (vision config, text config, image side in pixels, the image processor's patch
# grid limits)
FULL = dict(
    vision=dict(
        depth=8,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=896,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[7],
        hidden_act="silu",
    ),
    text=dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1e6},
        vocab_size=151936,
    ),
    image=448,
    num_requests=16,
    max_tokens=64,
)
SMOKE = dict(
    vision=dict(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
        hidden_act="silu",
    ),
    text=dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
        vocab_size=None,  # the tokenizer's
    ),
    image=112,
    num_requests=4,
    max_tokens=8,
)

WEIGHT_STD = 0.02
PAGE_SIZE = 16


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the model, made once ---------------------------------------------------------------------


def _shape(size: dict) -> dict:
    return {k: size[k] for k in ("vision", "text")}


def model_dir_for(size: dict, tokenizer_dir: str, cache_root: str) -> str:
    """The cached checkpoint of this shape and tokenizer (built on first use)."""
    key = json.dumps(
        {"shape": _shape(size), "tokenizer": os.path.abspath(tokenizer_dir), "v": 1},
        sort_keys=True,
    )
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    path = os.path.join(cache_root, f"qwen2_5_vl-{size['text']['num_hidden_layers']}L-{tag}")
    if not os.path.exists(os.path.join(path, "complete")):
        log(f"building the dummy model in {path} (once)")
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        build_model(size, tokenizer_dir, tmp)
        Path(tmp, "complete").write_text(key)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    return path


def build_model(size: dict, tokenizer_dir: str, path: str, seed: int = 0) -> None:
    """A Qwen2_5_VLForConditionalGeneration of `size` with random weights, the tokenizer with
    Qwen's vision tokens, and the processor's files."""
    import torch
    import transformers

    from serverless_llm.engine.models.vision.qwen_vl import Qwen2_5VLFamily

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    ids = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text = dict(size["text"])
    text["vocab_size"] = max(text["vocab_size"] or 0, len(tokenizer))
    config = transformers.Qwen2_5_VLConfig(
        vision_config=size["vision"],
        text_config=dict(
            **text,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        tie_word_embeddings=True,
        vision_start_token_id=ids[0],
        vision_end_token_id=ids[1],
        image_token_id=ids[2],
        video_token_id=ids[3],
    )
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    model = model.to_empty(device="cpu").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, WEIGHT_STD)
            elif "norm" in name or name.endswith("ln_q.weight"):
                p.fill_(1.0)
            else:  # biases
                p.zero_()
    model.tie_weights()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=56 * 56,
        max_pixels=28 * 28 * 1280,
        patch_size=size["vision"]["patch_size"],
        merge_size=size["vision"]["spatial_merge_size"],
        temporal_patch_size=size["vision"]["temporal_patch_size"],
    )
    processor = Qwen2_5VLFamily().processor_class()(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(path)


# -- the requests -----------------------------------------------------------------------------


def noise_image(side: int, seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))


def requests(n: int, side: int, seed: int) -> list[tuple[str, Any]]:
    """n (text, image) requests: a chat prompt with the image then a question; images seeded
    from `seed` on (the measured, warm-up and TTFT requests take different seeds: no prefix or
    encoder cache hits between them)."""
    out = []
    for i in range(n):
        question = QUESTIONS[i % len(QUESTIONS)]
        text = f"<|im_start|>user\n{IMAGE_PART}{question}<|im_end|>\n<|im_start|>assistant\n"
        out.append((text, noise_image(side, seed + i)))
    return out


SEED_MEASURED, SEED_WARMUP, SEED_TTFT = 0, 10_000, 20_000


# -- one system, in its own process -----------------------------------------------------------


class Phases:
    """Wall time split into vision tower, the rest of prefill and decode: `prefill_end` is when
    the last request got its first token; the tower's time is summed by hooks."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.tower = 0.0
        self.preprocess = 0.0
        self.prefill_end: float | None = None

    def split(self, total: float) -> dict[str, float]:
        first = (self.prefill_end or self.start + total) - self.start
        return {
            "preprocess_s": self.preprocess,
            "tower_s": self.tower,
            "prefill_s": max(0.0, first - self.tower - self.preprocess),
            "decode_s": max(0.0, total - first),
        }


def run_engine(model_dir: str, size: dict, args) -> dict:
    from serverless_llm import LLM, SamplingParams

    n, m, side = args.num_requests, args.max_tokens, size["image"]
    measured = requests(n, side, SEED_MEASURED)
    prompt_len = 64 + (side // size["vision"]["patch_size"] // 2) ** 2
    llm = LLM(
        model_dir,
        dtype="float32",
        max_model_len=-(-(prompt_len + m) // PAGE_SIZE) * PAGE_SIZE,
        block_size=PAGE_SIZE,
    )
    engine = llm.engine
    phases = Phases()

    # hooks: the tower's time, the processor's time, when every request has its first token
    tower = engine.runner.vision_tower
    encode = tower.encode

    def timed_encode(items):
        t0 = time.perf_counter()
        try:
            return encode(items)
        finally:
            phases.tower += time.perf_counter() - t0

    tower.encode = timed_encode
    prepare = engine.prepare

    def timed_prepare(*a, **kw):
        t0 = time.perf_counter()
        try:
            return prepare(*a, **kw)
        finally:
            phases.preprocess += time.perf_counter() - t0

    engine.prepare = timed_prepare
    step = engine.step
    started: set[str] = set()  # requests of this call with a token
    expected = [0]

    def timed_step():
        outs = step()
        started.update(o.request_id for o in outs if o.num_output_tokens >= 1)
        if len(started) >= expected[0] and phases.prefill_end is None:
            phases.prefill_end = time.perf_counter()
        return outs

    engine.step = timed_step

    def params(k: int):
        return SamplingParams(max_tokens=k, ignore_eos=True, temperature=0.0)

    def prompts(reqs):
        return [{"prompt": t, "multi_modal_data": {"image": [img]}} for t, img in reqs]

    cache = engine.runner.encoder_cache

    def generate(reqs, k: int):
        # Every call starts cold: no prefix block and no image's features cached from an
        # earlier call (a retried measurement sees what the first attempt saw).
        reset = getattr(engine.block_pool, "reset_prefix_cache", None)
        if reset is not None:
            reset()
        cache.clear()
        encoded = cache.encoded
        started.clear()
        expected[0] = len(reqs)
        phases.reset()
        t0 = time.perf_counter()
        out = llm.generate(prompts(reqs), params(k))
        seconds = time.perf_counter() - t0
        tokens = [o.outputs[0].token_ids for o in out]
        if any(len(t) != k for t in tokens):
            raise RuntimeError(f"engine: token counts {sorted(set(map(len, tokens)))}, not {k}")
        if cache.encoded - encoded != len(reqs):
            raise RuntimeError(f"engine: {cache.encoded - encoded} images encoded, not {len(reqs)}")
        return seconds, tokens, phases.split(seconds)

    return _measure_both("engine", generate, measured, size, args)


def run_transformers(model_dir: str, size: dict, args) -> dict:
    import copy

    import torch
    import transformers

    from serverless_llm.engine.multimodal import vision_family_of

    transformers.logging.set_verbosity_error()
    n, side = args.num_requests, size["image"]
    measured = requests(n, side, SEED_MEASURED)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    processor = vision_family_of(config.architectures).make_processor(model_dir, config)
    processor.tokenizer.padding_side = "left"
    model = transformers.AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    phases = Phases()
    visual = model.model.visual
    starts: list[float] = []
    visual.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))

    def tower_done(*_):
        phases.tower += time.perf_counter() - starts.pop()

    visual.register_forward_hook(tower_done)

    class FirstToken:
        """A streamer: its first `put` is the prompt, its second the first new tokens."""

        def __init__(self) -> None:
            self.puts = 0

        def put(self, value) -> None:
            self.puts += 1
            if self.puts == 2:
                phases.prefill_end = time.perf_counter()

        def end(self) -> None:
            pass

    gen = copy.deepcopy(model.generation_config)
    gen.eos_token_id = [1 << 30]  # no token has it: the full length, EOS not masked
    gen.pad_token_id = processor.tokenizer.pad_token_id
    gen.do_sample = False
    gen.temperature = gen.top_p = gen.top_k = None

    @torch.inference_mode()
    def generate(reqs, k: int):
        phases.reset()
        t0 = time.perf_counter()
        inputs = processor(
            text=[t for t, _ in reqs],
            images=[img for _, img in reqs],
            padding=True,
            return_tensors="pt",
        )
        phases.preprocess = time.perf_counter() - t0
        width = inputs["input_ids"].shape[1]
        config = copy.copy(gen)
        config.max_new_tokens = k
        out = model.generate(**inputs, generation_config=config, streamer=FirstToken())
        seconds = time.perf_counter() - t0
        tokens = out[:, width:].tolist()
        if any(len(t) != k for t in tokens):
            raise RuntimeError(f"transformers: token counts {sorted(set(map(len, tokens)))}")
        return seconds, tokens, phases.split(seconds)

    return _measure_both("transformers", generate, measured, size, args)


def _measure_both(name, generate, measured, size, args) -> dict:
    """The throughput run (after a warm-up of 2 requests), then time to first token of one
    request alone (after a one-request warm-up; a fresh image each attempt, best of
    args.ttft_repeats)."""
    n, m, side = args.num_requests, args.max_tokens, size["image"]
    retries, settle = (0, 0.0) if args.smoke else (1, 20.0)
    warm = requests(2, side, SEED_WARMUP)

    def warm_up():
        log(f"{name}: warm-up, 2 requests x {min(8, m)} tokens")
        generate(warm, min(8, m))

    def timed():
        log(f"{name}: {n} requests x {m} tokens, all at once")
        return generate(measured, m)

    run = measure_clean(timed, prepare=warm_up, retries=retries, settle=settle, log=log)
    seconds, tokens, _ = run.value
    throughput = {
        "seconds": seconds,
        "tokens": sum(map(len, tokens)),
        "tok_s": sum(map(len, tokens)) / seconds,
        "phases": run.value[2],
        "other_cores": run.other_cores,
        "attempts": run.attempts,
        "first_tokens": [t[0] for t in tokens],
    }

    log(f"{name}: one request alone, warm-up")
    generate(requests(1, side, SEED_TTFT), 1)
    seeds = iter(range(SEED_TTFT + 1, SEED_TTFT + 1000))

    def timed_one():
        log(f"{name}: one request alone, max_tokens=1")
        return generate(requests(1, side, next(seeds)), 1)  # a fresh image each time

    best = None
    for _ in range(args.ttft_repeats):
        r = measure_clean(timed_one, retries=retries, settle=settle, log=log)
        if best is None or r.value[0] < best.value[0]:
            best = r
    ttft = {
        "seconds": best.value[0],
        "phases": best.value[2],
        "other_cores": best.other_cores,
        "first_token": best.value[1][0][0],
    }
    return {"throughput": throughput, "ttft": ttft}


def in_process(system: str, model_dir: str, args) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--system",
        system,
        "--model-dir",
        model_dir,
        "--num-requests",
        str(args.num_requests),
        "--max-tokens",
        str(args.max_tokens),
        "--ttft-repeats",
        str(args.ttft_repeats),
        *(["--smoke"] if args.smoke else []),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(done.stderr if done.returncode == 0 else "")
    if done.returncode != 0:
        raise RuntimeError(f"{system} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the whole run ----------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="the tokenizer's model directory (default: embedded SmolLM2)")
    p.add_argument("--num-requests", type=int, default=None, help="default 16 (smoke: 4)")
    p.add_argument("--max-tokens", type=int, default=None, help="default 64 (smoke: 8)")
    p.add_argument("--ttft-repeats", type=int, default=None, help="default 3 (smoke: 1)")
    p.add_argument(
        "--smoke", "--tiny", action="store_true", help="CI smoke size: a tiny model, 4 x 8"
    )
    p.add_argument(
        "--cache-dir",
        default=os.path.join(
            os.environ.get("SERVERLESS_LLM_CACHE")
            or os.path.join(os.path.expanduser("~"), ".cache", "serverless_llm"),
            "bench-vision",
        ),
        help="where the dummy checkpoint is made once and reused",
    )
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    size = SMOKE if args.smoke else FULL
    if args.num_requests is None:
        args.num_requests = size["num_requests"]
    if args.max_tokens is None:
        args.max_tokens = size["max_tokens"]
    if args.ttft_repeats is None:
        args.ttft_repeats = 1 if args.smoke else 3
    return args, size


def main(argv=None) -> int:
    args, size = parse_args(argv)
    if args.system:
        set_threads()
        run = run_engine if args.system == "engine" else run_transformers
        print(json.dumps(run(args.model_dir, size, args)))
        return 0
    tok_dir = args.model or default_model_dir()
    cache = args.cache_dir
    if args.smoke and args.json:  # CI: the tiny checkpoint beside the report, not in a cache
        cache = os.path.join(os.path.dirname(os.path.abspath(args.json)), "bench-vision")
    model_dir = model_dir_for(size, tok_dir, cache)
    load_before = load_average()
    results = {}
    for system in ("engine", "transformers"):
        log(f"{system}: in its own process")
        results[system] = in_process(system, model_dir, args)
    load_after = load_average()

    e, t = results["engine"], results["transformers"]
    tput = e["throughput"]["tok_s"] / t["throughput"]["tok_s"]
    ttft = e["ttft"]["seconds"] / t["ttft"]["seconds"]
    rows = []
    for system, r in results.items():
        tp, tt = r["throughput"], r["ttft"]
        rows.append(
            [
                system,
                f"{tp['tok_s']:.2f}",
                f"{tp['seconds']:.1f}",
                _phases(tp["phases"]),
                f"{tt['seconds']:.2f}",
                _phases(tt["phases"]),
                " / ".join(_cores(x["other_cores"]) for x in (tp, tt)),
            ]
        )
    info = machine_info()
    vc, tc = size["vision"], size["text"]
    print(
        f"{cpu_model_name()}, {info.get('cores')} cores, flags: {' '.join(info['flags'])}; "
        f"torch {info['torch']}, transformers {info['transformers']}; load before "
        f"{_load(load_before)}, after {_load(load_after)}"
    )
    print(
        f"Qwen2.5-VL dummy: tower {vc['depth']} layers x {vc['hidden_size']} "
        f"({vc['num_heads']} heads, windows {vc['window_size']} px, full attention on "
        f"{vc['fullatt_block_indexes']}), decoder {tc['num_hidden_layers']} layers x "
        f"{tc['hidden_size']}, vocab {tc['vocab_size'] or 'the tokenizer'}; "
        f"{args.num_requests} requests x one {size['image']}x{size['image']} image x "
        f"{args.max_tokens} tokens"
    )
    print(
        format_table(
            [
                "system",
                "tok/s",
                "batch s",
                "batch: preproc / tower / prefill / decode s",
                "TTFT s",
                "TTFT: preproc / tower / prefill / decode s",
                "others' cores",
            ],
            rows,
        )
    )
    same = sum(
        a == b for a, b in zip(e["throughput"]["first_tokens"], t["throughput"]["first_tokens"])
    )
    print(
        f"first generated token equal in {same}/{args.num_requests} requests (fp32, random weights)"
    )
    print(
        f"throughput engine / transformers generate (padded batch): {tput:.2f}x "
        f"(bar >= {BAR_THROUGHPUT}x): {'meets' if tput >= BAR_THROUGHPUT else 'misses'}"
    )
    print(
        f"time to first token engine / transformers: {ttft:.2f}x (bar <= {BAR_TTFT}x): "
        f"{'meets' if ttft <= BAR_TTFT else 'misses'}"
    )
    print(
        f"SUMMARY throughput_ratio={tput:.2f} ttft_ratio={ttft:.2f} "
        f"engine_tok_s={e['throughput']['tok_s']:.2f} "
        f"transformers_tok_s={t['throughput']['tok_s']:.2f} "
        f"engine_ttft_s={e['ttft']['seconds']:.3f} transformers_ttft_s={t['ttft']['seconds']:.3f}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "machine": info,
                    "size": size,
                    "num_requests": args.num_requests,
                    "max_tokens": args.max_tokens,
                    "results": results,
                    "ratios": {"throughput": tput, "ttft": ttft},
                    "load": {"before": load_before, "after": load_after},
                },
                indent=2,
            )
        )
    return 0


def _phases(p: dict) -> str:
    return " / ".join(f"{p[k]:.2f}" for k in ("preprocess_s", "tower_s", "prefill_s", "decode_s"))


def _cores(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


def _load(value) -> str:
    return "?" if value is None else " ".join(f"{v:.2f}" for v in value)


if __name__ == "__main__":
    sys.exit(main())

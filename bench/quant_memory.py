"""Resident weight memory of 4-bit models against their fp16 selves (issue 16's memory bar):
each shape is loaded twice through the engine's own loader with dummy weights in float16, once
plain and once as a 4-bit GPTQ checkpoint held packed (the CUDA form), and the bytes of every
parameter and buffer are summed.

    python bench/quant_memory.py                       # TinyLlama-1.1B and Llama-2-7B shapes
    python bench/quant_memory.py --shapes tinyllama-1.1b --group-size 32

Prints one row per shape: the fp16 bytes, the 4-bit bytes, their ratio for the whole model
and for the decoder linears alone (the embedding and the head stay in float16, as in every
4-bit format), then a last line against the bar (whole model <= 0.3x).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import format_table  # noqa: E402

SHAPES = {
    # hidden, intermediate, layers, heads, kv heads, vocab, tied
    "tinyllama-1.1b": (2048, 5632, 22, 32, 4, 32000, False),
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 128256, True),
    "llama-2-7b": (4096, 11008, 32, 32, 32, 32000, False),
    # Qwen3-MoE's proportions at ~1.1B: 32 experts of width 768 (top-4), hidden 1024
    "qwen3-moe-1.1b": (1024, 768, 12, 16, 4, 32000, False),
}
MOE = {"qwen3-moe-1.1b": dict(num_experts=32, num_experts_per_tok=4)}
BAR = 0.3


def _config_dir(root: Path, name: str, quant: dict | None) -> str:
    hidden, inter, layers, heads, kv, vocab, tied = SHAPES[name]
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM" if name in MOE else "LlamaForCausalLM"],
        "model_type": "qwen3_moe" if name in MOE else "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float16",
    }
    if name in MOE:
        cfg.update(MOE[name], moe_intermediate_size=inter, head_dim=hidden // heads)
    if quant is not None:
        cfg["quantization_config"] = quant
    out = root / f"{name}-{'q' if quant else 'f'}"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def _bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameter and buffer bytes, those inside the decoder layers)."""
    total = layers = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        n = t.numel() * t.element_size()
        total += n
        layers += n if name.startswith("layers.") else 0
    for m in model.modules():  # plain attributes: act-order permutations
        perm = getattr(m, "perm", None)
        if isinstance(perm, torch.Tensor):
            total += perm.numel() * perm.element_size()
            layers += perm.numel() * perm.element_size()
    return total, layers


def measure(name: str, group_size: int, root: Path) -> list:
    from serverless_llm.engine.config import EngineConfig
    from serverless_llm.engine.model_builder import load_model

    quant = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False}
    sizes = []
    for q in (None, quant):
        cfg = EngineConfig(
            model=_config_dir(root, name, q),
            load_format="dummy",
            dtype="float16",
            device="cpu",
            quantized_weights="packed",
            show_progress=False,
        )
        loaded = load_model(cfg)
        sizes.append(_bytes(loaded.model))
        del loaded
    (f_all, f_lin), (q_all, q_lin) = sizes
    return [
        name,
        f"{f_all / 2**30:.2f} GiB",
        f"{q_all / 2**30:.2f} GiB",
        q_all / f_all,
        q_lin / f_lin,
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["tinyllama-1.1b", "llama-2-7b"])
    p.add_argument("--group-size", type=int, default=128)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            rows.append(measure(name, args.group_size, Path(tmp)))
    print(f"4-bit GPTQ, group size {args.group_size}, packed; float16 reference")
    print(format_table(["shape", "fp16", "4-bit", "whole", "linears"], rows))
    verdicts = [f"{r[0]} {r[3]:.3f}x ({'meets' if r[3] <= BAR else 'MISSES'})" for r in rows]
    print(f"whole model vs fp16, bar <= {BAR}x: " + "; ".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-layer error of int8 activations on a GGUF file: the engine's few-row block kernel (int8 and
float inputs) and llama.cpp's own dot products (ggml's `ggml_vec_dot_*_q8_*` and
`quantize_row_q8_*`, called from the libggml-cpu that llama-cpp-python ships) on the same file
blocks and the same activations, each against the float64 product of the dequantized weight.

The activations are real: each block linear's input during the prefill of bench/common.py's chat
prompts (QUANTIZED_WEIGHTS=packed), for the layers named by --layers and the LM head. For each
tensor the table gives the relative RMS error ||out - ref|| / ||ref|| and the largest error over
max|ref|, and for the int8 kernel the share of outputs within the inputs' rounding bound,
sum over blocks of (a / 2) * sum|w| with a = max|x| / 127 per block (docs/quantization.md).

    .venv/bin/python bench/gguf_layer_error.py                  # SmolLM2 Q4_1, layers 0 15 29
    .venv/bin/python bench/gguf_layer_error.py --layers 0 --rows 16
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

# ggml's activation type for each weight type (its vec_dot_type) and that block's bytes
GGML_DOTS = {"Q4_0": ("q4_0", "q8_0", 34), "Q4_1": ("q4_1", "q8_1", 36),
             "Q5_0": ("q5_0", "q8_0", 34), "Q5_1": ("q5_1", "q8_1", 36),
             "Q8_0": ("q8_0", "q8_0", 34)}  # fmt: skip


def ggml_lib():
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
    lib.ggml_cpu_init()  # its float16 tables: without them every float16 scale reads as 0
    return lib


def ggml_linear(lib, raw: np.ndarray, type_name: str, x: np.ndarray) -> np.ndarray:
    """x [T, K] float32 times the file's weight rows `raw` [N, row bytes] as llama.cpp's CPU
    backend computes a row: x quantized to its Q8 type, then its vec_dot per output."""
    wt, at, size = GGML_DOTS[type_name]
    quant = getattr(lib, f"quantize_row_{at}")
    quant.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    dot = getattr(lib, f"ggml_vec_dot_{wt}_{at}")
    dot.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                    ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]  # fmt: skip
    t, k = x.shape
    n, row = raw.shape
    raw = np.ascontiguousarray(raw)
    out = np.zeros((t, n), np.float32)
    s = ctypes.c_float()
    for i in range(t):
        xi = np.ascontiguousarray(x[i], np.float32)
        y = np.zeros(k // 32 * size, np.uint8)
        quant(xi.ctypes.data, y.ctypes.data, k)
        base = raw.ctypes.data
        for j in range(n):
            dot(k, ctypes.byref(s), 0, base + j * row, 0, y.ctypes.data, 0, 1)
            out[i, j] = s.value
    return out


def capture(model_path: str | None, prompts: int) -> tuple[dict, object, object]:
    """Each block linear's prefill input (rows of all prompts) by module name, the model and
    the kernels."""
    from bench.common import chat_prompt_ids
    from serverless_llm import LLM, SamplingParams
    from serverless_llm.engine.layers.gguf_linear import GGUFBlockLinear

    llm = LLM(model_path, dtype="float32", quantized_weights="packed", max_model_len=1024)
    model = llm.engine.runner.model
    names = {id(m): n for n, m in model.named_modules()}
    names[id(model.packed_lm_head)] = "lm_head"
    seen: dict[str, list] = {}
    original = GGUFBlockLinear.forward

    def record(self, x):
        seen.setdefault(names.get(id(self), "?"), []).append(x.reshape(-1, x.shape[-1]).clone())
        return original(self, x)

    GGUFBlockLinear.forward = record
    try:
        ids = chat_prompt_ids(llm.get_tokenizer(), prompts)
        for p in ids:
            llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1))
    finally:
        GGUFBlockLinear.forward = original
    return {k: torch.cat(v) for k, v in seen.items()}, model, model.packed_lm_head.kernels


def errors(out: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    diff = out.astype(np.float64) - ref
    return float(np.linalg.norm(diff) / np.linalg.norm(ref)), float(
        np.abs(diff).max() / np.abs(ref).max()
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2)")
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 15, 29])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rows", type=int, default=48, help="activation rows per tensor")
    ap.add_argument("--head-rows", type=int, default=6, help="rows for the LM head (slow)")
    a = ap.parse_args()
    from serverless_llm.engine.kernels import gguf_blocks as gb
    from serverless_llm.engine.loader.gguf import embedded_model_path

    path = a.model or embedded_model_path()
    inputs, _, kernels = capture(a.model, a.prompts)
    tensors = gb.read_tensors(path)
    lib = ggml_lib()
    inputs_of = {"attn_q": "self_attn.qkv_proj", "attn_k": "self_attn.qkv_proj",
                 "attn_v": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                 "ffn_gate": "mlp.gate_up_proj", "ffn_up": "mlp.gate_up_proj",
                 "ffn_down": "mlp.down_proj"}  # fmt: skip
    jobs = [(f"blk.{i}.{t}.weight", f"layers.{i}.{m}", a.rows)
            for i in a.layers for t, m in inputs_of.items()]  # fmt: skip
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    jobs.append((head, "lm_head", a.head_rows))
    print(f"{'tensor':24s} {'type':5s} {'rows':>4s} | relative RMS error (max error / max|ref|): "
          "llama.cpp | ours int8 | ours float | int8 outputs within the bound")  # fmt: skip
    for name, where, rows in jobs:
        t = tensors[name]
        if t.type_name not in GGML_DOTS or where not in inputs:
            print(f"{name:24s} {t.type_name:5s} skipped (no ggml dot here or no input seen)")
            continue
        k = t.shape[0]
        x = inputs[where][:rows].float().contiguous()
        w = gb.from_gguf_blocks(t.data, t.type_name, k)
        ref = gb.reference_linear(x, w, quantize_x=False).numpy()
        ll = ggml_linear(lib, t.data, t.type_name, x.numpy())
        int8 = kernels.linear(x, w, path="best").numpy()
        flt = kernels.linear(x, w, path="float").numpy()
        _, scale = gb.quantize_rows_reference(x)
        n = w.shape[0]
        wd = gb.dequantize(w, torch.float64).abs().view(n, k // 32, 32).sum(-1)
        bound = ((scale.double() / 2) @ wd.T).numpy() + 1e-6 * (1 + np.abs(ref))
        within = float((np.abs(int8 - ref) <= bound).mean())
        cols = " | ".join(f"{e[0]:.2e} ({e[1]:.2e})" for e in
                          (errors(ll, ref), errors(int8, ref), errors(flt, ref)))  # fmt: skip
        print(f"{name:24s} {t.type_name:5s} {x.shape[0]:4d} | {cols} | {100 * within:.1f}%",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

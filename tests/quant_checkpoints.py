"""GPTQ and AWQ checkpoints written for tests, from the formats' published descriptions and
without the engine's code: each decoder linear of a float checkpoint is quantized (min/max per
group and output column), packed field by field in plain Python, and saved beside a float twin
holding exactly the weights the quantized one stands for, (q - zero) * scale, which
transformers then runs as the reference.

GPTQ (v1, as AutoGPTQ writes it): qweight int32 [in / p, out] with p = 32 / bits consecutive
input rows per word, the first in the lowest bits; qzeros int32 [groups, out / p] packed along
the outputs the same way, each zero point stored minus one; scales fp16 [groups, out]; g_idx
int32 [in], the group of each input row (a shuffled assignment under act-order); a zero bias
for every quantized linear, as AutoGPTQ saves one.
AWQ (GEMM, as AutoAWQ writes it): qweight int32 [in, out / 8], field k of each word holding
output column 8c + [0, 2, 4, 6, 1, 3, 5, 7][k]; qzeros int32 [groups, out / 8] the same way,
stored as is; scales fp16 [groups, out].
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

AWQ_FIELD_COLUMN = [0, 2, 4, 6, 1, 3, 5, 7]
# The linears a quantizer converts: attention and MLP projections, MoE experts (Qwen-MoE's
# mlp.experts.N.*_proj and shared_expert, Mixtral's block_sparse_moe.experts.N.w1/w2/w3); not
# the routers.
LINEAR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.\w+_proj|mlp(\.experts\.\d+|\.shared_expert)?\.\w+_proj"
    r"|block_sparse_moe\.experts\.\d+\.w[123])\.weight$"
)
# The same for DeepSeek's families (MLA's projections, `shared_experts`), as their FP8
# checkpoints quantize them: every linear of the layers but the router (`mlp.gate`).
MLA_LINEAR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj"
    r"|o_proj)|mlp(\.experts\.\d+|\.shared_experts)?\.(gate|up|down)_proj)\.weight$"
)


def int32_word(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def _quantize(w: torch.Tensor, bits: int, groups: list[int], n_groups: int, sym: bool):
    """Per (group, output column): scale and zero from the min and max of the group's inputs.
    Returns q [in][out], zeros [groups][out] (1..top-1), scales fp16 [groups, out] and the
    float weight [out, in] they stand for."""
    top = (1 << bits) - 1
    n_out, n_in = w.shape
    scales = torch.empty(n_groups, n_out, dtype=torch.float16)
    zeros = [[0] * n_out for _ in range(n_groups)]
    for g in range(n_groups):
        cols = [i for i in range(n_in) if groups[i] == g]
        block = w[:, cols]
        lo, hi = block.min(1).values.clamp(max=0), block.max(1).values.clamp(min=0)
        if sym:
            amax = torch.maximum(-lo, hi)
            lo, hi = -amax, amax
        s = ((hi - lo) / top).clamp(min=1e-5).half()
        scales[g] = s
        for o in range(n_out):
            z = (1 << (bits - 1)) if sym else round(-float(lo[o]) / float(s[o]))
            zeros[g][o] = min(max(z, 1), top)
    q = [[0] * n_out for _ in range(n_in)]
    deq = torch.empty(n_out, n_in)
    for i in range(n_in):
        g = groups[i]
        for o in range(n_out):
            s = float(scales[g, o])
            v = min(max(round(float(w[o, i]) / s) + zeros[g][o], 0), top)
            q[i][o] = v
            deq[o, i] = (v - zeros[g][o]) * s
    return q, zeros, scales, deq


def pack_gptq(q, zeros, bits: int):
    per = 32 // bits
    n_in, n_out = len(q), len(q[0])
    qweight = [
        [int32_word(sum(q[r * per + j][o] << (bits * j) for j in range(per))) for o in range(n_out)]
        for r in range(n_in // per)
    ]
    qzeros = [
        [
            int32_word(sum((z[c * per + j] - 1) << (bits * j) for j in range(per)))
            for c in range(n_out // per)
        ]
        for z in zeros
    ]
    return torch.tensor(qweight, dtype=torch.int32), torch.tensor(qzeros, dtype=torch.int32)


def pack_awq(rows) -> torch.Tensor:
    return torch.tensor(
        [
            [
                int32_word(sum(row[8 * c + AWQ_FIELD_COLUMN[k]] << (4 * k) for k in range(8)))
                for c in range(len(row) // 8)
            ]
            for row in rows
        ],
        dtype=torch.int32,
    )


def _save(src: str, float_dir: str, quant_dir: str, twin: dict, packed: dict, qc: dict):
    """src's files with its weights replaced: `twin` in float_dir, `packed` in quant_dir, whose
    config.json gets `qc` as its quantization_config. Returns (float_dir, quant_dir)."""
    for out, tensors in ((float_dir, twin), (quant_dir, packed)):
        shutil.copytree(src, out)
        os.remove(os.path.join(out, "model.safetensors"))
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors")
        )
    cfg_path = os.path.join(quant_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return float_dir, quant_dir


def write_quantized(
    src: str,
    float_dir: str,
    quant_dir: str,
    method: str,
    bits: int = 4,
    group_size: int = 32,
    act_order: bool = False,
    sym: bool = False,
    shared_order: bool = True,
    seed: int = 0,
    linear: re.Pattern = LINEAR,
) -> tuple[str, str]:
    """Quantizes the float checkpoint in `src`; writes the quantized checkpoint to `quant_dir`
    and its exact float twin to `float_dir` (both with src's tokenizer). Under act-order, the
    linears that read the same input (q, k, v; gate, up) share one group assignment, as GPTQ
    gives them (the same Hessian), unless `shared_order` is False. `linear`: which weights
    are quantized (default: the attention, MLP and expert projections)."""
    rng = random.Random(seed)
    orders: dict[str, list[int]] = {}
    state = load_file(os.path.join(src, "model.safetensors"))
    twin, packed = {}, {}
    for name, w in state.items():
        if not linear.match(name):
            twin[name] = packed[name] = w
            continue
        n_in = w.shape[1]
        gs = n_in if group_size == -1 else group_size
        groups = [i // gs for i in range(n_in)]
        if act_order:
            key = (
                re.sub(r"((q|k|v|gate|up)_proj|w1|w3)\.weight$", "in", name)
                if shared_order
                else name
            )
            if key not in orders:
                rng.shuffle(groups)
                orders[key] = groups
            groups = orders[key]
        n_groups = -(-n_in // gs)
        q, zeros, scales, deq = _quantize(w.float(), bits, groups, n_groups, sym)
        twin[name] = deq
        base = name[: -len(".weight")]
        if method == "gptq":
            qweight, qzeros = pack_gptq(q, zeros, bits)
            packed[base + ".g_idx"] = torch.tensor(groups, dtype=torch.int32)
            if base + ".bias" not in state:
                packed[base + ".bias"] = torch.zeros(w.shape[0], dtype=torch.float16)
        else:
            qweight, qzeros = pack_awq(q), pack_awq(zeros)
        packed[base + ".qweight"] = qweight
        packed[base + ".qzeros"] = qzeros
        packed[base + ".scales"] = scales
    if method == "gptq":
        qc = {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "desc_act": act_order,
            "sym": sym,
            "checkpoint_format": "gptq",
        }
    else:
        qc = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
        }
    return _save(src, float_dir, quant_dir, twin, packed, qc)


FP8_MAX = 448.0  # the largest float8_e4m3fn value


def write_fp8(
    src: str,
    float_dir: str,
    quant_dir: str,
    style: str,
    strategy: str,
    static_input: bool = False,
    linear: re.Pattern = LINEAR,
) -> tuple[str, str]:
    """src's decoder linears as FP8 (e4m3) weights with a float32 scale per tensor or per
    output channel (amax / 448), written in `style` "fp8" (vLLM's / transformers'
    `quant_method: fp8`, scalar scales) or "compressed-tensors" (llm-compressor's
    float-quantized format: scales [1] or [out, 1]); `static_input` adds an input_scale. The
    float twin holds weight.float() * scale. `linear`: which weights are quantized."""
    state = load_file(os.path.join(src, "model.safetensors"))
    twin, packed = {}, {}
    for name, w in state.items():
        if not linear.match(name):
            twin[name] = packed[name] = w
            continue
        w = w.float()
        if strategy == "tensor":
            scale = (w.abs().max() / FP8_MAX).reshape(())
        else:
            scale = w.abs().amax(1, keepdim=True) / FP8_MAX
        w8 = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        twin[name] = w8.float() * scale
        base = name[: -len(".weight")]
        packed[name] = w8
        if style == "compressed-tensors" and strategy == "tensor":
            scale = scale.reshape(1)
        packed[base + ".weight_scale"] = scale.float()
        if static_input:
            packed[base + ".input_scale"] = torch.tensor([0.02])
    if style == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "static" if static_input else "dynamic"}
    else:
        act = {"num_bits": 8, "type": "float", "symmetric": True}
        act.update(
            {"strategy": "tensor", "dynamic": False}
            if static_input
            else {"strategy": "token", "dynamic": True}
        )
        qc = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": strategy,
                        "symmetric": True,
                        "dynamic": False,
                    },
                    "input_activations": act,
                }
            },
            "ignore": ["lm_head"],
            "quantization_status": "compressed",
        }
    return _save(src, float_dir, quant_dir, twin, packed, qc)


def write_pack_quantized(
    src: str,
    float_dir: str,
    quant_dir: str,
    bits: int = 4,
    group_size: int = 32,
    act_order: bool = False,
    seed: int = 0,
) -> tuple[str, str]:
    """src's decoder linears in compressed-tensors' pack-quantized format (llm-compressor's
    W4A16 preset: symmetric integers in groups along the inputs): each row's signed values
    q in [-2^(b-1), 2^(b-1) - 1], stored plus 2^(b-1), packed 32 / b to an int32 along the
    row, the first in the lowest bits (`weight_packed` [out, in / p]); `weight_scale` fp16
    [out, groups] (max |w| of the group over 2^(b-1) - 1); `weight_shape` [out, in]; with
    act-order a shuffled group per input row in `weight_g_idx`. The twin holds q * scale."""
    rng = random.Random(seed)
    half = 1 << (bits - 1)
    per = 32 // bits
    state = load_file(os.path.join(src, "model.safetensors"))
    twin, packed = {}, {}
    for name, w in state.items():
        if not LINEAR.match(name):
            twin[name] = packed[name] = w
            continue
        w = w.float()
        n, k = w.shape
        groups = [i // group_size for i in range(k)]
        if act_order:
            rng.shuffle(groups)
        n_groups = -(-k // group_size)
        scales = torch.empty(n, n_groups, dtype=torch.float16)
        for g in range(n_groups):
            cols = [i for i in range(k) if groups[i] == g]
            scales[:, g] = (w[:, cols].abs().amax(1) / (half - 1)).clamp(min=1e-5).half()
        deq = torch.empty(n, k)
        words = []
        for o in range(n):
            stored = []
            for i in range(k):
                s = float(scales[o, groups[i]])
                q = min(max(round(float(w[o, i]) / s), -half), half - 1)
                deq[o, i] = q * s
                stored.append(q + half)
            words.append(
                [
                    int32_word(sum(stored[c * per + j] << (bits * j) for j in range(per)))
                    for c in range(k // per)
                ]
            )
        twin[name] = deq
        base = name[: -len(".weight")]
        packed[base + ".weight_packed"] = torch.tensor(words, dtype=torch.int32)
        packed[base + ".weight_scale"] = scales
        packed[base + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
        if act_order:
            packed[base + ".weight_g_idx"] = torch.tensor(groups, dtype=torch.int32)
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": group_size,
        "actorder": "group" if act_order else None,
    }
    qc = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }
    return _save(src, float_dir, quant_dir, twin, packed, qc)


def quantize_fp8_blocks(
    w: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] in FP8 (e4m3) blocks of block[0] rows by block[1] columns, the last ones partial:
    each block's scale is its max |w| / 448 (1 for an all-zero block), stored in `scale_dtype`;
    the values are w / scale rounded to e4m3. Returns (e4m3 weight [N, K], scales
    [ceil(N / bn), ceil(K / bk)] in scale_dtype, the float32 weight they stand for)."""
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    w = w.float()
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(rows, cols, dtype=scale_dtype)
    deq = torch.empty(n, k)
    for i in range(rows):
        for j in range(cols):
            at = (slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk))
            amax = float(w[at].abs().max())
            s = torch.tensor(amax / FP8_MAX if amax > 0 else 1.0).to(scale_dtype)
            scales[i, j] = s
            s = s.float()
            q[at] = (w[at] / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            deq[at] = q[at].float() * s
    return q, scales, deq


def write_fp8_block(
    src: str,
    float_dir: str,
    quant_dir: str,
    style: str,
    block: tuple[int, int] = (128, 128),
    linear: re.Pattern = LINEAR,
    padded: bool = False,
) -> tuple[str, str]:
    """src's decoder linears as FP8 weights with a scale per block (`quantize_fp8_blocks`),
    written in `style`:

    - "fp8": DeepSeek-V3's layout, as transformers' FineGrainedFP8 reads it: `weight`
      float8_e4m3fn [N, K] and `weight_scale_inv` float32 [ceil(N / bn), ceil(K / bk)] (the
      name says inverse; the value multiplies), `quant_method: fp8` with `weight_block_size`
      [bn, bk] and dynamic activations;
    - "compressed-tensors": llm-compressor's FP8_BLOCK preset (format float-quantized, weights
      `strategy: block` with `block_structure` [bn, bk], activations dynamic per group of 128):
      `weight` and `weight_scale` (in bfloat16, the dtype llm-compressor gives the scales of a
      bfloat16 model). `padded`: as compressed-tensors versions that padded a weight to whole
      blocks wrote it: `weight` [ceil(N / bn) * bn, ceil(K / bk) * bk], zeros past the edges,
      with `weight_shape_original` [N, K].

    The float twin holds the e4m3 values times their block's scale (float32)."""
    state = load_file(os.path.join(src, "model.safetensors"))
    twin, packed = {}, {}
    scale_dtype = torch.float32 if style == "fp8" else torch.bfloat16
    for name, w in state.items():
        if not linear.match(name):
            twin[name] = packed[name] = w
            continue
        q, scales, twin[name] = quantize_fp8_blocks(w, block, scale_dtype)
        base = name[: -len(".weight")]
        if padded:
            n, k = q.shape
            full = torch.zeros(scales.shape[0] * block[0], scales.shape[1] * block[1])
            full = full.to(torch.float8_e4m3fn)
            full[:n, :k] = q
            packed[base + ".weight_shape_original"] = torch.tensor([n, k], dtype=torch.int64)
            q = full
        packed[name] = q
        packed[base + (".weight_scale_inv" if style == "fp8" else ".weight_scale")] = scales
    if style == "fp8":
        qc = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(block),
        }
    else:
        qc = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "block",
                        "block_structure": list(block),
                        "symmetric": True,
                        "dynamic": False,
                    },
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "group",
                        "group_size": 128,
                        "symmetric": True,
                        "dynamic": True,
                    },
                }
            },
            "ignore": ["lm_head"],
            "quantization_status": "compressed",
        }
    return _save(src, float_dir, quant_dir, twin, packed, qc)

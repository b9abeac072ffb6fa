"""Which quantization a checkpoint uses, and the engine's answer to it (issue 16).

A quantized checkpoint says how in its config: `quantization_config`, as transformers and the
quantizers (AutoGPTQ / GPTQModel, AutoAWQ, llm-compressor, ...) write it. The engine's
`quantization` (the QUANTIZATION setting) may name a method too; it must agree with the
checkpoint. `check_quantization` reads the config into a `QuantScheme` the linear layers are
built from, or refuses what cannot be served with the reason named, before any weight is read:
otherwise the first `qweight` tensor would fail the weight mapping with an error that says
nothing about quantization.

Served today: GPTQ (v1 checkpoint format, 4 and 8 bits, any group size, act-order), AWQ (GEMM
layout, 4 bits, with zero points) and FP8 weights (e4m3, a scale per tensor or per output
channel), the last both as `quant_method: fp8` and as compressed-tensors' float-quantized
format; FP8 weights with a scale per block of the weight (DeepSeek's `weight_block_size`,
compressed-tensors' `block` strategy); MXFP4 experts (gpt-oss: `quant_method: mxfp4`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..config import ConfigError

# vLLM's kernel-specific names for the checkpoint formats they read.
_SAME_FORMAT = {"gptq_marlin": "gptq", "awq_marlin": "awq", "marlin": "gptq"}
# The checkpoint formats the engine serves.
SERVED = ("gptq", "awq", "fp8", "compressed-tensors", "mxfp4")
# Every `quantization` name that loads a served format, vLLM's kernel-specific ones included.
SERVED_METHODS = (*SERVED, *_SAME_FORMAT)
# The names `quantization` (QUANTIZATION) takes: vLLM's. Those outside SERVED_METHODS name real
# formats the engine does not serve yet, and stop the load with the reason.
QUANTIZATION_METHODS = (
    "awq",
    "gptq",
    "squeezellm",
    "fp8",
    "bitsandbytes",
    "marlin",
    "awq_marlin",
    "gptq_marlin",
    "compressed-tensors",
    "mxfp4",
)


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's linear layers are quantized: integer weights of `bits` bits in groups
    of `group_size` input rows (the whole input when -1), each group with a scale and a zero
    point per output column. A linear the quantizer left alone (AWQ's
    `modules_to_not_convert`) is recognised by its plain `weight` tensor at load."""

    # "gptq" | "awq" | "fp8" | "packed_int" (compressed-tensors pack-quantized) | "mxfp4"
    method: str
    bits: int
    group_size: int
    desc_act: bool = False
    # FP8 with a scale per block of (output rows, input columns), e.g. (128, 128); None: a scale
    # per tensor or per output channel.
    block: tuple[int, int] | None = None


def _get(qc, key, default=None):
    value = qc.get(key, default) if isinstance(qc, dict) else getattr(qc, key, default)
    return getattr(value, "value", value)  # transformers keeps some as an enum


# Settings files of the quantizers, read when config.json has no quantization_config, with the
# method each implies when the file does not name one.
SIDE_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))


def read_side_config(hf_config, model_dir: str) -> None:
    """Sets hf_config.quantization_config from AutoGPTQ's quantize_config.json or AutoAWQ's
    quant_config.json in `model_dir` when config.json has none (older repos keep it there)."""
    if getattr(hf_config, "quantization_config", None):
        return
    for name, method in SIDE_FILES:
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                qc = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {path}: {e}") from e
        if not isinstance(qc, dict):
            raise ConfigError(f"{path} is not a JSON object")
        qc.setdefault("quant_method", method)
        hf_config.quantization_config = qc
        return


def checkpoint_quantization(hf_config) -> str | None:
    """The checkpoint's quantization method (lower case), "unknown" for a quantization_config
    without one, or None for an unquantized checkpoint."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    method = _get(qc, "quant_method")
    return str(method).lower() if method else "unknown"


def _int(qc, key: str, source: str, default=None) -> int:
    value = _get(qc, key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{source}: quantization_config.{key}={value!r} is not an integer")
    return value


def _scheme(method: str, qc, source: str) -> QuantScheme:
    if method == "gptq":
        fmt = str(_get(qc, "checkpoint_format", "gptq") or "gptq").lower()
        if fmt != "gptq":
            raise ConfigError(
                f"{source}: GPTQ checkpoint_format={fmt!r} is not supported (only the v1 format "
                "'gptq', which AutoGPTQ and GPTQModel write by default)"
            )
        bits = _int(qc, "bits", source)
        if bits not in (4, 8):
            raise ConfigError(f"{source}: GPTQ with bits={bits} is not supported (4 or 8)")
        group = _int(qc, "group_size", source, -1)
        if group != -1 and group <= 0:
            raise ConfigError(f"{source}: GPTQ group_size={group} (a positive size or -1)")
        if _get(qc, "lm_head", False):
            raise ConfigError(
                f"{source}: a GPTQ checkpoint with a quantized lm_head is not supported"
            )
        return QuantScheme("gptq", bits, group, bool(_get(qc, "desc_act", False)))
    bits = _int(qc, "bits", source, _get(qc, "w_bit", 4))
    group = _int(qc, "group_size", source, _get(qc, "q_group_size", 128))
    version = str(_get(qc, "version", "gemm") or "gemm").lower()
    if bits != 4:
        raise ConfigError(f"{source}: AWQ with bits={bits} is not supported (4)")
    if group <= 0:
        raise ConfigError(f"{source}: AWQ group_size={group} (a positive size)")
    if version != "gemm":
        raise ConfigError(
            f"{source}: AWQ version={version!r} is not supported (only the GEMM layout, which "
            "AutoAWQ writes by default)"
        )
    if not _get(qc, "zero_point", True):
        raise ConfigError(f"{source}: AWQ without zero points (zero_point=false) is not supported")
    return QuantScheme("awq", bits, group)


def _block(value, key: str, source: str) -> tuple[int, int]:
    """A block shape [rows, columns] of positive integers."""
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise ConfigError(
            f"{source}: quantization_config {key}={value!r} is not two positive integers"
        )
    return int(value[0]), int(value[1])


def _fp8_scheme(qc, source: str) -> QuantScheme:
    """vLLM's / transformers' `quant_method: fp8`: a scale per tensor or channel, or with
    `weight_block_size` [rows, columns] a scale per block (DeepSeek-V3's fine-grained FP8, its
    scales named `weight_scale_inv`)."""
    block = _get(qc, "weight_block_size")
    if block:
        return QuantScheme("fp8", 8, -1, block=_block(block, "weight_block_size", source))
    return QuantScheme("fp8", 8, -1)


def _compressed_tensors_scheme(qc, source: str) -> QuantScheme:
    """llm-compressor's format: one config group whose `weights` say what the tensors hold."""
    groups = _get(qc, "config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(
            f"{source}: compressed-tensors with {len(groups)} config groups is not supported (one)"
        )
    weights = next(iter(groups.values())).get("weights") or {}
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if kind == "float" and bits == 8:
        if strategy == "block":  # llm-compressor's FP8_BLOCK: weight_scale per block
            block = _block(weights.get("block_structure"), "weights.block_structure", source)
            return QuantScheme("fp8", 8, -1, block=block)
        if strategy not in ("tensor", "channel"):
            raise ConfigError(
                f"{source}: compressed-tensors FP8 weights with strategy={strategy!r} are not "
                "supported ('tensor', 'channel' or 'block')"
            )
        return QuantScheme("fp8", 8, -1)
    fmt = _get(qc, "format")
    if kind == "int" and bits in (4, 8) and fmt == "pack-quantized":
        if not weights.get("symmetric", True):
            raise ConfigError(
                f"{source}: compressed-tensors pack-quantized with asymmetric weights (zero "
                "points) is not supported yet; symmetric (the W4A16 preset) is"
            )
        if strategy == "channel":
            return QuantScheme("packed_int", bits, -1)
        group = weights.get("group_size")
        if strategy != "group" or not isinstance(group, int) or group <= 0:
            raise ConfigError(
                f"{source}: compressed-tensors pack-quantized with strategy={strategy!r}, "
                f"group_size={group!r} is not supported ('group' with a size, or 'channel')"
            )
        return QuantScheme("packed_int", bits, group)
    raise ConfigError(
        f"{source}: compressed-tensors {fmt!r} with {bits}-bit {kind} weights is not supported "
        "yet (float-quantized FP8 and pack-quantized 4/8-bit integers are)"
    )


def check_quantization(requested: str | None, hf_config, source: str) -> QuantScheme | None:
    """The checkpoint's QuantScheme (None: unquantized). Raises ConfigError for what cannot be
    served: squeezellm, a requested method the checkpoint contradicts or lacks, methods not
    built yet, and GPTQ/AWQ variants outside the supported layouts."""
    if requested == "squeezellm":
        raise ConfigError(
            "quantization='squeezellm' is not supported: SqueezeLLM's format was dropped by vLLM "
            "(its checkpoints are few and unmaintained); serve an AWQ, GPTQ or FP8 checkpoint"
        )
    found = checkpoint_quantization(hf_config)
    if requested is not None:
        if found is None:
            raise ConfigError(
                f"quantization={requested!r}, but {source} is not quantized (its config has no "
                "quantization_config): unset QUANTIZATION"
            )
        if _SAME_FORMAT.get(requested, requested) != _SAME_FORMAT.get(found, found):
            raise ConfigError(
                f"quantization={requested!r} contradicts {source}, which is quantized with "
                f"{found!r}: unset QUANTIZATION or set it to {found!r}"
            )
    if found is None:
        return None
    method = _SAME_FORMAT.get(found, found)
    if method not in SERVED:
        raise ConfigError(
            f"{source} is a {found} checkpoint; of the quantized formats only "
            f"{', '.join(SERVED)} are supported so far: serve one of those, its unquantized "
            "model, or a .gguf file (dequantized at load)"
        )
    qc = hf_config.quantization_config
    if method == "fp8":
        return _fp8_scheme(qc, source)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc, source)
    if method == "mxfp4":  # E2M1 values with an E8M0 scale per 32 (kernels/mxfp4.py)
        return QuantScheme("mxfp4", 4, 32)
    return _scheme(method, qc, source)

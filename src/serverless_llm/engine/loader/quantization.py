"""Which quantization a checkpoint uses, and the engine's answer to it (issue 16 item 1).

A quantized checkpoint says how in its config: `quantization_config.quant_method`, as
transformers and the quantizers (AutoGPTQ, AutoAWQ, llm-compressor, ...) write it. The engine's
`quantization` (the QUANTIZATION setting) may name a method too; it must agree with the
checkpoint. The quantized linear layers are not built yet, so every quantized checkpoint is
refused here with its method named, before any weight is read: otherwise the first `qweight`
tensor would fail the weight mapping with an error that says nothing about quantization.
"""

from __future__ import annotations

from ..config import ConfigError

# vLLM's kernel-specific names for the checkpoint formats they read.
_SAME_FORMAT = {"gptq_marlin": "gptq", "awq_marlin": "awq", "marlin": "gptq"}


def checkpoint_quantization(hf_config) -> str | None:
    """The checkpoint's quantization method (lower case), "unknown" for a quantization_config
    without one, or None for an unquantized checkpoint."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    method = getattr(method, "value", method)  # transformers keeps some as an enum
    return str(method).lower() if method else "unknown"


def check_quantization(requested: str | None, hf_config, source: str) -> None:
    """Raises ConfigError for what cannot be served: squeezellm, a requested method the
    checkpoint contradicts or lacks, and (for now) any quantized checkpoint."""
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
    if found is not None:
        raise ConfigError(
            f"{source} is a {found} checkpoint; quantized checkpoints are not supported yet: "
            "serve its unquantized model, or a .gguf file (dequantized at load)"
        )

"""Model classes keyed by `config.architectures`."""

from __future__ import annotations

from .llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


class UnsupportedModelError(ValueError):
    pass


def model_class_for(config) -> type:
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise UnsupportedModelError(
        f"architecture {archs or '(none in config)'} is not supported; supported: "
        f"{', '.join(sorted(MODEL_REGISTRY))}"
    )

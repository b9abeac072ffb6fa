"""From a transformers config to the description of its decoder, by `config.architectures`."""

from __future__ import annotations

from . import (  # noqa: F401
    families_alibi,
    families_conv,
    families_gemma4,
    families_gpt,
    families_gpt_oss,
    families_jamba,
    families_kimi,
    families_linear,
    families_llama4,
    families_mamba,
    families_mla,
    families_moe,
    families_moe2,
    families_remote,
    families_vl,
)
from .decoder import DecoderSpec
from .families import FAMILIES
from .families_encoder import ENCODER_FAMILIES

MODEL_REGISTRY = FAMILIES  # architecture name -> description function


class UnsupportedModelError(ValueError):
    pass


def describe_model(config) -> DecoderSpec:
    """The decoder description of the first architecture in `config.architectures` that a
    family serves; UnsupportedModelError naming every supported one otherwise."""
    archs = list(getattr(config, "architectures", None) or [])
    text_arch = _text_decoder_arch(config)
    if text_arch is not None and not any(a in MODEL_REGISTRY for a in archs):
        # A composite (vision-language) checkpoint whose decoder is a plain causal LM of a
        # served family (LLaVA's Llama, Gemma 3's Gemma 3 text): described as that family.
        spec = describe_model(_with_architectures(config, [text_arch]))
        spec.arch = archs[0]
        return spec
    for arch in archs:
        base = classifier_base(arch)
        if base is not None and arch not in MODEL_REGISTRY:
            spec = describe_model(_with_architectures(config, [base]))
            if getattr(config, "classifier_from_token", None):
                # vLLM's recipe for a causal LM reranker (Qwen3-Reranker): hf_overrides name
                # the classifier architecture and the tokens whose logits score; the
                # checkpoint is the causal LM, served as the engine's yes/no scorer.
                return spec
            return as_classifier(spec, arch, config)
        if arch in MODEL_REGISTRY:
            try:
                spec = MODEL_REGISTRY[arch](config)
            except (ValueError, KeyError, AttributeError, TypeError) as e:
                # An option the engine does not implement, or a config without a field the
                # family needs: a load error naming both, not a crash.
                raise UnsupportedModelError(f"{arch}: {e}") from e
            spec.arch = arch
            return spec
    raise UnsupportedModelError(
        f"architecture {archs or '(none in config)'} is not supported. Supported architectures: "
        f"{', '.join(sorted(MODEL_REGISTRY) + sorted(ENCODER_FAMILIES))}. docs/models.md lists "
        "them with example repositories; a model whose code lives only in its repository (trust_remote_code) is "
        "served when its architecture is one of these."
    )


CLASSIFIER_SUFFIX = "ForSequenceClassification"


def classifier_base(arch: str) -> str | None:
    """The causal LM architecture a decoder `<Family>ForSequenceClassification` is built on
    (Qwen3ForSequenceClassification -> Qwen3ForCausalLM), when a family serves it."""
    if not arch.endswith(CLASSIFIER_SUFFIX):
        return None
    base = arch[: -len(CLASSIFIER_SUFFIX)] + "ForCausalLM"
    return base if base in MODEL_REGISTRY else None


def as_classifier(spec: DecoderSpec, arch: str, config) -> DecoderSpec:
    """The causal LM's description with transformers' sequence-classification head: a
    `score` linear [num_labels, hidden] without bias in place of the LM head."""
    import dataclasses

    names = spec.names
    top = {k: v for k, v in names.top.items() if v not in ("lm_head", "lm_head_bias")}
    top["score"] = "score"
    num_labels = int(getattr(config, "num_labels", None) or len(config.id2label))
    spec = dataclasses.replace(
        spec,
        names=dataclasses.replace(names, top=top),
        num_labels=num_labels,
        tied=False,
        lm_head_bias=False,
    )
    spec.arch = arch
    return spec


def _text_decoder_arch(config) -> str | None:
    """For the text part of a composite config (`loader/multimodal.text_part`), the causal LM
    architecture transformers maps its text config's model type to, when a family serves it."""
    if not getattr(config, "text_part_of", None):
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
    return arch if arch in MODEL_REGISTRY else None


def _with_architectures(config, archs: list[str]):
    import copy

    config = copy.copy(config)
    config.architectures = archs
    return config

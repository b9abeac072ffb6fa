"""From a transformers config to the description of its decoder, by `config.architectures`."""

from __future__ import annotations

from . import (  # noqa: F401
    families_alibi,
    families_conv,
    families_gpt,
    families_jamba,
    families_kimi,
    families_linear,
    families_mamba,
    families_moe,
    families_remote,
)
from .decoder import DecoderSpec
from .families import FAMILIES

MODEL_REGISTRY = FAMILIES  # architecture name -> description function


class UnsupportedModelError(ValueError):
    pass


def describe_model(config) -> DecoderSpec:
    """The decoder description of the first architecture in `config.architectures` that a
    family serves; UnsupportedModelError naming every supported one otherwise."""
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
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
        f"{', '.join(sorted(MODEL_REGISTRY))}. docs/models.md lists them with example "
        "repositories; a model whose code lives only in its repository (trust_remote_code) is "
        "served when its architecture is one of these."
    )

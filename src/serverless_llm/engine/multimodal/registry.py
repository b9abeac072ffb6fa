"""Vision families by composite architecture name. Each family module under `models/vision/`
registers itself with `@vision_family(...)`; this module imports them all."""

from __future__ import annotations

import importlib

from .base import VisionFamily
from .processor_import import defer_modeling

VISION_FAMILIES: dict[str, VisionFamily] = {}

# every module under models/vision/ that registers a family
_MODULES = ("llava", "qwen_vl", "gemma3", "idefics3", "pixtral", "llama4", "gemma4")
_loaded = False


def vision_family(*architectures: str):
    """Class decorator: registers one instance of a VisionFamily for these architectures."""

    def register(cls):
        instance = cls()
        for arch in architectures:
            VISION_FAMILIES[arch] = instance
        return cls

    return register


def _load() -> None:
    global _loaded
    if not _loaded:
        for name in _MODULES:
            importlib.import_module(f"..models.vision.{name}", __package__)
        _loaded = True


def vision_family_of(architectures) -> VisionFamily | None:
    """The vision family of the first of `architectures` that has one, or None."""
    _load()
    for arch in architectures or ():
        if arch in VISION_FAMILIES:
            # Its processor will be built: transformers' processing utilities imported now
            # without their modeling import (processor_import.py).
            defer_modeling()
            return VISION_FAMILIES[arch]
    return None

"""Images in the engine: what a processed image is (`ImageItem`, `MultiModalPrompt`), what a
vision family provides (`VisionFamily`, `VisionTower`), the families by architecture
(`vision_family_of`), and the encoder cache that keeps an image's features between chunks."""

from .base import (
    ImageFeatures,
    ImageItem,
    MultiModalPrompt,
    VisionFamily,
    VisionTower,
    hash_image_data,
)
from .encoder_cache import EncoderCache
from .inputs import MultiModalInput
from .registry import VISION_FAMILIES, vision_family, vision_family_of

__all__ = [
    "VISION_FAMILIES",
    "EncoderCache",
    "ImageFeatures",
    "ImageItem",
    "MultiModalInput",
    "MultiModalPrompt",
    "VisionFamily",
    "VisionTower",
    "hash_image_data",
    "vision_family",
    "vision_family_of",
]

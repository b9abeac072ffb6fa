from .decoder import DecoderModel, DecoderSpec
from .registry import MODEL_REGISTRY, UnsupportedModelError, describe_model

__all__ = [
    "MODEL_REGISTRY",
    "DecoderModel",
    "DecoderSpec",
    "UnsupportedModelError",
    "describe_model",
]

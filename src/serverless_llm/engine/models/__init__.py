from .registry import MODEL_REGISTRY, UnsupportedModelError, model_class_for

__all__ = ["MODEL_REGISTRY", "UnsupportedModelError", "model_class_for"]

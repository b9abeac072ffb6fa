"""Model resolution and weight loading: hub cache or download, local directories, GGUF files.

resolve_model turns what the user named into local files (the only step that may touch the
network); load_hf_config and iter_weights then read those files.
"""

from .base import ModelLoadError, ResolvedModel
from .gguf import embedded_model_path
from .resolve import resolve_model
from .weights import iter_weights, load_hf_config

__all__ = [
    "ModelLoadError",
    "ResolvedModel",
    "embedded_model_path",
    "iter_weights",
    "load_hf_config",
    "resolve_model",
]

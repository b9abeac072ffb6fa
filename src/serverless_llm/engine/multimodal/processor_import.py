"""Building an image processor without importing transformers' modeling machinery.

Every processor and image processor of transformers 5 imports `processing_utils`, which imports
`modeling_utils` (with torch present) for one name, `PreTrainedAudioTokenizerBase`, checked with
`isinstance` when a processor is handed an audio tokenizer. `modeling_utils` brings in
`activations`, `torch._dynamo`, `torch.distributed.tensor` and sympy: the same ~1-2 s of CPU at a
vision-language worker's start that loader/config_import.py keeps out of the config read
(docs/benchmarks.md, issue 42), for processors that never touch a model.

`defer_modeling` imports `processing_utils` once with `modeling_utils` standing in: the one name
it takes is a class whose `isinstance`/`issubclass` checks import the real module and ask its
class, and any other name read from the stand-in imports the real module and answers. The
processors are transformers' own; only when the modeling imports happen changes. The stand-in is
in `sys.modules` only while `processing_utils` imports, so a later `import
transformers.modeling_utils` gets the real module.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types

_MODELING = "transformers.modeling_utils"
_PROCESSING = "transformers.processing_utils"
_DEFERRED = ("PreTrainedAudioTokenizerBase",)
_lock = threading.Lock()


def _real_modeling() -> types.ModuleType:
    module = sys.modules.get(_MODELING)
    if isinstance(module, _StandIn):  # asked for while processing_utils was being imported
        del sys.modules[_MODELING]
    return importlib.import_module(_MODELING)


class _DeferredClass(type):
    """The metaclass of a stand-in for a class of `modeling_utils`: type checks against it are
    answered by the real class, imported then."""

    def _real(cls) -> type:
        return getattr(_real_modeling(), cls.__name__)

    def __instancecheck__(cls, instance) -> bool:
        return isinstance(instance, cls._real())

    def __subclasscheck__(cls, subclass) -> bool:
        return issubclass(subclass, cls._real())


class _StandIn(types.ModuleType):
    """`transformers.modeling_utils` while processing_utils imports: the deferred classes; any
    other name (a newer transformers importing more from it) imports the real module."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(_real_modeling(), name)


def modeling_imported() -> bool:
    """Whether the real `transformers.modeling_utils` is loaded."""
    module = sys.modules.get(_MODELING)
    return module is not None and not isinstance(module, _StandIn)


def defer_modeling() -> bool:
    """Imports transformers' processing utilities with their modeling import deferred, unless
    they are imported already (or this transformers has none); True when this call did it."""
    with _lock:
        if _PROCESSING in sys.modules or _MODELING in sys.modules:
            return False
        try:
            if importlib.util.find_spec(_PROCESSING) is None:
                return False
        except (ImportError, ValueError):
            return False
        stand_in = _StandIn(_MODELING)
        for name in _DEFERRED:
            setattr(stand_in, name, _DeferredClass(name, (), {"__module__": _MODELING}))
        sys.modules[_MODELING] = stand_in
        try:
            importlib.import_module(_PROCESSING)
        except Exception:  # left to the processor's build, which imports it itself and says why
            return False
        finally:
            if sys.modules.get(_MODELING) is stand_in:
                del sys.modules[_MODELING]
        return True

"""Reading a model config without importing transformers' modeling machinery.

In transformers 5 every model's configuration module imports `utils.type_validators`, which
imports `activations` only for `ACT2FN`, the table one validator (`activation_fn_key`) checks
an activation name against. `activations` imports `integrations.hub_kernels`, which pulls in
`torch._dynamo` and `torch.distributed.tensor` (sympy included): about 1.2 s of CPU at every
worker start (docs/benchmarks.md, issue 42), for a config that is read from a JSON file and
never runs an activation.

`defer_activations` imports `type_validators` once with `ACT2FN` bound to a mapping that
imports the real `activations` the first time anything reads it (the validator, or anything
else), so every config class is the one transformers builds, field for field, and the only
change is when the modeling imports happen: only if something needs them. Nothing else is
touched: the stand-in module lives in `sys.modules` only while `type_validators` is imported,
and a later `import transformers.activations` gets the real module.

`defer_models_index` does the like for the package `transformers.models`, whose `__init__` walks
every model's directory and reads its files to index what each exports (~0.2 s of CPU at every
start), while a config read imports only `models.auto` and the model's own configuration module
by their paths. Until something asks the package itself for a name, `sys.modules` holds a
stand-in with the real package's path and spec (so every submodule imports from where it always
does); the first such read imports the real, indexed package in its place and answers from it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from collections.abc import Iterator, Mapping

_ACTIVATIONS = "transformers.activations"
_VALIDATORS = "transformers.utils.type_validators"
_MODELS = "transformers.models"
# Reentrant: `_real_models` imports the real package while holding it, and an attribute read
# through the stand-in during that import (same thread) must not wait on itself.
_lock = threading.RLock()


def _real_activations() -> types.ModuleType:
    module = sys.modules.get(_ACTIVATIONS)
    if isinstance(module, _StandIn):  # asked for while type_validators was being imported
        del sys.modules[_ACTIVATIONS]
    return importlib.import_module(_ACTIVATIONS)


class DeferredActivations(Mapping):
    """transformers' ACT2FN, imported on first use (every read goes to the real table)."""

    def _table(self) -> Mapping:
        return _real_activations().ACT2FN

    def __getitem__(self, key: str):
        return self._table()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __repr__(self) -> str:
        return f"DeferredActivations(imported={activations_imported()})"


class _StandIn(types.ModuleType):
    """`transformers.activations` while type_validators imports: ACT2FN deferred; any other
    name (a newer transformers importing more from it) imports the real module and answers."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(_real_activations(), name)


def activations_imported() -> bool:
    """Whether the real `transformers.activations` (and its modeling imports) is loaded."""
    module = sys.modules.get(_ACTIVATIONS)
    return module is not None and not isinstance(module, _StandIn)


def defer_activations() -> bool:
    """Imports transformers' type validators with ACT2FN deferred, unless they are imported
    already (or this transformers has none); True when this call did it."""
    with _lock:
        if _VALIDATORS in sys.modules or _ACTIVATIONS in sys.modules:
            return False
        try:
            if importlib.util.find_spec(_VALIDATORS) is None:
                return False
        except (ImportError, ValueError):
            return False
        stand_in = _StandIn(_ACTIVATIONS)
        stand_in.ACT2FN = DeferredActivations()
        sys.modules[_ACTIVATIONS] = stand_in
        try:
            importlib.import_module(_VALIDATORS)
        except Exception:  # left to the config read, which imports them itself and says why
            return False
        finally:
            if sys.modules.get(_ACTIVATIONS) is stand_in:
                del sys.modules[_ACTIVATIONS]
        return True


def _real_models() -> types.ModuleType:
    with _lock:
        module = sys.modules.get(_MODELS)
        if isinstance(module, _ModelsStandIn):
            del sys.modules[_MODELS]
            real = importlib.import_module(_MODELS)
            # the submodules imported through the stand-in stay reachable as attributes
            for name, value in vars(module).items():
                if isinstance(value, types.ModuleType) and not hasattr(real, name):
                    setattr(real, name, value)
            parent = sys.modules.get("transformers")
            if parent is not None and getattr(parent, "models", None) is module:
                parent.models = real
            return real
    return importlib.import_module(_MODELS)


class _ModelsStandIn(types.ModuleType):
    """`transformers.models` before its index is needed: the real package's `__path__` and
    spec, so `transformers.models.<family>.<module>` imports as always; any other name read
    from the package itself imports the real one (`_real_models`) and answers from it."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(_real_models(), name)


def models_index_deferred() -> bool:
    """Whether `transformers.models` is still the stand-in (its index not built)."""
    return isinstance(sys.modules.get(_MODELS), _ModelsStandIn)


def defer_models_index() -> bool:
    """Puts the stand-in for `transformers.models` in place unless the package is imported
    already (or cannot be found); True when this call did it."""
    with _lock:
        if _MODELS in sys.modules:
            return False
        try:
            spec = importlib.util.find_spec(_MODELS)
        except (ImportError, ValueError):
            return False
        if spec is None or not spec.submodule_search_locations:
            return False
        stand_in = _ModelsStandIn(_MODELS)
        stand_in.__spec__ = spec
        stand_in.__path__ = list(spec.submodule_search_locations)
        stand_in.__file__ = spec.origin
        stand_in.__package__ = _MODELS
        sys.modules[_MODELS] = stand_in
        return True

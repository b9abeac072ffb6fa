"""What a kernel launch compiles to, told by Triton's own code, and a recorder of launches.

A Triton launch compiles one *specialisation* of its kernel: Triton's binder turns the call's
arguments into a list of (type, fact) pairs, one per parameter: a tensor's element type and
whether its address is a multiple of 16; an int's width and whether it is a multiple of 16, an
int equal to 1 made a constant; a constexpr's value. With the launch options (num_warps,
num_stages, debug...) that list is the key of the kernel's in-memory cache, and the compiled
source built from it is the key of Triton's on-disk cache. `LaunchSpec` is that pair, computed
by Triton's own binder (`create_function_from_signature` + `native_specialize_impl`) from a
launch's real arguments, so it is exactly what a GPU launch of the same call would ask for.

`record_launches` wraps every Triton launch of the process (compiled or interpreted) and
records its LaunchSpec; `execute=False` records without running (nor compiling) anything, which
is how the engine lists the specialisations a model can launch (engine/kernel_warmup.py).
`compile_spec` compiles one LaunchSpec for a target through the same steps as
`JITFunction.run` (so its on-disk key is the one the runtime asks for), with or without a GPU.

Triton is imported only when these functions run (see triton_lazy.py).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LaunchSpec:
    """One specialisation: the kernel (module and name), Triton's (type, fact) pair per
    parameter (("constexpr", value) for a constexpr) and the launch options."""

    module: str
    name: str
    specialization: tuple
    options: tuple  # sorted (name, value) pairs, as the launch passed them to Triton's binder

    @property
    def kernel(self) -> str:
        return f"{self.module}.{self.name}"

    def constexprs(self, param_names: list[str]) -> dict[str, Any]:
        return {n: s[1] for n, s in zip(param_names, self.specialization) if s[0] == "constexpr"}

    def label(self) -> str:
        facts = ",".join(f"{t}{'' if a in (None, '') else ':' + str(a)}" for t, a in
                         self.specialization)  # fmt: skip
        opts = ",".join(f"{k}={v}" for k, v in self.options if k in ("num_warps", "num_stages"))
        return f"{self.name}[{opts}]({facts})"


def _triton():
    from .triton_lazy import require_triton

    return require_triton()


# Triton's base backend decides the specialisation facts (alignment to 16, ints equal to 1); the
# CUDA backend inherits them, so the facts do not depend on the target's architecture.
_binders: dict[Any, tuple[Any, Any]] = {}
_binders_lock = threading.Lock()


def jit_function_of(fn) -> Any:
    """A Triton JITFunction over the kernel's plain Python function: the module's own when the
    module is bound and not interpreted, else a fresh one (for its parameters and binder)."""
    _triton()
    from triton.runtime.jit import JITFunction

    with _binders_lock:
        cached = _binders.get(fn)
        if cached is None:
            from triton.backends.compiler import BaseBackend
            from triton.runtime.jit import create_function_from_signature

            jf = JITFunction(fn)
            binder = create_function_from_signature(jf.signature, jf.params, BaseBackend)
            cached = _binders[fn] = (jf, binder)
    return cached


def runtime_options(jf, kwargs: dict) -> dict:
    """The launch keyword arguments as `JITFunction.run` completes them before binding."""
    from triton import knobs

    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", jf.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    return kwargs


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, tuple):
        return tuple(_hashable(v) for v in value)
    return value


def spec_of(fn, args: tuple, kwargs: dict) -> LaunchSpec:
    """The LaunchSpec of launching `fn` (the kernel's Python function) with these arguments."""
    jf, binder = jit_function_of(fn)
    _, specialization, options = binder(*args, **runtime_options(jf, kwargs))
    return LaunchSpec(
        fn.__module__,
        fn.__name__,
        _hashable(tuple(specialization)),
        tuple(sorted((k, _hashable(v)) for k, v in options.items())),
    )


@dataclass(eq=False)  # each is itself: nested recorders that saw the same launches stay apart
class LaunchRecorder:
    """The LaunchSpecs launched inside `record_launches`, in first-launch order, with how many
    times each was launched."""

    execute: bool
    counts: dict[LaunchSpec, int] = field(default_factory=dict)

    @property
    def specs(self) -> list[LaunchSpec]:
        return list(self.counts)

    def add(self, spec: LaunchSpec) -> None:
        self.counts[spec] = self.counts.get(spec, 0) + 1


_active: list[LaunchRecorder] = []
_patch_lock = threading.Lock()


@contextlib.contextmanager
def record_launches(execute: bool = True) -> Iterator[LaunchRecorder]:
    """Records every Triton kernel launch of the process while open. `execute=False`: the
    launches are recorded only (nothing runs or compiles; their outputs stay as allocated)."""
    triton = _triton()
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    recorder = LaunchRecorder(execute)
    with _patch_lock:
        if not _active:
            _patch(JITFunction)
            _patch(InterpretedFunction)
        _active.append(recorder)
    try:
        yield recorder
    finally:
        with _patch_lock:
            _active.remove(recorder)
            if not _active:
                _unpatch(JITFunction)
                _unpatch(InterpretedFunction)
    del triton


def _patch(cls) -> None:
    original = cls.run

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup and _active:
            spec = spec_of(self.fn, args, kwargs)
            for recorder in _active:
                recorder.add(spec)
            if not all(r.execute for r in _active):
                return None
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    run._launch_keys_original = original  # type: ignore[attr-defined]
    cls.run = run


def _unpatch(cls) -> None:
    cls.run = cls.run._launch_keys_original


# -- compiling a spec ------------------------------------------------------------------------------


def kernel_function(spec: LaunchSpec) -> Any:
    """The module's Triton JIT function for the spec's kernel (binding the module, see
    triton_lazy), as the launcher's own launch would use."""
    from .triton_lazy import LazyKernel

    module = importlib.import_module(spec.module)
    value = getattr(module, spec.name)
    return value.jit if isinstance(value, LazyKernel) else value


def compile_source(spec: LaunchSpec, target) -> tuple[Any, Any, Any]:
    """(ASTSource, backend, parsed options) of the spec for `target`: the steps of
    `JITFunction.run` / `_pack_args` after its binder, from the recorded specialisation."""
    from triton.compiler import ASTSource, make_backend

    jf = kernel_function(spec)
    backend = make_backend(target)
    names = [p.name for p in jf.params]
    bound = {n: (s[1] if s[0] == "constexpr" else None) for n, s in zip(names, spec.specialization)}
    options, signature, constexprs, attrs = jf._pack_args(
        backend, dict(spec.options), bound, [tuple(s) for s in spec.specialization],
        dict(spec.options),
    )  # fmt: skip
    return ASTSource(jf, signature, constexprs, attrs), backend, options


def cache_key(spec: LaunchSpec, target) -> str:
    """The on-disk cache entry (Triton's sha256 of its cache key) the spec compiles to on
    `target`: what `triton.compile` computes before looking in the cache."""
    import hashlib

    from triton.compiler.compiler import get_cache_invalidating_env_vars, get_cache_key

    src, backend, options = compile_source(spec, target)
    # triton.compile's own first steps: the source's options over the launch's, then the key.
    options = backend.parse_options(dict(options.__dict__, **src.parse_options()))
    key = get_cache_key(src, backend, options, env_vars=get_cache_invalidating_env_vars())
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def compile_spec(spec: LaunchSpec, target=None) -> Any:
    """Compiles the spec for `target` (default: the current GPU) into Triton's cache; no GPU is
    needed for an explicit target."""
    triton = _triton()
    src, _, options = compile_source(spec, target or _current_target())
    return triton.compile(src, target=target or _current_target(), options=options.__dict__)


def _current_target():
    from triton.runtime.driver import driver

    return driver.active.get_current_target()


def cuda_target(arch: int):
    """Triton's target for an NVIDIA architecture given as 80, 86, 90, 100..."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, 32)

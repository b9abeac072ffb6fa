"""Triton, imported at a kernel's first launch instead of with the kernel's module.

Each kernel module holds a Triton kernel and its torch reference side by side, and the references
are what the CPU path runs. That path must never import Triton: the CPU build of torch does not
bring it, the runtime requirements do not install it, and where it is installed importing it
still costs start-up time. So no kernel module imports Triton. Its kernels are decorated with
`jit` from here, which keeps the plain function until a kernel of that module is first launched,
and its launchers size grids with `next_power_of_2` and `cdiv` (plain Python, Triton's results).

The first launch imports Triton, binds `tl` (triton.language) in the kernel module's globals, where
the kernel bodies look it up (Triton's compiler and its interpreter both resolve a kernel's names
in its module; so each kernel module starts with `tl = None`), and replaces every `jit` function of
that module by its Triton JIT function, so kernels calling kernels call JIT functions. A `jit`
helper imported from another kernel module (kernels/triton_common.py's shared helpers,
kernels/e4m3.py's codec) is bound in its own module first, where its body finds `tl`, and the
importing module gets that same JIT function.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any


def require_triton() -> ModuleType:
    """The triton package; ImportError when it is not installed."""
    import triton  # the point of this module: Triton is imported on the kernel path only

    return triton


class LazyKernel:
    """A kernel function, until the first launch of its module's kernels makes it a JIT function.
    The module's own name for it then holds the JIT function, so only the first launch, and
    callers that kept this object, go through here."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    @property
    def jit(self) -> Any:
        """The Triton JIT function (or the interpreter's stand-in under TRITON_INTERPRET=1)."""
        return _bind_module(self.fn.__globals__)[self.fn.__name__]

    def __getitem__(self, grid) -> Callable:
        return self.jit[grid]


def jit(fn: Callable) -> LazyKernel:
    """`triton.jit`, deferred to the module's first launch (see the module docstring)."""
    return LazyKernel(fn)


def _bind_module(namespace: dict[str, Any]) -> dict[str, Any]:
    triton = require_triton()
    namespace["tl"] = triton.language
    for name, value in list(namespace.items()):
        if isinstance(value, LazyKernel):
            if value.fn.__globals__ is namespace:
                namespace[name] = triton.jit(value.fn)
            else:  # a helper imported from another kernel module: bound there, shared here
                namespace[name] = value.jit
    return namespace


def next_power_of_2(n: int) -> int:
    """As `triton.next_power_of_2` for n >= 0 (0 gives 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """As `triton.cdiv`: a / b rounded up."""
    return -(-a // b)

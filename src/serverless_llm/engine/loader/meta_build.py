"""Building a model on the meta device without torch's Python reference kernels.

A few operations on meta tensors run torch's Python references (torch._refs) instead of C++
meta kernels, and their first use imports heavy parts of torch: `nn.init.normal_` (every
`nn.Embedding`'s initialisation) imports torch._dynamo and sympy (~1 s of CPU), and
`torch.empty_like` in its default `preserve_format` (`Module.to_empty`, which gives a meta model
its storage) imports sympy (~0.3 s). Nothing else on a CPU worker's path to its first token
needs them (docs/benchmarks.md, issue 42).

`quiet_meta()` is a torch function mode for the build and the materialisation: an initialiser
called on a meta tensor returns it untouched (a meta tensor holds no values to set; the weights
are loaded or initialised after materialising), and `empty_like` of a contiguous meta tensor
asks for the contiguous layout, which is what preserving a contiguous tensor's layout gives.
Every other call runs as it would without the mode.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# Every public initialiser of torch.nn.init (they take the tensor first, or as `tensor=`).
INITIALIZERS = frozenset(
    getattr(torch.nn.init, name)
    for name in dir(torch.nn.init)
    if name.endswith("_") and not name.startswith("_") and callable(getattr(torch.nn.init, name))
)


def _is_meta(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


class quiet_meta(TorchFunctionMode):  # noqa: N801 - used as a context manager, like torch.device
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in INITIALIZERS:
            tensor = args[0] if args else kwargs.get("tensor")
            if _is_meta(tensor):
                return tensor
        elif func is torch.empty_like and args and _is_meta(args[0]):
            if "memory_format" not in kwargs and args[0].is_contiguous():
                kwargs = {**kwargs, "memory_format": torch.contiguous_format}
        return func(*args, **kwargs)

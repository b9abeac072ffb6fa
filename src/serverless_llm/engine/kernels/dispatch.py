"""Which implementation a layer runs: the Triton kernel or its torch reference.

Importing this module never imports Triton: the CPU build of torch does not ship it, and the CPU
default path is the torch reference. Triton runs on CUDA tensors, and on CPU tensors only when it
is forced (`ATTENTION_BACKEND=triton`) and the interpreter is on (`TRITON_INTERPRET=1`), which
is how the kernels are tested on machines without a GPU.
"""

from __future__ import annotations

import os

import torch

BACKEND_ENV = "ATTENTION_BACKEND"
KERNEL_BACKENDS = ("auto", "torch", "triton")


def interpreter_enabled() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run as numpy on the CPU (slow; tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() == "1"


def env_backend() -> str:
    """ATTENTION_BACKEND from the environment, lower-cased; `auto` when unset or empty."""
    value = os.environ.get(BACKEND_ENV, "").strip().lower()
    return value or "auto"


def use_triton(x: torch.Tensor) -> bool:
    """Whether a layer given `x` should run its Triton kernel.

    Read on every call (a dict lookup) so tests can flip the environment without reloading.
    """
    mode = env_backend()
    if mode == "torch":
        return False
    if x.is_cuda:
        return True
    return mode == "triton" and x.device.type == "cpu" and interpreter_enabled()

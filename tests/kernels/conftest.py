"""Without CUDA, kernel tests run Triton's interpreter on the CPU. TRITON_INTERPRET must be set
before Triton is imported (it reads the variable then), so tests/conftest.py sets it before any
test module is collected, and this file again for runs rooted here. With CUDA (and TRITON_INTERPRET not set to 1) the same tests run the compiled
kernels on the GPU (see `tests.kernels.batch.DEVICE`). Test modules that need Triton skip when
it is not installed."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _speed_up_interpreted_dot() -> None:
    """The interpreter computes `tl.dot` as `np.matmul(a, b, dtype=float32)`, which numpy runs
    as a plain loop (~300x slower than BLAS); it dominates the attention tests' time. For
    float16/float32 operands, converting to float32 first and multiplying there is the same
    math (fp16 products are exact in fp32, accumulation in fp32) in another summation order.
    A single-threaded einsum, not BLAS: BLAS thread pools stall for tens of ms per call on a
    busy 2-core machine. Anything else (bf16, fp8, int) keeps the interpreter's own path. If
    Triton's internals move, the patch is skipped and tests are only slower."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    original = getattr(builder, "create_dot", None)
    if builder is None or handle is None or original is None:
        return
    fast_types = (np.dtype(np.float16), np.dtype(np.float32))

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype in fast_types and b.data.dtype in fast_types and d.data.dtype == np.float32:
            a32 = np.ascontiguousarray(a.data, dtype=np.float32)
            b32 = np.ascontiguousarray(b.data, dtype=np.float32)
            prod = np.einsum("ij,jk->ik", a32, b32)
            return handle(prod + d.data, d.dtype.scalar)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _speed_up_interpreted_dot()

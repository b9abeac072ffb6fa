"""The marks of tests that need compiled kernels on a CUDA device (`pytest -m gpu`): skipped
without one, and under TRITON_INTERPRET=1 (the interpreter, not the device, would run them)."""

from __future__ import annotations

import os

import pytest
import torch

GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1",
        reason="TRITON_INTERPRET=1 is set: these tests are for compiled kernels",
    ),
]

"""builder/compile_kernels.py's architecture list (the Dockerfile's KERNEL_ARCH_LIST)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _builder():
    spec = importlib.util.spec_from_file_location(
        "compile_kernels", ROOT / "builder" / "compile_kernels.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arch_list_reads_torch_cuda_arch_list_style():
    b = _builder()
    assert b.arches(b.DEFAULT_ARCHES) == [80, 86, 89, 90, 100]
    assert b.arches("8.0;9.0+PTX, 12.0") == [80, 90, 120]


def test_dockerfile_bakes_kernels_with_the_default_list():
    text = (ROOT / "Dockerfile").read_text()
    b = _builder()
    assert f'ARG KERNEL_ARCH_LIST="{b.DEFAULT_ARCHES}"' in text
    assert "builder/compile_kernels.py" in text and "BAKED_TRITON_CACHE_DIR" in text

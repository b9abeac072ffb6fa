"""Fixtures shared by the engine's GGUF tests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


@pytest.fixture
def no_conversion(monkeypatch):
    """The converter must not run; the config/tokenizer writer copies them from the float
    checkpoint beside the file, in `float/` (transformers reads both from a full GGUF file; the
    tests' tiny files hold tensors only). Returns the GGUF paths whose metadata was written."""
    from serverless_llm.engine.loader import gguf as gguf_mod

    def must_not_convert(*args, **kwargs):
        raise AssertionError("a float copy was converted")

    monkeypatch.setattr(gguf_mod, "convert_gguf", must_not_convert)
    written = []

    def metadata(gguf_path, out_dir, show_progress=True):
        written.append(gguf_path)
        src = Path(gguf_path).parent / "float"
        for f in os.listdir(src):
            if not f.endswith(".safetensors"):
                shutil.copy(src / f, out_dir)

    monkeypatch.setattr(gguf_mod, "write_gguf_metadata", metadata)
    return written

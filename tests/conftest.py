"""Shared fixtures: tiny random models (built once per session) and the embedded SmolLM2,
converted once per session. Nothing here reaches a model hub."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Triton reads TRITON_INTERPRET when it is imported, and some libraries the tests import at
# collection import it (peft does): so it is set here, before any test module, not only in
# tests/kernels/conftest.py (which documents it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from tests.tiny_models import build_tiny_model  # noqa: E402

TINY_KINDS = ("llama", "llama3", "llama_tied", "mistral", "qwen2")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {kind: build_tiny_model(str(root / kind), kind) for kind in TINY_KINDS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory) -> str:
    """Where the session converts the embedded GGUF once (shared by every test using it)."""
    return str(tmp_path_factory.mktemp("model-cache"))


@pytest.fixture(scope="session")
def smollm2_dir(model_cache_dir) -> str:
    """SmolLM2-135M-Instruct as a safetensors directory (converted from the embedded GGUF)."""
    from serverless_llm.engine.config import EngineConfig
    from serverless_llm.engine.loader import resolve_model

    config = EngineConfig(model=None, download_dir=model_cache_dir, quantized_weights="dequantize")
    return resolve_model(config).model_dir

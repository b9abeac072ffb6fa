"""A GPT-shaped family end to end on the Triton backend (the interpreter on CPU, see
conftest.py), against transformers at a reduced size: 2 prompts, 8 greedy tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.engine.family_check import assert_matches_transformers, save_family_model  # noqa: E402
from tests.engine.test_families_gpt import CONFIGS  # noqa: E402
from tests.tiny_models import build_tokenizer  # noqa: E402


def test_phi_on_triton_backend(tmp_path):
    """Phi: partial rotary (neox), LayerNorm with bias (the layer's and the q/k LayerNorm shared
    by the heads) and gelu_new through their kernels, attention and MLP side by side."""
    path = save_family_model(str(tmp_path / "phi"), CONFIGS["phi"](build_tokenizer()))
    assert_matches_transformers(path, new_tokens=8, lengths=(3, 20), attention_backend="triton")

"""Granite 4.0-H (Mamba-2 layers beside attention, issue 35) end to end on the Triton backend (the
interpreter on CPU, see conftest.py), against transformers at a reduced size: 2 prompts, 8 greedy
tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.engine.family_check import assert_matches_transformers, save_family_model  # noqa: E402
from tests.engine.test_families_mamba import CONFIGS  # noqa: E402
from tests.tiny_models import build_tokenizer  # noqa: E402


def test_granite_4_h_on_triton_backend(tmp_path):
    """The Mamba-2 mixer through the Triton convolution, SSD scan (a 20-token prompt chunk and
    decodes) and gated RMSNorm kernels, beside paged attention and the fused MoE kernels."""
    name = "granitemoehybrid"
    path = save_family_model(str(tmp_path / name), CONFIGS[name](build_tokenizer()))
    assert_matches_transformers(path, new_tokens=8, lengths=(3, 20), attention_backend="triton")

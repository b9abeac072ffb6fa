"""Jamba end to end on the Triton backend (the interpreter on CPU, see conftest.py) against
transformers at a reduced size, 2 prompts, 8 greedy tokens: the Mamba layers' convolution,
selective scan and inner RMSNorms, the fused MoE kernels and paged attention, all as Triton
kernels in one model."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.engine.family_check import assert_matches_transformers, save_family_model  # noqa: E402
from tests.engine.test_families_jamba import CONFIGS  # noqa: E402
from tests.tiny_models import build_tokenizer  # noqa: E402


def test_jamba_on_triton_backend(tmp_path):
    path = save_family_model(str(tmp_path / "jamba"), CONFIGS["jamba"](build_tokenizer()))
    assert_matches_transformers(path, new_tokens=8, lengths=(3, 20), attention_backend="triton")

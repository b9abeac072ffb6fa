"""gpt-oss end to end on the Triton backend (the interpreter on CPU) against transformers at a
reduced size: the paged attention kernel with sinks on sliding (16-token window, shorter than
the prompt and its continuation) and full layers, the fused MoE kernel with expert biases and
the clamped SwiGLU; 2 prompts, 8 greedy tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.engine.family_check import assert_matches_transformers, save_family_model  # noqa: E402
from tests.engine.test_families_gpt_oss import gpt_oss_config  # noqa: E402


def test_gpt_oss_on_triton_backend(tmp_path):
    path = save_family_model(str(tmp_path / "gpt_oss"), gpt_oss_config(None))
    assert_matches_transformers(path, new_tokens=8, lengths=(3, 20), attention_backend="triton")

"""gpt-oss end to end on the Triton backend (the interpreter on CPU) against transformers at a
reduced size: the paged attention kernel with sinks on sliding (16-token window, shorter than
the prompt and its continuation) and full layers, the fused MoE kernel with expert biases and
the clamped SwiGLU, and the MXFP4 MoE kernel on an MXFP4 checkpoint; 2 prompts, 8 greedy
tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.engine.family_check import assert_matches_transformers, save_family_model  # noqa: E402
from tests.engine.mxfp4_pack import write_mxfp4_checkpoint  # noqa: E402
from tests.engine.test_families_gpt_oss import gpt_oss_config  # noqa: E402


def test_gpt_oss_on_triton_backend(tmp_path):
    path = save_family_model(str(tmp_path / "gpt_oss"), gpt_oss_config(None))
    assert_matches_transformers(path, new_tokens=8, lengths=(3, 20), attention_backend="triton")


def test_gpt_oss_mxfp4_experts_on_triton_backend(tmp_path):
    """The MXFP4 checkpoint with its experts kept 4-bit: the MXFP4 MoE kernel in the model."""
    path = save_family_model(str(tmp_path / "gpt_oss"), gpt_oss_config(None))
    write_mxfp4_checkpoint(path, str(tmp_path / "mxfp4"))
    assert_matches_transformers(
        str(tmp_path / "mxfp4"), new_tokens=8, lengths=(3, 20), attention_backend="triton",
        quantized_weights="packed",
    )  # fmt: skip

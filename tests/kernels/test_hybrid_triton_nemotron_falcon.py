"""Nemotron-H and Falcon-H1 (Mamba-2 hybrids, issue 35) end to end on the Triton backend (the
interpreter on CPU, see conftest.py), against transformers at a reduced size: 2 prompts, 8 greedy
tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.engine.family_check import assert_matches_transformers, save_family_model  # noqa: E402
from tests.engine.test_families_mamba import CONFIGS  # noqa: E402
from tests.tiny_models import build_tokenizer  # noqa: E402


@pytest.mark.parametrize("name", ["nemotron_h", "falcon_h1"])
def test_on_triton_backend(tmp_path, name):
    """Nemotron-H: Mamba-2 blocks with decode time steps outside the limit, attention without
    positions, the relu^2 MLP and the latent MoE of non-gated experts through the Triton kernels.
    Falcon-H1: attention and Mamba-2 side by side in every layer (paged KV and a state), its
    multipliers folded into the weights."""
    path = save_family_model(str(tmp_path / name), CONFIGS[name](build_tokenizer()))
    assert_matches_transformers(path, new_tokens=8, lengths=(3, 20), attention_backend="triton")

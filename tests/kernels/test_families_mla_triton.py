"""Latent attention families end to end on the Triton backend (the interpreter on CPU, see
conftest.py) against transformers at a reduced size: DeepSeek V3 (query LoRA, YaRN) dense and
with its MoE block, prompts prefilled whole and in chunks of 8 tokens (a chunk with context
reads its latents back from the cache), then decoded by the absorbed kernel."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.engine.family_check import assert_matches_transformers, save_family_model  # noqa: E402
from tests.engine.test_families_mla import CONFIGS  # noqa: E402
from tests.tiny_models import build_tokenizer  # noqa: E402


@pytest.mark.parametrize(
    "name,chunk", [("deepseek_v3", None), ("deepseek_v3", 8), ("deepseek_v3_moe", None)]
)
def test_mla_family_on_triton_backend(tmp_path, name, chunk):
    path = save_family_model(str(tmp_path / name), CONFIGS[name](build_tokenizer()))
    kw = {} if chunk is None else {"max_num_batched_tokens": chunk}
    assert_matches_transformers(
        path, new_tokens=8, lengths=(3, 20), attention_backend="triton", **kw
    )

"""Pooling settings read from a sentence-transformers layout (modules.json, 1_Pooling/), and
the pooled vectors they give against transformers' final hidden states."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers

from serverless_llm.engine.config import ConfigError
from serverless_llm.engine.pooling import PoolingParams, sentence_transformers_pooling
from serverless_llm.llm import LLM

TEXT = "Paged attention stores keys and values in fixed-size blocks."


def st_layout(src: str, dst, pooling: dict, normalize: bool) -> str:
    shutil.copytree(src, dst)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    (dst / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **pooling})
    )
    return str(dst)


def test_no_layout_is_none(tiny_llama):
    assert sentence_transformers_pooling(tiny_llama) == (None, None)
    assert sentence_transformers_pooling(None) == (None, None)


@pytest.mark.parametrize("normalize", [True, False])
def test_mean_layout_picks_mean_and_normalisation(tiny_llama, tmp_path, normalize):
    d = st_layout(tiny_llama, tmp_path / "m", {"pooling_mode_mean_tokens": True}, normalize)
    assert sentence_transformers_pooling(d) == ("mean", normalize)
    llm = LLM(d, task="embed", dtype="float32", num_kv_blocks=16, max_model_len=64)
    assert llm.engine.pooling == PoolingParams("mean", normalize)
    (out,) = llm.embed(TEXT)
    model = transformers.AutoModel.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0].mean(0)
    if normalize:
        ref = torch.nn.functional.normalize(ref, dim=-1)
    np.testing.assert_allclose(out.outputs.embedding, ref.numpy(), atol=1e-5)


def test_lasttoken_layout_and_settings_override(tiny_llama, tmp_path):
    d = st_layout(tiny_llama, tmp_path / "l", {"pooling_mode_lasttoken": True}, True)
    assert sentence_transformers_pooling(d) == ("last", True)
    llm = LLM(
        d, task="embed", pooling_type="mean", normalize=False, num_kv_blocks=16, max_model_len=64
    )
    assert llm.engine.pooling == PoolingParams("mean", False)


def test_cls_layout_pools_the_first_row(tiny_llama, tmp_path):
    d = st_layout(tiny_llama, tmp_path / "c", {"pooling_mode_cls_token": True}, True)
    assert sentence_transformers_pooling(d) == ("cls", True)
    llm = LLM(d, task="embed", dtype="float32", num_kv_blocks=16, max_model_len=64)
    assert llm.engine.pooling == PoolingParams("cls", True)
    (out,) = llm.embed(TEXT)
    model = transformers.AutoModel.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0, 0]
    ref = torch.nn.functional.normalize(ref, dim=-1)
    np.testing.assert_allclose(out.outputs.embedding, ref.numpy(), atol=1e-5)


def test_max_pooling_is_refused_naming_it(tiny_llama, tmp_path):
    d = st_layout(tiny_llama, tmp_path / "x", {"pooling_mode_max_tokens": True}, True)
    with pytest.raises(ConfigError, match="pooling_mode_max_tokens"):
        LLM(d, task="embed", num_kv_blocks=16, max_model_len=64)
    # POOLING_TYPE set: the layout's mode is not needed
    llm = LLM(d, task="embed", pooling_type="last", num_kv_blocks=16, max_model_len=64)
    assert llm.engine.pooling == PoolingParams("last", True)


def test_bad_task_and_pooling_type_are_config_errors(tiny_llama):
    with pytest.raises(ConfigError, match="task="):
        LLM(tiny_llama, task="bogus")
    with pytest.raises(ConfigError, match="pooling_type="):
        LLM(tiny_llama, task="embed", pooling_type="max")

"""Older GPTQ and AWQ repos keep their quantization settings in a file of their own rather
than in config.json: AutoGPTQ's `quantize_config.json` (often without `quant_method`) and
AutoAWQ's `quant_config.json` (`w_bit`, `q_group_size`, `version`). The loader reads them
when config.json has no `quantization_config`, and the hub download fetches them."""

from __future__ import annotations

import json
import os

import pytest

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.loader.hub import MODEL_PATTERNS
from tests.engine.reference import hf_greedy
from tests.engine.test_engine_vs_transformers import prompts_for
from tests.quant_checkpoints import write_quantized
from tests.tiny_models import build_tiny_model


def _move_config(quant_dir: str, file_name: str, qc: dict) -> None:
    path = os.path.join(quant_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    del cfg["quantization_config"]
    with open(path, "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(quant_dir, file_name), "w") as f:
        json.dump(qc, f)


@pytest.mark.parametrize(
    ("method", "file_name", "qc"),
    [
        (
            "gptq",
            "quantize_config.json",
            {"bits": 4, "group_size": 32, "desc_act": True, "sym": False, "damp_percent": 0.01},
        ),
        (
            "awq",
            "quant_config.json",
            {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"},
        ),
    ],
)
def test_a_side_file_gives_the_scheme(tmp_path, method, file_name, qc):
    src = build_tiny_model(
        str(tmp_path / "src"), "llama", seed=7, hidden_size=96, intermediate_size=160
    )
    float_dir, quant_dir = write_quantized(
        src, str(tmp_path / "float"), str(tmp_path / "quant"), method, 4, 32, method == "gptq"
    )
    _move_config(quant_dir, file_name, qc)
    llm = LLM(quant_dir, block_size=8, num_kv_blocks=64)
    assert llm.engine.model.quantization.startswith(f"{method} 4-bit group 32")
    prompt = prompts_for(llm.engine.vocab_size, seed=5)[3]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(float_dir, prompt, 16)


def test_the_hub_download_fetches_the_side_files():
    assert {"quantize_config.json", "quant_config.json"} <= set(MODEL_PATTERNS)

"""Quantized checkpoints are recognised from their config and refused with their method named,
before any weight is read; QUANTIZATION must agree with the checkpoint; squeezellm gets its own
answer (issue 16 item 1; the quantized layers themselves are not built yet)."""

from __future__ import annotations

import json
import shutil

import pytest

from serverless_llm import LLM
from serverless_llm.engine import model_builder
from serverless_llm.engine.config import ConfigError
from serverless_llm.engine.loader.quantization import checkpoint_quantization


def _quantized_copy(src: str, tmp_path, qc: dict | None) -> str:
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if qc is not None:
        cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.fixture
def no_weight_reads(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("weights were read")

    monkeypatch.setattr(model_builder, "iter_weights", refuse)


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}


def test_a_quantized_checkpoint_is_refused_with_its_method(tiny_llama, tmp_path, no_weight_reads):
    model = _quantized_copy(tiny_llama, tmp_path, GPTQ)
    with pytest.raises(ConfigError, match="is a gptq checkpoint; quantized checkpoints are not"):
        LLM(model, num_kv_blocks=16)


@pytest.mark.parametrize(
    ("requested", "message"),
    [
        ("awq", "quantization='awq' contradicts .* quantized with 'gptq'"),
        ("gptq_marlin", "is a gptq checkpoint"),  # the same format under vLLM's kernel name
        ("gptq", "is a gptq checkpoint"),
    ],
)
def test_quantization_must_agree_with_the_checkpoint(
    tiny_llama, tmp_path, no_weight_reads, requested, message
):
    model = _quantized_copy(tiny_llama, tmp_path, GPTQ)
    with pytest.raises(ConfigError, match=message):
        LLM(model, num_kv_blocks=16, quantization=requested)


def test_quantization_on_an_unquantized_checkpoint(tiny_llama, no_weight_reads):
    with pytest.raises(ConfigError, match="quantization='fp8', but .* is not quantized"):
        LLM(tiny_llama, num_kv_blocks=16, quantization="fp8")


def test_squeezellm_has_its_own_answer(tiny_llama, no_weight_reads):
    with pytest.raises(ConfigError, match="'squeezellm' is not supported: SqueezeLLM's format"):
        LLM(tiny_llama, num_kv_blocks=16, quantization="squeezellm")


def test_checkpoint_quantization_reads_dicts_objects_and_gaps():
    class Cfg:
        def __init__(self, qc):
            self.quantization_config = qc

    class Obj:
        quant_method = "AWQ"

    assert checkpoint_quantization(Cfg(None)) is None
    assert checkpoint_quantization(Cfg({})) is None
    assert checkpoint_quantization(Cfg({"quant_method": "compressed-tensors"})) == (
        "compressed-tensors"
    )
    assert checkpoint_quantization(Cfg(Obj())) == "awq"
    assert checkpoint_quantization(Cfg({"bits": 4})) == "unknown"

"""Quantized checkpoints are recognised from their config: GPTQ and AWQ read into a QuantScheme,
other methods and unsupported variants refused with the reason named before any weight is read;
QUANTIZATION must agree with the checkpoint; squeezellm gets its own answer (issue 16 item 1)."""

from __future__ import annotations

import json
import shutil

import pytest

from serverless_llm import LLM
from serverless_llm.engine import model_builder
from serverless_llm.engine.config import ConfigError
from serverless_llm.engine.loader.quantization import (
    QuantScheme,
    check_quantization,
    checkpoint_quantization,
)


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


def test_an_unserved_method_is_refused_with_its_name(tiny_llama, tmp_path, no_weight_reads):
    model = _quantized_copy(tiny_llama, tmp_path, {"quant_method": "bitsandbytes"})
    with pytest.raises(ConfigError, match="is a bitsandbytes checkpoint; of the quantized"):
        LLM(model, num_kv_blocks=16)


def test_quantization_must_agree_with_the_checkpoint(tiny_llama, tmp_path, no_weight_reads):
    model = _quantized_copy(tiny_llama, tmp_path, GPTQ)
    with pytest.raises(
        ConfigError, match="quantization='awq' contradicts .* quantized with 'gptq'"
    ):
        LLM(model, num_kv_blocks=16, quantization="awq")


class _Cfg:
    def __init__(self, qc):
        self.quantization_config = qc


@pytest.mark.parametrize("requested", [None, "gptq", "gptq_marlin"])
def test_an_agreeing_request_reads_the_scheme(requested):
    scheme = check_quantization(requested, _Cfg(dict(GPTQ, desc_act=True)), "m")
    assert scheme == QuantScheme("gptq", 4, 128, True)


PACKED = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": True}


def _ct(weights: dict) -> dict:
    group = {"targets": ["Linear"], "weights": weights}
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}}


@pytest.mark.parametrize(
    ("qc", "message"),
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3 is not supported"),
        (dict(GPTQ, checkpoint_format="gptq_v2"), "checkpoint_format='gptq_v2'"),
        (dict(GPTQ, lm_head=True), "quantized lm_head"),
        (dict(GPTQ, group_size=0), "group_size=0"),
        (dict(GPTQ, bits="4"), "bits='4' is not an integer"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
        ({"quant_method": "awq", "bits": 8, "group_size": 128}, "AWQ with bits=8"),
        ({"quant_method": "compressed-tensors"}, "with 0 config groups"),
        (_ct({"type": "int", "num_bits": 4, "strategy": "group"}), "4-bit int weights"),
        (
            _ct({"type": "float", "num_bits": 8, "strategy": "block"}),
            r"weights\.block_structure=None is not two positive integers",
        ),
        (_ct({"type": "float", "num_bits": 8, "strategy": "group"}), "strategy='group'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\] is not"),
        ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "two positive integers"),
        (
            dict(_ct(dict(PACKED, symmetric=False)), format="pack-quantized"),
            "asymmetric weights",
        ),
        (dict(_ct(dict(PACKED, strategy="block")), format="pack-quantized"), "strategy='block'"),
        ({"bits": 4}, "is a unknown checkpoint"),
    ],
)
def test_unsupported_variants_are_named(qc, message):
    with pytest.raises(ConfigError, match=message):
        check_quantization(None, _Cfg(qc), "m")


def test_pack_quantized_reads_as_packed_integers():
    qc = dict(_ct(PACKED), format="pack-quantized")
    assert check_quantization(None, _Cfg(qc), "m") == QuantScheme("packed_int", 4, 128)
    qc = dict(_ct(dict(PACKED, strategy="channel", num_bits=8)), format="pack-quantized")
    assert check_quantization(None, _Cfg(qc), "m") == QuantScheme("packed_int", 8, -1)


def test_fp8_in_both_styles_reads_as_fp8():
    fp8 = QuantScheme("fp8", 8, -1)
    assert check_quantization(None, _Cfg({"quant_method": "fp8"}), "m") == fp8
    ct = _ct({"type": "float", "num_bits": 8, "strategy": "channel"})
    assert check_quantization("compressed-tensors", _Cfg(ct), "m") == fp8


def test_block_fp8_in_both_styles_reads_as_fp8_with_its_block():
    """DeepSeek's `weight_block_size` and llm-compressor's FP8_BLOCK preset (`strategy: block`
    with its `block_structure`, format float-quantized)."""
    block = QuantScheme("fp8", 8, -1, block=(128, 128))
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert check_quantization(None, _Cfg(qc), "m") == block
    weights = {"type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 64]}
    ct = dict(_ct(weights), format="float-quantized")
    assert check_quantization(None, _Cfg(ct), "m") == QuantScheme("fp8", 8, -1, block=(128, 64))


def test_awq_defaults_as_autoawq_writes_them():
    qc = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "GEMM"}
    assert check_quantization(None, _Cfg(qc), "m") == QuantScheme("awq", 4, 64)


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

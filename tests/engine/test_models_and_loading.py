"""Model registry, dtypes, dummy weights and the embedded GGUF through the offline API."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.config import ConfigError, EngineConfig
from serverless_llm.engine.models import MODEL_REGISTRY, UnsupportedModelError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_unsupported_architecture_lists_supported(tiny_llama, tmp_path):
    d = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        LLM(str(d), num_kv_blocks=32, max_model_len=128)
    assert "FancyNewForCausalLM" in str(e.value)
    for name in MODEL_REGISTRY:
        assert name in str(e.value)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("float32", torch.float32),
        ("half", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("auto", torch.float32),
    ],
)
def test_dtypes(tiny_llama, dtype, expected):
    llm = LLM(tiny_llama, dtype=dtype, num_kv_blocks=32, max_model_len=128)
    assert llm.engine.dtype == expected
    assert llm.engine.kv_caches[0].dtype == expected
    out = llm.generate([[5, 6, 7, 8]], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 8


def test_half_precision_stays_close_to_float32(tiny_llama):
    """Low precision changes logits slightly; the first greedy tokens of a clear model agree."""
    ref = LLM(tiny_llama, num_kv_blocks=32, max_model_len=128).generate([[5, 6, 7, 8]], GREEDY)
    half = LLM(tiny_llama, dtype="float16", num_kv_blocks=32, max_model_len=128).generate(
        [[5, 6, 7, 8]], GREEDY
    )
    assert half[0].outputs[0].token_ids[:3] == ref[0].outputs[0].token_ids[:3]


def test_dummy_weights_need_only_the_config(tiny_llama):
    a = LLM(tiny_llama, load_format="dummy", seed=1, num_kv_blocks=32, max_model_len=128)
    b = LLM(tiny_llama, load_format="dummy", seed=1, num_kv_blocks=32, max_model_len=128)
    c = LLM(tiny_llama, load_format="dummy", seed=2, num_kv_blocks=32, max_model_len=128)
    pa = a.engine.model.embed_tokens.weight
    assert torch.equal(pa, b.engine.model.embed_tokens.weight)
    assert not torch.equal(pa, c.engine.model.embed_tokens.weight)
    assert len(a.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids) == 8


def test_bad_engine_settings_are_named():
    for kwargs, name in [
        (dict(block_size=12), "block_size"),
        (dict(dtype="float64"), "dtype"),
        (dict(load_format="onnx"), "load_format"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(max_num_seqs=0), "max_num_seqs"),
    ]:
        with pytest.raises(ConfigError, match=name):
            EngineConfig(**kwargs)


def test_max_model_len_beyond_the_model_is_refused(tiny_llama):
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(tiny_llama, num_kv_blocks=512, max_model_len=100_000)


def test_cache_smaller_than_one_sequence_is_refused(tiny_llama):
    with pytest.raises(ConfigError, match="KV cache"):
        LLM(tiny_llama, num_kv_blocks=2, block_size=8, max_model_len=128)


@pytest.mark.slow
def test_embedded_gguf_through_the_offline_api(model_cache_dir):
    """LLM() with no model is the embedded SmolLM2: a real chat answer."""
    llm = LLM(None, download_dir=model_cache_dir, max_model_len=512)
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    out = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0.0))[0].outputs[0]
    assert "Paris" in out.text


@pytest.mark.parametrize(("capability", "has_bf16"), [((7, 5), False), ((8, 0), True)])
def test_bfloat16_on_gpus_without_it(monkeypatch, caplog, capability, has_bf16):
    """DTYPE=auto on a bfloat16 checkpoint: kept where the GPU computes bfloat16 (sm80+), else
    float16 with a warning; DTYPE=bfloat16 by name on such a GPU is a clear error. (The GPU is
    simulated: resolve_dtype asks torch.cuda for the capability and the name.)"""
    import logging

    from serverless_llm.engine import config

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    cuda = torch.device("cuda")
    with caplog.at_level(logging.WARNING, logger=config.__name__):
        got = config.resolve_dtype("auto", "bfloat16", cuda)
    assert got == (torch.bfloat16 if has_bf16 else torch.float16)
    assert ("cannot compute in" in caplog.text) != has_bf16
    assert config.resolve_dtype("auto", torch.float16, cuda) == torch.float16
    assert config.resolve_dtype("auto", torch.float32, cuda) == torch.float16
    assert config.resolve_dtype("float16", torch.bfloat16, cuda) == torch.float16
    if has_bf16:
        assert config.resolve_dtype("bfloat16", None, cuda) == torch.bfloat16
    else:
        with pytest.raises(config.ConfigError, match="Test GPU.*no bfloat16"):
            config.resolve_dtype("bf16", None, cuda)
    # the CPU is never asked about its capability
    assert config.resolve_dtype("auto", "bfloat16", torch.device("cpu")) == torch.float32
    assert config.resolve_dtype("bfloat16", None, torch.device("cpu")) == torch.bfloat16

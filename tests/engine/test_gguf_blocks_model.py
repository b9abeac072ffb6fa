"""The embedded SmolLM2 Q4_1 GGUF with QUANTIZED_WEIGHTS=packed: every linear, the token
embedding and the tied LM head are served from the file's blocks, with no float copy converted or
held (layers/gguf_linear.py). With float inputs (the
default: x taken to 22-bit codes per block, float32's precision to a few units in the last
place) greedy tokens equal the float32 path's (QUANTIZED_WEIGHTS=dequantize: the same
weights dequantized once). With GGUF_BLOCK_INPUTS=int8 they follow it up to near ties: x is
quantized to int8 per block, so where the float path's two best tokens are within a small
logprob margin the pick may flip; before that tokens and logprobs agree closely."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.layers.gguf_linear import GGUFBlockEmbedding, GGUFBlockLinear
from serverless_llm.engine.layers.linear import PackedLinear

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
]
TIE = 0.25  # logprob margin under which the two paths may pick different tokens
# largest logprob difference of an agreed token: int8 inputs move each linear's output by
# ~0.3-1.5% (bench/gguf_layer_error.py, as llama.cpp's own q8 dots do), ~0.15 in a logprob
CLOSE = 0.25


KW = dict(max_model_len=512, dtype="float32")


@pytest.fixture(scope="module")
def engines(model_cache_dir):
    return (
        LLM(None, quantized_weights="dequantize", download_dir=model_cache_dir, **KW),
        LLM(None, quantized_weights="packed", download_dir=model_cache_dir, **KW),
    )


def chat(llm, text):
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.slow
def test_packed_gguf_reads_blocks(engines):
    float_llm, packed = engines
    model = packed.engine.runner.model
    blocks = [m for m in model.modules() if isinstance(m, GGUFBlockLinear)]
    assert len(blocks) == 4 * len(model.layers) + 1  # qkv, o, gate_up, down; the LM head
    assert isinstance(model.packed_lm_head, GGUFBlockLinear)
    assert model.packed_lm_head.blocks.bits == 8  # token_embd is Q8_0 in the file
    # the whole-layer native decode runs on the blocks (cpu_native.c calls the block linear)
    for layer in model.layers:
        w = layer.native_decode.weights
        assert w.qlinear == packed.engine.runner.model.packed_lm_head.kernels.steps_desc_address
        assert all((w.qkv_q, w.o_q, w.up_q, w.down_q))
    assert not any(isinstance(m, GGUFBlockLinear) for m in float_llm.engine.runner.model.modules())
    # no float copy: nothing converted for it, no float weight held for a linear or the
    # embedding (the file's blocks serve them all)
    assert packed.engine.resolved.load_format == "gguf"
    assert not list(Path(packed.engine.resolved.model_dir).glob("*.safetensors"))
    assert isinstance(model.embed_tokens, GGUFBlockEmbedding)
    assert not [m for m in model.modules() if type(m) in (PackedLinear, torch.nn.Linear)]


def test_blocks_by_default_on_cpu(model_cache_dir):
    """On CPU a GGUF is served from its blocks, asked for (packed) or by default (auto: one
    request decodes ~3x faster than from float32 and a batch as fast, measured); auto with
    LoRA adapters, dequantize, a dummy load or tensor parallelism convert to float32."""
    from serverless_llm.engine.config import EngineConfig
    from serverless_llm.engine.loader.resolve import gguf_kept_quantized

    cpu = dict(model=None, device="cpu", download_dir=model_cache_dir)
    assert gguf_kept_quantized(EngineConfig(**cpu, quantized_weights="packed"))
    assert gguf_kept_quantized(EngineConfig(**cpu, dtype="bfloat16", quantized_weights="packed"))
    assert gguf_kept_quantized(EngineConfig(**cpu))
    assert not gguf_kept_quantized(EngineConfig(**cpu, enable_lora=True))
    assert gguf_kept_quantized(EngineConfig(**cpu, enable_lora=True, quantized_weights="packed"))
    assert not gguf_kept_quantized(EngineConfig(**cpu, quantized_weights="dequantize"))
    assert not gguf_kept_quantized(EngineConfig(**cpu, tensor_parallel_size=2))
    assert not gguf_kept_quantized(
        EngineConfig(**cpu, quantized_weights="packed", load_format="dummy")
    )


@pytest.mark.slow
def test_float_inputs_give_the_float_paths_tokens(engines):
    float_llm, packed = engines
    if packed.engine.runner.model.packed_lm_head.path != "float":
        pytest.skip("GGUF_BLOCK_INPUTS=int8 in the environment (the test below)")
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for p in PROMPTS:
        want = float_llm.generate(chat(float_llm, p), params)[0].outputs[0].token_ids
        assert packed.generate(chat(packed, p), params)[0].outputs[0].token_ids == want, p


@pytest.mark.slow
def test_int8_inputs_follow_the_float_path_up_to_near_ties(engines, model_cache_dir):
    float_llm, _ = engines
    old = os.environ.get("GGUF_BLOCK_INPUTS")
    os.environ["GGUF_BLOCK_INPUTS"] = "int8"
    try:
        packed = LLM(None, quantized_weights="packed", download_dir=model_cache_dir, **KW)
    finally:
        if old is None:
            del os.environ["GGUF_BLOCK_INPUTS"]
        else:
            os.environ["GGUF_BLOCK_INPUTS"] = old
    assert packed.engine.runner.model.packed_lm_head.path == "best"
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=5, ignore_eos=True)
    agreed = 0
    for p in PROMPTS:
        prompt = chat(packed, p)
        want = float_llm.generate(prompt, params)[0].outputs[0]
        got = packed.generate(prompt, params)[0].outputs[0]
        for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids)):
            if a != b:  # a near tie in both paths' eyes
                assert want.logprobs[i][a].logprob - want.logprobs[i][b].logprob < TIE, (p, i)
                assert got.logprobs[i][b].logprob - got.logprobs[i][a].logprob < TIE, (p, i)
                break
            assert abs(want.logprobs[i][a].logprob - got.logprobs[i][b].logprob) < CLOSE
            agreed += 1
    assert agreed >= len(PROMPTS) * 8  # most of the way, not a divergence at every start


def test_auto_keeps_blocks_for_tested_families_only(tmp_path, monkeypatch):
    """QUANTIZED_WEIGHTS=auto serves the blocks only for the architectures whose direct read is
    tested (the file's general.architecture, read from its header before anything is written);
    another architecture's file is converted as before, with no unused config directory
    written for it first, unless packed is asked."""
    gguf = pytest.importorskip("gguf")
    from serverless_llm.engine.config import EngineConfig
    from serverless_llm.engine.loader import resolve
    from serverless_llm.engine.loader.gguf import gguf_architecture

    written = []
    monkeypatch.setattr(resolve, "gguf_metadata_dir", lambda path, *a: written.append(path))
    monkeypatch.setattr(resolve, "converted_gguf_dir", lambda *a: str(tmp_path / "converted"))
    cfg = dict(model=None, device="cpu", download_dir=str(tmp_path))
    for arch, auto_format in (("llama", "gguf"), ("qwen2", "gguf"), ("gemma3", "gguf"),
                              ("phi3", "gguf"), ("gemma4", "safetensors"),
                              ("gpt-oss", "safetensors")):  # fmt: skip
        path = str(tmp_path / f"{arch}.gguf")
        writer = gguf.GGUFWriter(path, arch)  # a header only: general.architecture first
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        assert gguf_architecture(path) == arch
        written.clear()
        _, got = resolve._from_gguf(path, EngineConfig(**cfg))
        assert got == auto_format, arch
        assert written == ([path] if got == "gguf" else [])  # no meta dir for a conversion
        _, got = resolve._from_gguf(path, EngineConfig(**cfg, quantized_weights="packed"))
        assert got == "gguf"
    # pairs before the architecture are skipped by their types (a string array, a string, ...)
    import struct

    def text(v: str) -> bytes:
        return struct.pack("<Q", len(v)) + v.encode()

    pairs = (text("a.tokens") + struct.pack("<IIQ", 9, 8, 2) + text("x") + text("yz")
             + text("a.name") + struct.pack("<I", 8) + text("tiny")
             + text("a.scores") + struct.pack("<IIQ", 9, 6, 3) + bytes(12)
             + text("a.n") + struct.pack("<IQ", 10, 7)
             + text("general.architecture") + struct.pack("<I", 8) + text("qwen3"))  # fmt: skip
    later = tmp_path / "later.gguf"
    later.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 5) + pairs)
    assert gguf_architecture(str(later)) == "qwen3"
    later.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 5) + pairs[:-12])  # cut short
    assert gguf_architecture(str(later)) is None
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(20))
    assert gguf_architecture(str(not_gguf)) is None

"""A GGUF model served from the file's blocks with no float copy (QUANTIZED_WEIGHTS=packed on
CPU: loader/resolve.py, loader/gguf_direct.py, layers/gguf_linear.py), on tiny random llama
models written to .gguf files by the `gguf` package (q/k rows permuted as llama.cpp's converter
stores them; each linear in one of Q8_0/Q4_1/Q4_0/Q5_0, norms F32): the start converts nothing
(only the config and tokenizer are written beside the file, faked here), every linear, the
token embedding and the LM head hold blocks and no float weight, and greedy tokens over prompts
long enough for the many-row GEMM (prefill) and a batch equal those of the same weights
dequantized into a float safetensors checkpoint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

from serverless_llm import LLM, SamplingParams  # noqa: E402
from serverless_llm.engine.config import EngineConfig  # noqa: E402
from serverless_llm.engine.kernels import gguf_blocks as gb  # noqa: E402
from serverless_llm.engine.layers.gguf_linear import (  # noqa: E402
    GGUFBlockEmbedding,
    GGUFBlockLinear,
)
from serverless_llm.engine.layers.linear import PackedLinear  # noqa: E402
from serverless_llm.engine.loader import resolve_model  # noqa: E402
from serverless_llm.engine.loader.gguf_direct import gguf_name_map  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

TYPES = ("Q8_0", "Q4_1", "Q4_0", "Q5_0")


def as_file(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: each head's rows (half, pair) -> (pair, half)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def write_gguf(src: Path, out: Path, float_dir: Path) -> Path:
    """The tiny checkpoint `src` as a .gguf file (linears cycling through TYPES) and, in
    float_dir, the same weights dequantized as a float safetensors checkpoint."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    config = model.config
    to_gguf = {hf: g for g, hf in gguf_name_map(config)[0].items()}
    writer = gguf.GGUFWriter(str(out), "llama")
    deq = {}
    for i, (name, t) in enumerate(model.state_dict().items()):
        if name not in to_gguf:  # a tied head: the embedding's tensor
            continue
        w = t.numpy()
        if w.ndim == 1:
            writer.add_tensor(to_gguf[name], w)
            deq[name] = t
            continue
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
        head = next((h for k, h in heads.items() if f".{k}." in name), None)
        stored = as_file(w, head) if head else w
        qtype = getattr(gguf.GGMLQuantizationType, TYPES[i % len(TYPES)])
        raw = quants.quantize(stored, qtype)
        writer.add_tensor(to_gguf[name], raw, raw_dtype=qtype)
        back = quants.dequantize(raw, qtype)
        if head:  # back to the checkpoint's rows
            back = _unfile(back, head)
        deq[name] = torch.from_numpy(np.ascontiguousarray(back, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_state_dict(deq, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(float_dir, safe_serialization=True)
    for f in os.listdir(src):
        if not f.endswith((".safetensors", ".json")) or "token" in f:
            shutil.copy(src / f, float_dir / f)
    return out


def _unfile(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `as_file`."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def chat_ids(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(length)
    return [torch.randint(5, 380, (length + 3 * i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("tied", [False, True])
def test_served_from_blocks_without_a_float_copy(tmp_path, no_conversion, monkeypatch, tied):
    kernels = gb.load()
    assert kernels is not None
    src = Path(build_tiny_model(str(tmp_path / "src"), "llama", tie_word_embeddings=tied))
    (tmp_path / "float").mkdir()
    path = write_gguf(src, tmp_path / "tiny.gguf", tmp_path / "float")
    cache = tmp_path / "cache"
    resolved = resolve_model(
        EngineConfig(
            model=str(path), quantized_weights="packed", device="cpu", download_dir=str(cache)
        )  # fmt: skip
    )
    assert resolved.load_format == "gguf" and resolved.gguf_path == str(path)
    assert not list(cache.rglob("*.safetensors"))  # no converted copy
    monkeypatch.setenv("GGUF_BLOCK_ROWS", "4")  # prompts past 4 rows: the GEMM
    kw = dict(dtype="float32", max_model_len=256, device="cpu")
    packed = LLM(str(path), quantized_weights="packed", download_dir=str(cache), **kw)
    assert no_conversion == [str(path)]
    model = packed.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, GGUFBlockLinear)]
    assert len(linears) == 4 * len(model.layers) + 1  # and the LM head
    assert isinstance(model.embed_tokens, GGUFBlockEmbedding)
    assert isinstance(model.packed_lm_head, GGUFBlockLinear)
    if tied:
        assert model.packed_lm_head.blocks is model.embed_tokens.blocks
    # no float weight of any linear, embedding or head is held
    assert not [m for m in model.modules() if type(m) in (PackedLinear, torch.nn.Linear)]
    assert all(lin.block_rows == 4 for lin in linears)
    if getattr(model, "native", None) is not None:  # a 5-row decode: one native call a layer,
        for layer in model.layers:  # its linears past 4 rows through the GEMM
            assert layer.native_decode is not None and layer.native_decode.rows >= 5
            w = layer.native_decode.weights
            assert w.qlinear == kernels.steps_desc_address
    assert not list(cache.rglob("*.safetensors"))
    float_llm = LLM(str(tmp_path / "float"), **kw)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in chat_ids(5, 9)]
    want = [o.outputs[0].token_ids for o in float_llm.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, params)]
    if kernels.has_float:  # float inputs: the dequantized weights' products up to rounding
        assert got == want
    else:  # int8 inputs for decode rows: the prefill (GEMM, float) still decides token one
        assert [g[0] for g in got] == [w[0] for w in want]

"""layers/gguf_linear.attach_gguf_blocks on a small hand-built model: the fused linears take the
file's blocks (q/k rows unpermuted as llama.cpp's converter writes them, or kept where a file
does not permute them), decode-sized steps run the block linear and larger ones oneDNN, and a
tensor that does not match its float weight leaves that linear float with a warning."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from torch import nn

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

from serverless_llm.engine.kernels import gguf_blocks as gb  # noqa: E402
from serverless_llm.engine.layers import gguf_linear  # noqa: E402
from serverless_llm.engine.layers.gguf_linear import GGUFBlockLinear  # noqa: E402
from serverless_llm.engine.layers.linear import PackedLinear, packed_ops_work  # noqa: E402

HEADS, KV, D, HID, INTER, VOCAB = 2, 1, 32, 64, 96, 40


def file_tensor(name, w, type_name="Q8_0"):
    raw = quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, type_name))
    return gb.FileTensor(name, type_name, (w.shape[1], w.shape[0]), raw)


def as_file(w, heads):  # llama.cpp's converter: each head's rows (half, pair) -> (pair, half)
    return w.view(heads, 2, D // 2, -1).transpose(1, 2).reshape(w.shape)


def build(permuted: bool, broken: str | None = None):
    g = torch.Generator().manual_seed(0)
    w = {n: torch.randn(r, k, generator=g) * 0.1 for n, r, k in (
        ("q", HEADS * D, HID), ("k", KV * D, HID), ("v", KV * D, HID), ("o", HID, HEADS * D),
        ("gate", INTER, HID), ("up", INTER, HID), ("down", HID, INTER), ("emb", VOCAB, HID))}  # fmt: skip
    names = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
             "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}  # fmt: skip
    tensors, floats = {}, {}
    for key, tensor in w.items():
        heads = {"q": HEADS, "k": KV}.get(key) if permuted else None
        stored = as_file(tensor, heads) if heads else tensor
        name = "token_embd.weight" if key == "emb" else f"blk.0.{names[key]}.weight"
        t = file_tensor(name, stored)
        tensors[name] = t
        back = gb.dequantize(gb.from_gguf_blocks(t.data, "Q8_0", t.shape[0]))
        if heads:  # the float checkpoint holds the unpermuted rows
            back = back[gguf_linear._unpermute_rows(back.shape[0], heads)]
        floats[key] = back
    if broken:
        floats[broken] = floats[broken] + 1.0
    attn = nn.Module()
    attn.qkv_proj = PackedLinear(None, torch.cat([floats["q"], floats["k"], floats["v"]]))
    attn.o_proj = PackedLinear(None, floats["o"])
    mlp = nn.Module()
    mlp.gate_up_proj = PackedLinear(None, torch.cat([floats["gate"], floats["up"]]))
    mlp.down_proj = PackedLinear(None, floats["down"])
    layer = nn.Module()
    layer.self_attn, layer.mlp, layer.native_decode = attn, mlp, None
    model = nn.Module()
    model.layers = nn.ModuleList([layer])
    model.packed_lm_head = PackedLinear(None, floats["emb"])
    config = types.SimpleNamespace(num_attention_heads=HEADS, num_key_value_heads=KV)
    return model, tensors, config


@pytest.fixture(scope="module")
def kernels():
    if not packed_ops_work():
        pytest.skip("no oneDNN packed linear in this torch build")
    k = gb.load()
    assert k is not None
    return k


@pytest.mark.parametrize("inputs", ["float", "int8"])
@pytest.mark.parametrize("permuted", [True, False])
def test_every_linear_takes_its_blocks(kernels, monkeypatch, permuted, inputs):
    monkeypatch.setenv("GGUF_BLOCK_INPUTS", inputs)
    model, tensors, config = build(permuted)
    monkeypatch.setattr(gguf_linear, "read_tensors", lambda path: tensors)
    line = gguf_linear.attach_gguf_blocks(model, "x.gguf", config, kernels)
    assert line.startswith("GGUF blocks: 5 linears")
    want_path = "float" if inputs == "float" and kernels.has_float else "best"
    assert f"({'float' if want_path == 'float' else 'int8'} inputs;" in line
    layer = model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                layer.mlp.down_proj, model.packed_lm_head):  # fmt: skip
        assert isinstance(lin, GGUFBlockLinear) and lin.path == want_path
        assert lin.desc.path == gb.PATHS[want_path]
        x = torch.randn(3, lin.in_features)
        small = lin(x)  # the block linear
        want = gb.reference_linear(x, lin.blocks, quantize_x=lin.path != "float")
        assert torch.allclose(small.double(), want, atol=1e-4)
        big = lin(torch.cat([x] * 7))  # 21 rows: oneDNN's float weight
        assert torch.allclose(big[:3], small, atol=0.05)


def test_a_mismatch_stays_float(kernels, monkeypatch, caplog):
    model, tensors, config = build(True, broken="down")
    monkeypatch.setattr(gguf_linear, "read_tensors", lambda path: tensors)
    with caplog.at_level(logging.WARNING):
        line = gguf_linear.attach_gguf_blocks(model, "x.gguf", config, kernels)
    assert line.startswith("GGUF blocks: 4 linears")
    down = model.layers[0].mlp.down_proj
    assert type(down) is PackedLinear
    assert "0.mlp.down_proj" in caplog.text


def test_a_bad_inputs_setting_is_named(kernels, monkeypatch):
    model, tensors, config = build(True)
    monkeypatch.setattr(gguf_linear, "read_tensors", lambda path: tensors)
    monkeypatch.setenv("GGUF_BLOCK_INPUTS", "int4")
    with pytest.raises(ValueError, match="GGUF_BLOCK_INPUTS='int4'"):
        gguf_linear.attach_gguf_blocks(model, "x.gguf", config, kernels)

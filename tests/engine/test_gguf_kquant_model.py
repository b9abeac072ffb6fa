"""A tiny Llama written as a GGUF file with the types a Q4_K_M download mixes (Q4_K, Q5_K and
Q6_K, plus Q5_0, Q5_1, Q4_0, Q8_0 and one Q2_K tensor), served with QUANTIZED_WEIGHTS=packed:
every linear whose tensors have a block layout reads the file's blocks (a linear with a Q4_K,
Q5_K or Q6_K part on the dense K-quant records, kernels/gguf_kquants.py, each part of a fused
linear in its own layout; the others on qb32; the Q5_K token embedding on its records too),
the Q2_K one stays float with a start-up line naming the type, and with float inputs (AVX-512)
greedy tokens equal the same model run from the dequantized float weights
(QUANTIZED_WEIGHTS=auto on a safetensors copy of gguf's own dequantization).

The K-quant blocks come from tests/kernels/gguf_packers.py (the `gguf` package only
dequantizes them); the engine is given the .gguf file itself, its config and tokenizer taken
from the float copy (the loader's conversion is stood in for: no tokenizer is written into the
file)."""

from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from serverless_llm import LLM, SamplingParams  # noqa: E402
from serverless_llm.engine.kernels import gguf_blocks as gb  # noqa: E402
from serverless_llm.engine.kernels import gguf_kquants as gk  # noqa: E402
from serverless_llm.engine.layers.gguf_kquant_linear import (  # noqa: E402
    KQuantEmbedding,
    KQuantLinear,
    kquant_path,
)
from serverless_llm.engine.layers.gguf_linear import GGUFBlockLinear  # noqa: E402
from serverless_llm.engine.loader import gguf as gguf_loader  # noqa: E402
from tests.kernels.gguf_packers import quantize  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

HEADS, KV = 4, 2
SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=HEADS,
             num_key_value_heads=KV, num_hidden_layers=2)  # fmt: skip
# HF name part -> (GGUF name part, type in layer 0, type in layer 1)
LINEARS = {
    "self_attn.q_proj": ("attn_q", "Q4_K", "Q5_1"),
    "self_attn.k_proj": ("attn_k", "Q4_K", "Q5_1"),
    "self_attn.v_proj": ("attn_v", "Q5_K", "Q5_1"),
    "self_attn.o_proj": ("attn_output", "Q8_0", "Q5_K"),
    "mlp.gate_proj": ("ffn_gate", "Q4_K", "Q4_K"),
    "mlp.up_proj": ("ffn_up", "Q5_0", "Q2_K"),  # Q2_K: no layout, layer 1's gate|up stays float
    "mlp.down_proj": ("ffn_down", "Q6_K", "Q4_0"),
}
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
PROMPTS = ["The quick brown fox", "Hello world! How are", "Paged attention stores keys",
           "Once upon a time, in a land"]  # fmt: skip


def to_file_order(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order: each head's (half, pair) rows as (pair, half)."""
    return w.view(heads, 2, w.shape[0] // heads // 2, -1).transpose(1, 2).reshape(w.shape)


def from_file_order(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.view(heads, w.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def write_models(root: str) -> tuple[str, str]:
    """A float checkpoint of gguf's dequantization and the .gguf it came from."""
    src = build_tiny_model(os.path.join(root, "src"), "llama", seed=3, **SIZES)
    state = load_file(os.path.join(src, "model.safetensors"))
    writer = gguf.GGUFWriter(os.path.join(root, "tiny.gguf"), "llama")
    out = {}

    def put(hf_name: str, file_name: str, type_name: str, heads: int | None = None) -> None:
        w = state[hf_name].float()
        stored = to_file_order(w, heads) if heads else w
        raw = quantize(stored.numpy(), type_name)
        qtype = gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(file_name, raw, raw_dtype=qtype)
        back = torch.from_numpy(quants.dequantize(raw, qtype).copy())
        out[hf_name] = from_file_order(back, heads) if heads else back

    put("model.embed_tokens.weight", "token_embd.weight", "Q5_K")
    put("lm_head.weight", "output.weight", "Q6_K")
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].float().numpy())
    out["model.norm.weight"] = state["model.norm.weight"].float()
    for i in range(SIZES["num_hidden_layers"]):
        for hf, (name, *types) in LINEARS.items():
            heads = {"attn_q": HEADS, "attn_k": KV}.get(name)
            put(f"model.layers.{i}.{hf}.weight", f"blk.{i}.{name}.weight", types[i], heads)
        for hf, name in NORMS.items():
            w = state[f"model.layers.{i}.{hf}.weight"].float()
            writer.add_tensor(f"blk.{i}.{name}.weight", w.numpy())
            out[f"model.layers.{i}.{hf}.weight"] = w
    assert sorted(out) == sorted(state)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    dequantized = os.path.join(root, "dequantized")
    shutil.copytree(src, dequantized)
    save_file({k: v.contiguous() for k, v in out.items()},
              os.path.join(dequantized, "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    return dequantized, os.path.join(root, "tiny.gguf")


KW = dict(max_model_len=256, dtype="float32")


def copier(src: str):
    """A stand-in for the loader's GGUF conversions (the file carries no tokenizer): the float
    copy's config, tokenizer and weights into the cache entry being built."""

    def write(gguf_path: str, out_dir: str, show_progress: bool = True) -> None:
        for name in os.listdir(src):
            shutil.copy2(os.path.join(src, name), os.path.join(out_dir, name))

    return write


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("kquant"))
    float_dir, gguf_path = write_models(root)
    reference = LLM(float_dir, quantized_weights="auto", **KW)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("serverless_llm")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    with pytest.MonkeyPatch.context() as mp:
        # decode steps through the few-row kernels (and layer 0's whole-layer decode), not
        # left to this machine's measurement against the GEMM
        mp.setenv("GGUF_BLOCK_ROWS", "16")
        for name in ("convert_gguf", "write_gguf_metadata"):
            if hasattr(gguf_loader, name):
                mp.setattr(gguf_loader, name, copier(float_dir))
        try:
            packed = LLM(gguf_path, quantized_weights="packed",
                         download_dir=os.path.join(root, "cache"), **KW)  # fmt: skip
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
    return reference, packed, records


def test_linears_read_the_files_blocks(engines):
    _, packed, records = engines
    model = packed.engine.runner.model
    if not (gk.load().vnni or gk.load().avx2):
        pytest.skip("neither AVX-512 VNNI nor AVX2: the K-quants stay on qb32 (kernel tests)")
    l0, l1 = model.layers
    for lin in (l0.self_attn.o_proj, l1.self_attn.qkv_proj, l1.mlp.down_proj):
        assert isinstance(lin, GGUFBlockLinear)  # Q8_0, Q5_1, Q4_0: qb32
    for lin in (l0.self_attn.qkv_proj, l0.mlp.gate_up_proj, l0.mlp.down_proj,
                l1.self_attn.o_proj, model.packed_lm_head):  # fmt: skip
        assert isinstance(lin, KQuantLinear)  # a Q4_K, Q5_K or Q6_K part
    assert isinstance(model.embed_tokens, KQuantEmbedding)
    assert model.embed_tokens.blocks.type_name == "Q5_K"
    assert not isinstance(l1.mlp.gate_up_proj, (GGUFBlockLinear, KQuantLinear))  # up is Q2_K

    def kinds(lin):
        return [p.type_name if isinstance(p, gk.KQ) else p.bits for p in lin.parts]

    # each part in its own layout: Q4_K q and k joined, the Q5_K v apart; no widening
    assert kinds(l0.self_attn.qkv_proj) == ["Q4_K", "Q5_K"]
    assert [p.shape[0] for p in l0.self_attn.qkv_proj.parts] == [256 + 128, 128]
    assert kinds(l0.mlp.gate_up_proj) == ["Q4_K", 5]  # Q4_K gate with a Q5_0 up
    assert kinds(l0.mlp.down_proj) == ["Q6_K"]
    assert kinds(model.packed_lm_head) == ["Q6_K"]  # output.weight
    assert kinds(l1.self_attn.o_proj) == ["Q5_K"]
    # the Q5_K records keep about the file's bytes (180 of 176 a super-block; qb32: 320)
    assert l1.self_attn.o_proj.blocks.nbytes() == 256 * 180
    # the K-quant records are served tiled (16 rows a stream) for int8 inputs, row after row
    # for float ones (layers/gguf_kquant_linear.served)
    for lin in (l0.self_attn.qkv_proj, l0.mlp.gate_up_proj, l0.mlp.down_proj,
                l1.self_attn.o_proj, model.packed_lm_head):  # fmt: skip
        for p in lin.parts:
            if isinstance(p, gk.KQ):
                assert p.tiled == (kquant_path(lin.path) == "best" and lin.kernels.vnni)
    assert (l1.self_attn.qkv_proj.blocks.bits, l1.self_attn.qkv_proj.blocks.d.dtype) == (
        5, torch.float16)  # fmt: skip
    assert any("dequantized to float at load: Q2_K (1 tensors)" in r for r in records), records
    assert any(r.startswith("GGUF blocks: 8 linears") for r in records), records
    # layer 0's whole-layer native decode reads its parts (mixed layouts) through the per-part
    # dispatch; layer 1, with a float gate|up, keeps the per-op path
    w = l0.native_decode.weights
    assert w.qlinear == model.packed_lm_head.kernels.multi_address
    assert all((w.qkv_q, w.o_q, w.up_q, w.down_q))
    assert l1.native_decode is None


def test_blocks_equal_the_float_weights(engines):
    """What each block linear holds is the dequantized float weight the reference serves."""
    reference, packed, _ = engines
    ref = reference.engine.runner.model.layers[0].self_attn.qkv_proj
    got = packed.engine.runner.model.layers[0].self_attn.qkv_proj
    x = torch.randn(2, ref.in_features, generator=torch.Generator().manual_seed(0))
    full = torch.cat([gk.dequantize(p) if isinstance(p, gk.KQ) else gb.dequantize(p)
                      for p in getattr(got, "parts", [got.blocks])])  # fmt: skip
    want = x.double() @ full.double().T
    assert torch.allclose(ref(x).double(), want, atol=1e-4)


def test_greedy_tokens_equal_the_dequantized_models(engines):
    reference, packed, _ = engines
    if packed.engine.runner.model.packed_lm_head.path != "float":
        pytest.skip("no AVX-512 here: the blocks take int8 inputs (kernel tests bound them)")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for p in PROMPTS:
        want = reference.generate(p, params)[0].outputs[0].token_ids
        got = packed.generate(p, params)[0].outputs[0].token_ids
        assert got == want, p
        assert len(set(want)) > 1  # not a degenerate model repeating one token


def test_the_files_bytes_dequantize_as_the_float_copy(engines, tmp_path):
    """The file as the engine reads it (our header walk) against gguf's reader: every tensor's
    float values through tensor_to_float equal the package's dequantization."""
    reference, packed, _ = engines
    del reference, packed
    path = tmp_path / "check.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    w = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    for t in ("Q2_K", "Q4_K", "Q5_K", "Q6_K", "F16"):
        raw = quantize(w, t) if t != "F16" else w.astype(np.float16)
        writer.add_tensor(
            f"t.{t}", raw, raw_dtype=gguf.GGMLQuantizationType[t] if t != "F16" else None
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = gb.read_tensors(str(path))
    for t in gguf.GGUFReader(str(path)).tensors:
        want = quants.dequantize(t.data, t.tensor_type).reshape(3, 256)
        assert torch.equal(
            gb.tensor_to_float(ours[t.name]), torch.from_numpy(np.ascontiguousarray(want))
        )


def test_kquant_inputs_knob(monkeypatch):
    """GGUF_KQUANT_INPUTS picks the K-quant parts' few-row inputs alone; unset, they follow
    GGUF_BLOCK_INPUTS' path; anything else is refused by name."""
    monkeypatch.delenv("GGUF_KQUANT_INPUTS", raising=False)
    assert (kquant_path("float"), kquant_path("best")) == ("float", "best")
    for raw, want in (("i15", "i15"), ("INT8", "best"), ("float", "float")):
        monkeypatch.setenv("GGUF_KQUANT_INPUTS", raw)
        assert kquant_path("float") == want
    # the record order each serves (int8: tiled; float, i15: row after row), the same values
    from serverless_llm.engine.layers.gguf_kquant_linear import served

    w = gk.from_file_blocks(quantize(np.ones((20, 256), np.float32), "Q6_K"), "Q6_K", 256)
    for raw, tiled in (("int8", True), ("float", False), ("i15", False)):
        monkeypatch.setenv("GGUF_KQUANT_INPUTS", raw)
        got = served(gk.tiled(w), "float", vnni=True)
        assert got.tiled == tiled and torch.equal(gk.dequantize(got), gk.dequantize(w))
        assert not served(w, "float", vnni=False).tiled  # the AVX2 path: rows in order
    monkeypatch.setenv("GGUF_KQUANT_INPUTS", "int4")
    with pytest.raises(ValueError, match="GGUF_KQUANT_INPUTS"):
        kquant_path("float")

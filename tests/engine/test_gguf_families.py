"""Every dense GGUF architecture the converter reads, served from the file's blocks under the
default QUANTIZED_WEIGHTS=auto on CPU (loader/resolve.GGUF_BLOCKS_BY_DEFAULT): a tiny random
model of each family written to a .gguf file by the `gguf` package the way llama.cpp's
converter stores it (llama's q/k rows permuted, gemma's norms as 1 + w; linears and the token
embedding cycling through Q8_0/Q4_1/Q4_0/Q5_0, 1-D tensors F32), and beside it the same weights
dequantized by the `gguf` package as a float safetensors checkpoint. The start converts nothing,
the linears the family's name map places hold blocks, and greedy tokens over a batch of prompts
long enough for the many-row GEMM equal those of the dequantized checkpoint. The per-family
differences (gemma's norm offset, qwen2's q/k/v biases, qwen3's and gemma3's q/k norms, tied
heads, phi3's fused qkv and gate|up) come from the family's weight-name map
(loader/gguf_direct.py), not from a loader of their own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

from serverless_llm import LLM, SamplingParams  # noqa: E402
from serverless_llm.engine.kernels import gguf_blocks as gb  # noqa: E402
from serverless_llm.engine.layers.gguf_linear import (  # noqa: E402
    GGUFBlockEmbedding,
    GGUFBlockLinear,
)
from serverless_llm.engine.loader import gguf as gguf_mod  # noqa: E402
from serverless_llm.engine.loader.resolve import GGUF_BLOCKS_BY_DEFAULT  # noqa: E402
from tests.engine.test_gguf_direct import chat_ids  # noqa: E402
from tests.tiny_models import build_tokenizer, tiny_dims  # noqa: E402

TYPES = ("Q8_0", "Q4_1", "Q4_0", "Q5_0")
HEADS, KV_HEADS = 4, 2
HEAD_DIM = 16  # 64 / 4

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=24)
# family -> (config class, options over the tiny sizes, the file's general.architecture)
FAMILIES = {
    "mistral": (transformers.MistralConfig, dict(sliding_window=24), "llama"),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True), "qwen2"),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16), "qwen3"),
    "phi3": (transformers.Phi3Config, dict(), "phi3"),
    "gemma2": (transformers.Gemma2Config, dict(GEMMA, tie_word_embeddings=True), "gemma2"),
    "gemma3": (transformers.Gemma3TextConfig, dict(GEMMA, tie_word_embeddings=True), "gemma3"),
    "starcoder2": (transformers.Starcoder2Config, dict(), "starcoder2"),
    "stablelm": (transformers.StableLmConfig, dict(), "stablelm"),
    "gpt2": (transformers.GPT2Config, dict(naming="gpt2"), "gpt2"),
    "bloom": (transformers.BloomConfig, dict(naming="bloom"), "bloom"),
    "falcon": (
        transformers.FalconConfig,
        dict(naming="falcon", new_decoder_architecture=True, num_kv_heads=KV_HEADS),
        "falcon",
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        dict(MOE, shared_expert_intermediate_size=64),
        "qwen2moe",
    ),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(MOE, head_dim=16), "qwen3moe"),
    "mamba": (transformers.MambaConfig, dict(state_size=8), "mamba"),
    "lfm2": (transformers.Lfm2Config, dict(layer_types=["conv", "full_attention"]), "lfm2"),
}


def build(path: Path, family: str) -> transformers.PreTrainedModel:
    cls, options, _ = FAMILIES[family]
    options = dict(options)
    naming = options.pop("naming", "llama")
    tokenizer = build_tokenizer()
    kw = dict(tie_word_embeddings=False)
    if naming == "llama":
        kw.update(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
    config = cls(**tiny_dims(tokenizer, naming, **{**kw, **options}))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.architectures = [type(model).__name__]
    with torch.no_grad():  # wider than the init, so greedy picks are clear
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.3)  # not all zeros: the biases show
            elif "norm" in name:
                p.normal_(1.0, 0.3)  # not all ones (gemma's: 1 + w): the norm offset shows
    tokenizer.save_pretrained(path)
    return model


def _permute(w: np.ndarray, heads: int, inverse: bool) -> np.ndarray:
    """llama.cpp's converter's q/k row order (each head's rows (half, pair) -> (pair, half))."""
    rows = w.shape[0]
    if inverse:
        return w.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
    return w.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, arch: str, out: Path, float_dir: Path) -> None:
    """`model` as a .gguf file of architecture `arch`, and in float_dir its weights as the file
    holds them, dequantized, as a float safetensors checkpoint (config and tokenizer too)."""
    config = model.config
    # the names llama.cpp's converter gives: the gguf package's table for the architecture
    table = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), config.num_hidden_layers
    )
    writer = gguf.GGUFWriter(str(out), arch)
    deq = {}
    tensors = []  # (checkpoint name, the file's name for it, value)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied head: the file has token_embd only, as llama.cpp writes it
        if name.endswith("experts.gate_up_proj"):  # [experts, gate | up rows, in]: two stacks
            gate, up = t.chunk(2, dim=1)
            tensors += [(name + ":gate", table.get_name(name[: -len("gate_up_proj")]
                                                        + "gate_proj") + ".weight", gate),
                        (name + ":up", table.get_name(name[: -len("gate_up_proj")]
                                                      + "up_proj") + ".weight", up)]  # fmt: skip
            continue
        if name.endswith("experts.down_proj"):
            tensors.append((name, table.get_name(name) + ".weight", t))
            continue
        suffixes = (".weight", ".bias")
        gname = table.get_name(name, suffixes) or table.get_name(name.split(".", 1)[1], suffixes)
        assert gname is not None, name
        if "gate_inp_shexp" in gname:  # [1, in]: llama.cpp stores it as [in]
            t = t.reshape(-1)
        if arch == "bloom" and "attn_qkv" in gname:  # per head [q, k, v] -> q | k | v
            heads = config.n_head
            t = t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        if arch == "falcon" and "attn_qkv" in gname:  # per kv group [q.., k, v] -> q | k | v
            g = t.reshape(config.num_kv_heads, -1, HEAD_DIM, *t.shape[1:])
            t = torch.cat([g[:, :-2].reshape(-1, *t.shape[1:]), g[:, -2].reshape(-1, *t.shape[1:]),
                           g[:, -1].reshape(-1, *t.shape[1:])])  # fmt: skip
        tensors.append((name, gname, t))
    for i, (name, gname, t) in enumerate(tensors):
        w = t.numpy()
        if w.ndim == 1 or "conv" in gname or "ssm_a" in gname or w.shape[-1] % 32:
            # norms, biases, convolutions, Mamba's A, rows not whole blocks: F32, as llama.cpp
            # keeps them
            stored = w + 1 if arch.startswith("gemma") and "norm" in gname else w
            stored = -np.exp(w) if gname.endswith("ssm_a") else stored  # A, not log(-A)
            stored = stored.squeeze(1) if w.ndim == 3 else stored  # a conv's [C, 1, k] as [C, k]
            writer.add_tensor(gname, np.ascontiguousarray(stored, np.float32))
            deq[name] = model.state_dict()[name]  # as the checkpoint holds it
            continue
        heads = {"attn_q.": HEADS, "attn_k.": KV_HEADS}
        head = next((h for k, h in heads.items() if k in gname), None) if arch == "llama" else None
        stored = _permute(w, head, False) if head else w
        conv1d = arch == "gpt2" and gname.endswith(("attn_qkv.weight", "attn_output.weight",
                                                     "ffn_up.weight", "ffn_down.weight"))  # fmt: skip
        stored = np.ascontiguousarray(stored.T) if conv1d else stored  # GPT-2's [in, out]
        qtype = getattr(gguf.GGMLQuantizationType, TYPES[i % len(TYPES)])
        raw = quants.quantize(stored, qtype)
        writer.add_tensor(gname, raw, raw_dtype=qtype)
        back = quants.dequantize(raw, qtype)
        back = _permute(back, head, True) if head else back
        back = back.T if conv1d else back
        if arch == "bloom" and "attn_qkv" in gname:  # q | k | v -> per head [q, k, v]
            back = back.reshape(3, config.n_head, -1, back.shape[-1]).swapaxes(0, 1)
        if arch == "falcon" and "attn_qkv" in gname:  # q | k | v -> per kv group [q.., k, v]
            kv, rows = config.num_kv_heads, back.shape[0] - 2 * config.num_kv_heads * HEAD_DIM
            q = back[:rows].reshape(kv, -1, HEAD_DIM, back.shape[-1])
            k, v = (x.reshape(kv, 1, HEAD_DIM, -1) for x in np.split(back[rows:], 2))
            back = np.concatenate([q, k, v], axis=1)
        deq[name] = torch.from_numpy(np.ascontiguousarray(back, np.float32).reshape(t.shape))
    for name in [n for n in deq if n.endswith(":gate")]:  # the experts' stacks as HF holds them
        hf = name[: -len(":gate")]
        deq[hf] = torch.cat([deq.pop(name), deq.pop(hf + ":up")], dim=1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_state_dict(deq, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(float_dir, safe_serialization=True)


# the fewest of the layers' linears served from blocks, of 2 layers x (q|k|v, o, gate|up,
# down), with each layer's parts taken from the family's name map
# (loader/gguf_direct.gguf_block_parts): all 8 for the dense families (phi3's and gpt2's fused
# q|k|v and gate|up, the plain MLPs' up); 6 where a layer's layout is not stacked blocks
# (Bloom's and Falcon's per-head q|k|v, the MoE layers' experts, lfm2's convolution layer,
# mamba's dt_proj whose 4 inputs are not whole blocks)
BLOCK_LINEARS = {"lfm2": 6, "mamba": 6, "qwen2_moe": 6, "qwen3_moe": 6, "bloom": 6,
                 "falcon": 6}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_served_from_blocks_by_default(tmp_path, no_conversion, monkeypatch, family):
    kernels = gb.load()
    assert kernels is not None
    float_dir = tmp_path / "float"
    float_dir.mkdir()
    model = build(float_dir, family)
    arch = FAMILIES[family][2]
    path = tmp_path / "tiny.gguf"
    write_gguf(model, arch, path, float_dir)
    tied = model.config.tie_word_embeddings
    del model
    assert gguf_mod.gguf_architecture(str(path)) == arch
    assert arch in GGUF_BLOCKS_BY_DEFAULT
    monkeypatch.setenv("GGUF_BLOCK_ROWS", "4")  # prompts past 4 rows: the GEMM
    cache = tmp_path / "cache"
    kw = dict(dtype="float32", max_model_len=256, device="cpu")
    served = LLM(str(path), download_dir=str(cache), **kw)  # QUANTIZED_WEIGHTS=auto
    assert served.engine.resolved.load_format == "gguf"
    assert no_conversion == [str(path)]
    assert not list(cache.rglob("*.safetensors"))  # no converted copy
    m = served.engine.runner.model
    linears = [x for x in m.modules() if isinstance(x, GGUFBlockLinear)]
    assert len(m.layers) == 2
    assert BLOCK_LINEARS.get(family, 8) + 1 <= len(linears) <= 8 + 1  # and the LM head
    assert isinstance(m.embed_tokens, GGUFBlockEmbedding)
    assert isinstance(m.packed_lm_head if tied else m.lm_head, GGUFBlockLinear)
    if tied:
        assert m.packed_lm_head.blocks is m.embed_tokens.blocks
    reference = LLM(str(float_dir), **kw)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in chat_ids(4, 9)]
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in served.generate(prompts, params)]
    assert len({t for w in want for t in w}) > 2  # not a degenerate model
    if kernels.has_float:  # float inputs: the dequantized weights' products up to rounding
        assert got == want
    else:  # int8 inputs for decode rows: the prefill (GEMM, float) still decides token one
        assert [g[0] for g in got] == [w[0] for w in want]


def test_block_parts_come_from_the_name_map(tmp_path):
    """Which file tensors each block linear of a layer stacks, from the family's weight-name
    map: llama's four as the block loader has them (q/k with their head counts, the rows being
    permuted), qwen2's unpermuted, phi3's fused attn_qkv and ffn_up whole, a plain MLP's ffn_up,
    GPT-2's transposed Conv1D weights."""
    from serverless_llm.engine.layers.gguf_linear import _parts
    from serverless_llm.engine.loader.gguf_direct import gguf_block_parts

    def config(family):
        return build(tmp_path / family, family).config

    llama = config("mistral")
    old = _parts(llama, 1)  # (norms come too: the caller takes linears only)
    assert {k: v for k, v in gguf_block_parts(llama, 1).items() if k in old} == old
    b = "blk.1."
    want = {"self_attn.qkv_proj": [(b + "attn_q.weight", None), (b + "attn_k.weight", None),
                                   (b + "attn_v.weight", None)],
            "self_attn.o_proj": [(b + "attn_output.weight", None)],
            "mlp.gate_up_proj": [(b + "ffn_gate.weight", None), (b + "ffn_up.weight", None)],
            "mlp.down_proj": [(b + "ffn_down.weight", None)]}  # fmt: skip
    assert {k: v for k, v in gguf_block_parts(config("qwen2"), 1).items() if k in want} == want
    phi3 = gguf_block_parts(config("phi3"), 1)
    assert phi3["self_attn.qkv_proj"] == [(b + "attn_qkv.weight", None)]
    assert phi3["mlp.gate_up_proj"] == [(b + "ffn_up.weight", None)]
    assert gguf_block_parts(config("starcoder2"), 1)["mlp.up_proj"] == [(b + "ffn_up.weight", None)]
    gpt2 = gguf_block_parts(config("gpt2"), 1)
    assert gpt2["self_attn.qkv_proj"] == [(b + "attn_qkv.weight", None)]
    assert gpt2["mlp.down_proj"] == [(b + "ffn_down.weight", None)]

"""FP8 checkpoints with a scale per block of the weight (issue 37): DeepSeek's layout
(`weight_block_size`, `weight_scale_inv`) and compressed-tensors' `block` strategy (its
current layout and the padded one older versions wrote), written by the test packer
(tests/quant_checkpoints.py `write_fp8_block`) from the format descriptions. Served dequantized
at load (CPU's default) and kept 8-bit (the GPU form, its torch reference here), they generate
the greedy tokens transformers generates on the weights they stand for: a Llama whose sizes cut
the 128 x 128 blocks short at both edges (and whose q, k and v split blocks between them), and
a DeepSeek-V3 MoE (MLA with a query LoRA, YaRN, grouped routing, a shared expert, a dense first
layer) whose experts are block FP8 too. transformers reads the packer's checkpoint itself (it
dequantizes block FP8 on CPU) into exactly the float twin. Then: the bytes kept, the start-up
line, errors naming the tensor, dummy weights. The Triton path: tests/kernels/
test_fp8_block_triton.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.config import EngineConfig
from serverless_llm.engine.layers.moe import Experts
from serverless_llm.engine.layers.quant_linear import Fp8BlockWeight, QuantLinear
from serverless_llm.engine.model_builder import load_model
from tests.engine.reference import hf_greedy, hf_model
from tests.engine.test_engine_vs_transformers import prompts_for
from tests.quant_checkpoints import MLA_LINEAR, write_fp8_block
from tests.tiny_models import build_tiny_model

# q 192 rows (1.5 blocks of 128), k and v 64, hidden 192 and intermediate 320 (2.5 blocks)
SHAPE = dict(hidden_size=192, intermediate_size=320, num_attention_heads=6, num_key_value_heads=2)
# (style, block, padded)
CASES = {
    "deepseek-128": ("fp8", (128, 128), False),
    "ct-128": ("compressed-tensors", (128, 128), False),
    "ct-128-padded": ("compressed-tensors", (128, 128), True),
    "deepseek-32x64": ("fp8", (32, 64), False),  # every size a whole number of blocks
}
PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("block-fp8")
    made: dict[str, tuple[str, str]] = {}

    def get(case: str) -> tuple[str, str]:
        if case not in made:
            style, block, padded = CASES[case]
            src = build_tiny_model(str(root / f"{case}-src"), "llama", seed=7, **SHAPE)
            made[case] = write_fp8_block(
                src, str(root / f"{case}-float"), str(root / f"{case}-quant"), style, block,
                padded=padded,
            )  # fmt: skip
        return made[case]

    return get


@pytest.mark.parametrize("mode", ["dequantize", "packed"])
@pytest.mark.parametrize("case", ["deepseek-128", "ct-128", "ct-128-padded"])
def test_greedy_tokens_match_transformers_on_the_dequantized_weights(checkpoints, case, mode):
    float_dir, quant_dir = checkpoints(case)
    llm = LLM(quant_dir, block_size=8, num_kv_blocks=96, quantized_weights=mode)
    prompts = prompts_for(llm.engine.vocab_size, seed=1)
    for prompt, out in zip(prompts, llm.generate(prompts, PARAMS)):
        assert out.outputs[0].token_ids == hf_greedy(float_dir, prompt, 32), (case, len(prompt))


def test_transformers_reads_the_checkpoint_as_the_float_twin(checkpoints):
    """transformers' own reading of the packer's checkpoint (FineGrainedFP8, dequantized on a
    machine without a GPU; it derives the block from the scale grid, so the sizes here are
    whole blocks) holds exactly the twin's weights, and the engine's tokens on the FP8
    checkpoint are transformers' on it."""
    float_dir, quant_dir = checkpoints("deepseek-32x64")
    hf = hf_model(quant_dir)
    twin = load_file(os.path.join(float_dir, "model.safetensors"))
    state = hf.state_dict()
    quantized = [k for k in twin if k.endswith("_proj.weight")]
    assert len(quantized) == 14
    for name in quantized:
        assert torch.equal(state[name], twin[name]), name
    llm = LLM(quant_dir, block_size=8, num_kv_blocks=64)
    prompts = prompts_for(llm.engine.vocab_size, seed=2)[:4]
    for prompt, out in zip(prompts, llm.generate(prompts, PARAMS)):
        assert out.outputs[0].token_ids == hf_greedy(quant_dir, prompt, 32), len(prompt)


def test_packed_keeps_the_bytes_and_the_block_scales(checkpoints):
    """Kept 8-bit: each linear holds its checkpoint bytes, its parts' block grids stacked (q's
    second block ends at row 192, where k's own grid starts) and float32 scales model.to(dtype)
    leaves alone; the layer computes x times the twin's weight."""
    float_dir, quant_dir = checkpoints("deepseek-128")
    loaded = load_model(EngineConfig(model=quant_dir, quantized_weights="packed"))
    quant = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 8 and all(isinstance(m.packed[0], Fp8BlockWeight) for m in quant)
    state = load_file(os.path.join(quant_dir, "model.safetensors"))
    twin = load_file(os.path.join(float_dir, "model.safetensors"))
    qkv = loaded.model.layers[0].self_attn.qkv_proj.packed[0]
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    want = torch.cat([state[f"{n}.weight"].view(torch.uint8) for n in names])
    assert torch.equal(qkv.weight_bits, want)
    assert torch.equal(qkv.scale, torch.cat([state[f"{n}.weight_scale_inv"] for n in names]))
    assert qkv.scale.shape == (4, 2)  # q: 2 rows of blocks, k: 1, v: 1
    assert qkv.row_block.tolist() == [0] * 128 + [1] * 64 + [2] * 64 + [3] * 64
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(0))
    w = torch.cat([twin[f"{n}.weight"] for n in names])
    torch.testing.assert_close(qkv(x, False), x @ w.t(), rtol=1e-5, atol=1e-5)
    weight_bytes = sum(p.weight_bits.nbytes for m in quant for p in m.packed)
    other = sum(p.scale.nbytes + p.row_block.nbytes for m in quant for p in m.packed)
    assert other < 0.03 * weight_bytes  # 4 bytes per output row and per block
    loaded.model.to(torch.bfloat16)
    assert qkv.scale.dtype == torch.float32 and qkv.weight_bits.dtype == torch.uint8


def test_the_start_up_line_says_which_form(checkpoints, caplog):
    _, quant_dir = checkpoints("ct-128")
    with caplog.at_level("INFO", logger="serverless_llm.engine.llm_engine"):
        LLM(quant_dir, num_kv_blocks=64, max_model_len=256)
    assert "quantization=fp8 8-bit block 128x128, dequantize (dequantized once at load) " in (
        caplog.text
    )


def _edit(quant_dir: str, tmp_path, edit) -> str:
    out = str(tmp_path / "edited")
    shutil.copytree(quant_dir, out)
    path = os.path.join(out, "model.safetensors")
    state = load_file(path)
    edit(state)
    save_file(state, path)
    return out


WEIGHT = "model.layers.1.mlp.down_proj.weight"
SCALE = WEIGHT + "_scale_inv"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda s: s.__setitem__(SCALE, s[SCALE][:, :1].contiguous()),
            rf"'{SCALE}' is torch.float32 \(2, 1\); expected a float scale per 128x128 block, "
            r"\(2, 3\) for 320 inputs and 192 outputs",
        ),
        (lambda s: s.pop(SCALE), r"checkpoint lacks 1 tensors, e\.g\. .*down_proj\.weight_scale"),
        (
            lambda s: s.__setitem__(WEIGHT, s[WEIGHT][:, :300].contiguous()),
            rf"'{WEIGHT}' is torch.float8_e4m3fn \(192, 300\), expected float8_e4m3fn "
            r"\(192, 320\)",
        ),
    ],
    ids=["scale-shape", "missing-scale", "weight-shape"],
)
def test_a_checkpoint_that_contradicts_its_config_names_the_tensor(
    checkpoints, tmp_path, edit, message
):
    _, quant_dir = checkpoints("deepseek-128")
    with pytest.raises(KeyError, match=message):
        LLM(_edit(quant_dir, tmp_path, edit), num_kv_blocks=16)


# -- DeepSeek-V3's MoE, every linear in block FP8 (the router in float) -------------------------


@pytest.mark.parametrize("mode", ["dequantize", "packed"])
def test_deepseek_v3_moe_in_block_fp8_matches_transformers(tmp_path, mode):
    """MLA (q LoRA, YaRN), grouped top-k routing with the correction bias, a shared expert and
    a dense first layer, every projection and expert in 32 x 64 blocks (the latent projection's
    40 rows and the experts' 32 inputs cut blocks short): dequantized at load, or kept 8-bit
    (experts as bytes and block scales, no float copy)."""
    from tests.engine.family_check import save_family_model
    from tests.engine.test_families_mla import CONFIGS
    from tests.tiny_models import build_tokenizer

    config = CONFIGS["deepseek_v3_moe"](build_tokenizer())
    src = save_family_model(str(tmp_path / "src"), config, std=0.1)
    float_dir, quant_dir = write_fp8_block(
        src, str(tmp_path / "float"), str(tmp_path / "quant"), "fp8", (32, 64), linear=MLA_LINEAR
    )
    state = load_file(os.path.join(quant_dir, "model.safetensors"))
    assert state["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert state["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    llm = LLM(quant_dir, block_size=8, num_kv_blocks=96, max_model_len=256, dtype="float32",
              quantized_weights=mode)  # fmt: skip
    experts = [m for m in llm.engine.model.modules() if isinstance(m, Experts)]
    if mode == "packed":
        assert experts and all(m.quantized == {"w13", "w2"} for m in experts)
        assert all(not hasattr(m, "w13") and m.w13_weight.dtype == torch.uint8 for m in experts)
        assert experts[0].w13_scale.shape == (8, 2, 1)  # per expert: gate's grid, up's grid
    else:
        assert "(experts dequantized)" in llm.engine.model.quantization
    prompts = prompts_for(llm.engine.vocab_size, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(float_dir, prompt, 24), len(prompt)


def test_dummy_weights_in_block_fp8(tmp_path):
    """LOAD_FORMAT=dummy over a block-FP8 config: random bytes and block grids, dense layers
    and experts kept 8-bit, that serve."""
    from tests.engine.family_check import save_family_model
    from tests.engine.test_families_mla import CONFIGS
    from tests.tiny_models import build_tokenizer

    src = save_family_model(str(tmp_path / "src"), CONFIGS["deepseek_v3_moe"](build_tokenizer()))
    path = os.path.join(src, "config.json")
    cfg = json.load(open(path))
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    json.dump(cfg, open(path, "w"))
    llm = LLM(src, load_format="dummy", quantized_weights="packed", num_kv_blocks=32,
              max_model_len=128)  # fmt: skip
    quant = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
    assert quant and all(isinstance(m.packed[0], Fp8BlockWeight) for m in quant)
    experts = [m for m in llm.engine.model.modules() if isinstance(m, Experts)]
    assert experts and all(m.w2_weight.dtype == torch.uint8 for m in experts)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4

"""GPTQ and AWQ checkpoints load and generate the tokens transformers generates on the weights
they stand for (issue 16): a tiny Llama and a tiny Qwen2 (qkv bias) quantized by the test
packer (tests/quant_checkpoints.py) with odd group counts and act-order, served with the
weights dequantized at load (the CPU default) and packed at their bit width (the CUDA form; on
CPU repacked into qb32 blocks for the native kernels, layers/quant_blocks.py); and checkpoints that contradict their config fail naming the tensor."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.config import EngineConfig
from serverless_llm.engine.layers.quant_blocks import PermutedBlocks
from serverless_llm.engine.layers.quant_linear import QuantLinear
from serverless_llm.engine.model_builder import load_model
from tests.engine.reference import hf_greedy
from tests.engine.test_engine_vs_transformers import prompts_for
from tests.quant_checkpoints import write_fp8, write_pack_quantized, write_quantized
from tests.tiny_models import build_tiny_model

# hidden 96 and intermediate 160: groups of 32 give 3 and 5 groups (odd counts).
SHAPE = dict(hidden_size=96, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2)
# (family, method, bits, group size, act-order, symmetric, act-order shared by q/k/v, gate/up)
CASES = {
    "llama-gptq4-g32-actorder": ("llama", "gptq", 4, 32, True, False, True),
    "llama-gptq8-whole-sym": ("llama", "gptq", 8, -1, False, True, True),
    "qwen2-gptq4-g32-actorder-unshared": ("qwen2", "gptq", 4, 32, True, False, False),
    "qwen2-awq-g32": ("qwen2", "awq", 4, 32, False, False, True),
    "llama-awq-g32": ("llama", "awq", 4, 32, False, False, True),
}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    made: dict[str, tuple[str, str]] = {}

    def get(case: str) -> tuple[str, str]:
        if case not in made:
            kind, method, bits, group, act_order, sym, shared = CASES[case]
            src = build_tiny_model(str(root / f"{case}-src"), kind, seed=3, **SHAPE)
            made[case] = write_quantized(
                src,
                str(root / f"{case}-float"),
                str(root / f"{case}-quant"),
                method,
                bits,
                group,
                act_order,
                sym,
                shared,
            )
        return made[case]

    return get


@pytest.mark.parametrize("mode", ["dequantize", "packed"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers_on_the_dequantized_weights(quantized, case, mode):
    float_dir, quant_dir = quantized(case)
    llm = LLM(quant_dir, block_size=8, num_kv_blocks=64, quantized_weights=mode)
    prompts = prompts_for(llm.engine.vocab_size, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(float_dir, prompt, 32), (case, len(prompt))


def test_packed_weights_stay_at_their_bit_width(quantized):
    _, quant_dir = quantized("llama-gptq4-g32-actorder")
    loaded = load_model(EngineConfig(model=quant_dir, quantized_weights="packed"))
    quant = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    for m in quant:
        assert m.weight is None and len(m.packed) == 1  # q, k, v share their act-order
        (p,) = m.packed
        assert p.perm is not None  # act-order: the input is permuted at each call
        if isinstance(p, PermutedBlocks):  # on CPU: the packed form repacked into qb32 blocks
            blocks = p.inner.blocks
            assert blocks.bits == 4 and blocks.qs.dtype == torch.uint8
            assert blocks.shape == (m.out_features, m.in_features)
            assert blocks.qs.shape == (m.out_features, m.in_features // 32, 16)
            continue
        assert p.qweight.dtype == torch.int32  # without the block kernels: the packed form
        assert p.qweight.shape == (m.in_features // 8, m.out_features)
    loaded = load_model(EngineConfig(model=quant_dir, quantized_weights="dequantize"))
    assert not any(isinstance(m, QuantLinear) for m in loaded.model.modules())


# -- checkpoints that contradict their config ----------------------------------------------------


def _edit(quant_dir: str, tmp_path, edit) -> str:
    out = str(tmp_path / "edited")
    shutil.copytree(quant_dir, out)
    path = os.path.join(out, "model.safetensors")
    state = load_file(path)
    edit(state, out)
    save_file(state, path)
    return out


def _config(out: str, **changes) -> None:
    path = os.path.join(out, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"].update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


LAYER0 = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda s, d: s.pop(LAYER0 + ".scales"),
            rf"checkpoint lacks 1 tensors, e\.g\. .*{LAYER0}\.scales",
        ),
        (
            lambda s, d: s.__setitem__(LAYER0 + ".qweight", s[LAYER0 + ".qweight"][:-1]),
            rf"'{LAYER0}\.qweight' has shape \(11, 96\), expected \(12, 96\)",
        ),
        (
            lambda s, d: _config(d, bits=8),
            r"'model\.layers\.0\.\w+\.\w+_proj\.qweight' has shape \((\d+), \d+\), expected "
            r"\((\d+), \d+\) for 8-bit gptq",
        ),
        (
            lambda s, d: _config(d, group_size=48),
            r"'model\.layers\.0\.\w+\.\w+_proj\.\w+' has shape \(\d+, \d+\), expected .* group_size 48",
        ),
        (
            lambda s, d: s.__setitem__(LAYER0 + ".g_idx", s[LAYER0 + ".g_idx"] + 5),
            rf"'{LAYER0}\.g_idx' names groups outside 0\.\.2",
        ),
        (
            lambda s, d: s.__setitem__(LAYER0 + ".scales", s[LAYER0 + ".scales"].int()),
            rf"'{LAYER0}\.scales' is torch\.int32",
        ),
    ],
    ids=[
        "missing-scales",
        "short-qweight",
        "bits-contradict",
        "group-contradicts",
        "g_idx",
        "dtype",
    ],
)
def test_a_checkpoint_that_contradicts_its_config_names_the_tensor(
    quantized, tmp_path, edit, message
):
    _, quant_dir = quantized("llama-gptq4-g32-actorder")
    bad = _edit(quant_dir, tmp_path, edit)
    with pytest.raises(KeyError, match=message):
        LLM(bad, num_kv_blocks=16)


def test_a_quantized_config_over_float_weights_is_refused(tiny_llama, tmp_path):
    out = str(tmp_path / "float-weights")
    shutil.copytree(tiny_llama, out)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(KeyError, match="the config says gptq, but no linear of the checkpoint"):
        LLM(out, num_kv_blocks=16)


def test_a_linear_left_unquantized_loads_beside_quantized_ones(quantized, tmp_path):
    """AWQ's modules_to_not_convert: such a linear is saved as a plain weight."""
    float_dir, quant_dir = quantized("llama-awq-g32")
    twin = load_file(os.path.join(float_dir, "model.safetensors"))
    name = "model.layers.1.mlp.down_proj"

    def unquantize(state, d):
        for kind in ("qweight", "qzeros", "scales"):
            del state[f"{name}.{kind}"]
        state[f"{name}.weight"] = twin[f"{name}.weight"]

    mixed = _edit(quant_dir, tmp_path, unquantize)
    for mode in ("packed", "dequantize"):
        llm = LLM(mixed, block_size=8, num_kv_blocks=64, quantized_weights=mode)
        prompt = prompts_for(llm.engine.vocab_size, seed=2)[4]
        out = llm.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        )
        assert out[0].outputs[0].token_ids == hf_greedy(float_dir, prompt, 16)


# -- FP8 weights ----------------------------------------------------------------------------------

FP8_CASES = {
    "fp8-tensor": ("llama", "fp8", "tensor", False),
    "ct-channel": ("qwen2", "compressed-tensors", "channel", False),
    "ct-tensor-static": ("llama", "compressed-tensors", "tensor", True),
}


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    made: dict[str, tuple[str, str]] = {}

    def get(case: str) -> tuple[str, str]:
        if case not in made:
            kind, style, strategy, static = FP8_CASES[case]
            src = build_tiny_model(str(root / f"{case}-src"), kind, seed=4, **SHAPE)
            made[case] = write_fp8(
                src,
                str(root / f"{case}-float"),
                str(root / f"{case}-quant"),
                style,
                strategy,
                static,
            )
        return made[case]

    return get


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_fp8_greedy_tokens_match_transformers_on_the_dequantized_weights(fp8_checkpoints, case):
    float_dir, quant_dir = fp8_checkpoints(case)
    llm = LLM(quant_dir, block_size=8, num_kv_blocks=64)  # CPU: dequantized at load
    prompts = prompts_for(llm.engine.vocab_size, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(float_dir, prompt, 32), (case, len(prompt))


def test_fp8_packed_keeps_the_bytes_and_quantizes_activations_per_token(fp8_checkpoints):
    _, quant_dir = fp8_checkpoints("ct-channel")
    loaded = load_model(EngineConfig(model=quant_dir, quantized_weights="packed"))
    quant = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 8
    state = load_file(os.path.join(quant_dir, "model.safetensors"))
    layer = loaded.model.layers[1].mlp.down_proj
    (packed,) = layer.packed
    w8 = state["model.layers.1.mlp.down_proj.weight"]
    assert packed.weight_bits.dtype == torch.uint8 and packed.weight_bits.shape == w8.shape
    assert torch.equal(packed.weight_bits.view(torch.float8_e4m3fn).float(), w8.float())
    assert packed.scale.dtype == torch.float32
    # The layer's output: each row of x scaled to FP8's range (max |x| -> 448), rounded to FP8.
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    xs = x.abs().amax(1, keepdim=True) / 448
    x8 = (x / xs).to(torch.float8_e4m3fn).float() * xs
    scale = state["model.layers.1.mlp.down_proj.weight_scale"].reshape(-1, 1)
    want = x8 @ (w8.float() * scale).t()
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_fp8_scale_of_the_wrong_shape_names_the_tensor(fp8_checkpoints, tmp_path):
    _, quant_dir = fp8_checkpoints("ct-channel")
    name = "model.layers.0.mlp.up_proj.weight_scale"
    bad = _edit(quant_dir, tmp_path, lambda s, d: s.__setitem__(name, s[name][:5]))
    with pytest.raises(KeyError, match=rf"'{name}' is torch.float32 \(5, 1\); a scale per tensor"):
        LLM(bad, num_kv_blocks=16)


# -- compressed-tensors pack-quantized (W4A16) ----------------------------------------------------


@pytest.mark.parametrize("mode", ["dequantize", "packed"])
@pytest.mark.parametrize(("kind", "act_order"), [("llama", True), ("qwen2", False)])
def test_pack_quantized_greedy_matches_transformers(tmp_path, kind, act_order, mode):
    src = build_tiny_model(str(tmp_path / "src"), kind, seed=6, **SHAPE)
    float_dir, quant_dir = write_pack_quantized(
        src, str(tmp_path / "float"), str(tmp_path / "quant"), 4, 32, act_order
    )
    llm = LLM(quant_dir, block_size=8, num_kv_blocks=64, quantized_weights=mode)
    prompts = prompts_for(llm.engine.vocab_size, seed=1)[:4]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(float_dir, prompt, 32), len(prompt)


def test_the_start_up_line_names_the_quantization(quantized, caplog):
    _, quant_dir = quantized("llama-gptq4-g32-actorder")
    with caplog.at_level("INFO", logger="serverless_llm.engine.llm_engine"):
        LLM(quant_dir, num_kv_blocks=64, max_model_len=256, quantized_weights="packed")
    assert "quantization=gptq 4-bit group 32 act-order, packed " in caplog.text


# -- mixture-of-experts checkpoints (experts quantized, routers float) -------------------------


@pytest.mark.parametrize("mode", ["dequantize", "packed"])
@pytest.mark.parametrize(
    ("family", "method", "act_order"),
    [("qwen2_moe", "gptq", True), ("mixtral", "awq", False), ("qwen3_moe", "gptq", False)],
)
def test_quantized_moe_matches_transformers(tmp_path, family, method, act_order, mode):
    """Qwen2-MoE (shared expert, a dense layer) in GPTQ with act-order, Mixtral (w1/w2/w3
    experts) in AWQ, Qwen3-MoE in GPTQ: every expert quantized by the packer, the routers left
    in float as quantizers leave them; the experts dequantized into the stacked weights at load,
    or kept packed (the packed MoE kernel's torch reference here): the tokens equal
    transformers' on the float twin."""
    import transformers

    from tests.engine.family_check import save_family_model, tiny_dims
    from tests.engine.test_families_moe import CONFIGS
    from tests.tiny_models import build_tokenizer

    tok = build_tokenizer()
    config = CONFIGS[family](tok)
    if family == "mixtral":  # expert width a multiple of AWQ's 8-column packing and the groups
        config = transformers.MixtralConfig(
            **tiny_dims(tok), num_local_experts=6, num_experts_per_tok=2
        )
    src = save_family_model(str(tmp_path / "src"), config, std=0.1)
    float_dir, quant_dir = write_quantized(
        src, str(tmp_path / "float"), str(tmp_path / "quant"), method, 4, 32, act_order
    )
    state = load_file(os.path.join(quant_dir, "model.safetensors"))
    assert any(".experts.0." in k and k.endswith(".qweight") for k in state)
    llm = LLM(quant_dir, block_size=8, num_kv_blocks=64, max_model_len=256, dtype="float32",
              quantized_weights=mode)  # fmt: skip
    assert ("(experts dequantized)" in llm.engine.model.quantization) == (mode == "dequantize")
    if mode == "packed":
        experts = next(m for m in llm.engine.model.modules() if hasattr(m, "quantized"))
        assert experts.w13_qweight.dtype == torch.int32
        assert not hasattr(experts, "w13")  # no float copy of the experts
    prompts = prompts_for(llm.engine.vocab_size, seed=1)[:4]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(float_dir, prompt, 24), len(prompt)


def test_quantized_moe_missing_expert_tensor_is_named(tmp_path):
    from tests.engine.family_check import save_family_model
    from tests.engine.test_families_moe import CONFIGS
    from tests.tiny_models import build_tokenizer

    src = save_family_model(str(tmp_path / "src"), CONFIGS["qwen3_moe"](build_tokenizer()))
    _, quant_dir = write_quantized(src, str(tmp_path / "f"), str(tmp_path / "q"), "gptq", 4, 32)
    path = os.path.join(quant_dir, "model.safetensors")
    state = load_file(path)
    del state["model.layers.1.mlp.experts.4.up_proj.scales"]
    save_file(state, path)
    with pytest.raises(KeyError, match="experts.4.up_proj.scales"):
        LLM(quant_dir, num_kv_blocks=16, max_model_len=128)


@pytest.mark.parametrize(
    ("style", "strategy"), [("fp8", "tensor"), ("compressed-tensors", "channel")]
)
def test_fp8_moe_matches_transformers(tmp_path, style, strategy):
    """FP8 experts (vLLM's fp8 and llm-compressor's float-quantized): dequantized into the
    stacked weights with their scales (the CPU default)."""
    from tests.engine.family_check import save_family_model
    from tests.engine.test_families_moe import CONFIGS
    from tests.tiny_models import build_tokenizer

    src = save_family_model(str(tmp_path / "src"), CONFIGS["qwen2_moe"](build_tokenizer()), std=0.1)
    float_dir, quant_dir = write_fp8(
        src, str(tmp_path / "float"), str(tmp_path / "quant"), style, strategy
    )
    llm = LLM(quant_dir, block_size=8, num_kv_blocks=64, max_model_len=256, dtype="float32")
    prompts = prompts_for(llm.engine.vocab_size, seed=1)[:3]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(float_dir, prompt, 16), len(prompt)


def test_fp8_moe_packed_keeps_the_bytes(tmp_path):
    """FP8 experts held packed (the CUDA default; here on the torch path): e4m3 bytes and
    float32 channel scales, which model.to(bfloat16) leaves alone, and each sparse layer's
    experts compute what the dequantized experts compute."""
    from serverless_llm.engine.layers.moe import Experts
    from tests.engine.family_check import save_family_model
    from tests.engine.test_families_moe import CONFIGS
    from tests.tiny_models import build_tokenizer

    src = save_family_model(str(tmp_path / "src"), CONFIGS["qwen2_moe"](build_tokenizer()), std=0.1)
    _, quant_dir = write_fp8(src, str(tmp_path / "f"), str(tmp_path / "q"), "fp8", "tensor")
    forms = {}
    for mode in ("packed", "dequantize"):
        config = EngineConfig(model=quant_dir, dtype="float32", quantized_weights=mode)
        loaded = load_model(config)
        forms[mode] = [m for m in loaded.model.modules() if isinstance(m, Experts)]
    packed, plain = forms["packed"], forms["dequantize"]
    assert packed and all(m.quantized == {"w13", "w2"} for m in packed)
    x = torch.randn(5, packed[0].hidden, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 3], [1, 2], [7, 0], [5, 6], [4, 1]])
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(1))
    for a, b in zip(packed, plain):
        assert a.w13_weight.dtype == torch.uint8 and a.w2_scale.dtype == torch.float32
        torch.testing.assert_close(a(x, weights, ids), b(x, weights, ids), rtol=1e-5, atol=1e-5)
    packed[0].to(torch.bfloat16)
    assert packed[0].w13_scale.dtype == torch.float32 and packed[0].w13_weight.dtype == torch.uint8


def test_fp8_moe_dummy_weights_packed(tmp_path):
    """LOAD_FORMAT=dummy on an FP8 MoE config held packed: random e4m3 experts (bytes, float32
    scales) that serve; the experts take about half of float16's bytes."""
    from serverless_llm.engine.layers.moe import Experts
    from tests.engine.family_check import save_family_model
    from tests.engine.test_families_moe import CONFIGS
    from tests.tiny_models import build_tokenizer

    src = save_family_model(str(tmp_path / "src"), CONFIGS["qwen2_moe"](build_tokenizer()), std=0.1)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    llm = LLM(src, load_format="dummy", quantized_weights="packed", dtype="float16",
              num_kv_blocks=32, max_model_len=128)  # fmt: skip
    experts = [m for m in llm.engine.model.modules() if isinstance(m, Experts)]
    assert experts and all(m.w13_weight.dtype == torch.uint8 for m in experts)
    e = experts[0]
    held = sum(getattr(e, f"{w}_{f}").nbytes for w in ("w13", "w2") for f in ("weight", "scale"))
    as_float16 = e.num_experts * 3 * e.inter * e.hidden * 2
    assert held < 0.55 * as_float16
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("mode", ["dequantize", "packed"])
def test_quantized_moe_without_g_idx(tmp_path, mode):
    """GPTQ checkpoints may leave out g_idx (no act-order): each expert settles after the last
    tensor, in both forms."""
    from tests.engine.family_check import save_family_model
    from tests.engine.test_families_moe import CONFIGS
    from tests.tiny_models import build_tokenizer

    src = save_family_model(str(tmp_path / "src"), CONFIGS["qwen3_moe"](build_tokenizer()), std=0.1)
    float_dir, quant_dir = write_quantized(
        src, str(tmp_path / "f"), str(tmp_path / "q"), "gptq", 4, 32, False
    )
    path = os.path.join(quant_dir, "model.safetensors")
    state = {k: v for k, v in load_file(path).items() if not k.endswith(".g_idx")}
    save_file(state, path)
    llm = LLM(quant_dir, num_kv_blocks=64, max_model_len=128, dtype="float32",
              quantized_weights=mode)  # fmt: skip
    prompt = prompts_for(llm.engine.vocab_size, seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert out == hf_greedy(float_dir, prompt, 12)

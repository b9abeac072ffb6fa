"""Gated DeltaNet hybrids (issue 35) against transformers: Qwen3-Next, Qwen3.5 (dense and MoE)
and OLMo Hybrid as tiny random models with linear and full attention layers interleaved, 8
prompts of different lengths batched together, 48 greedy tokens each; and a Qwen3.5 multimodal
checkpoint (Qwen3_5ForConditionalGeneration, a tiny vision tower beside the decoder) served with
its tower, against the same model's text-only `generate` and its `generate` with an image (the
vision families' own tests: test_vision_qwen_vl.py, test_vision_engine.py)."""

from __future__ import annotations

import copy
import logging
import os
import shutil

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from serverless_llm import LLM, SamplingParams
from tests.engine.family_check import (
    NEW_TOKENS,
    engine_greedy,
    family_models_fixture,
    family_prompts,
    greedy_family_test,
    tiny_dims,
)
from tests.engine.vision_check import engine_greedy as vision_engine_greedy
from tests.engine.vision_check import family_processor, hf_vision_greedy
from tests.engine.vision_qwen_vl_models import sample_images, save_tiny_qwen3_5_vl
from tests.tiny_models import build_tokenizer

# Gated DeltaNet sizes: 2 q/k heads serving 4 value heads (GQA), heads of 16, 4 taps.
LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
QWEN = dict(head_dim=32, layer_types=LAYERS, **LINEAR)  # rotary over a quarter of each head
QWEN_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)

CONFIGS = {
    # MoE with a shared expert, layer 2 dense (mlp_only_layers), attention bias on
    "qwen3_next": lambda tok: transformers.Qwen3NextConfig(
        **tiny_dims(tok, num_hidden_layers=4),
        **QWEN,
        **QWEN_MOE,
        mlp_only_layers=[2],
        attention_bias=True,
    ),
    "qwen3_5": lambda tok: transformers.Qwen3_5TextConfig(
        **tiny_dims(tok, num_hidden_layers=4), **QWEN
    ),
    "qwen3_5_moe": lambda tok: transformers.Qwen3_5MoeTextConfig(
        **tiny_dims(tok, num_hidden_layers=4), **QWEN, **QWEN_MOE
    ),
    # attention first, beta in [0, 2] (allow_neg_eigval), q/k norms over all heads
    "olmo_hybrid": lambda tok: transformers.OlmoHybridConfig(
        **tiny_dims(tok, num_hidden_layers=4),
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        **LINEAR,
    ),
}

family_models = family_models_fixture(CONFIGS)
test_family_greedy_equals_transformers = greedy_family_test(CONFIGS)


def _vl_config(tok) -> transformers.Qwen3_5Config:
    text = dict(**tiny_dims(tok, num_hidden_layers=2), **QWEN)
    text["layer_types"] = ["linear_attention", "full_attention"]
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=4,
        temporal_patch_size=2,
        num_position_embeddings=16,
    )
    return transformers.Qwen3_5Config(
        text_config=text, vision_config=vision, architectures=["Qwen3_5ForConditionalGeneration"]
    )


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory) -> str:
    """A tiny Qwen3_5ForConditionalGeneration checkpoint with its processor's files
    (vision_qwen_vl_models.py): a three-layer hybrid decoder beside a two-block vision tower."""
    return save_tiny_qwen3_5_vl(str(tmp_path_factory.mktemp("qwen3_5_vl")))


def _vl_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' text-only greedy generate of the multimodal model itself."""
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32
    ).eval()
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = [model.config.text_config.vocab_size + 1]  # never stops early
    config.pad_token_id = 0
    config.max_new_tokens = NEW_TOKENS
    config.do_sample = False
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            out.append(gen[0, len(prompt) :].tolist())
    return out


def _tensor_names(path: str) -> list[str]:
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return list(f.keys())


def _rewritten(src: str, dst: str, rewrite) -> str:
    """A copy of the checkpoint `src` in `dst` whose tensors are `rewrite(tensors)`."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if name != "model.safetensors":
            shutil.copy(os.path.join(src, name), dst)
    tensors = rewrite(load_file(os.path.join(src, "model.safetensors")))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_native_linears_and_experts_equal_transformers(family_models, monkeypatch):
    """Qwen3-Next with its linears on the native GEMM at every decode step and its experts in
    the native GEMM's panels, each block's experts in one native call (every step), on the
    native backend: greedy tokens equal transformers'."""
    from serverless_llm.engine.kernels.cpu_native import NativeKernels
    from serverless_llm.engine.layers import moe
    from tests.engine.family_check import assert_matches_transformers

    monkeypatch.setenv("NATIVE_LINEAR_ROWS", "64")
    calls = {"one call": 0, "per expert": 0}
    real_call, real_linear = NativeKernels.moe_experts, moe._expert_linear

    def one_call(self, *args, **kw):
        calls["one call"] += 1
        return real_call(self, *args, **kw)

    def per_expert(rows, weight):
        calls["per expert"] += 1
        return real_linear(rows, weight)

    monkeypatch.setattr(NativeKernels, "moe_experts", one_call)
    monkeypatch.setattr(moe, "_expert_linear", per_expert)
    assert_matches_transformers(family_models("qwen3_next"), attention_backend="native")
    assert calls["one call"] > 0 and calls["per expert"] == 0, calls


def test_multimodal_checkpoint_serves_text_and_images(vl_model, caplog):
    """The composite config's text part drives the decoder (vocabulary, context, layers), the
    language model's tensors load from under model.language_model., the vision tower's into
    the engine's Qwen3.5 tower (so no note that images are not served); the text-only greedy
    tokens are the multimodal model's own text-only ones, and a prompt with an image gives the
    tokens of its `generate` with that image."""
    tensors = load_file(os.path.join(vl_model, "model.safetensors"))
    visual = {
        k.removeprefix("model.visual."): v
        for k, v in tensors.items()
        if k.startswith("model.visual.")
    }
    assert visual
    vocab = transformers.AutoConfig.from_pretrained(vl_model).text_config.vocab_size
    prompts = family_prompts(vocab)
    with caplog.at_level(logging.INFO):
        llm = LLM(vl_model, block_size=8, num_kv_blocks=160, max_model_len=256, dtype="float32")
    notes = [r.getMessage() for r in caplog.records if "not served yet" in r.getMessage()]
    assert not notes, notes
    tower = llm.engine.vision.tower
    assert type(tower).__name__ == "Qwen3_5VisionTower"
    params = dict(tower.named_parameters())
    assert params.keys() == visual.keys()
    for name, param in params.items():
        assert torch.equal(param, visual[name]), name
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sampling)]
    assert got == _vl_greedy(vl_model, prompts)
    family, processor = family_processor(vl_model)
    text = f"Look: {family.image_placeholder(processor)} What is it?"
    with_image = [(text, sample_images()[:1])]
    want = hf_vision_greedy(vl_model, with_image, 16)
    assert vision_engine_greedy(llm, with_image, 16) == want


def test_multi_token_prediction_tensors_are_skipped(family_models, tmp_path):
    """A checkpoint carrying multi-token-prediction layers (`mtp.*`, as the released Qwen3-Next
    and Qwen3.5 ones do) loads without error, and gives the same tokens as without them."""

    def add_mtp(tensors):
        tensors["mtp.fc.weight"] = torch.zeros(64, 128)
        tensors["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
        return tensors

    src = family_models("qwen3_5")
    dst = _rewritten(src, str(tmp_path / "with_mtp"), add_mtp)
    prompts = family_prompts(384)[:3]
    assert engine_greedy(dst, prompts, 8) == engine_greedy(src, prompts, 8)


PROJ = ("gate_proj", "up_proj", "down_proj")


def test_experts_stored_as_3d_tensors_load(family_models, tmp_path):
    """Qwen MoE checkpoints may hold every expert of a layer in one tensor (gate_up_proj
    [E, 2I, H], down_proj [E, H, I], transformers 5's own layout): the same tokens as the
    per-expert tensors."""

    def fuse(tensors):
        out = {k: t for k, t in tensors.items() if ".mlp.experts." not in k}
        for name in tensors:
            if name.endswith(".mlp.experts.0.gate_proj.weight"):
                base = name.removesuffix("0.gate_proj.weight")
                experts = range(sum(1 for k in tensors if k.startswith(base)) // 3)
                w = {p: [tensors[f"{base}{e}.{p}.weight"] for e in experts] for p in PROJ}
                gate_up = [torch.cat([g, u]) for g, u in zip(w["gate_proj"], w["up_proj"])]
                out[base + "gate_up_proj"] = torch.stack(gate_up)
                out[base + "down_proj"] = torch.stack(w["down_proj"])
        return out

    src = family_models("qwen3_5_moe")
    dst = _rewritten(src, str(tmp_path / "fused"), fuse)
    assert any(k.endswith("experts.gate_up_proj") for k in _tensor_names(dst))
    prompts = family_prompts(384)[:3]
    assert engine_greedy(dst, prompts, 8) == engine_greedy(src, prompts, 8)


def test_text_part_of_a_composite_config():
    """The text part stands for the model: the composite's architectures and tied embeddings
    (transformers ties by the composite config), its quantization where the text config has
    none; a plain config is returned as it is."""
    from serverless_llm.engine.loader.multimodal import text_part

    config = _vl_config(build_tokenizer())
    config.tie_word_embeddings = True
    config.quantization_config = {"quant_method": "fp8"}
    text = text_part(config)
    assert text is not config.text_config  # a copy: the composite config is left as it was
    assert text.architectures == ["Qwen3_5ForConditionalGeneration"]
    assert text.text_part_of == "Qwen3_5ForConditionalGeneration"
    assert text.tie_word_embeddings and not config.text_config.tie_word_embeddings
    assert text.quantization_config == {"quant_method": "fp8"}
    assert text.vocab_size == 384 and text.hidden_size == 64
    plain = CONFIGS["qwen3_5"](build_tokenizer())
    assert text_part(plain) is plain

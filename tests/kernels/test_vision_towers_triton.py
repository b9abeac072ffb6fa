"""The vision towers with their attention on the Triton kernel (kernels/vision_attention.py:
interpreted on CPU, compiled on a GPU) give the features of their torch path: every tower, two
images of different sizes encoded together (Qwen2.5-VL: its windows and full-attention layers;
Pixtral: two patch grids in one launch), float32. And Qwen2.5-VL through the engine on the
Triton backend (paged attention with M-RoPE positions and the vision kernel) gives transformers'
greedy tokens for a prompt with an image batched with a text-only one."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

pytest.importorskip("triton")

from serverless_llm.engine.kernels import vision_attention as va  # noqa: E402
from tests.engine.vision_check import (  # noqa: E402
    engine_greedy,
    family_processor,
    hf_vision_greedy,
    make_llm,
)
from tests.kernels.batch import DEVICE  # noqa: E402

# case -> (module under tests/engine, builder)
TOWERS = {
    "gemma3": ("vision_gemma3_models", "save_tiny_gemma3"),
    "gemma4": ("vision_gemma4_models", "save_tiny_gemma4"),
    "idefics3": ("vision_idefics3_models", "save_tiny_idefics3"),
    "llama4": ("vision_llama4_models", "save_tiny_llama4"),
    "llava": ("vision_llava_models", "save_tiny_llava"),
    "llava_next": ("vision_llava_models", "save_tiny_llava_next"),
    "mistral3": ("vision_pixtral_models", "save_tiny_mistral3"),
    "qwen2_5_vl": ("vision_qwen_vl_models", "save_tiny_qwen2_5_vl"),
    "qwen3_vl": ("vision_qwen_vl_models", "save_tiny_qwen3_vl"),
}


def _build(case: str, path: str):
    module, builder = TOWERS[case]
    mod = importlib.import_module(f"tests.engine.{module}")
    getattr(mod, builder)(path)
    return mod.sample_images()


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the kernel's launches (the towers reach it through `vision_attention`)."""
    calls = []
    launch = va.vision_attention_triton

    def counted(*args, **kwargs):
        calls.append(args[3].numel() - 1)  # sequences in the launch
        return launch(*args, **kwargs)

    monkeypatch.setattr(va, "vision_attention_triton", counted)
    return calls


@pytest.mark.parametrize("case", sorted(TOWERS))
def test_tower_features_on_the_kernel_equal_torch(tmp_path, kernel_calls, case):
    path = str(tmp_path / case)
    images = _build(case, path)
    family, processor = family_processor(path)
    ph = family.image_placeholder(processor)
    mm = family.process(processor, f"Look {ph} and {ph}.", [images[0], images[1]])
    items = [item.data for item in mm.items]
    tower = family.build_tower(transformers.AutoConfig.from_pretrained(path), torch.float32)
    weights = load_file(os.path.join(path, "model.safetensors"))
    tower.load_weights((k, v) for k, v in weights.items() if k.startswith(family.tower_prefixes))
    tower.eval()
    if DEVICE.type == "cpu":
        tower.encode(items)
        assert not kernel_calls  # a tower alone on the CPU keeps its torch attention
    tower.to(DEVICE)
    items = [
        {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in item.items()}
        for item in items
    ]

    tower.set_use_kernels(False)
    want = tower.encode(items)
    assert not kernel_calls
    tower.set_use_kernels(True)
    got = tower.encode(items)
    assert kernel_calls, "the tower never reached the kernel"
    assert len(got) == len(want)
    tol = dict(atol=1e-5, rtol=1e-5) if DEVICE.type == "cpu" else dict(atol=1e-4, rtol=1e-4)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.embeds, w.embeds, **tol)
        for gd, wd in zip(g.deepstack or [], w.deepstack or []):
            torch.testing.assert_close(gd, wd, **tol)


def test_qwen2_5_vl_engine_on_triton_backend_equals_transformers(tmp_path, kernel_calls):
    """A 2-layer tower (windows of 2 x 2 cells, then full attention) over the 2-layer decoder,
    a prompt with one 112 x 112 image (16 tokens, 4 windows) batched with a text-only one, 16
    new tokens: every kernel interpreted (compiled where there is a GPU)."""
    path = str(tmp_path / "qwen2_5_vl")
    module = importlib.import_module("tests.engine.vision_qwen_vl_models")
    module.save_tiny_qwen2_5_vl(path, depth=2)
    image = module.sample_images()[2]
    family, processor = family_processor(path)
    prompts = [
        (f"Hello {family.image_placeholder(processor)} what is it?", [image]),
        ("Once upon a time", []),
    ]
    llm = make_llm(path, attention_backend="triton", max_model_len=128, num_kv_blocks=32)
    assert llm.engine.backend.name == "triton"
    got = engine_greedy(llm, prompts, new_tokens=16)
    assert kernel_calls == [4, 1]  # layer 0 over the 4 windows, layer 1 over the image
    assert got == hf_vision_greedy(path, prompts, new_tokens=16)

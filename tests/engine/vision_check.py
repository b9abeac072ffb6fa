"""Checking a vision-language family end to end against transformers: prompts with none, one
and two images of different sizes, batched together through the engine (`LLM.generate` with
vLLM's `multi_modal_data` prompts), greedy, token for token against transformers' `generate`
on the processor's inputs, one prompt at a time."""

from __future__ import annotations

import copy

import torch
import transformers

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.multimodal import vision_family_of

NEW_TOKENS = 32


def family_processor(path: str):
    config = transformers.AutoConfig.from_pretrained(path)
    family = vision_family_of(config.architectures)
    return family, family.make_processor(path, config)


def vision_prompts(placeholder: str, images: list) -> list[tuple[str, list]]:
    """4 prompts: one image, two images, no image, one image (another size), each with text
    before and after its images."""
    a, b, c = images[0], images[1], images[2]
    return [
        (f"Hello world! {placeholder} What is this?", [a]),
        (f"The quick {placeholder} brown {placeholder} fox", [b, c]),
        ("Once upon a time, in a land far away", []),
        (f"{placeholder}Paged attention stores keys", [c]),
    ]


@torch.inference_mode()
def hf_vision_greedy(path: str, prompts, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy tokens for each (text, images) prompt, one at a time."""
    _, processor = family_processor(path)
    model = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    model.eval()
    # An EOS id no token has: the full length without masking EOS (ignore_eos's meaning; see
    # reference.hf_greedy).
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = [1 << 30]
    config.pad_token_id = 0
    config.max_new_tokens = new_tokens
    config.do_sample = False
    out = []
    for text, images in prompts:
        kw = {"images": images} if images else {}
        inputs = processor(text=[text], return_tensors="pt", **kw)
        n = inputs["input_ids"].shape[1]
        gen = model.generate(**inputs, generation_config=config)
        out.append(gen[0, n:].tolist())
        assert len(out[-1]) == new_tokens, "transformers stopped early"
    return out


def engine_prompts(prompts) -> list:
    return [
        {"prompt": text, "multi_modal_data": {"image": images}} if images else text
        for text, images in prompts
    ]


def engine_greedy(llm: LLM, prompts, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return [r.outputs[0].token_ids for r in llm.generate(engine_prompts(prompts), params)]


def make_llm(path: str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_model_len", 512)
    return LLM(model=path, **kw)


def saved_variants(tmp_path_factory, save, variants: dict):
    """name -> the checkpoint `save(path, **variants[name])` wrote, built once per test module
    (a module fixture returns this)."""
    saved: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in saved:
            saved[name] = save(str(tmp_path_factory.mktemp(name)), **variants[name])
        return saved[name]

    return get


def checkpoint_tower(family, config, path: str, dtype=torch.float32):
    """The family's tower with its tensors from the checkpoint in `path`."""
    from safetensors.torch import load_file

    tower = family.build_tower(config, dtype)
    weights = load_file(f"{path}/model.safetensors")
    tower.load_weights((k, v) for k, v in weights.items() if k.startswith(family.tower_prefixes))
    return tower.eval()

"""Tiny random Llama 4 vision-language checkpoints (`Llama4ForConditionalGeneration`) for tests.

A checkpoint holds Llama 4's vision model (unfold patch embedding, class row, 2D rotary, two
encoder layers, pixel shuffle and the adapter MLP) on 56 px tiles of 7 px patches (64 patches,
16 tokens a tile), the multi-modal projector, a four-layer Llama 4 text decoder (chunked
attention with a chunk shorter than an image's run, NoPE layers with temperature tuning, an MoE
layer), the test tokenizer with Llama 4's image and header tokens, and the processor's files
written as a real checkpoint's are (`"image_processor_type": "Llama4ImageProcessorFast"`, which
needs torchvision, so AutoProcessor cannot build it here), with Llama 4's chat template.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import processors
from transformers.models.llama4.processing_llama4 import chat_template as LLAMA4_CHAT_TEMPLATE

from serverless_llm.engine.models.vision.llama4_image import Llama4ImageProcessorPil
from tests.tiny_models import build_tokenizer, tiny_dims

IMAGE = "<|image|>"
IMAGE_START = "<|image_start|>"
IMAGE_END = "<|image_end|>"
PATCH = "<|patch|>"
TILE_X = "<|tile_x_separator|>"
TILE_Y = "<|tile_y_separator|>"
IMAGE_TOKENS = [IMAGE_START, IMAGE_END, IMAGE, PATCH, TILE_X, TILE_Y]
CHAT_TOKENS = ["<|header_start|>", "<|header_end|>", "<|eot|>"]


def llama4_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The test tokenizer with Llama 4's image and chat tokens, a BOS in front of every text
    (so add_special_tokens=False shows), and Llama 4's chat template."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS + CHAT_TOKENS})
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.bos_token_id)]
    )
    tokenizer.chat_template = LLAMA4_CHAT_TEMPLATE
    return tokenizer


def llama4_config(
    tokenizer,
    *,
    tile: int = 56,
    patch_size: int = 7,
    vision_hidden: int = 32,
    vision_heads: int = 2,
    vision_layers: int = 2,
    projector_dim: int = 48,
    rope_theta: float = 10000.0,
    chunk: int = 24,
) -> transformers.Llama4Config:
    """A tiny Llama4Config whose image token ids are the tokenizer's (the features go to the
    `<|patch|>` tokens: `image_token_index`)."""
    vision = dict(
        hidden_size=vision_hidden,
        num_hidden_layers=vision_layers,
        num_attention_heads=vision_heads,
        intermediate_size=4 * vision_hidden,  # the adapter reads 2x2 pixel-shuffled patches
        image_size=tile,
        patch_size=patch_size,
        pixel_shuffle_ratio=0.5,
        projector_input_dim=projector_dim,
        projector_output_dim=projector_dim,
        vision_output_dim=projector_dim,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
    )
    text = tiny_dims(
        tokenizer,
        num_hidden_layers=4,
        intermediate_size=32,
        head_dim=16,
        intermediate_size_mlp=96,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        no_rope_layer_interval=2,
        attention_chunk_size=chunk,
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=8,
        attn_scale=0.5,
    )
    ids = tokenizer.convert_tokens_to_ids([IMAGE_START, IMAGE_END, PATCH])
    return transformers.Llama4Config(
        text_config=text,
        vision_config=vision,
        boi_token_index=ids[0],
        eoi_token_index=ids[1],
        image_token_index=ids[2],
        architectures=["Llama4ForConditionalGeneration"],
    )


def llama4_processor(tokenizer, config, max_patches: int = 4) -> transformers.Llama4Processor:
    vc = config.vision_config
    image_processor = Llama4ImageProcessorPil(
        size={"height": vc.image_size, "width": vc.image_size}, max_patches=max_patches
    )
    return transformers.Llama4Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=vc.patch_size,
        pixel_shuffle_ratio=vc.pixel_shuffle_ratio,
        chat_template=LLAMA4_CHAT_TEMPLATE,
    )


def save_tiny_llama4(path: str, seed: int = 0, std: float = 0.2, max_patches: int = 4, **variant):
    """A random tiny Llama 4 vision-language checkpoint saved into `path` (weights, tokenizer,
    processor files); `variant`: keyword arguments of `llama4_config`. Returns `path`."""
    tokenizer = llama4_tokenizer()
    config = llama4_config(tokenizer, **variant)
    torch.manual_seed(seed)
    # float32 already (a .to(dtype) would drop the imaginary part of the rotary buffer)
    model = transformers.Llama4ForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    llama4_processor(tokenizer, config, max_patches).save_pretrained(path)
    # as Meta's checkpoints name it: the torchvision image processor
    _rename_image_processor(path, "Llama4ImageProcessorFast")
    return path


def _rename_image_processor(path: str, name: str) -> None:
    for file in ("processor_config.json", "preprocessor_config.json"):
        full = os.path.join(path, file)
        if not os.path.exists(full):
            continue
        with open(full, encoding="utf-8") as f:
            data = json.load(f)
        settings = data.get("image_processor", data)
        if "image_processor_type" in settings:
            settings["image_processor_type"] = name
        with open(full, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)


def sample_images(seed: int = 0) -> list[Image.Image]:
    """Random-noise RGB images (width x height): 40x40 (one tile, grown to it), 96x48 (1x2
    tiles and the global one, padded), 150x100 (2x2 and global, shrunk and padded), 36x80 (2x1
    and global, padded), 70x56."""
    rng = np.random.default_rng(seed)
    sizes = [(40, 40), (96, 48), (150, 100), (36, 80), (70, 56)]
    return [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), mode="RGB")
        for w, h in sizes
    ]

"""Tiny random LLaVA and LLaVA-NeXT checkpoints (CLIP vision tower, Llama text decoder) for the
vision tests, and sample images of several sizes and aspect ratios.

Each builder saves a complete checkpoint directory: config, safetensors weights (std 0.2 so
greedy picks are clear), the byte-level test tokenizer with an `<image>` token, and the
processor's files (image processor config, processor config, chat template)."""

from __future__ import annotations

import os

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import processors

from tests.tiny_models import build_tokenizer, make_config

IMAGE_TOKEN = "<image>"

# Renders a message's content list: an image part as "<image>\n", a text part as is.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def llava_tokenizer() -> transformers.PreTrainedTokenizerFast:
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    # a BOS in front, as Llama's tokenizers add it (so add_special_tokens=False shows)
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.bos_token_id)]
    )
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    return tokenizer


def clip_vision_config(image_size: int = 56, patch_size: int = 14, **overrides):
    kw = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=16,
    )
    kw.update(overrides)
    return transformers.CLIPVisionConfig(**kw)


def siglip_vision_config(image_size: int = 56, patch_size: int = 14, **overrides):
    kw = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=patch_size,
    )
    kw.update(overrides)
    return transformers.SiglipVisionConfig(**kw)


def vision_config(vision: str, image_size: int):
    if vision == "clip":
        return clip_vision_config(image_size)
    if vision == "siglip":
        return siglip_vision_config(image_size)
    raise ValueError(vision)


def _randomize_and_save(model, path: str, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
            else:
                # norms around 1, biases and embeddings (class embedding, image_newline) small
                p.normal_(1.0 if p.dim() == 1 and torch.all(p == 1) else 0.0, 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)


def save_tiny_llava(
    path: str,
    *,
    vision_feature_layer: int | list[int] = -2,
    vision_feature_select_strategy: str = "default",
    multimodal_projector_bias: bool = True,
    projector_hidden_act: str = "gelu",
    image_size: int = 56,
    do_pad: bool = False,
    vision: str = "clip",
    seed: int = 0,
) -> str:
    """A LlavaForConditionalGeneration with a 2-layer CLIP tower (56 px, 14 px patches: 16
    patches + CLS) or SigLIP tower (`vision="siglip"`: no CLS) and the tiny Llama decoder;
    returns `path`."""
    tokenizer = llava_tokenizer()
    text_config = make_config("llama", tokenizer)
    config = transformers.LlavaConfig(
        vision_config=vision_config(vision, image_size),
        text_config=text_config,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy=vision_feature_select_strategy,
        multimodal_projector_bias=multimodal_projector_bias,
        projector_hidden_act=projector_hidden_act,
        image_seq_length=(image_size // 14) ** 2,
    )
    model = transformers.LlavaForConditionalGeneration(config).eval()
    _randomize_and_save(model, path, seed)
    image_processor = transformers.LlavaImageProcessorPil(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
        do_pad=do_pad,
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy=vision_feature_select_strategy,
        num_additional_image_tokens=int(vision == "clip"),
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path


def save_tiny_llava_next(
    path: str,
    *,
    vision_feature_layer: int | list[int] = -2,
    multimodal_projector_bias: bool = True,
    vision: str = "clip",
    tile: int = 42,
    pinpoints: list[list[int]] | None = None,
    seed: int = 0,
) -> str:
    """A LlavaNextForConditionalGeneration: the tiny CLIP tower on `tile`-px tiles (42 px, 14 px
    patches: 3 x 3 features a tile; "default" strategy drops CLIP's class row, SigLIP keeps
    all ("full")), any-resolution pinpoints of 1 x 2, 2 x 1, 2 x 2, 3 x 1 and 1 x 3 tiles, and
    the tiny Llama decoder; returns `path`."""
    tokenizer = llava_tokenizer()
    text_config = make_config("llama", tokenizer)
    strategy = "default" if vision == "clip" else "full"
    if pinpoints is None:
        pinpoints = [[tile * r, tile * c] for r, c in ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))]
    config = transformers.LlavaNextConfig(
        vision_config=vision_config(vision, tile),
        text_config=text_config,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy=strategy,
        multimodal_projector_bias=multimodal_projector_bias,
        image_grid_pinpoints=pinpoints,
        image_seq_length=(tile // 14) ** 2,
    )
    model = transformers.LlavaNextForConditionalGeneration(config).eval()
    _randomize_and_save(model, path, seed)
    image_processor = transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": tile},
        crop_size={"height": tile, "width": tile},
        image_grid_pinpoints=pinpoints,
    )
    processor = transformers.LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=int(vision == "clip"),
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path


def sample_images(seed: int = 0) -> list[Image.Image]:
    """Random-noise RGB images (W x H): square, landscape, portrait, small, wide, and two whose
    aspect ratios leave LLaVA-NeXT's tile grids padding rows (100 x 70) or columns (50 x 120)
    to cut."""
    rng = np.random.default_rng(seed)
    sizes = [(64, 64), (96, 48), (40, 80), (30, 30), (112, 36), (100, 70), (50, 120)]
    return [Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)) for w, h in sizes]

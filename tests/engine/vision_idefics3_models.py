"""Tiny random Idefics3 and SmolVLM checkpoints (SigLIP-style vision tower with a pixel-shuffle
connector, Llama text decoder) for the vision tests, and sample images of several sizes and
aspect ratios.

Each builder saves a complete checkpoint directory: config, safetensors weights (std 0.2 so
greedy picks are clear), the byte-level test tokenizer with the family's image tokens
(`<fake_token_around_image>`, `<image>`, `<end_of_utterance>`, `<global-img>` and the
`<row_i_col_j>` tile tags) and the processor's files (image processor config, processor config,
chat template).

Sizes: 32 px frames of 8 px patches (4 x 4 patches) shuffled by 2 into 4 image tokens a frame;
an image is resized to a longest edge of 64 px (`longest_edge`), then cut into up to 2 x 2 tiles
of 32 px plus the whole image at 32 px (`do_image_splitting`)."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import transformers
from PIL import Image

from tests.tiny_models import build_tokenizer, make_config

FAKE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
END_OF_UTTERANCE = "<end_of_utterance>"
GLOBAL_TOKEN = "<global-img>"
ROW_COL_TOKENS = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]

# Renders a message's content list: an image part as "<image>", a text part as is; a turn is
# "Role: ...<end_of_utterance>\n" (no space after the colon when the turn opens with an image).
IDEFICS3_CHAT_TEMPLATE = (
    "<s>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def idefics3_tokenizer() -> transformers.PreTrainedTokenizerFast:
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                FAKE_TOKEN,
                IMAGE_TOKEN,
                END_OF_UTTERANCE,
                GLOBAL_TOKEN,
                *ROW_COL_TOKENS,
            ]
        }
    )
    tokenizer.chat_template = IDEFICS3_CHAT_TEMPLATE
    return tokenizer


def _vision_config(cls, image_size: int, patch_size: int, **overrides):
    kw = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=patch_size,
    )
    kw.update(overrides)
    return cls(**kw)


def _randomize_and_save(model, path: str, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
            else:
                # norms around 1, biases small
                p.normal_(1.0 if torch.all(p == 1) else 0.0, 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)


def _save(
    family: str,
    path: str,
    *,
    image_size: int,
    patch_size: int,
    scale_factor: int,
    longest_edge: int,
    do_image_splitting: bool,
    seed: int,
) -> str:
    tokenizer = idefics3_tokenizer()
    text_config = make_config("llama", tokenizer)
    image_seq_len = (image_size // patch_size) ** 2 // scale_factor**2
    if family == "idefics3":
        config_cls, model_cls = (
            transformers.Idefics3Config,
            transformers.Idefics3ForConditionalGeneration,
        )
        vision_cls = transformers.Idefics3VisionConfig
        image_processor_cls = transformers.Idefics3ImageProcessorPil
    else:
        config_cls, model_cls = (
            transformers.SmolVLMConfig,
            transformers.SmolVLMForConditionalGeneration,
        )
        vision_cls = transformers.SmolVLMVisionConfig
        image_processor_cls = transformers.SmolVLMImageProcessorPil
    config = config_cls(
        vision_config=_vision_config(vision_cls, image_size, patch_size),
        text_config=text_config,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=scale_factor,
        tie_word_embeddings=False,
    )
    model = model_cls(config).eval()
    _randomize_and_save(model, path, seed)
    image_processor = image_processor_cls(
        size={"longest_edge": longest_edge},
        max_image_size={"longest_edge": image_size},
        do_image_splitting=do_image_splitting,
    )
    if family == "idefics3":
        processor = transformers.Idefics3Processor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            image_seq_len=image_seq_len,
            chat_template=IDEFICS3_CHAT_TEMPLATE,
        )
        processor.save_pretrained(path)
    else:
        # what SmolVLMProcessor.save_pretrained writes for images (the class itself needs a
        # video processor, whose class needs torchvision, and num2words)
        tokenizer.save_pretrained(path)
        image_processor.save_pretrained(path)
        with open(os.path.join(path, "processor_config.json"), "w") as f:
            json.dump({"image_seq_len": image_seq_len, "processor_class": "SmolVLMProcessor"}, f)
    return path


def save_tiny_idefics3(
    path: str,
    *,
    image_size: int = 32,
    patch_size: int = 8,
    scale_factor: int = 2,
    longest_edge: int = 64,
    do_image_splitting: bool = True,
    seed: int = 0,
) -> str:
    """An Idefics3ForConditionalGeneration with a 2-layer vision tower (32 px frames, 8 px
    patches, pixel shuffle by `scale_factor`) and the tiny Llama decoder; returns `path`."""
    return _save(
        "idefics3",
        path,
        image_size=image_size,
        patch_size=patch_size,
        scale_factor=scale_factor,
        longest_edge=longest_edge,
        do_image_splitting=do_image_splitting,
        seed=seed,
    )


def save_tiny_smolvlm(
    path: str,
    *,
    image_size: int = 32,
    patch_size: int = 8,
    scale_factor: int = 2,
    longest_edge: int = 64,
    do_image_splitting: bool = True,
    seed: int = 0,
) -> str:
    """A SmolVLMForConditionalGeneration (the Idefics3 tower and connector) with the tiny Llama
    decoder; returns `path`."""
    return _save(
        "smolvlm",
        path,
        image_size=image_size,
        patch_size=patch_size,
        scale_factor=scale_factor,
        longest_edge=longest_edge,
        do_image_splitting=do_image_splitting,
        seed=seed,
    )


def sample_images(seed: int = 0) -> list[Image.Image]:
    """Random-noise RGB images: square, landscape, portrait, small, and wide (W x H)."""
    rng = np.random.default_rng(seed)
    sizes = [(64, 64), (96, 48), (40, 80), (30, 30), (112, 36)]
    return [Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)) for w, h in sizes]

"""Tiny random Pixtral-tower checkpoints for the vision tests: Mistral3ForConditionalGeneration
(Pixtral encoder, Mistral 3's merging projector, Mistral decoder) and LlavaForConditionalGeneration
with a Pixtral vision_config (Pixtral-12B's layout: LLaVA's projector), and sample images of
several sizes and aspect ratios.

Each builder saves a complete checkpoint directory: config, safetensors weights (std 0.2 so
greedy picks are clear), the byte-level test tokenizer with Mistral's `[IMG]`, `[IMG_BREAK]`,
`[IMG_END]`, `[INST]`, `[/INST]` tokens, and the processor's files (PixtralProcessor: its image
processor config, patch and merge sizes, chat template)."""

from __future__ import annotations

import os

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers.processors import TemplateProcessing
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

from serverless_llm.engine.models.vision.pixtral import pixtral_processor_class
from tests.tiny_models import build_tokenizer, make_config

IMAGE_TOKEN, BREAK_TOKEN, END_TOKEN = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
MISTRAL_TOKENS = [IMAGE_TOKEN, BREAK_TOKEN, END_TOKEN, "[INST]", "[/INST]"]

# Mistral's layout: [INST] user parts [/INST], an image part as "[IMG]".
PIXTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}[IMG]"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "[/INST]{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def pixtral_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The test tokenizer with Mistral's tokens; like Mistral's, it starts a text with `<s>`
    when asked to add special tokens."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": MISTRAL_TOKENS})
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    tokenizer.chat_template = PIXTRAL_CHAT_TEMPLATE
    return tokenizer


def pixtral_vision_config(patch_size: int, **overrides) -> transformers.PixtralVisionConfig:
    kw = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=64,
        patch_size=patch_size,
        hidden_act="gelu",
    )
    kw.update(overrides)
    return transformers.PixtralVisionConfig(**kw)


def _randomize_and_save(model, path: str, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
            else:  # norms around 1, biases small
                p.normal_(1.0 if torch.all(p == 1) else 0.0, 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)


def _save_processor(path, tokenizer, patch_size: int, merge: int, longest_edge: int) -> None:
    image_processor = PixtralImageProcessorPil(
        size={"longest_edge": longest_edge},
        patch_size={"height": patch_size, "width": patch_size},
    )
    processor = pixtral_processor_class()(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        spatial_merge_size=merge,
        chat_template=PIXTRAL_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)


def save_tiny_mistral3(
    path: str,
    *,
    patch_size: int = 4,
    spatial_merge_size: int = 2,
    longest_edge: int = 64,
    vision_feature_layer: int = -1,
    multimodal_projector_bias: bool = False,
    projector_hidden_act: str = "gelu",
    vision_act: str = "gelu",
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> str:
    """A Mistral3ForConditionalGeneration: a 2-layer Pixtral tower (4 px patches, 2x2 merge:
    one [IMG] token per 8 px square, images up to 64 px a side) and the tiny Mistral decoder;
    returns `path`."""
    tokenizer = pixtral_tokenizer()
    text_config = make_config("mistral", tokenizer, sliding_window=None)
    config = transformers.Mistral3Config(
        vision_config=pixtral_vision_config(
            patch_size,
            hidden_act=vision_act,
            rope_parameters={"rope_type": "axial", "rope_theta": rope_theta},
        ),
        text_config=text_config,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        spatial_merge_size=spatial_merge_size,
        vision_feature_layer=vision_feature_layer,
        multimodal_projector_bias=multimodal_projector_bias,
        projector_hidden_act=projector_hidden_act,
        tie_word_embeddings=tie_word_embeddings,
    )
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    _randomize_and_save(model, path, seed)
    _save_processor(path, tokenizer, patch_size, spatial_merge_size, longest_edge)
    return path


def save_tiny_pixtral_llava(
    path: str,
    *,
    patch_size: int = 8,
    longest_edge: int = 64,
    vision_feature_layer: int | list[int] = -1,
    multimodal_projector_bias: bool = True,
    projector_hidden_act: str = "gelu",
    vision_act: str = "silu",
    seed: int = 0,
) -> str:
    """A LlavaForConditionalGeneration with a 2-layer Pixtral tower (8 px patches: one [IMG]
    token per patch, images up to 64 px a side; "full" feature strategy as Pixtral-12B) and the
    tiny Mistral decoder; returns `path`."""
    tokenizer = pixtral_tokenizer()
    text_config = make_config("mistral", tokenizer, sliding_window=None)
    config = transformers.LlavaConfig(
        vision_config=pixtral_vision_config(patch_size, hidden_act=vision_act),
        text_config=text_config,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy="full",
        multimodal_projector_bias=multimodal_projector_bias,
        projector_hidden_act=projector_hidden_act,
    )
    model = transformers.LlavaForConditionalGeneration(config).eval()
    _randomize_and_save(model, path, seed)
    _save_processor(path, tokenizer, patch_size, 1, longest_edge)
    return path


def sample_images(seed: int = 0) -> list[Image.Image]:
    """Random-noise RGB images: square, landscape, portrait, small, wide and large (W x H)."""
    rng = np.random.default_rng(seed)
    sizes = [(64, 64), (96, 48), (40, 80), (30, 30), (112, 36), (28, 50)]
    return [Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)) for w, h in sizes]

"""Tiny random Gemma 3 vision-language checkpoints (`Gemma3ForConditionalGeneration`) for tests.

A checkpoint holds a SigLIP vision tower (8x8 patches of 7 px on a 56 px image by default), the
multi-modal projector (pooled to `mm_tokens_per_image` soft tokens), a two-layer Gemma 3 text
decoder (one sliding-window layer, one global), the test tokenizer with Gemma 3's image tokens
(`<start_of_image>`, `<end_of_image>`, `<image_soft_token>`) and turn tokens, and the processor's
files (`Gemma3ImageProcessorPil` settings, `image_seq_length`, a Gemma-3-style chat template).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import transformers
from PIL import Image

from tests.tiny_models import build_tokenizer

BOI = "<start_of_image>"
EOI = "<end_of_image>"
IMAGE_TOKEN = "<image_soft_token>"
TURN_TOKENS = ["<start_of_turn>", "<end_of_turn>"]

# A Gemma-3-style template: a system message is folded into the first user turn, the assistant
# speaks as "model", and an image part is written as the begin-of-image token (the processor
# expands it to the image's full token run).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set sys = messages[0]['content'] if messages[0]['content'] is string "
    "else messages[0]['content'][0]['text'] %}"
    "{% set prefix = sys + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + BOI + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def build_gemma3_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The test tokenizer with Gemma 3's image and turn tokens, the image ones also named as the
    tokenizer's `boi_token`, `eoi_token` and `image_token` (what Gemma3Processor reads)."""
    base = build_tokenizer()
    base.add_special_tokens({"additional_special_tokens": [BOI, EOI, IMAGE_TOKEN, *TURN_TOKENS]})
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE_TOKEN},
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def gemma3_config(
    tokenizer,
    *,
    image_size: int = 56,
    patch_size: int = 7,
    mm_tokens_per_image: int = 16,
    vision_hidden: int = 32,
    vision_layers: int = 2,
    sliding_window: int = 32,
    hidden_act: str = "gelu_pytorch_tanh",
    tie_word_embeddings: bool = True,
) -> transformers.Gemma3Config:
    """A tiny Gemma3Config whose image token ids are the tokenizer's. `tie_word_embeddings`
    False saves a separate lm_head (the engine's Gemma descriptions tie always, so such a
    checkpoint is for transformers-side checks only)."""
    ids = tokenizer.convert_tokens_to_ids([BOI, EOI, IMAGE_TOKEN])
    vision = transformers.SiglipVisionConfig(
        hidden_size=vision_hidden,
        intermediate_size=2 * vision_hidden,
        num_hidden_layers=vision_layers,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=patch_size,
        hidden_act=hidden_act,
        vision_use_head=False,
    )
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=sliding_window,
        sliding_window_pattern=2,  # layer 0 sliding, layer 1 global
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=mm_tokens_per_image,
        boi_token_index=ids[0],
        eoi_token_index=ids[1],
        image_token_index=ids[2],
        tie_word_embeddings=tie_word_embeddings,
        architectures=["Gemma3ForConditionalGeneration"],
    )


def save_tiny_gemma3(path: str, seed: int = 0, std: float = 0.2, **variant) -> str:
    """A random tiny Gemma 3 vision-language checkpoint saved into `path` (weights, tokenizer,
    processor files); `variant`: keyword arguments of `gemma3_config`. Returns `path`."""
    tokenizer = build_gemma3_tokenizer()
    config = gemma3_config(tokenizer, **variant)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    size = config.vision_config.image_size
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": size, "width": size})
    processor = transformers.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
        image_seq_length=config.mm_tokens_per_image,
    )
    processor.save_pretrained(path)
    return path


def sample_images(seed: int = 0) -> list[Image.Image]:
    """Random-noise RGB images of different sizes and aspect ratios (square, wide, tall)."""
    rng = np.random.default_rng(seed)
    sizes = [(40, 40), (96, 48), (36, 80), (70, 56)]  # (width, height)
    return [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), mode="RGB")
        for w, h in sizes
    ]

"""Tiny random Qwen2.5-VL, Qwen3-VL and Qwen3.5 (dense and MoE) checkpoints for the vision
tests, and sample images of several sizes and aspect ratios.

Each builder saves a complete checkpoint directory: config, safetensors weights (std 0.2 so
greedy picks are clear), the byte-level test tokenizer with Qwen's vision tokens, and the
processor's files (image processor settings, processor config naming the stock processor class,
chat template). The image processors are sized so an image is 1 to 16 tokens."""

from __future__ import annotations

import os

import numpy as np
import torch
import transformers
from PIL import Image

from serverless_llm.engine.models.vision.qwen_vl import (
    Qwen2_5VLFamily,
    Qwen3_5VLFamily,
    Qwen3VLFamily,
)
from tests.tiny_models import build_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# Qwen's chat layout; an image part is "<|vision_start|><|image_pad|><|vision_end|>".
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_vl_tokenizer() -> transformers.PreTrainedTokenizerFast:
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    return tokenizer


def _token_ids(tokenizer) -> dict:
    ids = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    return dict(
        vision_start_token_id=ids[0],
        vision_end_token_id=ids[1],
        image_token_id=ids[2],
        video_token_id=ids[3],
    )


def _text_ids(tokenizer) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _save(model, family, image_processor, tokenizer, path: str, seed: int) -> str:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
            else:  # norm weights near 1, biases small
                p.normal_(1.0 if torch.all(p == 1) else 0.0, 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    processor = family.processor_class()(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN_VL_CHAT_TEMPLATE
    )
    processor.save_pretrained(path)
    return path


def save_tiny_qwen2_5_vl(
    path: str,
    *,
    depth: int = 3,
    fullatt_block_indexes=(1,),
    window_size: int = 56,
    hidden_act: str = "silu",
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> str:
    """A Qwen2_5_VLForConditionalGeneration: a 3-layer tower (hidden 32, 2 heads, 14 px patches,
    merge 2, windows of 56 px = 2 x 2 merged cells, full attention on layer 1) and a 2-layer
    Qwen2.5-VL decoder (hidden 64, head_dim 16, mrope_section [2, 3, 3]); images of 28 to 112 px
    a side. Returns `path`."""
    tokenizer = qwen_vl_tokenizer()
    config = transformers.Qwen2_5_VLConfig(
        vision_config=dict(
            depth=depth,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=window_size,
            fullatt_block_indexes=list(fullatt_block_indexes),
            hidden_act=hidden_act,
        ),
        text_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            **_text_ids(tokenizer),
        ),
        tie_word_embeddings=tie_word_embeddings,
        **_token_ids(tokenizer),
    )
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    return _save(model, Qwen2_5VLFamily(), image_processor, tokenizer, path, seed)


def save_tiny_qwen3_vl(
    path: str,
    *,
    depth: int = 3,
    deepstack_visual_indexes=(0, 1),
    num_position_embeddings: int = 16,
    hidden_act: str = "gelu_pytorch_tanh",
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> str:
    """A Qwen3VLForConditionalGeneration: a 3-layer tower (hidden 32, 2 heads, 16 px patches,
    merge 2, a 4 x 4 grid of learned positions, DeepStack after layers 0 and 1) and a 2-layer
    Qwen3-VL decoder (hidden 64, head_dim 16, interleaved mrope_section [4, 2, 2]); images of
    32 to 128 px a side. Returns `path`."""
    tokenizer = qwen_vl_tokenizer()
    config = transformers.Qwen3VLConfig(
        vision_config=dict(
            depth=depth,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            out_hidden_size=64,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=num_position_embeddings,
            deepstack_visual_indexes=list(deepstack_visual_indexes),
            hidden_act=hidden_act,
        ),
        text_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            rope_scaling={
                "rope_type": "default",
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
            **_text_ids(tokenizer),
        ),
        tie_word_embeddings=tie_word_embeddings,
        **_token_ids(tokenizer),
    )
    model = transformers.Qwen3VLForConditionalGeneration(config).eval()
    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=32 * 32,
        max_pixels=128 * 128,
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return _save(model, Qwen3VLFamily(), image_processor, tokenizer, path, seed)


def save_tiny_qwen3_5_vl(
    path: str,
    *,
    moe: bool = False,
    layer_types=("linear_attention", "full_attention", "linear_attention"),
    rope_parameters: dict | None = None,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> str:
    """A Qwen3_5ForConditionalGeneration (`moe`: Qwen3_5MoeForConditionalGeneration): Qwen3-VL's
    2-layer tower without DeepStack (hidden 32, 2 heads, 16 px patches, merge 2, a 4 x 4 grid of
    learned positions) and a 3-layer hybrid decoder (Gated DeltaNet, gated attention, Gated
    DeltaNet; hidden 64, head_dim 32). Its rope by default: half of each head rotates (16 dims,
    8 frequencies), interleaved mrope_section [3, 3, 2]; `rope_parameters` replaces it (e.g.
    without sections: transformers' [11, 11, 10], past the 4 frequencies of a quarter head).
    MoE: 4 experts, top 2, a gated shared expert on every layer. Images of 32 to 128 px a side.
    Returns `path`."""
    tokenizer = qwen_vl_tokenizer()
    if rope_parameters is None:
        rope_parameters = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        }
    text = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        rope_parameters=dict(rope_parameters),
        **_text_ids(tokenizer),
    )
    if moe:
        text.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=16,
    )
    config_class, model_class = (
        (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration)
        if moe
        else (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration)
    )
    config = config_class(
        vision_config=vision,
        text_config=text,
        tie_word_embeddings=tie_word_embeddings,
        **_token_ids(tokenizer),
    )
    model = model_class(config).eval()
    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=32 * 32,
        max_pixels=128 * 128,
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return _save(model, Qwen3_5VLFamily(), image_processor, tokenizer, path, seed)


def save_tiny_qwen3_5_moe_vl(path: str, **options) -> str:
    """`save_tiny_qwen3_5_vl` with moe=True: a Qwen3_5MoeForConditionalGeneration."""
    return save_tiny_qwen3_5_vl(path, moe=True, **options)


def sample_images(seed: int = 0) -> list[Image.Image]:
    """Noise images (width x height): 90 x 60, 50 x 110, 112 x 112, 30 x 40 (RGB) and 70 x 45
    (grayscale, converted by the processor)."""
    rng = np.random.default_rng(seed)
    images = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for w, h in ((90, 60), (50, 110), (112, 112), (30, 40))
    ]
    images.append(Image.fromarray(rng.integers(0, 256, (45, 70), dtype=np.uint8)))
    return images

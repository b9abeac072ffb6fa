"""Tiny random Gemma 4 vision-language checkpoints (`Gemma4ForConditionalGeneration`) for tests.

A checkpoint holds Gemma 4's vision tower (patches of 4 px, pooled 2x2 to at most 70 soft tokens
an image, two layers 32 wide, the soft tokens standardized), its `embed_vision` embedder, a
four-layer Gemma 4 text decoder (sliding and global layers, the global ones with wider heads and
values = keys, per-layer input embeddings, the last layer sharing KV), no audio tower, the test
tokenizer with Gemma 4's image, audio and video tokens and turn tokens, and the processor's files
(`Gemma4ImageProcessorPil` settings, a Gemma-style chat template).

Gemma4Processor needs a video processor, which needs torchvision: the processor files are
written by the family's images-only processor (models/vision/gemma4.py) under Gemma4Processor's
name.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import transformers
from PIL import Image

from tests.tiny_models import build_tokenizer

IMAGE_TOKEN, BOI, EOI = "<|image|>", "<|image>", "<image|>"
AUDIO_TOKEN, BOA, EOA = "<|audio|>", "<|audio>", "<audio|>"
VIDEO_TOKEN = "<|video|>"
TURN_TOKENS = ["<start_of_turn>", "<end_of_turn>"]

# A Gemma-style template: the assistant speaks as "model", an image part is written as the image
# token (the processor expands it to the image's begin token, soft tokens and end token).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + IMAGE_TOKEN + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def build_gemma4_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The test tokenizer with Gemma 4's multimodal and turn tokens, named as the tokenizer's
    `image_token`, `boi_token`, ... (what Gemma4Processor reads; it requires the audio ones
    even for images)."""
    base = build_tokenizer()
    tokens = [IMAGE_TOKEN, BOI, EOI, AUDIO_TOKEN, BOA, EOA, VIDEO_TOKEN, *TURN_TOKENS]
    base.add_special_tokens({"additional_special_tokens": tokens})
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        extra_special_tokens={
            "image_token": IMAGE_TOKEN,
            "boi_token": BOI,
            "eoi_token": EOI,
            "audio_token": AUDIO_TOKEN,
            "boa_token": BOA,
            "eoa_token": EOA,
        },
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def gemma4_config(
    tokenizer,
    *,
    patch_size: int = 4,
    pooling_kernel_size: int = 2,
    vision_hidden: int = 32,
    vision_layers: int = 2,
    vision_heads: int = 4,
    vision_kv_heads: int = 4,
    standardize: bool = True,
    use_clipped_linears: bool = False,
    per_layer_input: int = 8,
    kv_shared_layers: int = 1,
    sliding_window: int = 24,
    bidirectional: str | None = None,
) -> transformers.Gemma4Config:
    """A tiny Gemma4Config whose multimodal token ids are the tokenizer's. `bidirectional`: the
    text config's `use_bidirectional_attention` ("vision": the 26B and 31B models'). Without
    per-layer inputs, no KV sharing either (transformers 5.23's forward fails with sharing
    and no per-layer inputs)."""
    ids = dict(
        zip(
            ("image", "boi", "eoi", "audio", "boa", "eoa", "video"),
            tokenizer.convert_tokens_to_ids(
                [IMAGE_TOKEN, BOI, EOI, AUDIO_TOKEN, BOA, EOA, VIDEO_TOKEN]
            ),
        )
    )
    vision = dict(
        hidden_size=vision_hidden,
        intermediate_size=2 * vision_hidden,
        num_hidden_layers=vision_layers,
        num_attention_heads=vision_heads,
        num_key_value_heads=vision_kv_heads,
        head_dim=vision_hidden // vision_heads,
        patch_size=patch_size,
        pooling_kernel_size=pooling_kernel_size,
        position_embedding_size=160,
        standardize=standardize,
        use_clipped_linears=use_clipped_linears,
    )
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_kv_shared_layers=kv_shared_layers,
        hidden_size_per_layer_input=per_layer_input,
        vocab_size_per_layer_input=len(tokenizer),
        final_logit_softcapping=30.0,
        use_bidirectional_attention=bidirectional,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return transformers.Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        image_token_id=ids["image"],
        boi_token_id=ids["boi"],
        eoi_token_id=ids["eoi"],
        audio_token_id=ids["audio"],
        boa_token_id=ids["boa"],
        eoa_token_index=ids["eoa"],
        video_token_id=ids["video"],
        architectures=["Gemma4ForConditionalGeneration"],
    )


def _randomize(model, std: float, seed: int) -> None:
    """Weights widened so greedy picks are clear; norm weights, layer scalars, the soft tokens'
    standardization and (clipped linears) the clamp bounds random, so each is exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            else:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "layer_scalar":
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
            elif leaf == "std_bias":
                b.copy_(torch.randn(b.shape, generator=g) * 0.5)
            elif leaf == "std_scale":
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
            elif leaf in ("input_min", "output_min"):
                b.fill_(-0.4 - 0.2 * float(torch.rand((), generator=g)))
            elif leaf in ("input_max", "output_max"):
                b.fill_(0.4 + 0.2 * float(torch.rand((), generator=g)))


def save_tiny_gemma4(
    path: str, seed: int = 0, std: float = 0.2, max_soft_tokens: int = 70, **variant
) -> str:
    """A random tiny Gemma 4 vision-language checkpoint saved into `path` (weights, tokenizer,
    processor files); `variant`: keyword arguments of `gemma4_config`. Returns `path`."""
    from serverless_llm.engine.models.vision.gemma4 import _images_processor_class

    tokenizer = build_gemma4_tokenizer()
    config = gemma4_config(tokenizer, **variant)
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config).to(torch.float32)
    _randomize(model, std, seed)
    # transformers embeds an image, audio or video token as the pad token wherever it stands,
    # a generated one too (the engine embeds it as itself): their rows (the tied output's) are
    # zero, so that their logit 0 never wins a greedy pick.
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        for name in ("image_token_id", "audio_token_id", "video_token_id"):
            embed[getattr(config, name)] = 0.0
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    vc = config.vision_config
    image_processor = transformers.Gemma4ImageProcessorPil(
        patch_size=vc.patch_size,
        pooling_kernel_size=vc.pooling_kernel_size,
        max_soft_tokens=max_soft_tokens,
    )
    processor = _images_processor_class()(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
        image_seq_length=max_soft_tokens,
    )
    processor.save_pretrained(path)
    name = os.path.join(path, "processor_config.json")
    with open(name) as f:
        saved = json.load(f)
    saved["processor_class"] = "Gemma4Processor"
    # as a real checkpoint's files: the audio feature extractor's settings and the video
    # processor's beside (that one written by hand: it cannot be made without torchvision)
    audio = transformers.Gemma4AudioFeatureExtractor()
    saved["feature_extractor"] = json.loads(audio.to_json_string())
    saved["video_processor"] = {
        "video_processor_type": "Gemma4VideoProcessor",
        "patch_size": vc.patch_size,
        "pooling_kernel_size": vc.pooling_kernel_size,
        "max_soft_tokens": max_soft_tokens,
    }
    with open(name, "w") as f:
        json.dump(saved, f, indent=2)
    return path


def sample_images(seed: int = 0) -> list[Image.Image]:
    """Random-noise RGB images of different sizes and aspect ratios (square, wide, tall, and
    one the processor keeps as it is)."""
    rng = np.random.default_rng(seed)
    sizes = [(40, 40), (96, 48), (36, 80), (64, 64)]  # (width, height)
    return [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), mode="RGB")
        for w, h in sizes
    ]

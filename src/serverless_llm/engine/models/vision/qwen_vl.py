"""Vision families Qwen2.5-VL, Qwen3-VL and Qwen3.5 (dense and MoE) (images; videos are refused).

Both take images at (nearly) their own resolution: the processor resizes an image to a multiple
of patch_size * merge_size, cuts it into patches of `patch_size` squared, each repeated over
`temporal_patch_size` frames, and lists them in merge-block order (the merge_size x merge_size
patches that become one token are consecutive). `image_grid_thw` gives the patch grid (1, h, w);
the image takes h * w / merge_size^2 `<|image_pad|>` tokens, between `<|vision_start|>` and
`<|vision_end|>` (ordinary text tokens).

The tower (`qwen_vl_tower.py`):
- Qwen2.5-VL: patches -> linear embedding (the 3-D convolution with stride = kernel), blocks of
  RMSNorm -> attention with 2-D rotary -> RMSNorm -> gated MLP, attention within windows of
  `window_size` pixels except on the `fullatt_block_indexes` layers (whole image), then the
  merger (RMSNorm, merge_size^2 patches -> one row, MLP) to the text width.
- Qwen3-VL: the same embedding (with a bias) plus learned position embeddings resampled
  (bilinear, corners aligned) from their square grid to the image's, LayerNorm blocks with a
  plain MLP, attention over the whole image, the merger; and DeepStack: the hidden states after
  each of the `deepstack_visual_indexes` layers through their own mergers (LayerNorm after the
  merge), returned in `ImageFeatures.deepstack`, in order. transformers adds the i-th of them to
  the decoder's hidden states after decoder layer i (i = 0, 1, ...), at the image's positions.
- Qwen3.5 (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration): Qwen3-VL's
  tower without DeepStack (transformers' Qwen3.5 vision model has none, whatever its config
  says), the same processor (Qwen3VLProcessor) and positions; its decoder is the Gated DeltaNet
  hybrid of models/families_linear.py, whose attention layers rotate the partial rotary part of
  each head by M-RoPE (Qwen3-VL's interleaved layout).

Multimodal rope (M-RoPE): `mrope_positions` gives every prompt token its (temporal, height,
width) positions as the model's `get_rope_index` does: text tokens count on from the previous
token in all three streams; an image's tokens at start + (0, row, col) of its merged grid, and
the text after it starts at start + max(rows, cols).
"""

from __future__ import annotations

import torch
from torch import nn

from ...multimodal.base import (
    ImageItem,
    MultiModalPrompt,
    VisionFamily,
    VisionTower,
    hash_image_data,
    token_runs,
)
from ...multimodal.registry import vision_family
from .qwen_vl_tower import TOWER_PREFIXES, Qwen2_5VisionTower, Qwen3VisionTower

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"


def mrope_positions(
    num_tokens: int, images: list[tuple[int, tuple[int, int, int]]], merge_size: int
) -> tuple[torch.Tensor, int]:
    """The three rotary position streams [3, num_tokens] of a prompt and the offset of the
    tokens generated after it (transformers' `rope_deltas`: max position + 1 - num_tokens).

    `images`: per image in prompt order, the offset of its first image token and its patch grid
    (t, h, w); it occupies t * (h / merge_size) * (w / merge_size) tokens from there."""
    pos = torch.empty(3, num_tokens, dtype=torch.long)
    nxt = 0  # the position the next text token takes
    done = 0  # prompt tokens placed so far
    for offset, (t, h, w) in images:
        if offset < done:
            raise ValueError(f"image at token {offset} overlaps the one before it")
        pos[:, done:offset] = torch.arange(nxt, nxt + offset - done)
        nxt += offset - done
        rows, cols = h // merge_size, w // merge_size
        n = t * rows * cols
        if offset + n > num_tokens:
            raise ValueError(f"image at token {offset} ({n} tokens) runs past the prompt")
        grid = torch.arange(n)
        pos[0, offset : offset + n] = nxt + grid // (rows * cols)
        pos[1, offset : offset + n] = nxt + grid // cols % rows
        pos[2, offset : offset + n] = nxt + grid % cols
        nxt += max(rows, cols)
        done = offset + n
    pos[:, done:] = torch.arange(nxt, nxt + num_tokens - done)
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos, delta


def _image_only(cls):
    """transformers' processor class `cls` built from its image processor and tokenizer alone:
    the stock one also wants a video processor, whose class needs torchvision. Named as `cls`,
    so the processor files it saves name the stock class."""
    from transformers.processing_utils import ProcessorMixin

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # the stock __init__'s token attributes, then the mixin without a video processor
        for kind in ("image", "video"):
            token = getattr(tokenizer, f"{kind}_token", None) or f"<|{kind}_pad|>"
            token_id = getattr(tokenizer, f"{kind}_token_id", None)
            setattr(self, f"{kind}_token", token)
            setattr(self, f"{kind}_token_id", token_id or tokenizer.convert_tokens_to_ids(token))
        for kind, token in (("start", VISION_START), ("end", VISION_END)):
            token = getattr(tokenizer, f"vision_{kind}_token", None) or token
            setattr(self, f"vision_{kind}_token", token)
            setattr(self, f"vision_{kind}_token_id", tokenizer.convert_tokens_to_ids(token))
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": __name__})


class _QwenVLFamily(VisionFamily):
    tower_prefixes = TOWER_PREFIXES
    mrope = True
    processor_class_name = ""
    tower_class: type[VisionTower]

    def __init__(self):
        self._processor_class = None

    def processor_class(self):
        if self._processor_class is None:
            import transformers

            self._processor_class = _image_only(getattr(transformers, self.processor_class_name))
        return self._processor_class

    def make_processor(self, model_dir: str, config):
        return self.processor_class().from_pretrained(model_dir)

    def image_placeholder(self, processor) -> str:
        return VISION_START + processor.image_token + VISION_END

    def process(
        self, processor, text: str, images: list, add_special_tokens: bool = True
    ) -> MultiModalPrompt:
        images = list(images or [])
        if processor.video_token in text:
            raise ValueError(
                f"{processor.video_token!r} in the prompt: videos are not served, only images"
            )
        placeholders = text.count(processor.image_token)
        if placeholders != len(images):
            raise ValueError(
                f"the prompt has {placeholders} image placeholder(s) ({processor.image_token!r}) "
                f"but {len(images)} image(s) were given"
            )
        out = processor(
            text=[text],
            images=images or None,
            add_special_tokens=add_special_tokens,
            return_tensors="pt",
        )
        ids = out["input_ids"][0].tolist()
        if not images:
            positions, delta = mrope_positions(len(ids), [], 1)
            return MultiModalPrompt(ids, [], positions, delta)
        merge = processor.image_processor.merge_size
        grids = out["image_grid_thw"]
        pixels = out["pixel_values"]
        runs = token_runs(ids, processor.image_token_id)
        if len(runs) != len(images):
            raise ValueError(
                f"{len(runs)} runs of image tokens in the processed prompt for {len(images)} images"
            )
        items, placed, row = [], [], 0
        for (offset, length), grid in zip(runs, grids):
            t, h, w = (int(x) for x in grid)
            if length != t * h * w // merge**2:
                raise ValueError(f"an image run of {length} tokens for the patch grid {(t, h, w)}")
            patches = t * h * w
            data = {
                "pixel_values": pixels[row : row + patches].clone(),
                "image_grid_thw": grid.view(1, 3).clone(),
            }
            row += patches
            items.append(ImageItem(offset, length, data, hash_image_data(data)))
            placed.append((offset, (t, h, w)))
        positions, delta = mrope_positions(len(ids), placed, merge)
        return MultiModalPrompt(ids, items, positions, delta)

    def build_tower(self, config, dtype: torch.dtype) -> VisionTower:
        return self.tower_class(config, dtype)


@vision_family("Qwen2_5_VLForConditionalGeneration")
class Qwen2_5VLFamily(_QwenVLFamily):
    processor_class_name = "Qwen2_5_VLProcessor"
    tower_class = Qwen2_5VisionTower


@vision_family("Qwen3VLForConditionalGeneration")
class Qwen3VLFamily(_QwenVLFamily):
    processor_class_name = "Qwen3VLProcessor"
    tower_class = Qwen3VisionTower


class Qwen3_5VisionTower(Qwen3VisionTower):
    """Qwen3-VL's tower without DeepStack layers or their mergers."""

    def build(self, vc) -> None:
        super().build(vc)
        self.deepstack_layers = []
        self.deepstack_merger_list = nn.ModuleList()


@vision_family("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
class Qwen3_5VLFamily(Qwen3VLFamily):
    tower_class = Qwen3_5VisionTower

"""Vision families LLaVA (`LlavaForConditionalGeneration`) and LLaVA-NeXT
(`LlavaNextForConditionalGeneration`): a CLIP (or SigLIP) vision transformer, a two-linear
projector into the text model's hidden size, and (NeXT) any-resolution tiling.

LLaVA: one square image (the processor's crop) -> the hidden states of `vision_feature_layer`
(one layer, or several concatenated along the hidden dim) -> the class row dropped under the
"default" `vision_feature_select_strategy` -> linear_1, act, linear_2. Each image's placeholder
is expanded to exactly that many `<image>` tokens.

LLaVA-NeXT: the processor picks the grid pinpoint (height, width) that best fits the image,
resizes and pads the image to it, cuts it into tower-size tiles and prepends the whole image
resized to one tile (the base). Every tile goes through the LLaVA path; the tiles' feature
grids are laid out as the image, the rows or columns that are only padding are cut away
(unpadding back to the original aspect ratio), a learned `image_newline` row is appended at
the end of every feature row, and the base tile's features come first. The placeholder count
therefore depends on the image's size; the processor computes the same count.

When `vision_config.model_type == "pixtral"` (Pixtral-in-LLaVA checkpoints, Pixtral-12B) the
processor, the processing and the tower are the Pixtral family's (models/vision/pixtral.py).

Spans come from the processor itself: it reports where each placeholder's expansion lies in
the expanded text (`return_text_replacement_offsets`), and the tokenizer's offsets map those
characters to tokens, so the count of tokens per image is always the processor's.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable

import torch
import transformers
from torch import nn

from ...multimodal.base import (
    ImageFeatures,
    ImageItem,
    MultiModalPrompt,
    VisionFamily,
    VisionTower,
    hash_image_data,
    load_tower_tensors,
)
from ...multimodal.registry import vision_family
from .llava_clip import VisionTransformer, activation, hidden_state_indices

_MODEL_PREFIX = "model."
# Tensors of the older checkpoints (transformers < 5) sit under vision_tower.vision_model.
_WRAPPED = "vision_model."


# --- any-resolution geometry (LLaVA-NeXT) ----------------------------------------------------


def best_resolution(image_size, pinpoints) -> tuple[int, int]:
    """The (height, width) among `pinpoints` the image of `image_size` (height, width) fits
    best: the most of its pixels kept once scaled to fit inside, then the least area wasted."""
    h, w = (int(v) for v in image_size)
    best, best_kept, best_waste = None, 0, math.inf
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        kept = min(int(w * scale) * int(h * scale), w * h)
        waste = pw * ph - kept
        if kept > best_kept or (kept == best_kept and waste < best_waste):
            best, best_kept, best_waste = (ph, pw), kept, waste
    return best


def tile_grid(image_size, pinpoints, tile: int) -> tuple[int, int]:
    """Rows and columns of tiles the image of `image_size` (height, width) is cut into."""
    h, w = best_resolution(image_size, pinpoints)
    return math.ceil(h / tile), math.ceil(w / tile)


def num_tiles(image_size, pinpoints, tile: int) -> int:
    """Tiles of one image: its grid plus the base (the whole image as one tile)."""
    rows, cols = tile_grid(image_size, pinpoints, tile)
    return rows * cols + 1


def unpadded_extent(image_size, height: int, width: int) -> tuple[int, int, int, int]:
    """The part of a [height, width] feature grid that covers the image of `image_size`
    (height, width) rather than the padding the processor centred it in: (top, bottom, left,
    right) bounds. The padded side loses the same number of rows (or columns) at each end."""
    oh, ow = (int(v) for v in image_size)
    if ow / oh > width / height:  # wider than the grid: padding above and below
        kept = int(round(oh * (width / ow), 7))
        pad = (height - kept) // 2
        return pad, height - pad, 0, width
    kept = int(round(ow * (height / oh), 7))
    pad = (width - kept) // 2
    return 0, height, pad, width - pad


# --- the towers ------------------------------------------------------------------------------


class Projector(nn.Module):
    """linear_1 (vision hidden x feature layers -> text hidden), act, linear_2."""

    def __init__(self, vision_dim: int, text_dim: int, bias: bool, act: str) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_dim, text_dim, bias=bias)
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaTower(VisionTower):
    """CLIP/SigLIP + projector: `data` {"pixel_values": [1, c, size, size]} per image."""

    def __init__(self, config) -> None:
        super().__init__()
        vc = config.vision_config
        self.indices = hidden_state_indices(config.vision_feature_layer, vc.num_hidden_layers)
        strategy = config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"unknown vision_feature_select_strategy {strategy!r}")
        self.drop_first = strategy == "default"
        self.vision_tower = VisionTransformer(vc, max(self.indices))
        self.multi_modal_projector = Projector(
            vc.hidden_size * len(self.indices),
            config.text_config.hidden_size,
            getattr(config, "multimodal_projector_bias", True),
            config.projector_hidden_act,
        )

    def tile_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, c, size, size] -> [n, rows per tile, text hidden]: the selected hidden states
        side by side, the class row dropped ("default"), projected."""
        states = self.vision_tower(pixel_values, self.indices)
        x = states[0] if len(states) == 1 else torch.cat(states, dim=-1)
        if self.drop_first:
            x = x[:, 1:]
        return self.multi_modal_projector(x)

    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[ImageFeatures]:
        if not items:
            return []
        with torch.no_grad():
            feats = self.tile_features(torch.cat([item["pixel_values"] for item in items]))
        return [ImageFeatures(embeds=f) for f in feats]

    # -- weights --

    def local_name(self, name: str) -> str | None:
        """The tower parameter a checkpoint tensor fills, or None for one the tower skips."""
        if name.startswith(_MODEL_PREFIX):
            name = name[len(_MODEL_PREFIX) :]
        head, _, rest = name.partition(".")
        if head == "vision_tower":
            if rest.startswith(_WRAPPED):
                rest = rest[len(_WRAPPED) :]
            if rest == "embeddings.position_ids" or self.vision_tower.skipped(rest):
                return None
            return f"vision_tower.{rest}"
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        # names local_name maps to None are tensors the tower leaves out on purpose
        load_tower_tensors(params, weights, self.local_name, "LLaVA", skip=lambda n: n is None)


class LlavaNextTower(LlavaTower):
    """LLaVA-NeXT: `data` {"pixel_values": [tiles, c, size, size] (the base first),
    "image_sizes": [1, 2] (the original height, width)} per image."""

    def __init__(self, config) -> None:
        super().__init__(config)
        vc = config.vision_config
        self.pinpoints = [tuple(p) for p in config.image_grid_pinpoints]
        self.tile = vc.image_size
        self.grid = vc.image_size // vc.patch_size
        rows = self.grid * self.grid + int(self.vision_tower.has_class) - int(self.drop_first)
        if rows != self.grid * self.grid:
            # transformers lays each tile's rows out as a grid x grid square (its view fails
            # otherwise): CLIP needs its class row dropped, SigLIP (none) its first row kept
            raise ValueError(
                f"LLaVA-NeXT tiles give {rows} rows, not {self.grid}x{self.grid}: "
                "vision_feature_select_strategy does not fit the vision tower"
            )
        self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size))

    def pack(self, feats: torch.Tensor, image_size) -> torch.Tensor:
        """One image's tile features [tiles, grid * grid, d] -> its rows in prompt order."""
        newline = self.image_newline.to(feats.dtype)
        base = feats[0]
        if feats.shape[0] == 1:
            return torch.cat([base, newline[None]])
        rows, cols = tile_grid(image_size, self.pinpoints, self.tile)
        g, d = self.grid, feats.shape[-1]
        # tiles in row-major order -> one [rows * g, cols * g, d] grid laid out as the image
        grid = feats[1:].view(rows, cols, g, g, d).permute(0, 2, 1, 3, 4)
        grid = grid.reshape(rows * g, cols * g, d)
        top, bottom, left, right = unpadded_extent(image_size, rows * g, cols * g)
        grid = grid[top:bottom, left:right]
        ends = newline.expand(grid.shape[0], 1, d)
        return torch.cat([base, torch.cat([grid, ends], dim=1).reshape(-1, d)])

    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[ImageFeatures]:
        if not items:
            return []
        counts = [item["pixel_values"].shape[0] for item in items]
        out = []
        with torch.no_grad():
            feats = self.tile_features(torch.cat([item["pixel_values"] for item in items]))
            for item, f in zip(items, feats.split(counts), strict=True):
                size = item["image_sizes"].reshape(-1).tolist()
                out.append(ImageFeatures(embeds=self.pack(f, size)))
        return out


# --- the families ----------------------------------------------------------------------------


def _is_pixtral(config) -> bool:
    return getattr(config.vision_config, "model_type", None) == "pixtral"


def _image_slices(out, count: int, processor) -> list[dict[str, torch.Tensor]]:
    """Each image's own part of the processor's batched outputs."""
    pixels = out["pixel_values"]
    sizes = out.get("image_sizes")
    if sizes is not None:
        sizes = torch.as_tensor(sizes)
    slices = []
    for i in range(count):
        if pixels.dim() == 5:
            # LLaVA-NeXT: [images, most tiles, c, h, w], zero tiles after an image's own
            pinpoints = processor.image_processor.image_grid_pinpoints
            n = num_tiles(sizes[i].tolist(), pinpoints, pixels.shape[-1])
            data = {"pixel_values": pixels[i, :n], "image_sizes": sizes[i : i + 1]}
        else:
            data = {"pixel_values": pixels[i : i + 1]}
        slices.append({k: v.contiguous().clone() for k, v in data.items()})
    return slices


def _token_span(offsets: list[list[int]], start: int, end: int) -> tuple[int, int]:
    """The tokens that spell the characters [start, end) of the expanded text."""
    inside = []
    for i, (a, b) in enumerate(offsets):
        if b <= a:
            continue  # added tokens with no text (BOS)
        if a >= start and b <= end:
            inside.append(i)
        elif a < end and b > start:
            raise ValueError("an image's tokens merge with the text next to its placeholder")
    if not inside or inside[-1] - inside[0] + 1 != len(inside):
        raise ValueError("an image's placeholder tokens are not one contiguous run")
    return inside[0], len(inside)


@vision_family("LlavaForConditionalGeneration")
class LlavaFamily(VisionFamily):
    tower_prefixes = (
        "model.vision_tower.",
        "model.multi_modal_projector.",
        "vision_tower.",
        "multi_modal_projector.",
    )

    tower_class = LlavaTower
    processor_names = ("LlavaProcessor", "LlavaImageProcessorPil")

    def make_processor(self, model_dir: str, config):
        if _is_pixtral(config):
            from .pixtral import pixtral_make_processor

            return pixtral_make_processor(model_dir, config)
        try:
            processor = transformers.AutoProcessor.from_pretrained(model_dir)
        except (ImportError, OSError, ValueError):
            # AutoProcessor may reach for a torchvision-backed image processor
            processor = self.build_processor(model_dir, config)
        if hasattr(processor, "vision_feature_select_strategy") and processor.patch_size is None:
            # checkpoints from before the processor expanded the placeholder: the expansion
            # follows the model's config, as the model counts its features
            processor.patch_size = config.vision_config.patch_size
            processor.vision_feature_select_strategy = config.vision_feature_select_strategy
            processor.num_additional_image_tokens = int(
                getattr(config.vision_config, "model_type", "").startswith("clip")
            )
        return processor

    def build_processor(self, model_dir: str, config):
        """The processor assembled from its PIL image processor and the tokenizer (what
        AutoProcessor builds, without its choice of image processor backend)."""
        proc_name, image_name = self.processor_names
        return getattr(transformers, proc_name)(
            image_processor=getattr(transformers, image_name).from_pretrained(model_dir),
            tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir),
            chat_template=_chat_template(model_dir),
            **_processor_options(model_dir),
        )

    def image_placeholder(self, processor) -> str:
        return processor.image_token

    def process(
        self, processor, text: str, images: list, add_special_tokens: bool = True
    ) -> MultiModalPrompt:
        if type(processor).__name__ == "PixtralProcessor":
            from .pixtral import pixtral_process

            return pixtral_process(processor, text, images, add_special_tokens)
        images = list(images or ())
        placeholder = self.image_placeholder(processor)
        found = text.count(placeholder)
        if found != len(images):
            raise ValueError(
                f"the prompt has {found} image placeholder(s) {placeholder!r} "
                f"but {len(images)} image(s) were given"
            )
        kwargs = dict(text=[text], add_special_tokens=add_special_tokens, return_tensors="pt")
        if not images:
            return MultiModalPrompt(token_ids=processor(**kwargs)["input_ids"][0].tolist())
        out = processor(
            images=images,
            return_text_replacement_offsets=True,
            return_offsets_mapping=True,
            **kwargs,
        )
        ids = out["input_ids"][0]
        offsets = out["offset_mapping"][0].tolist()
        spans = [r["new_span"] for r in out["text_replacement_offsets"][0] if r["type"] == "image"]
        if len(spans) != len(images):
            raise ValueError(f"the processor expanded {len(spans)} of {len(images)} images")
        items = []
        for data, (start, end) in zip(_image_slices(out, len(images), processor), spans):
            offset, length = _token_span(offsets, start, end)
            mask = ids[offset : offset + length] == processor.image_token_id
            items.append(
                ImageItem(
                    offset=offset,
                    length=length,
                    data=data,
                    hash=hash_image_data(data),
                    embed_mask=None if bool(mask.all()) else mask,
                )
            )
        return MultiModalPrompt(token_ids=ids.tolist(), items=items)

    def build_tower(self, config, dtype: torch.dtype) -> VisionTower:
        if _is_pixtral(config):
            from .pixtral import pixtral_llava_tower

            return pixtral_llava_tower(config, dtype)
        return self.tower_class(config).to(dtype)


@vision_family("LlavaNextForConditionalGeneration")
class LlavaNextFamily(LlavaFamily):
    tower_prefixes = LlavaFamily.tower_prefixes + ("model.image_newline", "image_newline")
    tower_class = LlavaNextTower
    processor_names = ("LlavaNextProcessor", "LlavaNextImageProcessorPil")


def _chat_template(model_dir: str) -> str | None:
    """The checkpoint's chat template: chat_template.jinja, else the tokenizer's."""
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    for name in ("chat_template.json", "processor_config.json", "tokenizer_config.json"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
            if template:
                return template
    return None


def _processor_options(model_dir: str) -> dict:
    """The processor's own options from processor_config.json (patch size, strategy ...)."""
    path = os.path.join(model_dir, "processor_config.json")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        options = json.load(f)
    options.pop("processor_class", None)
    options.pop("chat_template", None)
    options.pop("image_processor", None)
    return options

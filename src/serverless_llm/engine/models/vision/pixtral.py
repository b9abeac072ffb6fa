"""Vision family: Pixtral's encoder, with Mistral 3's projector (Mistral3ForConditionalGeneration)
or LLaVA's (LlavaForConditionalGeneration whose vision_config is a Pixtral one, Pixtral-12B).

The encoder (what transformers' PixtralVisionModel computes): each image at its own size (a
multiple of the patch size) is cut into patches, embedded by a bias-free linear map (the patch
convolution), RMS-normed, then runs through pre-norm layers of attention (2D rotary positions:
the first quarter of each rotated half turns with the patch's row, the second with its column)
and a gated MLP. Each image attends only within its own patches; images of one size are batched
together.

The projectors: Mistral 3's RMS-norms the selected hidden state, merges each
spatial_merge_size x spatial_merge_size block of patches into one row (a linear map of their
concatenation) and maps it through linear-act-linear; LLaVA's maps the selected hidden states
(several layers concatenated) through linear-act-linear.

The processor (transformers' PixtralProcessor) writes one `[IMG]` per merged patch, an
`[IMG_BREAK]` after each row and `[IMG_END]` in place of the last break. The model writes the
image's features over the `[IMG]` tokens only (its placeholder mask is `input_ids ==
image_token_id`); the break and end tokens keep their own embeddings. So an image's span is its
whole run of tokens and its embed mask is True exactly at the `[IMG]` positions.

`pixtral_make_processor`, `pixtral_process` and `pixtral_llava_tower` serve the LLaVA family
(models/vision/llava.py) for checkpoints whose vision_config.model_type is "pixtral".
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.activation import ACTIVATIONS
from ...kernels.vision_attention import cu_seqlens_of, kernel_wanted, vision_attention
from ...loader.meta_build import quiet_meta
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

logger = logging.getLogger(__name__)

# checkpoint prefixes of the tower and projector: transformers 5 names (model.X) and the names
# save_pretrained writes (X, the older LLaVA layout)
TOWER_PREFIXES = (
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "vision_tower.",
    "multi_modal_projector.",
)


def _activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} (known: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class RMSNorm(nn.Module):
    """x / rms(x) in float32, back to x's dtype, times the weight (transformers' order)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class PixtralAttention(nn.Module):
    use_kernels: bool | None = None  # the Triton kernel: set by the engine, else on CUDA

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim)
        k = self.k_proj(x).view(n, self.heads, self.head_dim)
        v = self.v_proj(x).view(n, self.heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if kernel_wanted(self.use_kernels, x):  # every image of every size in one launch
            lengths = [length for count, length in groups for _ in range(count)]
            cu = cu_seqlens_of(lengths, x.device)
            out = vision_attention(q, k, v, cu, use_kernel=True, max_seqlen=max(lengths))
            return self.o_proj(out.reshape(n, -1))
        # each run of images of one size: [images, patches, heads, head_dim], attending within
        # each image
        parts, start = [], 0
        for count, length in groups:
            end = start + count * length
            shape = (count, length, self.heads, self.head_dim)
            q_, k_, v_ = (t[start:end].view(shape) for t in (q, k, v))
            parts.append(_attend(q_, k_, v_).reshape(count * length, -1))
            start = end
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(out.reshape(n, -1))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[B, L, heads, d] each -> [B, L, heads, d]: full (non-causal) attention within each image."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class PixtralMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PixtralLayer(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.attention_norm = RMSNorm(vc.hidden_size, 1e-5)
        self.attention = PixtralAttention(vc.hidden_size, vc.num_attention_heads)
        self.ffn_norm = RMSNorm(vc.hidden_size, 1e-5)
        self.feed_forward = PixtralMLP(vc.hidden_size, vc.intermediate_size, vc.hidden_act)

    def forward(self, x, cos, sin, groups):
        x = x + self.attention(self.attention_norm(x), cos, sin, groups)
        return x + self.feed_forward(self.ffn_norm(x))


class _Transformer(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.layers = nn.ModuleList(PixtralLayer(vc) for _ in range(vc.num_hidden_layers))


def _rope_theta(vc) -> float:
    params = getattr(vc, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(vc, "rope_theta", 10000.0))


class PixtralEncoder(nn.Module):
    """transformers' PixtralVisionModel over a list of images of any sizes (names as in its
    checkpoints, under `vision_tower.`)."""

    def __init__(self, vc):
        super().__init__()
        self.patch_size = int(vc.patch_size)
        self.hidden = vc.hidden_size
        self.heads = vc.num_attention_heads
        self.num_layers = vc.num_hidden_layers
        self.theta = _rope_theta(vc)
        self.patch_conv = nn.Conv2d(
            vc.num_channels, vc.hidden_size, self.patch_size, stride=self.patch_size, bias=False
        )
        self.ln_pre = RMSNorm(vc.hidden_size, 1e-5)
        self.transformer = _Transformer(vc)

    def _rotary(self, grids, device, dtype):
        """cos, sin [patches, 1, head_dim] for the patches of every image in order: of the half
        of the head dim that rotates, its first half turns by row, its second by column."""
        d = self.hidden // self.heads
        inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float) / d))
        pos = []
        for h, w in grids:
            rows = torch.arange(h, device=device).repeat_interleave(w)
            cols = torch.arange(w, device=device).repeat(h)
            pos.append(torch.stack([rows, cols], dim=-1))
        pos = torch.cat(pos).float()
        angles = torch.cat([pos[:, :1] * inv[0::2], pos[:, 1:] * inv[1::2]], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(
        self, images: list[torch.Tensor], sizes: list[tuple[int, int]], layers: list[int]
    ) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """images: [channels, H, W] each (at least its size, padding beyond it ignored); sizes:
        (height, width) in pixels each. Returns the hidden states of `layers` (transformers'
        indices: 0 is the normed patch embeddings, i the output of layer i; negative from the
        end) as [all patches, hidden] each, the images' patches in order, and each image's
        patch grid (rows, cols)."""
        p = self.patch_size
        weight = self.patch_conv.weight
        want = [i % (self.num_layers + 1) for i in layers]
        grids, patches = [], []
        for img, (height, width) in zip(images, sizes):
            h, w = height // p, width // p
            c = img.shape[0]
            x = img[:, : h * p, : w * p].reshape(c, h, p, w, p).permute(1, 3, 0, 2, 4)
            patches.append(x.reshape(h * w, c * p * p))
            grids.append((h, w))
        x = torch.cat(patches).to(weight.dtype) @ weight.reshape(weight.shape[0], -1).t()
        x = self.ln_pre(x)
        cos, sin = self._rotary(grids, x.device, x.dtype)
        groups = self._groups(grids)
        states = {0: x} if 0 in want else {}
        for i, layer in enumerate(self.transformer.layers[: max(want)], start=1):
            x = layer(x, cos, sin, groups)
            if i in want:
                states[i] = x
        return [states[i] for i in want], grids

    @staticmethod
    def _groups(grids) -> list[tuple[int, int]]:
        """(images, patches per image) of each run of consecutive images of one grid size."""
        groups: list[tuple[int, int]] = []
        for i, (h, w) in enumerate(grids):
            if i and grids[i - 1] == (h, w):
                groups[-1] = (groups[-1][0] + 1, h * w)
            else:
                groups.append((1, h * w))
        return groups


class Mistral3Projector(nn.Module):
    """Mistral 3's multi-modal projector: RMSNorm, the patch merger, linear-act-linear."""

    def __init__(self, config):
        super().__init__()
        vc, tc = config.vision_config, config.text_config
        m = int(config.spatial_merge_size)
        self.merge = m
        bias = bool(getattr(config, "multimodal_projector_bias", False))
        self.norm = RMSNorm(vc.hidden_size, tc.rms_norm_eps)
        self.patch_merger = nn.Module()
        self.patch_merger.merging_layer = nn.Linear(
            vc.hidden_size * m * m, vc.hidden_size, bias=False
        )
        self.linear_1 = nn.Linear(vc.hidden_size, tc.hidden_size, bias=bias)
        self.linear_2 = nn.Linear(tc.hidden_size, tc.hidden_size, bias=bias)
        self.act = _activation(config.projector_hidden_act)

    def forward(self, x: torch.Tensor, grids) -> list[torch.Tensor]:
        x = self.norm(x)
        m, d = self.merge, x.shape[-1]
        merged = []
        for rows, (h, w) in zip(x.split([h * w for h, w in grids]), grids):
            # each m x m block of the grid, its d channels each over the block's m*m patches
            hm, wm = h // m, w // m
            g = rows.view(h, w, d)[: hm * m, : wm * m]
            g = g.reshape(hm, m, wm, m, d).permute(0, 2, 4, 1, 3)
            merged.append(g.reshape(hm * wm, d * m * m))
        x = self.patch_merger.merging_layer(torch.cat(merged))
        x = self.linear_2(self.act(self.linear_1(x)))
        return list(x.split([(h // m) * (w // m) for h, w in grids]))


class LlavaProjector(nn.Module):
    """LLaVA's multi-modal projector: linear-act-linear over the selected hidden states."""

    def __init__(self, config, num_layers: int):
        super().__init__()
        vc, tc = config.vision_config, config.text_config
        bias = bool(getattr(config, "multimodal_projector_bias", True))
        self.linear_1 = nn.Linear(vc.hidden_size * num_layers, tc.hidden_size, bias=bias)
        self.linear_2 = nn.Linear(tc.hidden_size, tc.hidden_size, bias=bias)
        self.act = _activation(config.projector_hidden_act)

    def forward(self, x: torch.Tensor, grids) -> list[torch.Tensor]:
        x = self.linear_2(self.act(self.linear_1(x)))
        return list(x.split([h * w for h, w in grids]))


class PixtralTower(VisionTower):
    """The Pixtral encoder and a projector. Each item: `pixel_values` [1, channels, H, W] and
    `image_sizes` [1, 2] (height, width in pixels)."""

    def __init__(self, config, projector: str):
        super().__init__()
        layer = config.vision_feature_layer
        self.feature_layers = [layer] if isinstance(layer, int) else [int(i) for i in layer]
        n = config.vision_config.num_hidden_layers
        if not self.feature_layers or any(not -n - 1 <= i <= n for i in self.feature_layers):
            raise ValueError(
                f"vision_feature_layer {layer!r}: the Pixtral tower has hidden states 0..{n} "
                f"(-{n + 1}..-1 from the end)"
            )
        self.vision_tower = PixtralEncoder(config.vision_config)
        if projector == "mistral3":
            if len(self.feature_layers) != 1:
                raise ValueError(
                    "Mistral3ForConditionalGeneration takes one vision_feature_layer (its "
                    f"projector norms and merges one hidden state), not {layer!r}"
                )
            self.multi_modal_projector = Mistral3Projector(config)
        else:
            self.multi_modal_projector = LlavaProjector(config, len(self.feature_layers))

    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[ImageFeatures]:
        if not items:
            return []
        sizes = [tuple(int(v) for v in item["image_sizes"].reshape(-1)[:2]) for item in items]
        p = self.vision_tower.patch_size
        # images of one patch grid next to each other: each such run attends as one batch
        order = sorted(range(len(items)), key=lambda i: (sizes[i][0] // p, sizes[i][1] // p))
        images = [
            items[i]["pixel_values"].reshape(-1, *items[i]["pixel_values"].shape[-2:])
            for i in order
        ]
        with torch.no_grad():
            states, grids = self.vision_tower(
                images, [sizes[i] for i in order], self.feature_layers
            )
            x = states[0] if len(states) == 1 else torch.cat(states, dim=-1)
            feats = self.multi_modal_projector(x, grids)
        out: list[ImageFeatures | None] = [None] * len(items)
        for i, f in zip(order, feats):
            out[i] = ImageFeatures(embeds=f)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        load_tower_tensors(params, weights, lambda n: n.removeprefix("model."), "Pixtral")


def _build(config, dtype: torch.dtype, projector: str) -> PixtralTower:
    with torch.device("meta"), quiet_meta():  # no torch._refs imports
        tower = PixtralTower(config, projector)
    with quiet_meta():
        tower = tower.to_empty(device="cpu")
    return tower.to(dtype).eval()


def pixtral_llava_tower(config, dtype: torch.dtype) -> PixtralTower:
    """The tower of a LlavaForConditionalGeneration whose vision_config is Pixtral's (Pixtral-12B):
    the Pixtral encoder's hidden state(s) of `vision_feature_layer` (several: concatenated),
    every patch kept, through LLaVA's linear-act-linear projector.

    transformers' "default" feature strategy would drop the first patch of all the images'
    patches together (Pixtral has no class token) and then fail to split the features by image;
    such a config is refused."""
    strategy = getattr(config, "vision_feature_select_strategy", "full")
    if strategy != "full":
        raise ValueError(
            "LLaVA with a Pixtral vision tower needs vision_feature_select_strategy 'full' (the "
            f"tower has no class token to drop), got {strategy!r}"
        )
    return _build(config, dtype, "llava")


# --- processing ---------------------------------------------------------------------------


def pixtral_processor_class():
    """transformers' PixtralProcessor. Its module imports a helper from the torchvision image
    processor's module; where torchvision is absent that module is stood in for, for the import
    only, by the PIL image processor's module, which defines the same helper."""
    name = "transformers.models.pixtral.processing_pixtral"
    if name in sys.modules:
        return sys.modules[name].PixtralProcessor
    try:
        return importlib.import_module(name).PixtralProcessor
    except ImportError as exc:
        if "torchvision" not in str(exc):
            raise
    pil = importlib.import_module("transformers.models.pixtral.image_processing_pil_pixtral")
    tv_name = "transformers.models.pixtral.image_processing_pixtral"
    stand_in = types.ModuleType(tv_name)
    stand_in.get_resize_output_image_size = pil.get_resize_output_image_size
    sys.modules[tv_name] = stand_in
    try:
        return importlib.import_module(name).PixtralProcessor
    finally:
        if sys.modules.get(tv_name) is stand_in:
            del sys.modules[tv_name]


def pixtral_make_processor(model_dir: str, config):
    """The checkpoint's PixtralProcessor (its PIL image processor where torchvision is absent;
    the tokenizer and chat template of the checkpoint). Its patch size and merge size must be
    the model's (the vision tower's patch size; Mistral 3's spatial_merge_size, 1 for LLaVA):
    the processor's defaults stand where its files do not say, so they are set to the model's
    (with a warning) when they differ."""
    processor = pixtral_processor_class().from_pretrained(model_dir)
    patch = int(config.vision_config.patch_size)
    merge = int(getattr(config, "spatial_merge_size", 1) or 1)
    if (processor.patch_size, processor.spatial_merge_size) != (patch, merge):
        logger.warning(
            "%s: the processor's patch_size %s and spatial_merge_size %s differ from the model's "
            "(%d, %d); using the model's",
            model_dir,
            processor.patch_size,
            processor.spatial_merge_size,
            patch,
            merge,
        )
        processor.patch_size, processor.spatial_merge_size = patch, merge
    return processor


def pixtral_process(
    processor, text: str, images: list, add_special_tokens: bool = True
) -> MultiModalPrompt:
    """The PixtralProcessor's ids for `text` (one `[IMG]` per image) and `images`, each image
    an ImageItem over its run of `[IMG]`/`[IMG_BREAK]`/`[IMG_END]` tokens, features going to its
    `[IMG]` positions; its data is its own pixel_values (cropped to its size: the processor pads
    a batch to its largest image) and image_sizes."""
    images = list(images or [])
    token = processor.image_token
    found = text.count(token)
    if found != len(images):
        raise ValueError(
            f"the prompt has {found} image placeholder(s) {token!r} but {len(images)} image(s) "
            "were given; write one placeholder per image"
        )
    out = processor(
        text=[text],
        images=images or None,
        add_special_tokens=add_special_tokens,
        return_tensors="pt",
    )
    ids = out["input_ids"][0].tolist()
    if not images:
        return MultiModalPrompt(token_ids=ids)
    img_id, break_id, end_id = (
        processor.image_token_id,
        processor.image_break_token_id,
        processor.image_end_token_id,
    )
    unit = processor.patch_size * processor.spatial_merge_size
    pixel_values, image_sizes = out["pixel_values"], out["image_sizes"]
    items, pos = [], 0
    for i in range(len(images)):
        height, width = (int(v) for v in image_sizes[i])
        rows, cols = height // unit, width // unit
        expected = ([img_id] * cols + [break_id]) * rows
        expected[-1] = end_id
        start = ids.index(img_id, pos)
        if ids[start : start + len(expected)] != expected:
            raise ValueError(
                f"image {i}: its tokens in the processor's ids are not the expected run"
            )
        ids_span = torch.tensor(expected)
        data = {
            "pixel_values": pixel_values[i : i + 1, :, :height, :width].contiguous(),
            "image_sizes": image_sizes[i : i + 1].clone(),
        }
        items.append(
            ImageItem(
                offset=start,
                length=len(expected),
                data=data,
                hash=hash_image_data(data),
                embed_mask=ids_span == img_id,
            )
        )
        pos = start + len(expected)
    return MultiModalPrompt(token_ids=ids, items=items)


@vision_family("Mistral3ForConditionalGeneration")
class Mistral3Family(VisionFamily):
    """Mistral 3 (Mistral Small 3.1 / 3.2, Magistral, Devstral Small with images): the Pixtral
    encoder and Mistral 3's merging projector, a Mistral decoder."""

    tower_prefixes = TOWER_PREFIXES

    def make_processor(self, model_dir: str, config):
        return pixtral_make_processor(model_dir, config)

    def image_placeholder(self, processor) -> str:
        return processor.image_token

    def process(self, processor, text: str, images: list, add_special_tokens: bool = True):
        return pixtral_process(processor, text, images, add_special_tokens)

    def build_tower(self, config, dtype: torch.dtype) -> VisionTower:
        return _build(config, dtype, "mistral3")


__all__ = [
    "TOWER_PREFIXES",
    "Mistral3Family",
    "PixtralEncoder",
    "PixtralTower",
    "pixtral_llava_tower",
    "pixtral_processor_class",
    "pixtral_make_processor",
    "pixtral_process",
]

"""Vision family: Llama 4 (`Llama4ForConditionalGeneration`).

The processor (llama4_image.py computes transformers' image processor without torchvision)
puts each image on a canvas of square tiles (up to `max_patches`), cuts it into those tiles
and, when there is more than one, adds the whole image squeezed to one tile (the global tile).
Every tile goes through the vision model alone:

- patches: the tile unfolded into `patch_size` squares (channel-major, then rows, then
  columns of a patch), one linear without bias; a learned class row is appended *after* the
  patches, the learned positional embedding added, then `layernorm_pre`;
- encoder layers: pre-LayerNorm attention (q/k/v/o with biases, every row sees every row)
  with 2D rotary on q and k: the head's pairs of adjacent dims are complex numbers, the first
  quarter of the head's dims turned by (column + 1) * freq, the second by (row + 1) * freq
  (freq = theta ^ (-4j / head_dim)), the class row not turned; then a pre-LayerNorm GELU MLP
  (exact GELU, LayerNorms of eps 1e-5 whatever the config says, as transformers has them);
- `layernorm_post`, the class row dropped, the patch grid pixel-shuffled (each 2x2 block of
  patches becomes one row of 4x the width: top-left, top-right, bottom-left, bottom-right), the
  adapter MLP (fc1, GELU, fc2, GELU, no biases), then the multi-modal projector (one linear
  without bias) into the text width.

The prompt: each `<|image|>` placeholder becomes `<|image_start|>`, then per local tile (rows
of tiles, `<|tile_x_separator|>` between the tiles of a row, `<|tile_y_separator|>` after each
row) the tile's `<|patch|>` tokens, then `<|image|>` and the global tile's `<|patch|>` tokens
(a one-tile image: only these), then `<|image_end|>`. transformers writes the features over
the `<|patch|>` tokens (`image_token_index`), tiles in order, the global tile last. An image's
span runs from its first to its last `<|patch|>`; the separators and `<|image|>` inside it
keep their own embeddings (embed_mask False).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

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
    prefixed_name,
)
from ...multimodal.registry import vision_family

# checkpoint prefix -> the tower's own module prefix (transformers 5.23 and Meta's
# checkpoints write `vision_model.` and `multi_modal_projector.`; a wrapped state dict has
# `model.` in front)
_PREFIXES = (
    ("model.vision_model.", "vision."),
    ("vision_model.", "vision."),
    ("model.multi_modal_projector.", "projector."),
    ("multi_modal_projector.", "projector."),
)
_LN_EPS = 1e-5  # transformers' nn.LayerNorm default: the config's norm_eps is not used

# Llama4Processor's arguments that processor_config.json may hold
_PROCESSOR_OPTIONS = (
    "patch_size",
    "pixel_shuffle_ratio",
    "fake_image_token",
    "image_token",
    "start_of_image_token",
    "end_of_image_token",
    "patch_token",
    "tile_x_separator_token",
    "tile_y_separator_token",
)


def vision_config_problem(config) -> str | None:
    """Why the composite's vision model cannot run on an image (transformers' would fail on
    it too), or None: the adapter's and projector's widths must chain, the patch grid must
    pixel-shuffle evenly, the heads must split into rotary quarters."""
    vc = config.vision_config
    ratio = vc.pixel_shuffle_ratio
    factor = round(1.0 / ratio) if ratio > 0 else 0
    side = vc.image_size // vc.patch_size
    head_dim = vc.hidden_size // vc.num_attention_heads
    if factor < 1 or abs(factor * ratio - 1.0) > 1e-6:
        return f"pixel_shuffle_ratio {ratio} is not 1 / an integer"
    if side % factor:
        return f"a {side}x{side} patch grid does not pixel-shuffle by {factor}"
    if vc.intermediate_size != vc.hidden_size * factor**2:
        return (
            f"the adapter reads {vc.hidden_size * factor**2}-wide shuffled patches, "
            f"intermediate_size is {vc.intermediate_size}"
        )
    if vc.projector_input_dim != vc.projector_output_dim:
        return "the adapter's fc2 reads projector_output_dim, fc1 gives projector_input_dim"
    if vc.vision_output_dim != vc.projector_output_dim:
        return "the projector reads vision_output_dim, the adapter gives projector_output_dim"
    if head_dim % 4 or vc.hidden_size % vc.num_attention_heads:
        return f"heads of {vc.hidden_size} / {vc.num_attention_heads} dims (2D rotary: 4k)"
    return None


class _PatchEmbedding(nn.Module):
    """Unfold into patches + linear (the checkpoint's `patch_embedding.linear`)."""

    def __init__(self, vc):
        super().__init__()
        self.patch = vc.patch_size
        self.linear = nn.Linear(vc.num_channels * vc.patch_size**2, vc.hidden_size, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        b, c, h, w = pixels.shape
        p = self.patch
        # [B, C, rows, p, cols, p] -> [B, rows, cols, C, p, p]: nn.Unfold's feature order
        x = pixels.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return self.linear(x.reshape(b, (h // p) * (w // p), c * p * p))


def rotary_angles(vc) -> torch.Tensor:
    """[patches + 1, head_dim / 2] float32 angles of the tower's 2D rotary: pair j of a head
    turns by (column + 1) * freq_j for j < head_dim / 4, by (row + 1) * freq_(j - head_dim / 4)
    after; the class row (last) by 0."""
    side = vc.image_size // vc.patch_size
    head_dim = vc.hidden_size // vc.num_attention_heads
    rope = getattr(vc, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(vc, "rope_theta", 10000.0))
    quarter = head_dim // 4
    freqs = 1.0 / (theta ** (torch.arange(0, 2 * quarter, 2)[:quarter].float() / (2 * quarter)))
    idx = torch.arange(side * side)
    cols = (idx % side + 1).float()[:, None] * freqs
    rows = (idx // side + 1).float()[:, None] * freqs
    angles = torch.cat([cols, rows], dim=-1)
    return torch.cat([angles, torch.zeros(1, 2 * quarter)])  # the class row


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, N, H, D] with adjacent dims as (real, imaginary) pairs, turned by the angles whose
    cos/sin are [N, D/2], in float32 (as transformers' complex product), back in x's dtype."""
    f = x.float().unflatten(-1, (-1, 2))
    re, im = f[..., 0], f[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.stack([re * c - im * s, re * s + im * c], dim=-1)
    return out.flatten(-2).to(x.dtype)


class _SelfAttention(nn.Module):
    use_kernels: bool | None = None  # the Triton kernel: set by the engine, else on CUDA

    def __init__(self, vc):
        super().__init__()
        d = vc.hidden_size
        self.heads = vc.num_attention_heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.o_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        shape = (b, n, self.heads, d // self.heads)
        q = _rotate(self.q_proj(x).view(shape), cos, sin)
        k = _rotate(self.k_proj(x).view(shape), cos, sin)
        v = self.v_proj(x).view(shape)
        if kernel_wanted(self.use_kernels, x):  # the tiles packed, one launch for all
            flat = (b * n, self.heads, d // self.heads)
            cu = cu_seqlens_of([n] * b, x.device)
            out = vision_attention(
                q.reshape(flat), k.reshape(flat), v.reshape(flat), cu, use_kernel=True, max_seqlen=n
            )
            return self.o_proj(out.view(b, n, d))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, n, d))


class _Mlp(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.fc1 = nn.Linear(vc.hidden_size, vc.intermediate_size)
        self.fc2 = nn.Linear(vc.intermediate_size, vc.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(vc.hidden_size, eps=_LN_EPS)
        self.self_attn = _SelfAttention(vc)
        self.post_attention_layernorm = nn.LayerNorm(vc.hidden_size, eps=_LN_EPS)
        self.mlp = _Mlp(vc)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Encoder(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(vc) for _ in range(vc.num_hidden_layers))


class _AdapterMlp(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.fc1 = nn.Linear(vc.intermediate_size, vc.projector_input_dim, bias=False)
        self.fc2 = nn.Linear(vc.projector_output_dim, vc.projector_output_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc2(F.gelu(self.fc1(x))))


class _VisionAdapter(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.factor = round(1.0 / vc.pixel_shuffle_ratio)
        self.mlp = _AdapterMlp(vc)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.mlp(pixel_shuffle(patches, self.factor))


def pixel_shuffle(patches: torch.Tensor, k: int) -> torch.Tensor:
    """[B, side * side, D] patches (row-major) -> [B, (side / k)^2, k * k * D]: each k x k block
    becomes one row (blocks row-major), its patches side by side row by row."""
    b, n, d = patches.shape
    side = int(round(n**0.5))
    x = patches.view(b, side // k, k, side // k, k, d).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (side // k) ** 2, k * k * d)


class _VisionModel(nn.Module):
    def __init__(self, vc):
        super().__init__()
        side = vc.image_size // vc.patch_size
        self.side = side
        self.tile = vc.image_size
        self.patch_embedding = _PatchEmbedding(vc)
        self.class_embedding = nn.Parameter(torch.empty(vc.hidden_size))
        self.positional_embedding_vlm = nn.Parameter(torch.empty(side * side + 1, vc.hidden_size))
        self.layernorm_pre = nn.LayerNorm(vc.hidden_size, eps=_LN_EPS)
        self.layernorm_post = nn.LayerNorm(vc.hidden_size, eps=_LN_EPS)
        self.model = _Encoder(vc)
        self.vision_adapter = _VisionAdapter(vc)
        self._vc = vc
        self._rotary: dict = {}  # device -> (cos, sin), made at first use

    def rotary(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._rotary:
            angles = rotary_angles(self._vc).to(device)
            self._rotary[device] = (torch.cos(angles), torch.sin(angles))
        return self._rotary[device]

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if tuple(pixels.shape[-2:]) != (self.tile, self.tile):
            raise ValueError(
                f"Llama 4 vision: tiles of {tuple(pixels.shape[-2:])} pixels, the tower takes "
                f"{self.tile}x{self.tile}"
            )
        x = self.patch_embedding(pixels)
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([x, cls], dim=1) + self.positional_embedding_vlm.to(x.dtype)
        x = self.layernorm_pre(x)
        cos, sin = self.rotary(x.device)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.layernorm_post(x)[:, :-1]
        return self.vision_adapter(x)


class _Projector(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.linear_1 = nn.Linear(
            config.vision_config.vision_output_dim, config.text_config.hidden_size, bias=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_1(x)


class Llama4Tower(VisionTower):
    # tiles per vision forward: bounds the activations of a prompt with many images
    max_batch = 32

    def __init__(self, config):
        super().__init__()
        # built as the config declares it, as transformers does, so that the weights of a
        # checkpoint whose tower cannot run (`vision_config_problem`) still load and its text
        # is served; its processor refuses images
        self.vision = _VisionModel(config.vision_config)
        self.projector = _Projector(config)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, side, side] -> [tiles, tokens a tile, text hidden]."""
        return self.projector(self.vision(pixels))

    @torch.no_grad()
    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[ImageFeatures]:
        if not items:
            return []
        dtype = self.projector.linear_1.weight.dtype
        counts = [item["pixel_values"].shape[0] for item in items]
        # every tile of every image has the tower's size: all of them stack
        tiles = torch.cat([item["pixel_values"] for item in items]).to(dtype)
        out = torch.cat(
            [self(tiles[i : i + self.max_batch]) for i in range(0, len(tiles), self.max_batch)]
        )
        feats, start = [], 0
        for c in counts:
            feats.append(ImageFeatures(embeds=out[start : start + c].flatten(0, 1)))
            start += c
        return feats

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        load_tower_tensors(params, weights, lambda n: prefixed_name(n, _PREFIXES), "Llama 4")


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _chat_template(model_dir: str, tokenizer) -> str | None:
    """The checkpoint's chat template: chat_template.jinja, a processor's or the tokenizer's."""
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    for name in ("chat_template.json", "processor_config.json"):
        template = _read_json(os.path.join(model_dir, name)).get("chat_template")
        if template:
            return template
    return getattr(tokenizer, "chat_template", None)


def tokens_per_tile(processor) -> int:
    """`<|patch|>` tokens (and feature rows) of one tile, as Llama4Processor counts them."""
    side = processor.image_processor.size["height"]
    return (side // processor.patch_size) ** 2 // processor.downsample_ratio


@vision_family("Llama4ForConditionalGeneration")
class Llama4Family(VisionFamily):
    tower_prefixes = tuple(prefix for prefix, _ in _PREFIXES)

    def make_processor(self, model_dir: str, config):
        """AutoProcessor when it builds (it needs torchvision for Llama 4's image processor,
        so here it does not); else Llama4Processor around `Llama4ImageProcessorPil` with the
        checkpoint's settings. No image processor settings saved: an OSError (served for text
        only)."""
        import transformers

        try:
            processor = transformers.AutoProcessor.from_pretrained(model_dir, local_files_only=True)
            if isinstance(processor, transformers.Llama4Processor):
                self._check(processor, config)
                return processor
        except (ImportError, OSError, ValueError, TypeError):
            pass
        # Here, not with the module: it imports transformers' image processing stack, which
        # every engine start paid through the vision registry (text models included): ~0.5 s
        # of CPU, of which ~0.25 s stays (the tokenizer's load imports part of it).
        from .llama4_image import Llama4ImageProcessorPil

        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        image_processor = Llama4ImageProcessorPil.from_pretrained(model_dir, local_files_only=True)
        saved = _read_json(os.path.join(model_dir, "processor_config.json"))
        options = {k: saved[k] for k in _PROCESSOR_OPTIONS if k in saved}
        vc = config.vision_config
        options.setdefault("patch_size", vc.patch_size)
        # Llama4Processor does not save its pixel_shuffle_ratio: the model's
        options.setdefault("pixel_shuffle_ratio", vc.pixel_shuffle_ratio)
        processor = transformers.Llama4Processor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            chat_template=_chat_template(model_dir, tokenizer),
            **options,
        )
        self._check(processor, config)
        return processor

    @staticmethod
    def _check(processor, config) -> None:
        """The processor's expansion must be what the model counts, its tokens the tokenizer's."""
        tokenizer = processor.tokenizer
        vocab = tokenizer.get_vocab()
        tokens = (
            processor.fake_image_token,
            processor.image_token,
            processor.start_of_img_token,
            processor.end_of_img_token,
            processor.img_patch_token,
            processor.tile_token,
            processor.tile_global_token,
        )
        absent = [t for t in tokens if t not in vocab]
        if absent:
            raise ValueError(f"Llama 4: the tokenizer lacks the image tokens {absent}")
        if vocab[processor.img_patch_token] != config.image_token_id:
            raise ValueError(
                f"Llama 4: the processor's {processor.img_patch_token!r} is token "
                f"{vocab[processor.img_patch_token]}, the model fills token "
                f"{config.image_token_id} with image features"
            )
        problem = vision_config_problem(config)
        if problem:
            raise ValueError(f"Llama 4: the vision model cannot run: {problem}")
        vc = config.vision_config
        size = processor.image_processor.size
        model_tokens = (vc.image_size // vc.patch_size) ** 2 // round(
            1 / vc.pixel_shuffle_ratio
        ) ** 2
        if (size["height"], size["width"]) != (vc.image_size, vc.image_size) or (
            tokens_per_tile(processor) != model_tokens
        ):
            raise ValueError(
                f"Llama 4: the processor's {size['height']}x{size['width']} tiles of "
                f"{tokens_per_tile(processor)} tokens do not match the model's "
                f"{vc.image_size} px tiles of {model_tokens} features"
            )

    def image_placeholder(self, processor) -> str:
        return processor.fake_image_token

    def process(
        self, processor, text: str, images: list, add_special_tokens: bool = True
    ) -> MultiModalPrompt:
        images = list(images or [])
        placeholder = self.image_placeholder(processor)
        found = text.count(placeholder)
        if found != len(images):
            raise ValueError(
                f"Llama 4 prompt has {found} image placeholders ({placeholder!r}) "
                f"for {len(images)} images"
            )
        kwargs = dict(text=[text], add_special_tokens=add_special_tokens, return_tensors="pt")
        if not images:
            return MultiModalPrompt(token_ids=processor(**kwargs)["input_ids"][0].tolist())
        out = processor(images=images, return_text_replacement_offsets=True, **kwargs)
        ids = out["input_ids"][0]
        patch_id = processor.tokenizer.convert_tokens_to_ids(processor.img_patch_token)
        expansions = [r for r in out["text_replacement_offsets"][0] if r["type"] == "image"]
        counts = [r["replacement"].count(processor.img_patch_token) for r in expansions]
        per_tile = tokens_per_tile(processor)
        pixels = out["pixel_values"]
        positions = torch.nonzero(ids == patch_id).flatten()
        if (
            len(counts) != len(images)
            or len(positions) != sum(counts)
            or any(c % per_tile for c in counts)
            or sum(counts) // per_tile != pixels.shape[0]
        ):
            raise ValueError(
                f"Llama 4 prompt: {len(positions)} {processor.img_patch_token} tokens for "
                f"{len(images)} images expanded to {counts} (does the text hold image tokens?)"
            )
        items, start, row = [], 0, 0
        for count in counts:
            first, last = int(positions[start]), int(positions[start + count - 1])
            tiles = count // per_tile
            data = {"pixel_values": pixels[row : row + tiles].contiguous()}
            mask = ids[first : last + 1] == patch_id
            items.append(
                ImageItem(
                    offset=first,
                    length=last + 1 - first,
                    data=data,
                    hash=hash_image_data(data),
                    embed_mask=None if bool(mask.all()) else mask,
                )
            )
            start += count
            row += tiles
        return MultiModalPrompt(token_ids=ids.tolist(), items=items)

    def build_tower(self, config, dtype: torch.dtype) -> VisionTower:
        with torch.device("meta"), quiet_meta():  # no torch._refs imports
            tower = Llama4Tower(config)
        with quiet_meta():
            tower = tower.to_empty(device="cpu")
        return tower.to(dtype)

"""Vision family: Gemma 3 (`Gemma3ForConditionalGeneration`).

The tower is a SigLIP vision encoder (a patch convolution, learned position embeddings, pre-norm
transformer blocks with a tanh-GELU MLP, a final LayerNorm) followed by Gemma 3's projector: the
patch grid is average-pooled to `mm_tokens_per_image` soft tokens, normalised by a Gemma RMSNorm
(weight applied as 1 + w, in float32) and multiplied by `mm_input_projection_weight`
[vision hidden, text hidden]. Every image is resized to the encoder's one `image_size`, so an
image always gives `mm_tokens_per_image` rows and images batch by stacking.

The processor writes each `<start_of_image>` placeholder as
"\\n\\n" + `<start_of_image>` + `<image_soft_token>` * mm_tokens_per_image + `<end_of_image>` +
"\\n\\n"; only the soft tokens take features, so an image's span is its run of soft tokens alone
(embed_mask None). With pan-and-scan (`enable_pan_and_scan`, or a processor called with
`do_pan_and_scan`), a
placeholder becomes the original image's run and one run per crop, with text between them; each
run is an `ImageItem` of its own (its own pixel rows), in prompt order.

In prefill transformers lets the tokens of one run of soft tokens attend to each other both ways
(`VisionFamily.bidirectional_images`): the begin/end-of-image tokens around a run stay causal.
"""

from __future__ import annotations

import math
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
    token_runs,
)
from ...multimodal.registry import vision_family

# checkpoint prefix -> the tower's own module prefix. Older (and transformers 5.23's own saved)
# checkpoints write the encoder as `vision_tower.`, Gemma 3's original checkpoints as
# `vision_tower.vision_model.`, a model's state dict as `model.vision_tower.`.
_PREFIXES = (
    ("model.vision_tower.vision_model.", "vision."),
    ("model.vision_tower.", "vision."),
    ("vision_tower.vision_model.", "vision."),
    ("vision_tower.", "vision."),
    ("model.multi_modal_projector.", "projector."),
    ("multi_modal_projector.", "projector."),
)
# SigLIP's attention-pooling head: in a checkpoint saved with `vision_use_head`, never used by
# Gemma 3 (its features are the encoder's last hidden state).
_UNUSED = ("vision.head.",)


def _activation(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    raise ValueError(f"Gemma 3 vision tower: unsupported activation {name!r}")


class _Embeddings(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.patch_size = vc.patch_size
        self.patch_embedding = nn.Conv2d(
            vc.num_channels, vc.hidden_size, vc.patch_size, stride=vc.patch_size
        )
        self.num_patches = (vc.image_size // vc.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches, vc.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [B, patches, D], row-major
        if x.shape[1] != self.num_patches:
            raise ValueError(
                f"Gemma 3 vision tower: an image of {tuple(pixels.shape[-2:])} pixels gives "
                f"{x.shape[1]} patches, the encoder takes {self.num_patches}"
            )
        return x + self.position_embedding.weight


class _SelfAttention(nn.Module):
    use_kernels: bool | None = None  # the Triton kernel: set by the engine, else on CUDA

    def __init__(self, vc):
        super().__init__()
        d = vc.hidden_size
        self.heads = vc.num_attention_heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        if kernel_wanted(self.use_kernels, x):  # the images packed, one launch for all
            q, k, v = (
                p(x).view(b * n, self.heads, d // self.heads)
                for p in (self.q_proj, self.k_proj, self.v_proj)
            )
            cu = cu_seqlens_of([n] * b, x.device)
            out = vision_attention(q, k, v, cu, use_kernel=True, max_seqlen=n)
            return self.out_proj(out.view(b, n, d))

        def heads(t):
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class _Mlp(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.fc1 = nn.Linear(vc.hidden_size, vc.intermediate_size)
        self.fc2 = nn.Linear(vc.intermediate_size, vc.hidden_size)
        self.act = _activation(vc.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Block(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.self_attn = _SelfAttention(vc)
        self.layer_norm2 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.mlp = _Mlp(vc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.layers = nn.ModuleList(_Block(vc) for _ in range(vc.num_hidden_layers))


class _SiglipEncoder(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.embeddings = _Embeddings(vc)
        self.encoder = _Encoder(vc)
        self.post_layernorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for block in self.encoder.layers:
            x = block(x)
        return self.post_layernorm(x)


class _GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class _Projector(nn.Module):
    """The patch grid average-pooled to the image's soft tokens, normalised, projected to the
    text hidden size."""

    def __init__(self, config):
        super().__init__()
        vc = config.vision_config
        self.side = vc.image_size // vc.patch_size  # patches per side
        tokens_side = int(math.isqrt(config.mm_tokens_per_image))
        if tokens_side * tokens_side != config.mm_tokens_per_image or self.side % tokens_side:
            raise ValueError(
                f"Gemma 3: {config.mm_tokens_per_image} tokens per image do not pool a "
                f"{self.side}x{self.side} patch grid evenly"
            )
        self.pool = self.side // tokens_side
        self.mm_soft_emb_norm = _GemmaRMSNorm(vc.hidden_size, vc.layer_norm_eps)
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(vc.hidden_size, config.text_config.hidden_size)
        )

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        b, n, d = patches.shape
        grid = patches.transpose(1, 2).reshape(b, d, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.pool, self.pool).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).to(patches.dtype)


class Gemma3Tower(VisionTower):
    # images per encoder forward: bounds the activations of a prompt with many images
    max_batch = 16

    def __init__(self, config):
        super().__init__()
        self.vision = _SiglipEncoder(config.vision_config)
        self.projector = _Projector(config)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vision(pixels))

    @torch.no_grad()
    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[ImageFeatures]:
        dtype = self.projector.mm_input_projection_weight.dtype
        rows = [item["pixel_values"] for item in items]
        counts = [r.shape[0] for r in rows]
        if not rows:
            return []
        # the processor resizes every image to one size: all images stack
        pixels = torch.cat(rows).to(dtype)
        out = torch.cat(
            [self(pixels[i : i + self.max_batch]) for i in range(0, len(pixels), self.max_batch)]
        )
        feats, start = [], 0
        for c in counts:
            feats.append(ImageFeatures(embeds=out[start : start + c].flatten(0, 1)))
            start += c
        return feats

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        load_tower_tensors(
            params,
            weights,
            lambda n: prefixed_name(n, _PREFIXES),
            "Gemma 3",
            skip=lambda local: local is not None and local.startswith(_UNUSED),
        )


def enable_pan_and_scan(processor, **settings):
    """Makes `processor` pan-and-scan every image (its crops become more images of the same
    placeholder). Gemma3Processor's own default (`do_pan_and_scan` False) overrides the image
    processor's saved setting, so a checkpoint's `do_pan_and_scan` alone does not switch it on;
    `settings`: `pan_and_scan_min_crop_size`, `pan_and_scan_max_num_crops`,
    `pan_and_scan_min_ratio_to_activate`."""
    processor.images_kwargs = {**type(processor).images_kwargs, "do_pan_and_scan": True, **settings}
    return processor


@vision_family("Gemma3ForConditionalGeneration")
class Gemma3Family(VisionFamily):
    tower_prefixes = tuple(prefix for prefix, _ in _PREFIXES)
    bidirectional_images = True

    def make_processor(self, model_dir: str, config):
        import transformers

        try:
            processor = transformers.AutoProcessor.from_pretrained(model_dir, local_files_only=True)
            if isinstance(processor, transformers.Gemma3Processor):
                return processor
        except Exception:  # no processor files, or a fast image processor needing torchvision
            pass
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        try:
            image_processor = transformers.Gemma3ImageProcessorPil.from_pretrained(
                model_dir, local_files_only=True
            )
        except OSError:  # no image processor settings saved: Gemma 3's, at the encoder's size
            size = config.vision_config.image_size
            image_processor = transformers.Gemma3ImageProcessorPil(
                size={"height": size, "width": size}
            )
        return transformers.Gemma3Processor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            chat_template=getattr(tokenizer, "chat_template", None),
            image_seq_length=config.mm_tokens_per_image,
        )

    def image_placeholder(self, processor) -> str:
        return processor.boi_token

    def process(
        self, processor, text: str, images: list, add_special_tokens: bool = True
    ) -> MultiModalPrompt:
        images = list(images or [])
        placeholder = self.image_placeholder(processor)
        found = text.count(placeholder)
        if found != len(images):
            raise ValueError(
                f"Gemma 3 prompt has {found} image placeholders ({placeholder!r}) "
                f"for {len(images)} images"
            )
        out = processor(
            text=[text],
            images=images or None,
            add_special_tokens=add_special_tokens,
            return_tensors="pt",
        )
        ids = out["input_ids"][0].tolist()
        runs = token_runs(ids, processor.tokenizer.image_token_id)
        pixels = out.get("pixel_values")
        num_pixels = 0 if pixels is None else pixels.shape[0]
        if len(runs) != num_pixels or any(n != processor.image_seq_length for _, n in runs):
            raise ValueError(
                f"Gemma 3 prompt: {len(runs)} runs of image tokens (lengths "
                f"{[n for _, n in runs]}) for {num_pixels} processed images of "
                f"{processor.image_seq_length} tokens each (does the text hold image tokens?)"
            )
        items = []
        for i, (offset, length) in enumerate(runs):
            data = {"pixel_values": pixels[i : i + 1].contiguous()}
            items.append(ImageItem(offset, length, data, hash_image_data(data)))
        return MultiModalPrompt(token_ids=ids, items=items)

    def build_tower(self, config, dtype: torch.dtype) -> VisionTower:
        with torch.device("meta"), quiet_meta():  # no torch._refs imports
            tower = Gemma3Tower(config)
        with quiet_meta():
            tower = tower.to_empty(device="cpu")
        return tower.to(dtype)

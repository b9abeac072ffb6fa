"""Vision family: Gemma 4 (`Gemma4ForConditionalGeneration`), images (its audio and video stay
refused).

The processor resizes every image keeping its aspect ratio to the largest size whose sides are
multiples of `pooling_kernel_size * patch_size` and whose patch count fits `max_soft_tokens *
pooling_kernel_size**2`, cuts it into patches (row-major, each patch's pixels in (row, column,
channel) order, rescaled to [0, 1]) and pads the patch list to that budget; each patch's (x, y)
grid position comes beside it ((-1, -1) for the padding). An image's placeholder (`<|image|>`,
`processor.image_token`) becomes `<|image>` + `<|image|>` * soft tokens + `<image|>`, the soft
token count being that image's own (patches / pooling_kernel_size**2): the span of an image is
its run of soft tokens alone (embed_mask None), the begin/end tokens stay text.

The tower (transformers' Gemma4VisionModel and the `embed_vision` embedder):
- patch embedding: the pixels mapped to [-1, 1], a linear map without bias, plus a learned
  position embedding of the patch's x and one of its y (`position_embedding_table` [2, P, D]);
- encoder layers as Gemma 4's text layers (RMSNorms with the weight as is, before and after
  attention and MLP; q/k RMSNorm over each head, values RMS-normed without a weight; attention
  scale 1; a gated tanh-GELU MLP), every patch of an image attending to every other of it;
  the rotary is 2-D: the first half of each head rotates by the patch's x, the second by its y,
  each half a rotate-half rope over its own channels (`rope_theta`, 100 by default);
- every linear optionally clamped at its input and output (`use_clipped_linears`, bounds
  stored in the checkpoint);
- the patch grid average-pooled k x k (k = `pooling_kernel_size`) to the soft tokens (rounded to
  the model dtype), scaled by sqrt(hidden) in float32 and, with `standardize`, shifted by
  `std_bias` and scaled by `std_scale`;
- `embed_vision`: an RMSNorm without weight, then a linear map to the text hidden size.

The padding patches take no part: only an image's real patches are kept in its data (the
attention masks the padding out of the keys, and the pooler drops it), so `encode` packs the
images' patches and attends within each image.

Where the features go (transformers' Gemma4Model.forward): over the token embeddings after
their sqrt(hidden) scale (the engine's scatter). Gemma 4's per-layer inputs at the image rows
take the pad token's per-layer embedding (transformers replaces the image ids by the pad id
before its lookup) mixed with the projection of the image features: the engine's decoder does
the same (`DecoderSpec.per_layer_image_id`).

Image tokens attending both ways: transformers does so only when the text config says
`use_bidirectional_attention: "vision"` (the 26B and 31B models), and then on the sliding-window
layers only (the global layers stay causal). So `bidirectional` is "sliding" for such a
checkpoint (the engine puts its key limits on the sliding layers' cache groups alone, and a
prefill chunk never ends inside an image) and "none" for the others (E2B, E4B: causal).
"""

from __future__ import annotations

import functools
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

# checkpoint prefix -> the tower's own module prefix (transformers 5 writes `model.`; a bare
# Gemma4Model's state dict has none)
_PREFIXES = (
    ("model.vision_tower.", "vision."),
    ("vision_tower.", "vision."),
    ("model.embed_vision.", "embed."),
    ("embed_vision.", "embed."),
)
# the video token Gemma4Processor adds to its tokenizer when it lacks it
_VIDEO_TOKEN = "<|video|>"


def _activation(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name in ("silu", "swish"):
        return F.silu
    raise ValueError(f"Gemma 4 vision tower: unsupported activation {name!r}")


class _RMSNorm(nn.Module):
    """Gemma 4's RMSNorm: in float32, times the weight as is (none with `scale=False`)."""

    def __init__(self, dim: int, eps: float, scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim)) if scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.to(x.dtype)


class _Linear(nn.Module):
    """A linear map without bias, its input and output clamped to the checkpoint's bounds when
    the config says `use_clipped_linears` (transformers' Gemma4ClippableLinear)."""

    def __init__(self, vc, d_in: int, d_out: int):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=False)
        self.clipped = bool(getattr(vc, "use_clipped_linears", False))
        if self.clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                self.register_buffer(name, torch.empty(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        x = self.linear(x)
        if self.clipped:
            x = torch.clamp(x, self.output_min, self.output_max)
        return x


class _PatchEmbedder(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.input_proj = nn.Linear(3 * vc.patch_size**2, vc.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(
            torch.empty(2, vc.position_embedding_size, vc.hidden_size)
        )

    def forward(self, pixels: torch.Tensor, xy: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3 p^2] in [0, 1], xy [N, 2] the patches' (x, y) -> [N, D]."""
        w = self.input_proj.weight
        x = self.input_proj((2 * (pixels - 0.5)).to(w.dtype))
        table = self.position_embedding_table
        return x + (table[0][xy[:, 0]] + table[1][xy[:, 1]])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The 2-D rotary of x [N, H, d]: each half of d is a rotate-half rope of its own, the first
    by x, the second by y (cos, sin [N, d], the halves' tables side by side)."""
    out = []
    half = x.shape[-1] // 2
    for part in range(2):
        sl = slice(part * half, (part + 1) * half)
        xs, c, s = x[..., sl], cos[:, None, sl], sin[:, None, sl]
        a, b = xs.chunk(2, dim=-1)
        out.append(xs * c + torch.cat((-b, a), dim=-1) * s)
    return torch.cat(out, dim=-1)


def _segment_attention(q, k, v, lengths: list[int]) -> torch.Tensor:
    """Attention (scale 1) within consecutive segments of `lengths` rows: q, k, v [N, H, d] ->
    [N, H, d]. Segments of one length go as one batch, others padded to the longest, the
    padding masked out of the keys."""
    n, heads, d = q.shape
    if len(set(lengths)) == 1:
        s, length = len(lengths), lengths[0]

        def batched(t):
            return t.reshape(s, length, heads, d).transpose(1, 2)

        out = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), scale=1.0)
        return out.transpose(1, 2).reshape(n, heads, d)
    lens = torch.tensor(lengths, device=q.device)
    longest = max(lengths)
    starts = torch.cumsum(lens, 0) - lens
    col = torch.arange(longest, device=q.device)
    valid = col[None, :] < lens[:, None]  # [S, L]
    index = (starts[:, None] + col[None, :]).clamp(max=n - 1)

    def padded(t):
        return t[index].transpose(1, 2)  # [S, H, L, d]

    mask = valid[:, None, None, :]
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), mask, scale=1.0)
    return out.transpose(1, 2)[valid]


class _Attention(nn.Module):
    use_kernels: bool | None = None  # the Triton kernel: set by the engine, else on CUDA

    def __init__(self, vc):
        super().__init__()
        d = vc.hidden_size
        self.heads = vc.num_attention_heads
        self.kv_heads = vc.num_key_value_heads
        self.head_dim = vc.head_dim
        self.q_proj = _Linear(vc, d, self.heads * self.head_dim)
        self.k_proj = _Linear(vc, d, self.kv_heads * self.head_dim)
        self.v_proj = _Linear(vc, d, self.kv_heads * self.head_dim)
        self.o_proj = _Linear(vc, self.heads * self.head_dim, d)
        self.q_norm = _RMSNorm(self.head_dim, vc.rms_norm_eps)
        self.k_norm = _RMSNorm(self.head_dim, vc.rms_norm_eps)
        self.v_norm = _RMSNorm(self.head_dim, vc.rms_norm_eps, scale=False)

    def forward(self, x, cos, sin, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(n, self.kv_heads, self.head_dim))
        v = self.v_norm(self.v_proj(x).view(n, self.kv_heads, self.head_dim))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        if kernel_wanted(self.use_kernels, x):  # every image in one launch
            cu = cu_seqlens_of(lengths, x.device)
            out = vision_attention(q, k, v, cu, 1.0, use_kernel=True, max_seqlen=max(lengths))
        else:
            out = _segment_attention(q, k, v, lengths)
        return self.o_proj(out.reshape(n, self.heads * self.head_dim))


class _Mlp(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.gate_proj = _Linear(vc, vc.hidden_size, vc.intermediate_size)
        self.up_proj = _Linear(vc, vc.hidden_size, vc.intermediate_size)
        self.down_proj = _Linear(vc, vc.intermediate_size, vc.hidden_size)
        self.act = _activation(vc.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, vc):
        super().__init__()
        d, eps = vc.hidden_size, vc.rms_norm_eps
        self.input_layernorm = _RMSNorm(d, eps)
        self.self_attn = _Attention(vc)
        self.post_attention_layernorm = _RMSNorm(d, eps)
        self.pre_feedforward_layernorm = _RMSNorm(d, eps)
        self.mlp = _Mlp(vc)
        self.post_feedforward_layernorm = _RMSNorm(d, eps)

    def forward(self, x, cos, sin, lengths):
        h = self.self_attn(self.input_layernorm(x), cos, sin, lengths)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class _Encoder(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(vc) for _ in range(vc.num_hidden_layers))


class _VisionModel(nn.Module):
    """Gemma4VisionModel's parameters under its names: patch_embedder, encoder.layers,
    std_bias / std_scale (with `standardize`)."""

    def __init__(self, vc):
        super().__init__()
        self.patch_embedder = _PatchEmbedder(vc)
        self.encoder = _Encoder(vc)
        self.standardize = bool(getattr(vc, "standardize", False))
        if self.standardize:
            self.register_buffer("std_bias", torch.empty(vc.hidden_size))
            self.register_buffer("std_scale", torch.empty(vc.hidden_size))


class _Embedder(nn.Module):
    """Gemma4MultimodalEmbedder: an RMSNorm without weight, a linear map to the text width."""

    def __init__(self, vc, text_hidden: int):
        super().__init__()
        width = getattr(vc, "output_proj_dims", None) or vc.hidden_size
        self.embedding_pre_projection_norm = _RMSNorm(width, vc.rms_norm_eps, scale=False)
        self.embedding_projection = nn.Linear(width, text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


class Gemma4Tower(VisionTower):
    # patches per encoder forward: bounds the activations of a step with many images
    max_patches = 32768

    def __init__(self, config):
        super().__init__()
        vc = config.vision_config
        if vc.head_dim % 4:
            raise ValueError(
                f"Gemma 4 vision tower: head_dim {vc.head_dim} is not a multiple of 4 (the 2-D "
                "rotary splits each head in two rotate-half halves)"
            )
        self.vision = _VisionModel(vc)
        self.embed = _Embedder(vc, config.text_config.hidden_size)
        self.pool = vc.pooling_kernel_size
        self.root_hidden = vc.hidden_size**0.5
        rope = getattr(vc, "rope_parameters", None) or {}
        self.theta = float(rope.get("rope_theta", 100.0))
        self.head_dim = vc.head_dim

    def _rope(self, xy: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim]: x's table twice, then y's twice (each half's rotate-half)."""
        half = self.head_dim // 2  # each axis's channels
        steps = torch.arange(0, half, 2, dtype=torch.float32, device=xy.device)
        inv_freq = 1.0 / self.theta ** (steps / half)  # in float32, whatever the dtype
        freqs = xy.float()[:, :, None] * inv_freq  # [N, 2, d/4]
        fx, fy = freqs[:, 0], freqs[:, 1]
        angles = torch.cat((fx, fx, fy, fy), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _pool(self, h: torch.Tensor, xy: torch.Tensor) -> torch.Tensor:
        """One image's patches [n, D] (grid positions xy) averaged over k x k cells -> the soft
        tokens [n / k^2, D] in row-major cell order, rounded to h's dtype."""
        k = self.pool
        cells_x = (int(xy[:, 0].max()) + 1) // k
        cell = xy[:, 0] // k + cells_x * (xy[:, 1] // k)
        count = h.shape[0] // (k * k)
        out = torch.zeros(count, h.shape[1], dtype=torch.float32, device=h.device)
        out.index_add_(0, cell, h.float() / (k * k))
        return out.to(h.dtype)

    def _forward(self, pixels: list[torch.Tensor], xys: list[torch.Tensor]) -> list[torch.Tensor]:
        dtype = self.embed.embedding_projection.weight.dtype
        lengths = [p.shape[0] for p in pixels]
        xy = torch.cat(xys).long()
        x = self.vision.patch_embedder(torch.cat(pixels), xy)
        cos, sin = self._rope(xy, x.dtype)
        for layer in self.vision.encoder.layers:
            x = layer(x, cos, sin, lengths)
        out = []
        for h, pos in zip(x.split(lengths), xys):
            soft = self._pool(h, pos.long()).float() * self.root_hidden
            if self.vision.standardize:
                soft = (soft - self.vision.std_bias.float()) * self.vision.std_scale.float()
            out.append(self.embed(soft.to(dtype)))
        return out

    @torch.no_grad()
    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[ImageFeatures]:
        k2 = self.pool * self.pool
        for item in items:
            n = item["pixel_values"].shape[0]
            if n % k2:
                raise ValueError(
                    f"Gemma 4 vision tower: an image of {n} patches does not pool "
                    f"{self.pool}x{self.pool}"
                )
        feats: list[ImageFeatures] = []
        group: list[dict[str, torch.Tensor]] = []
        size = 0

        def flush():
            if group:
                pixels = [g["pixel_values"] for g in group]
                xys = [g["image_position_ids"] for g in group]
                feats.extend(ImageFeatures(embeds=e) for e in self._forward(pixels, xys))
                group.clear()

        for item in items:
            n = item["pixel_values"].shape[0]
            if group and size + n > self.max_patches:
                flush()
                size = 0
            group.append(item)
            size += n
        flush()
        return feats

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        params.update(self.named_buffers())  # clip bounds, std_bias / std_scale
        load_tower_tensors(params, weights, lambda n: prefixed_name(n, _PREFIXES), "Gemma 4")


@functools.cache
def _images_processor_class():
    """Gemma4Processor without its video processor (which needs torchvision) and its audio
    feature extractor: images (and text) only, each processed exactly as Gemma4Processor
    does (its own methods)."""
    import transformers
    from transformers.processing_utils import ProcessorMixin

    class Gemma4ImagesProcessor(transformers.Gemma4Processor):
        def __init__(self, image_processor, tokenizer, chat_template=None, image_seq_length=280):
            ProcessorMixin.__init__(
                self,
                image_processor=image_processor,
                tokenizer=tokenizer,
                chat_template=chat_template,
            )
            self.image_seq_length = image_seq_length
            self.image_token = tokenizer.image_token
            self.image_token_id = tokenizer.image_token_id
            self.boi_token = tokenizer.boi_token
            self.eoi_token = tokenizer.eoi_token
            # As Gemma4Processor: its tokenizer gets the video token when it lacks it.
            tokenizer.add_special_tokens({"additional_special_tokens": [_VIDEO_TOKEN]})
            self.video_token = _VIDEO_TOKEN
            self.video_token_id = tokenizer.convert_tokens_to_ids(_VIDEO_TOKEN)
            for name in ("audio_token", "boa_token", "eoa_token", "audio_token_id"):
                setattr(self, name, getattr(tokenizer, name, None))

    return Gemma4ImagesProcessor


@vision_family("Gemma4ForConditionalGeneration")
class Gemma4Family(VisionFamily):
    tower_prefixes = tuple(prefix for prefix, _ in _PREFIXES)

    def bidirectional(self, config) -> str:
        """ "sliding" with use_bidirectional_attention "vision", else "none" (the module's
        docstring)."""
        text = getattr(config, "text_config", config)
        vision = getattr(text, "use_bidirectional_attention", None) == "vision"
        return "sliding" if vision else "none"

    def make_processor(self, model_dir: str, config):
        import transformers

        try:
            processor = transformers.AutoProcessor.from_pretrained(model_dir, local_files_only=True)
            if isinstance(processor, transformers.Gemma4Processor):
                return processor
        except Exception:  # the video processor needs torchvision (or no processor files)
            pass
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        image_processor = transformers.Gemma4ImageProcessorPil.from_pretrained(
            model_dir, local_files_only=True
        )
        return _images_processor_class()(
            image_processor=image_processor,
            tokenizer=tokenizer,
            chat_template=getattr(tokenizer, "chat_template", None),
            image_seq_length=image_processor.max_soft_tokens,
        )

    def image_placeholder(self, processor) -> str:
        return processor.image_token

    def process(
        self, processor, text: str, images: list, add_special_tokens: bool = True
    ) -> MultiModalPrompt:
        images = list(images or [])
        for name in ("video_token", "audio_token"):
            token = getattr(processor, name, None)
            if token and token in text:
                raise ValueError(
                    f"{token!r} in the prompt: Gemma 4's {name[:5]} is not served, only images"
                )
        placeholder = self.image_placeholder(processor)
        found = text.count(placeholder)
        if found != len(images):
            raise ValueError(
                f"Gemma 4 prompt has {found} image placeholders ({placeholder!r}) "
                f"for {len(images)} images"
            )
        out = processor(
            text=[text],
            images=images or None,
            add_special_tokens=add_special_tokens,
            return_tensors="pt",
        )
        ids = out["input_ids"][0].tolist()
        runs = token_runs(ids, processor.image_token_id)
        if not images:
            if runs:
                raise ValueError("Gemma 4 prompt holds image tokens but no image was given")
            return MultiModalPrompt(token_ids=ids)
        pixels, positions = out["pixel_values"], out["image_position_ids"]
        k2 = processor.image_processor.pooling_kernel_size**2
        real = (positions != -1).all(dim=-1)  # [images, max patches]
        counts = [int(n) // k2 for n in real.sum(dim=-1)]
        if [n for _, n in runs] != counts:
            raise ValueError(
                f"Gemma 4 prompt: runs of image tokens of lengths {[n for _, n in runs]} for "
                f"images of {counts} soft tokens (does the text hold image tokens?)"
            )
        items = []
        for i, (offset, length) in enumerate(runs):
            keep = real[i]
            data = {
                "pixel_values": pixels[i][keep].contiguous(),
                "image_position_ids": positions[i][keep].contiguous(),
            }
            items.append(ImageItem(offset, length, data, hash_image_data(data)))
        return MultiModalPrompt(token_ids=ids, items=items)

    def build_tower(self, config, dtype: torch.dtype) -> VisionTower:
        with torch.device("meta"), quiet_meta():  # no torch._refs imports
            tower = Gemma4Tower(config)
        with quiet_meta():
            tower = tower.to_empty(device="cpu")
        return tower.to(dtype)

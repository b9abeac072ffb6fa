"""Vision family: Idefics3 and SmolVLM (a SigLIP-style vision transformer, a pixel-shuffle
connector, a Llama text decoder).

The processor resizes an image (longest edge to `size`), cuts it into tiles of the vision
encoder's frame size (`max_image_size`) and adds the whole image resized to one frame (the
"global" frame), unless the image fits one frame or splitting is off. Each frame becomes
`image_seq_len` `<image>` tokens; the text one image stands for is

    <fake_token_around_image><row_1_col_1><image>*n<fake_token_around_image><row_1_col_2>...\\n
    ...\\n\\n<fake_token_around_image><global-img><image>*n<fake_token_around_image>

(only the global part when the image is one frame). An image's `ImageItem` spans its first to
its last `<image>` token; the tile tags and newlines inside are not fed (embed_mask False).

The tower: patch convolution, learned position embeddings indexed by each patch's bucketed
fractional coordinate within the frame's valid patches (frames padded to the batch's size keep
their valid region's positions), pre-LN encoder layers attending over the valid patches only,
the post layernorm; then the connector folds every `scale_factor` x `scale_factor` block of
patches into one vector (pixel shuffle) and projects it to the text width. A frame gives
(patches per side / scale_factor)^2 rows, an image its frames' rows in frame order (tiles in
row-major order, then the global frame), which are the rows transformers scatters into its
`<image>` tokens in order.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.activation import ACTIVATIONS
from ...kernels.vision_attention import cu_seqlens_of, kernel_wanted, vision_attention
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


def _activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(
            f"vision tower activation {name!r} is not supported; supported: "
            f"{', '.join(sorted(ACTIVATIONS))}"
        )
    return ACTIVATIONS[name]


class _Embeddings(nn.Module):
    """Patch convolution plus position embeddings of a `side` x `side` grid, looked up by each
    valid patch's bucketed fractional (row, column) within its frame's valid region."""

    def __init__(self, vc) -> None:
        super().__init__()
        self.patch = vc.patch_size
        self.side = vc.image_size // vc.patch_size
        self.patch_embedding = nn.Conv2d(
            vc.num_channels, vc.hidden_size, kernel_size=self.patch, stride=self.patch
        )
        self.position_embedding = nn.Embedding(self.side * self.side, vc.hidden_size)

    def position_ids(self, patch_mask: torch.Tensor) -> torch.Tensor:
        """patch_mask [B, rows, cols] bool -> position ids [B, rows * cols] (0 where padded)."""
        b, rows, cols = patch_mask.shape
        device = patch_mask.device
        # bucket edges 1/side, 2/side, ... below 1, as float32 fractions
        edges = torch.arange(1 / self.side, 1.0, 1 / self.side, device=device)
        valid_rows = patch_mask[:, :, 0].sum(dim=1)
        valid_cols = patch_mask[:, 0, :].sum(dim=1)
        frac_r = (
            torch.arange(rows, device=device, dtype=torch.float32)[None, :]
            * (1.0 / valid_rows)[:, None]
        )
        frac_c = (
            torch.arange(cols, device=device, dtype=torch.float32)[None, :]
            * (1.0 / valid_cols)[:, None]
        )
        bucket_r = torch.bucketize(frac_r.clamp(max=1.0 - 1e-6), edges, right=True)
        bucket_c = torch.bucketize(frac_c.clamp(max=1.0 - 1e-6), edges, right=True)
        ids = (bucket_r[:, :, None] * self.side + bucket_c[:, None, :]).reshape(b, -1)
        return torch.where(patch_mask.reshape(b, -1), ids, torch.zeros_like(ids))

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return x + self.position_embedding(self.position_ids(patch_mask))


class _Attention(nn.Module):
    use_kernels: bool | None = None  # the Triton kernel: set by the engine, else on CUDA

    def __init__(self, vc) -> None:
        super().__init__()
        d = vc.hidden_size
        self.heads = vc.num_attention_heads
        self.head_dim = d // self.heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, _ = x.shape
        # Frames with padded patches keep the masked SDPA: their padded rows are queries too
        # (their outputs reach the connector) but not keys, which packing cannot express.
        if mask is None and kernel_wanted(self.use_kernels, x):
            q, k, v = (
                p(x).view(b * n, self.heads, self.head_dim)
                for p in (self.q_proj, self.k_proj, self.v_proj)
            )
            cu = cu_seqlens_of([n] * b, x.device)
            out = vision_attention(q, k, v, cu, self.head_dim**-0.5, True, max_seqlen=n)
            return self.out_proj(out.view(b, n, -1))

        def heads(t):
            return t.view(b, n, self.heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q_proj(x)),
            heads(self.k_proj(x)),
            heads(self.v_proj(x)),
            attn_mask=mask,
            scale=self.head_dim**-0.5,
        )
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class _MLP(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.act = _activation(vc.hidden_act)
        self.fc1 = nn.Linear(vc.hidden_size, vc.intermediate_size)
        self.fc2 = nn.Linear(vc.intermediate_size, vc.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _EncoderLayer(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.self_attn = _Attention(vc)
        self.layer_norm2 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.mlp = _MLP(vc)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(vc) for _ in range(vc.num_hidden_layers))


class _VisionModel(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.embeddings = _Embeddings(vc)
        self.encoder = _Encoder(vc)
        self.post_layernorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values, patch_mask)
        b = x.shape[0]
        # keys of padded patches are left out; every frame has at least one valid patch
        mask = None if bool(patch_mask.all()) else patch_mask.reshape(b, 1, 1, -1)
        for layer in self.encoder.layers:
            x = layer(x, mask)
        return self.post_layernorm(x)


class _Projection(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)


class _Connector(nn.Module):
    """Pixel shuffle by `scale`: each scale x scale block of the patch grid becomes one vector
    (its rows in order, each row's patches in order, each patch's features), then a projection
    to the text width."""

    def __init__(self, config) -> None:
        super().__init__()
        self.scale = config.scale_factor
        width = config.vision_config.hidden_size * self.scale**2
        self.modality_projection = _Projection(width, config.text_config.hidden_size)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        b, _, d = x.shape
        s = self.scale
        x = x.view(b, rows // s, s, cols // s, s, d).permute(0, 1, 3, 2, 4, 5)
        x = x.reshape(b, (rows // s) * (cols // s), s * s * d)
        return self.modality_projection.proj(x)


class Idefics3Tower(VisionTower):
    """The vision model and connector of an Idefics3 / SmolVLM checkpoint. One image's data:
    `pixel_values` [frames, 3, H, W] and `pixel_attention_mask` [frames, H, W] (its tiles, then
    its global frame); its features: frames x (H / patch / scale) x (W / patch / scale) rows."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        vc = config.vision_config
        self.patch = vc.patch_size
        self.scale = config.scale_factor
        self.vision_model = _VisionModel(vc)
        self.connector = _Connector(config)
        self.to(dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.connector.modality_projection.proj.weight.dtype

    def _patch_mask(self, pixel_mask: torch.Tensor) -> torch.Tensor:
        """[B, H, W] pixel mask -> [B, H / patch, W / patch]: a patch is valid when any of its
        pixels is."""
        b, h, w = pixel_mask.shape
        p = self.patch
        rows, cols = h // p, w // p
        m = pixel_mask[:, : rows * p, : cols * p].reshape(b, rows, p, cols, p)
        return m.bool().any(dim=4).any(dim=2)

    def _encode_frames(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor) -> torch.Tensor:
        patch_mask = self._patch_mask(pixel_mask)
        rows, cols = patch_mask.shape[1:]
        if rows != cols or rows % self.scale:
            raise ValueError(
                f"Idefics3 frames must be square with a patch grid divisible by the scale factor "
                f"{self.scale}; got {rows} x {cols} patches"
            )
        hidden = self.vision_model(pixel_values.to(self.dtype), patch_mask)
        return self.connector(hidden, rows, cols)

    @torch.no_grad()
    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[ImageFeatures]:
        frames = [item["pixel_values"] for item in items]
        masks = [
            item.get("pixel_attention_mask")
            if item.get("pixel_attention_mask") is not None
            else torch.ones((f.shape[0], *f.shape[2:]), dtype=torch.bool, device=f.device)
            for item, f in zip(items, frames)
        ]
        # frames of one size go through the encoder together
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, f in enumerate(frames):
            by_size.setdefault(tuple(f.shape[2:]), []).append(i)
        out: list[ImageFeatures | None] = [None] * len(items)
        for idx in by_size.values():
            feats = self._encode_frames(
                torch.cat([frames[i] for i in idx]), torch.cat([masks[i] for i in idx])
            )
            counts = [frames[i].shape[0] for i in idx]
            for i, f in zip(idx, feats.split(counts)):
                out[i] = ImageFeatures(embeds=f.reshape(-1, f.shape[-1]))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        load_tower_tensors(params, weights, _tower_key, "Idefics3")


def _tower_key(name: str) -> str:
    return name.removeprefix("model.")


def _image_seq_len(config) -> int:
    """The `<image>` tokens a frame stands for, as the model computes it (for a checkpoint whose
    processor config does not say): (frame patches per side)^2 / scale_factor^2."""
    vc = config.vision_config
    return int((vc.image_size // vc.patch_size) ** 2 / config.scale_factor**2)


@functools.cache
def _smolvlm_processor_class():
    """SmolVLMProcessor for images only: transformers' class requires a video processor (its
    class needs torchvision) and num2words (for video prompts); images need neither."""
    from transformers import SmolVLMProcessor
    from transformers.processing_utils import ProcessorMixin

    class SmolVLMImageProcessorOnly(SmolVLMProcessor):
        def __init__(
            self, image_processor, tokenizer, image_seq_len: int = 169, chat_template=None, **kw
        ):
            self.fake_image_token = getattr(
                tokenizer, "fake_image_token", "<fake_token_around_image>"
            )
            self.image_token = getattr(tokenizer, "image_token", "<image>")
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.end_of_utterance_token = getattr(
                tokenizer, "end_of_utterance_token", "<end_of_utterance>"
            )
            self.global_image_token = getattr(tokenizer, "global_image_token", "<global-img>")
            self.image_seq_len = image_seq_len
            self.video_token = getattr(tokenizer, "video_token", "<video>")
            ProcessorMixin.__init__(
                self, image_processor, tokenizer, chat_template=chat_template, **kw
            )

        def apply_chat_template(self, conversation, chat_template=None, **kwargs):
            # SmolVLMProcessor's own adds video sampling defaults from its video processor
            return ProcessorMixin.apply_chat_template(
                self, conversation, chat_template=chat_template, **kwargs
            )

    return SmolVLMImageProcessorOnly


class Idefics3Family(VisionFamily):
    tower_prefixes = ("model.vision_model.", "model.connector.", "vision_model.", "connector.")
    smolvlm = False

    def make_processor(self, model_dir: str, config):
        import transformers

        if self.smolvlm:
            cls = _smolvlm_processor_class()
            image_processor_cls = transformers.SmolVLMImageProcessorPil
        else:
            cls = transformers.Idefics3Processor
            image_processor_cls = transformers.Idefics3ImageProcessorPil
        processor_dict, _ = cls.get_processor_dict(model_dir)
        processor_dict = {
            k: v for k, v in processor_dict.items() if k in ("image_seq_len", "chat_template")
        }
        processor_dict.setdefault("image_seq_len", _image_seq_len(config))
        image_processor = image_processor_cls.from_pretrained(model_dir)
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        if processor_dict.get("chat_template") is None and tokenizer.chat_template is not None:
            processor_dict["chat_template"] = tokenizer.chat_template
        return cls(image_processor=image_processor, tokenizer=tokenizer, **processor_dict)

    def image_placeholder(self, processor) -> str:
        return processor.image_token

    def process(
        self, processor, text: str, images: list, add_special_tokens: bool = True
    ) -> MultiModalPrompt:
        images = list(images or [])
        placeholder = processor.image_token
        found = text.count(placeholder)
        if found != len(images):
            raise ValueError(
                f"the prompt has {found} image placeholder(s) {placeholder!r} but "
                f"{len(images)} image(s) were given"
            )
        if not images:
            ids = processor.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
            return MultiModalPrompt(token_ids=list(ids))
        out = processor(
            text=[text],
            images=[images],
            add_special_tokens=add_special_tokens,
            return_text_replacement_offsets=True,
            return_tensors="pt",
        )
        ids = out["input_ids"][0]
        token_ids = ids.tolist()
        pixel_values = out["pixel_values"][0]
        pixel_mask = out.get("pixel_attention_mask")
        pixel_mask = pixel_mask[0] if pixel_mask is not None else None
        replacements = [r for r in out["text_replacement_offsets"][0] if r["type"] == "image"]
        if len(replacements) != len(images):
            raise ValueError(
                f"the processor expanded {len(replacements)} image placeholder(s) for "
                f"{len(images)} image(s)"
            )
        is_image = ids == processor.image_token_id
        image_positions = torch.nonzero(is_image).flatten().tolist()
        seq_len = processor.image_seq_len
        items: list[ImageItem] = []
        frame = token = 0
        for r in replacements:
            # every <image> of the text is one image's expansion: the k-th image takes the next
            # image tokens, as many as its replacement text holds
            count = r["replacement"].count(processor.image_token)
            if count == 0 or count % seq_len or token + count > len(image_positions):
                raise ValueError(
                    f"an image's expansion holds {count} image tokens, not a multiple of "
                    f"image_seq_len {seq_len}"
                )
            offset = image_positions[token]
            stop = image_positions[token + count - 1] + 1
            token += count
            frames = count // seq_len
            data = {"pixel_values": pixel_values[frame : frame + frames].contiguous()}
            if pixel_mask is not None:
                data["pixel_attention_mask"] = pixel_mask[frame : frame + frames].contiguous()
            frame += frames
            items.append(
                ImageItem(
                    offset=offset,
                    length=stop - offset,
                    data=data,
                    hash=hash_image_data(data),
                    embed_mask=is_image[offset:stop].clone(),
                )
            )
        # a single prompt's frames are all its images' own: no padding frames of other samples
        if frame != pixel_values.shape[0] or int(is_image.sum()) != frame * seq_len:
            raise ValueError(
                f"the processor gave {pixel_values.shape[0]} frames for {frame} frames of image "
                f"tokens ({int(is_image.sum())} tokens of {seq_len} a frame)"
            )
        return MultiModalPrompt(token_ids=token_ids, items=items)

    def build_tower(self, config, dtype: torch.dtype) -> VisionTower:
        return Idefics3Tower(config, dtype)


@vision_family("Idefics3ForConditionalGeneration")
class Idefics3VisionFamily(Idefics3Family):
    smolvlm = False


@vision_family("SmolVLMForConditionalGeneration")
class SmolVLMVisionFamily(Idefics3Family):
    smolvlm = True

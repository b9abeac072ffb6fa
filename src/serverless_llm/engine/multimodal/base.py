"""The contract between the engine and a vision family.

A family (one module under `models/vision/`) turns a prompt's text and images into a
`MultiModalPrompt` with its model's own transformers processor (`VisionFamily.process`), and
builds the vision tower that turns one image's processor outputs into the embeddings that take
the place of its placeholder tokens (`VisionTower.encode`). The engine does the rest: it runs
the tower in the step that first needs an image's features, keeps them in the encoder cache
until the request's tokens past the image are computed, writes them over the placeholder
tokens' embeddings, and keys prefix-cache blocks by the image's hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(eq=False)
class ImageItem:
    """One image of a prompt, processed.

    `offset`/`length`: the span of prompt positions its placeholder occupies (the run of image
    tokens, and any break or end tokens inside the run); `embed_mask` ([length] bool) says which
    positions of the span take a feature row (None: all of them). The tower's output for this
    image has exactly `num_embeds` rows, in span order.
    `data`: what the tower's `encode` takes for this image alone (pixel_values, grid sizes ...),
    on the CPU, as the processor produced it.
    `hash`: identifies the image's content (its processed pixels and sizes): it keys the encoder
    cache and the prefix cache, so two prompts that differ only in an image share no block."""

    offset: int
    length: int
    data: dict[str, torch.Tensor]
    hash: bytes
    embed_mask: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        return self.length if self.embed_mask is None else int(self.embed_mask.sum())


@dataclass(eq=False)
class ImageFeatures:
    """A tower's output for one image: `embeds` [num_embeds, text hidden] in the model dtype;
    `deepstack` (Qwen3-VL): one [num_embeds, text hidden] tensor per early decoder layer, added
    to that layer's output at the image's positions (None for every other family)."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor] | None = None

    @property
    def num_rows(self) -> int:
        return self.embeds.shape[0]

    def nbytes(self) -> int:
        extra = sum(t.numel() * t.element_size() for t in self.deepstack or ())
        return self.embeds.numel() * self.embeds.element_size() + extra


@dataclass(eq=False)
class MultiModalPrompt:
    """A prompt with its images processed: its token ids with every image's placeholder
    expanded to the image's tokens, the images in prompt order, and (families with multimodal
    rotary positions, `VisionFamily.mrope`) the three position streams of every prompt token
    [3, len(token_ids)] with the offset generated tokens add to their index (transformers'
    `rope_deltas`: generated token at index i has position i + mrope_delta in all streams)."""

    token_ids: list[int]
    items: list[ImageItem] = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0


class VisionTower(nn.Module):
    """A family's vision encoder and projector: from one image's processor outputs to the rows
    that replace its placeholder embeddings. Built on the CPU in the model dtype; the engine
    moves it to the model's device."""

    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[ImageFeatures]:
        """Features of several images (each item's tensors on this tower's device), batched as
        the family allows; one ImageFeatures per item, in order."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads the tower's tensors, named as in the checkpoint (the names that start with one
        of the family's `tower_prefixes`); every parameter must be loaded (a KeyError naming
        the missing or unexpected ones otherwise)."""
        raise NotImplementedError

    def set_use_kernels(self, use: bool) -> None:
        """Whether the tower's attention runs the Triton kernel (kernels/vision_attention.py),
        as the engine's attention backend does: sets `use_kernels` on each of its modules that
        has one. Never called (a tower used alone), they run it on CUDA tensors only."""
        for module in self.modules():
            if hasattr(module, "use_kernels"):
                module.use_kernels = use


class VisionFamily:
    """What the engine needs of a vision-language family. One instance per family module,
    registered for its composite architectures (`registry.vision_family`)."""

    # Checkpoint tensor name prefixes of the vision tower and projector (transformers 5 names
    # and the older Llava-style names): these tensors go to the tower, the rest to the decoder.
    tower_prefixes: tuple[str, ...] = ()
    # Multimodal rotary positions (Qwen2.5-VL, Qwen3-VL, Qwen3.5): MultiModalPrompt carries
    # them, and the decoder's rotary takes three streams (`mrope_section` of the text config).
    mrope: bool = False
    # Gemma 3: an image's tokens attend to each other both ways in prefill, so a prefill chunk
    # never ends inside an image's span.
    bidirectional_images: bool = False

    def bidirectional(self, config) -> str:
        """Where an image's tokens attend to each other both ways for the checkpoint of the
        composite `config`: "none" (causal), "all" (every layer) or "sliding" (the
        sliding-window layers only). By default from `bidirectional_images`."""
        return "all" if self.bidirectional_images else "none"

    def make_processor(self, model_dir: str, config):
        """The family's transformers processor for the checkpoint in `model_dir` (config: the
        composite transformers config), built from its PIL image processor and tokenizer where
        AutoProcessor needs torchvision (absent on CPU installs)."""
        raise NotImplementedError

    def image_placeholder(self, processor) -> str:
        """The text that stands for one image in a prompt before processing (what the chat
        template writes for an image part, e.g. "<image>" or "<|vision_start|><|image_pad|>
        <|vision_end|>"): the offline API's prompts carry one per image."""
        raise NotImplementedError

    def process(
        self, processor, text: str, images: list, add_special_tokens: bool = True
    ) -> MultiModalPrompt:
        """`text` (with one placeholder per image, in order) and the PIL images through the
        processor (its tokenizer adding special tokens or not, as `add_special_tokens` says: a
        rendered chat template has them already): the expanded token ids exactly as
        transformers' processor gives them, each
        image's span, data and hash, and (mrope) the position streams exactly as the model's
        `get_rope_index` computes them. ValueError with a clear message when the placeholders
        and images do not match."""
        raise NotImplementedError

    def build_tower(self, config, dtype: torch.dtype) -> VisionTower:
        """The tower of the composite transformers `config`, with uninitialised weights."""
        raise NotImplementedError


def load_tower_tensors(
    targets: dict[str, torch.Tensor],
    weights: Iterable[tuple[str, object]],
    local_name,
    label: str,
    skip=None,
) -> None:
    """Copies checkpoint tensors into a tower's parameters (and buffers) `targets` by local
    name (`local_name(checkpoint name)`, None when it is not the tower's); tensors whose local
    name `skip` accepts (None included) are left out (tensors the tower does not use).
    ValueError for a shape mismatch; KeyError naming every missing and unexpected tensor."""
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        local = local_name(name)
        if skip is not None and skip(local):
            continue
        if local not in targets:
            unexpected.append(name)
            continue
        if not isinstance(tensor, torch.Tensor):  # a lazily read checkpoint tensor
            tensor = tensor.full()
        target = targets[local]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"{label} tower: {name} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        loaded.add(local)
    missing = sorted(set(targets) - loaded)
    if missing or unexpected:
        raise KeyError(
            f"{label} tower weights: missing {missing or 'none'}; unexpected {unexpected or 'none'}"
        )


def prefixed_name(name: str, prefixes) -> str | None:
    """`name` with the first matching checkpoint prefix of `prefixes` ((prefix, local prefix)
    pairs) replaced by its local prefix; None when none matches."""
    for prefix, local in prefixes:
        if name.startswith(prefix):
            return local + name[len(prefix) :]
    return None


def token_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of every maximal run of `token_id` in `ids`."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate(ids):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i - start))
            start = None
    if start is not None:
        runs.append((start, len(ids) - start))
    return runs


def hash_image_data(data: dict[str, torch.Tensor], extra: bytes = b"") -> bytes:
    """A content hash of one image's processed tensors (names, shapes, dtypes and bytes)."""
    h = hashlib.sha256(extra)
    for name in sorted(data):
        t = data[name]
        if not isinstance(t, torch.Tensor):
            h.update(f"{name}={t!r};".encode())
            continue
        t = t.detach().contiguous().cpu()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()

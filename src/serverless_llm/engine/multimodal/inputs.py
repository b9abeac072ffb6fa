"""A prompt with images, as the engine takes it (the API routes and the offline `LLM` build it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MultiModalInput:
    """Prompt text carrying the model's image placeholder once per image (a rendered chat
    template writes them for image parts), and the images (PIL), in order.
    `add_special_tokens`: whether the tokenizer adds its special tokens (BOS ...): False for a
    rendered chat template, which holds them already."""

    text: str
    images: list = field(default_factory=list)
    add_special_tokens: bool = True

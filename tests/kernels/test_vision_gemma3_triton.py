"""Gemma 3 with images on the Triton backend (interpreted): its image tokens attend to each
other both ways in prefill, which the paged attention kernel masks with the step's key limits;
greedy tokens equal transformers'."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.engine.vision_check import (  # noqa: E402
    engine_greedy,
    family_processor,
    hf_vision_greedy,
    make_llm,
    vision_prompts,
)
from tests.engine.vision_gemma3_models import sample_images, save_tiny_gemma3  # noqa: E402


def test_gemma3_images_on_triton_equal_transformers(tmp_path):
    path = save_tiny_gemma3(str(tmp_path / "gemma3"), tie_word_embeddings=False)
    family, processor = family_processor(path)
    prompts = vision_prompts(family.image_placeholder(processor), sample_images())[:2]
    want = hf_vision_greedy(path, prompts, 8)
    llm = make_llm(path, attention_backend="triton", device="cpu")
    assert engine_greedy(llm, prompts, 8) == want

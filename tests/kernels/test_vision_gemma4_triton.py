"""Gemma 4 with images on the Triton backend (interpreted), a checkpoint with
`use_bidirectional_attention: "vision"`: its image tokens attend to each other both ways on the
sliding-window layers only, which the paged attention kernel masks with the step's key limits
on those layers' cache groups alone; greedy tokens equal transformers'."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.engine.vision_check import (  # noqa: E402
    engine_greedy,
    hf_vision_greedy,
    make_llm,
    vision_prompts,
)
from tests.engine.vision_gemma4_models import (  # noqa: E402
    IMAGE_TOKEN,
    sample_images,
    save_tiny_gemma4,
)


def test_gemma4_bidirectional_images_on_triton_equal_transformers(tmp_path):
    path = save_tiny_gemma4(str(tmp_path / "gemma4"), bidirectional="vision", vision_layers=1)
    prompts = vision_prompts(IMAGE_TOKEN, sample_images())[:2]
    want = hf_vision_greedy(path, prompts, 8)
    llm = make_llm(path, attention_backend="triton", device="cpu")
    assert engine_greedy(llm, prompts, 8) == want

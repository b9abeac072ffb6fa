"""The warm-up's list holds the vision towers' own launches (engine/kernel_warmup.py,
`_vision_launches`): requests with images of several sizes, served on the Triton backend (the
interpreter on CPU), launch the tower's attention kernel with specialisations that must all be
in the list made with the engine's image inputs. A fixed-size family (Gemma 3: every image
resized to one size) and a dynamic-resolution one with windows (Qwen2.5-VL: the tile choice
follows the patches of each image and its 64-patch windows). Without the vision sweep the
tower's launches are missing, and a drifted launch (twice the warps) fails the check."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("triton")

from serverless_llm import LLM, SamplingParams  # noqa: E402
from serverless_llm.engine.kernel_warmup import SweepLimits, list_launches  # noqa: E402
from serverless_llm.engine.kernels import vision_attention  # noqa: E402
from serverless_llm.engine.kernels.launch_keys import record_launches  # noqa: E402
from tests.kernels.test_kernel_warmup import _assert_listed  # noqa: E402

KERNEL = "_vision_attention_kernel"


def _gemma3(tmp_path):
    from tests.engine.vision_gemma3_models import BOI, sample_images, save_tiny_gemma3

    images = sample_images()[:3]
    prompts = [
        {"prompt": f"Look: {BOI} what is it?", "multi_modal_data": {"image": [images[0]]}},
        {"prompt": f"First {BOI} then {BOI}.", "multi_modal_data": {"image": images[1:3]}},
    ]
    return save_tiny_gemma3(str(tmp_path / "gemma3")), prompts


def _qwen2_5_vl(tmp_path):
    from serverless_llm.engine.models.vision.qwen_vl import VISION_END, VISION_START
    from tests.engine.vision_qwen_vl_models import sample_images, save_tiny_qwen2_5_vl

    pad = VISION_START + "<|image_pad|>" + VISION_END
    images = sample_images()  # 90 x 60, 50 x 110, 112 x 112, 30 x 40, 70 x 45
    prompts = [
        {"prompt": f"Describe {pad} briefly.", "multi_modal_data": {"image": [image]}}
        for image in images
    ]
    prompts.append({"prompt": f"Two: {pad} and {pad}.",
                    "multi_modal_data": {"image": [images[2], images[3]]}})  # fmt: skip
    return save_tiny_qwen2_5_vl(str(tmp_path / "qwen2_5_vl")), prompts


FAMILIES = {"gemma3": _gemma3, "qwen2_5_vl": _qwen2_5_vl}


def _tower_served(llm: LLM, prompts, monkeypatch) -> set:
    """The specialisations the tower launched serving `prompts` (recorded around its encode)."""
    tower = llm.engine.runner.vision_tower
    encode = tower.encode
    specs: set = set()

    def encode_recorded(items):
        with record_launches() as rec:
            out = encode(items)
        specs.update(rec.specs)
        return out

    monkeypatch.setattr(tower, "encode", encode_recorded)
    llm.engine.runner.encoder_cache.clear()  # every image through the tower, served before or not
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    monkeypatch.setattr(tower, "encode", encode)
    return specs


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vision_tower_launches_are_listed(family, tmp_path, monkeypatch):
    path, prompts = FAMILIES[family](tmp_path)
    llm = LLM(path, attention_backend="triton", dtype="float32", block_size=8,
              num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=256,
              max_num_seqs=4)  # fmt: skip
    e = llm.engine
    assert e.runner.vision_tower is not None and e.inputs.images is not None
    # The text sweep at its smallest: only the tower's launches are checked here (the decoder's
    # image steps are, in test_kernel_warmup_families.py), and they follow no step limit.
    limits = SweepLimits(16, 1, 32)
    listed = set(list_launches(e.runner, limits, e.inputs.images))
    served = _tower_served(llm, prompts, monkeypatch)
    assert {s.name for s in served} == {KERNEL}, served
    _assert_listed(served, listed)

    # The sweep without the engine's image inputs lists none of the tower's launches.
    assert not served & set(list_launches(e.runner, limits))

    # A launcher that drifts from what the sweep recorded (twice the warps) fails the check.
    real = vision_attention.vision_tiles

    def drifted(head_dim, max_seqlen, dtype):
        cfg = real(head_dim, max_seqlen, dtype)
        return dataclasses.replace(cfg, num_warps=cfg.num_warps * 2)

    monkeypatch.setattr(vision_attention, "vision_tiles", drifted)
    drifted_served = _tower_served(llm, prompts, monkeypatch)
    assert drifted_served and {s.name for s in drifted_served - listed} == {KERNEL}
    with pytest.raises(AssertionError, match="not in the warm-up's list"):
        _assert_listed(drifted_served, listed)

"""The LLaVA and LLaVA-NeXT vision families (engine/models/vision/llava.py) against
transformers: processor ids and image spans, per-image data and hashes, and the tower's
features against what transformers' model writes over the image tokens."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

from serverless_llm.engine.models.vision import llava as llava_module
from serverless_llm.engine.multimodal import VISION_FAMILIES
from tests.engine.vision_llava_models import sample_images, save_tiny_llava, save_tiny_llava_next

NEXT = transformers.LlavaNextForConditionalGeneration
# name -> (builder, its options, transformers class)
VARIANTS = {
    "llava": (save_tiny_llava, {}, transformers.LlavaForConditionalGeneration),
    "llava_layers_full_nobias": (
        save_tiny_llava,
        dict(
            vision_feature_layer=[-2, -1],
            vision_feature_select_strategy="full",
            multimodal_projector_bias=False,
        ),
        transformers.LlavaForConditionalGeneration,
    ),
    "llava_first_and_last": (
        save_tiny_llava,
        dict(vision_feature_layer=[0, 2], projector_hidden_act="silu", do_pad=True),
        transformers.LlavaForConditionalGeneration,
    ),
    "llava_siglip": (
        save_tiny_llava,
        dict(vision="siglip", vision_feature_select_strategy="full", vision_feature_layer=-1),
        transformers.LlavaForConditionalGeneration,
    ),
    "next": (save_tiny_llava_next, {}, NEXT),
    "next_siglip_layers": (
        save_tiny_llava_next,
        dict(vision="siglip", vision_feature_layer=[-1, 0], multimodal_projector_bias=False),
        NEXT,
    ),
    "next_wide_tiles": (
        save_tiny_llava_next,
        dict(tile=28, pinpoints=[[28, 112], [112, 28], [56, 56], [56, 84], [84, 56]]),
        NEXT,
    ),
}


class Checkpoint:
    """A tiny checkpoint with its family, processor, tower and transformers model."""

    def __init__(self, path: str, model_class) -> None:
        self.path = path
        self.model_class = model_class
        self.config = transformers.AutoConfig.from_pretrained(path)
        # the module registers its families on import (the other families' modules are not
        # needed here)
        self.family = VISION_FAMILIES[self.config.architectures[0]]
        assert type(self.family).__module__ == llava_module.__name__
        self.processor = self.family.make_processor(path, self.config)
        self.weights = load_file(os.path.join(path, "model.safetensors"))
        self.tower = self.family.build_tower(self.config, torch.float32)
        self.tower.load_weights(self.tower_weights())
        self.model = model_class.from_pretrained(path, dtype=torch.float32).eval()

    def tower_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(k, v) for k, v in self.weights.items() if k.startswith(self.family.tower_prefixes)]

    def image_token_id(self) -> int:
        return self.config.image_token_id

    def scattered(self, text: str, images) -> tuple[torch.Tensor, torch.Tensor]:
        """The input ids and the input embeddings transformers' model gives its decoder."""
        inputs = self.processor(text=[text], images=images, return_tensors="pt")
        seen = {}

        def grab(module, args, kwargs):
            seen["embeds"] = kwargs["inputs_embeds"][0]

        hook = self.model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.no_grad():
                self.model(**inputs)
        finally:
            hook.remove()
        return inputs["input_ids"][0], seen["embeds"]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def llava(request, tmp_path_factory) -> Checkpoint:
    build, options, model_class = VARIANTS[request.param]
    return Checkpoint(build(str(tmp_path_factory.mktemp(request.param)), **options), model_class)


def image_inputs(inputs) -> dict:
    """The processor outputs transformers' get_image_features takes."""
    return {k: inputs[k] for k in ("pixel_values", "image_sizes") if k in inputs}


PROMPTS = [
    ("Hello world!", 0),
    ("Describe <image> please.", 1),
    ("<image>First, then the second <image>\nDone.", 2),
    ("Two at once <image><image> and text.", 2),
]


def check_prompt(ckpt: Checkpoint, text: str, images, add_special_tokens: bool) -> None:
    mm = ckpt.family.process(ckpt.processor, text, images, add_special_tokens=add_special_tokens)
    ref = ckpt.processor(text=[text], images=images or None, add_special_tokens=add_special_tokens)[
        "input_ids"
    ][0]
    assert mm.token_ids == list(ref)
    assert len(mm.items) == len(images)
    ids = torch.tensor(mm.token_ids)
    image_positions = (ids == ckpt.image_token_id()).nonzero().flatten().tolist()
    covered = []
    for item in mm.items:
        span = ids[item.offset : item.end]
        mask = span == ckpt.image_token_id()
        if item.embed_mask is None:
            assert bool(mask.all())
        else:
            assert torch.equal(item.embed_mask, mask)
        covered += [item.offset + i for i in range(item.length) if mask[i]]
    assert covered == image_positions
    # items are in prompt order and do not overlap
    for a, b in zip(mm.items, mm.items[1:]):
        assert a.end <= b.offset


def test_processor_builds_without_torchvision(llava):
    assert importlib.util.find_spec("torchvision") is None
    assert type(llava.processor).__name__ == llava.family.processor_names[0]
    assert type(llava.processor.image_processor).__name__.endswith("Pil")
    built = llava.family.build_processor(llava.path, llava.config)
    images = sample_images()[:2]
    text = "a <image> b <image>"
    assert torch.equal(
        built(text=[text], images=images, return_tensors="pt")["input_ids"],
        llava.processor(text=[text], images=images, return_tensors="pt")["input_ids"],
    )
    assert llava.family.image_placeholder(llava.processor) == "<image>"
    rendered = llava.processor.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}],
            }
        ],
        add_generation_prompt=True,
    )
    assert rendered.count("<image>") == 1


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_process_matches_processor(llava, add_special_tokens):
    images = sample_images()
    for text, n in PROMPTS:
        check_prompt(llava, text, images[1 : 1 + n], add_special_tokens)
    with_bos = llava.family.process(llava.processor, "Hello", [], add_special_tokens=True)
    without = llava.family.process(llava.processor, "Hello", [], add_special_tokens=False)
    assert with_bos.token_ids == [llava.processor.tokenizer.bos_token_id] + without.token_ids


def test_image_data_and_hash(llava):
    a, b, c = sample_images()[:3]
    fam, proc = llava.family, llava.processor
    one = fam.process(proc, "x <image> y <image>", [a, b])
    two = fam.process(proc, "other text <image>", [b])
    three = fam.process(proc, "<image>", [c])
    assert one.items[1].hash == two.items[0].hash
    assert one.items[0].hash != one.items[1].hash != three.items[0].hash
    assert torch.equal(one.items[1].data["pixel_values"], two.items[0].data["pixel_values"])
    if llava.model_class is NEXT:
        # its own tiles only (the processor pads a batch to its image with the most tiles),
        # and its original size
        alone = fam.process(proc, "<image>", [a])
        assert one.items[0].hash == alone.items[0].hash
        for item, image in zip(one.items, (a, b)):
            assert item.data["image_sizes"].tolist() == [[image.height, image.width]]
            pinpoints = llava.config.image_grid_pinpoints
            tile = llava.config.vision_config.image_size
            tiles = llava_module.num_tiles((image.height, image.width), pinpoints, tile)
            assert item.data["pixel_values"].shape[0] == tiles
    else:
        assert set(one.items[0].data) == {"pixel_values"}
        assert one.items[0].data["pixel_values"].shape[0] == 1


def test_placeholder_mismatch(llava):
    images = sample_images()[:2]
    with pytest.raises(ValueError, match="placeholder"):
        llava.family.process(llava.processor, "one <image> only", images)
    with pytest.raises(ValueError, match="placeholder"):
        llava.family.process(llava.processor, "<image> <image>", images[:1])
    with pytest.raises(ValueError, match="placeholder"):
        llava.family.process(llava.processor, "no image here", images[:1])


def test_encode_matches_transformers(llava):
    images = sample_images()[1:]  # six sizes
    text = "First <image> then <image> and <image><image>.<image> <image>"
    mm = llava.family.process(llava.processor, text, images)
    with torch.no_grad():
        ours = llava.tower.encode([item.data for item in mm.items])
        inputs = llava.processor(text=[text], images=images, return_tensors="pt")
        ref = llava.model.get_image_features(**image_inputs(inputs)).pooler_output
    assert len(ours) == len(ref) == len(images)
    for feats, want, item in zip(ours, ref, mm.items):
        assert (
            feats.embeds.shape
            == want.shape
            == (item.num_embeds, llava.config.text_config.hidden_size)
        )
        torch.testing.assert_close(feats.embeds, want, atol=1e-4, rtol=1e-4)
    # exactly the rows transformers writes over the image tokens
    ids, embeds = llava.scattered(text, images)
    assert ids.tolist() == mm.token_ids
    for feats, item in zip(ours, mm.items):
        torch.testing.assert_close(
            feats.embeds, embeds[item.offset : item.end], atol=1e-4, rtol=1e-4
        )
    # one image alone gives what it gives in a batch
    with torch.no_grad():
        alone = llava.tower.encode([mm.items[2].data])[0]
    torch.testing.assert_close(alone.embeds, ours[2].embeds, atol=1e-5, rtol=1e-5)


def test_weights(llava):
    weights = llava.tower_weights()
    assert weights and all(not k.startswith("language_model") for k, _ in weights)
    fresh = llava.family.build_tower(llava.config, torch.float32)
    # every tower parameter from the checkpoint, in either naming
    renamed = []
    for name, t in weights:
        if name.startswith("vision_tower."):
            name = "model.vision_tower.vision_model." + name[len("vision_tower.") :]
        else:
            name = "model." + name
        renamed.append((name, t))
    fresh.load_weights(renamed)
    for (name, param), (_, want) in zip(
        sorted(fresh.state_dict().items()), sorted(llava.tower.state_dict().items())
    ):
        assert torch.equal(param, want), name
    missing = [(k, v) for k, v in weights if "linear_2.weight" not in k]
    with pytest.raises(KeyError, match="linear_2"):
        llava.family.build_tower(llava.config, torch.float32).load_weights(missing)
    extra = weights + [("multi_modal_projector.linear_3.weight", torch.zeros(2))]
    with pytest.raises(KeyError, match="linear_3"):
        llava.family.build_tower(llava.config, torch.float32).load_weights(extra)


def test_tower_dtype(llava):
    tower = llava.family.build_tower(llava.config, torch.bfloat16)
    tower.load_weights(llava.tower_weights())
    assert {p.dtype for p in tower.parameters()} == {torch.bfloat16}
    mm = llava.family.process(llava.processor, "<image>", sample_images()[:1])
    with torch.no_grad():
        out = tower.encode([mm.items[0].data])[0].embeds
    assert out.dtype == torch.bfloat16 and out.shape[0] == mm.items[0].num_embeds


def test_pixtral_llava_delegates(tmp_path):
    """LLaVA with a Pixtral vision_config (Pixtral-12B): the processor, the processing and the
    tower are the Pixtral family's, reached through this family."""
    pixtral = pytest.importorskip("serverless_llm.engine.models.vision.pixtral")
    models = pytest.importorskip("tests.engine.vision_pixtral_models")
    if not hasattr(pixtral, "pixtral_llava_tower"):
        pytest.skip("the Pixtral family does not expose pixtral_llava_tower yet")
    ckpt = Checkpoint(
        models.save_tiny_pixtral_llava(str(tmp_path)), transformers.LlavaForConditionalGeneration
    )
    assert type(ckpt.processor).__name__ == "PixtralProcessor"
    assert type(ckpt.tower).__module__ == pixtral.__name__
    images = models.sample_images()[:2]
    placeholder = ckpt.family.image_placeholder(ckpt.processor)
    text = f"look {placeholder} and {placeholder}!"
    mm = ckpt.family.process(ckpt.processor, text, images)
    inputs = ckpt.processor(text=[text], images=images, return_tensors="pt")
    assert mm.token_ids == inputs["input_ids"][0].tolist()
    assert all(item.embed_mask is not None for item in mm.items)
    with torch.no_grad():
        ours = ckpt.tower.encode([item.data for item in mm.items])
    ids, embeds = ckpt.scattered(text, images)
    for feats, item in zip(ours, mm.items, strict=True):
        rows = embeds[item.offset : item.end][item.embed_mask]
        torch.testing.assert_close(feats.embeds, rows, atol=1e-4, rtol=1e-4)


def test_next_needs_square_tile_features(tmp_path):
    """transformers lays each LLaVA-NeXT tile's features out as a square grid: CLIP's class row
    kept ("full") does not fit, and the tower refuses the config."""
    config = transformers.AutoConfig.from_pretrained(save_tiny_llava_next(str(tmp_path)))
    config.vision_feature_select_strategy = "full"
    with pytest.raises(ValueError, match="vision_feature_select_strategy"):
        VISION_FAMILIES["LlavaNextForConditionalGeneration"].build_tower(config, torch.float32)


def test_processor_without_expansion_options(tmp_path):
    """A checkpoint whose processor config predates the placeholder expansion (no patch size):
    the expansion follows the model's config."""
    path = save_tiny_llava(str(tmp_path))
    config = transformers.AutoConfig.from_pretrained(path)
    family = VISION_FAMILIES["LlavaForConditionalGeneration"]
    want = family.make_processor(path, config)
    config_file = os.path.join(path, "processor_config.json")
    with open(config_file) as f:
        options = json.load(f)
    for key in ("patch_size", "vision_feature_select_strategy", "num_additional_image_tokens"):
        options.pop(key)
    with open(config_file, "w") as f:
        json.dump(options, f)
    processor = family.make_processor(path, config)
    images = sample_images()[:2]
    text = "<image> and <image>"
    assert (
        family.process(processor, text, images).token_ids
        == family.process(want, text, images).token_ids
    )

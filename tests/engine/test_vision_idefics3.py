"""Idefics3 and SmolVLM: the processor (built without torchvision), the prompt's expanded ids and
image spans, and the vision tower's features, against transformers on tiny random checkpoints;
a text-only prompt through the engine against transformers' generate."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

from serverless_llm.engine.models.vision import idefics3
from tests.engine.vision_idefics3_models import (
    IMAGE_TOKEN,
    sample_images,
    save_tiny_idefics3,
    save_tiny_smolvlm,
)

# case -> (family, builder, its options)
CASES = {
    "idefics3": ("idefics3", save_tiny_idefics3, {}),
    "idefics3_nosplit_scale3": (
        "idefics3",
        save_tiny_idefics3,
        dict(
            image_size=48, patch_size=8, scale_factor=3, longest_edge=96, do_image_splitting=False
        ),
    ),
    "smolvlm": ("smolvlm", save_tiny_smolvlm, {}),
    "smolvlm_large_tiles": ("smolvlm", save_tiny_smolvlm, dict(longest_edge=96)),
}
FAMILIES = {"idefics3": idefics3.Idefics3VisionFamily(), "smolvlm": idefics3.SmolVLMVisionFamily()}
ARCHS = {
    "idefics3": "Idefics3ForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    saved: dict[str, str] = {}

    def get(case: str) -> str:
        if case not in saved:
            _, builder, options = CASES[case]
            saved[case] = builder(str(tmp_path_factory.mktemp(case)), **options)
        return saved[case]

    return get


@pytest.fixture(scope="module")
def hf_models():
    loaded: dict[str, torch.nn.Module] = {}

    def get(path: str):
        if path not in loaded:
            model = transformers.AutoModelForImageTextToText.from_pretrained(
                path, dtype=torch.float32
            )
            loaded[path] = model.eval()
        return loaded[path]

    return get


def _setup(models, case):
    family_name = CASES[case][0]
    path = models(case)
    config = transformers.AutoConfig.from_pretrained(path)
    family = FAMILIES[family_name]
    return family_name, path, config, family, family.make_processor(path, config)


def _reference_ids(family_name, path, processor, text, images, add_special_tokens):
    """transformers' expanded ids: Idefics3Processor itself; for SmolVLM (whose processor class
    needs torchvision and num2words here) transformers' own SmolVLM image prompt string for the
    rows and columns its image processor reports, tokenized."""
    if family_name == "idefics3":
        ref = transformers.AutoProcessor.from_pretrained(path)
        assert type(ref) is transformers.Idefics3Processor
        kw = dict(images=[images]) if images else {}
        out = ref(text=[text], add_special_tokens=add_special_tokens, **kw)
        return out["input_ids"][0]
    parts = text.split(IMAGE_TOKEN)
    expanded = parts[0]
    for image, rest in zip(images, parts[1:]):
        info = processor.image_processor(images=[[image]], return_row_col_info=True)
        expanded += get_image_prompt_string(
            info["rows"][0][0],
            info["cols"][0][0],
            processor.image_seq_len,
            fake_token_around_image="<fake_token_around_image>",
            image_token=IMAGE_TOKEN,
            global_image_token="<global-img>",
        )
        expanded += rest
    return processor.tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]


PROMPTS = [
    ("What is this? No image here.", []),
    ("User:<image>Describe it.<end_of_utterance>\nAssistant:", [1]),
    ("A <image> then <image> and done", [0, 2]),
    ("<image><image><image>", [4, 3, 1]),
]


@pytest.mark.parametrize("case", list(CASES))
def test_processor_without_torchvision(models, case):
    family_name, _, config, family, processor = _setup(models, case)
    assert "Pil" in type(processor.image_processor).__name__
    assert family.image_placeholder(processor) == IMAGE_TOKEN
    vc = config.vision_config
    assert (
        processor.image_seq_len == (vc.image_size // vc.patch_size) ** 2 // config.scale_factor**2
    )
    assert processor.chat_template
    if family_name == "smolvlm":
        assert isinstance(processor, transformers.SmolVLMProcessor)
    else:
        assert isinstance(processor, transformers.Idefics3Processor)
    rendered = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
        add_generation_prompt=True,
    )
    assert rendered.count(IMAGE_TOKEN) == 1


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_process_ids_and_spans(models, case, add_special_tokens):
    family_name, path, _, family, processor = _setup(models, case)
    pool = sample_images()
    image_id = processor.image_token_id
    for text, which in PROMPTS:
        images = [pool[i] for i in which]
        mm = family.process(processor, text, images, add_special_tokens=add_special_tokens)
        want = _reference_ids(family_name, path, processor, text, images, add_special_tokens)
        assert mm.token_ids == list(want), text
        ids = torch.tensor(mm.token_ids)
        assert len(mm.items) == len(images)
        # the items' fed rows are exactly the image tokens, in order, spans disjoint
        fed = torch.zeros(len(ids), dtype=torch.bool)
        last_end = 0
        for item in mm.items:
            assert item.offset >= last_end
            last_end = item.end
            assert item.embed_mask.shape == (item.length,)
            assert bool(item.embed_mask[0]) and bool(item.embed_mask[-1])
            assert torch.equal(item.embed_mask, ids[item.offset : item.end] == image_id)
            fed[item.offset : item.end] |= item.embed_mask
            frames = item.data["pixel_values"].shape[0]
            assert item.data["pixel_attention_mask"].shape[0] == frames
            assert item.num_embeds == frames * processor.image_seq_len
        assert torch.equal(fed, ids == image_id)


@pytest.mark.parametrize("case", ["idefics3", "smolvlm"])
def test_frames_and_tile_tags(models, case):
    """The 96 x 48 image is two tiles side by side plus the global frame: the span runs from
    the first tile's image tokens to the global frame's, across the tags and newlines."""
    _, _, _, family, processor = _setup(models, case)
    image = sample_images()[1]
    mm = family.process(processor, "x<image>y", [image])
    (item,) = mm.items
    assert item.data["pixel_values"].shape[0] == 3
    tokens = processor.tokenizer.convert_ids_to_tokens(mm.token_ids[item.offset : item.end])
    n = processor.image_seq_len
    assert tokens[:n] == [IMAGE_TOKEN] * n
    assert tokens[-n:] == [IMAGE_TOKEN] * n
    assert "<row_1_col_2>" in tokens and "<global-img>" in tokens
    assert mm.token_ids[item.offset - 1] == processor.tokenizer.convert_tokens_to_ids(
        "<row_1_col_1>"
    )


@pytest.mark.parametrize("case", ["idefics3", "smolvlm"])
def test_hashes(models, case):
    _, _, _, family, processor = _setup(models, case)
    pool = sample_images()
    a = family.process(processor, "<image> and <image>", [pool[0], pool[2]])
    b = family.process(processor, "other text <image>", [pool[2]])
    c = family.process(processor, "<image>", [sample_images(seed=1)[2]])
    assert a.items[1].hash == b.items[0].hash
    assert a.items[0].hash != a.items[1].hash
    assert b.items[0].hash != c.items[0].hash


@pytest.mark.parametrize("case", ["idefics3", "smolvlm"])
def test_placeholder_mismatch(models, case):
    _, _, _, family, processor = _setup(models, case)
    pool = sample_images()
    with pytest.raises(ValueError, match="placeholder"):
        family.process(processor, "<image> and <image>", [pool[0]])
    with pytest.raises(ValueError, match="placeholder"):
        family.process(processor, "no image", [pool[0]])
    with pytest.raises(ValueError, match="placeholder"):
        family.process(processor, "<image>", [])


def _tower(family, path, config):
    tower = family.build_tower(config, torch.float32)
    weights = load_file(f"{path}/model.safetensors")
    tower.load_weights((k, v) for k, v in weights.items() if k.startswith(family.tower_prefixes))
    return tower.eval(), weights


def _hf_features(model, processor, images):
    """transformers' features of each image alone (the model's get_image_features)."""
    feats = []
    for image in images:
        out = processor(text=[IMAGE_TOKEN], images=[[image]], return_tensors="pt")
        with torch.no_grad():
            got = model.model.get_image_features(
                out["pixel_values"], out["pixel_attention_mask"]
            ).pooler_output
        feats.append(got[0])
    return feats


@pytest.mark.parametrize("case", list(CASES))
def test_encode_equals_transformers(models, hf_models, case):
    _, path, config, family, processor = _setup(models, case)
    tower, _ = _tower(family, path, config)
    model = hf_models(path)
    images = sample_images()
    mm = family.process(processor, "".join(f"img {IMAGE_TOKEN} " for _ in images), images)
    got = tower.encode([item.data for item in mm.items])
    want = _hf_features(model, processor, images)
    assert len(got) == len(images)
    for item, g, w in zip(mm.items, got, want):
        assert g.embeds.shape == (item.num_embeds, config.text_config.hidden_size)
        torch.testing.assert_close(g.embeds, w, atol=1e-4, rtol=1e-4)
    # what the model scatters: its features in order into the prompt's image tokens
    ids = torch.tensor([mm.token_ids])
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        text = "".join(f"img {IMAGE_TOKEN} " for _ in images)
        out = processor(text=[text], images=[images], return_tensors="pt")
        feats = model.model.get_image_features(
            out["pixel_values"], out["pixel_attention_mask"]
        ).pooler_output
        merged = embeds.masked_scatter(
            (ids == config.image_token_id)[..., None], torch.cat(feats)[None]
        )[0]
    for item, g in zip(mm.items, got):
        rows = torch.arange(item.offset, item.end)[item.embed_mask]
        torch.testing.assert_close(merged[rows], g.embeds, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["idefics3", "smolvlm"])
def test_padding_frames_of_a_batch_do_not_leak(models, hf_models, case):
    """transformers pads a batch's samples to the most frames with all-zero frames and drops
    them before encoding; an item's data holds only its image's own frames."""
    _, path, config, family, processor = _setup(models, case)
    tower, _ = _tower(family, path, config)
    model = hf_models(path)
    pool = sample_images()
    out = processor(
        text=[f"a {IMAGE_TOKEN}{IMAGE_TOKEN}", f"b {IMAGE_TOKEN}"],
        images=[[pool[0], pool[1]], [pool[3]]],
        return_tensors="pt",
        padding=True,
    )
    assert out["pixel_values"].shape[1] == 8  # 5 + 3 frames; the second sample's 5 padded by 3
    with torch.no_grad():
        want = model.model.get_image_features(
            out["pixel_values"], out["pixel_attention_mask"]
        ).pooler_output
    a = family.process(processor, f"a {IMAGE_TOKEN}{IMAGE_TOKEN}", [pool[0], pool[1]])
    b = family.process(processor, f"b {IMAGE_TOKEN}", [pool[3]])
    got = tower.encode([item.data for item in a.items + b.items])
    torch.testing.assert_close(
        torch.cat([got[0].embeds, got[1].embeds]), want[0], atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(got[2].embeds, want[1], atol=1e-4, rtol=1e-4)


def test_partially_valid_frames(models, hf_models):
    """Frames padded inside (a pixel mask with a valid top-left region): position ids bucketed
    over the valid patches, padded keys left out, as transformers computes them."""
    _, path, config, family, _ = _setup(models, "idefics3")
    tower, _ = _tower(family, path, config)
    model = hf_models(path)
    torch.manual_seed(0)
    pixel_values = torch.randn(3, 3, 32, 32)
    mask = torch.zeros(3, 32, 32, dtype=torch.long)
    mask[0] = 1
    mask[1, :24, :16] = 1
    mask[2, :9, :30] = 1
    pixel_values = pixel_values * mask[:, None]
    items = [
        {"pixel_values": pixel_values[:1], "pixel_attention_mask": mask[:1]},
        {"pixel_values": pixel_values[1:], "pixel_attention_mask": mask[1:]},
    ]
    got = tower.encode(items)
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values[None], mask[None]).pooler_output[0]
    torch.testing.assert_close(torch.cat([g.embeds for g in got]), want, atol=1e-4, rtol=1e-4)


def test_encode_bfloat16(models):
    """A bfloat16 tower against transformers' model in bfloat16 (the features in the tower's
    dtype)."""
    _, path, config, family, processor = _setup(models, "idefics3")
    tower = family.build_tower(config, torch.bfloat16)
    weights = load_file(f"{path}/model.safetensors")
    tower.load_weights((k, v) for k, v in weights.items() if k.startswith(family.tower_prefixes))
    images = sample_images()[:3]
    mm = family.process(processor, IMAGE_TOKEN * len(images), images)
    got = torch.cat([g.embeds for g in tower.encode([item.data for item in mm.items])])
    assert got.dtype == torch.bfloat16
    model = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16)
    out = processor(text=[IMAGE_TOKEN * len(images)], images=[images], return_tensors="pt")
    with torch.no_grad():
        want = model.eval().model.get_image_features(
            out["pixel_values"], out["pixel_attention_mask"]
        )
    torch.testing.assert_close(got, torch.cat(want.pooler_output), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("case", ["idefics3", "smolvlm"])
def test_every_tower_weight_loaded(models, case):
    _, path, config, family, _ = _setup(models, case)
    tower, weights = _tower(family, path, config)
    tower_names = [k for k in weights if k.startswith(family.tower_prefixes)]
    assert len(tower_names) == len(list(tower.parameters()))
    assert not any(k.startswith(family.tower_prefixes) for k in weights if "text_model" in k)
    fresh = family.build_tower(config, torch.float32)
    with pytest.raises(KeyError, match="missing"):
        fresh.load_weights((k, weights[k]) for k in tower_names[1:])
    with pytest.raises(KeyError, match="unexpected"):
        fresh.load_weights(
            [(k, weights[k]) for k in tower_names]
            + [("model.connector.extra.weight", weights[tower_names[0]])]
        )
    # the older naming without the model. prefix loads too
    fresh.load_weights((k.removeprefix("model."), weights[k]) for k in tower_names)


def test_registered():
    from serverless_llm.engine.multimodal.registry import vision_family_of

    assert isinstance(vision_family_of([ARCHS["idefics3"]]), idefics3.Idefics3VisionFamily)
    assert isinstance(vision_family_of([ARCHS["smolvlm"]]), idefics3.SmolVLMVisionFamily)


def _hf_generate(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = [model.config.text_config.vocab_size + 1]
    config.pad_token_id = 0
    config.max_new_tokens = new_tokens
    config.do_sample = False
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("case", ["idefics3", "smolvlm"])
def test_text_only_greedy_equals_transformers(models, hf_models, case):
    from tests.engine.family_check import engine_greedy, family_prompts

    path = models(case)
    model = hf_models(path)
    prompts = family_prompts(300, lengths=(1, 7, 20, 45))
    got = engine_greedy(path, prompts, 24)
    for prompt, tokens in zip(prompts, got):
        assert tokens == _hf_generate(model, prompt, 24), f"prompt of {len(prompt)} tokens"

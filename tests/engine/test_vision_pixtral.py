"""The Pixtral vision family against transformers: Mistral3ForConditionalGeneration (Pixtral
encoder, Mistral 3's merging projector) and LlavaForConditionalGeneration with a Pixtral
vision_config (the functions llava.py delegates to): the processor without torchvision, the
expanded ids, each image's span, embed mask, data and hash, the tower's features against
transformers' `get_image_features` and against what the model writes into its decoder's input
embeddings, weight loading, the refusals, and the text decoder's greedy tokens through the
engine."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import transformers
from safetensors.torch import load_file

from serverless_llm.engine.models.vision import pixtral
from serverless_llm.engine.multimodal.registry import VISION_FAMILIES
from tests.engine.family_check import engine_greedy, family_prompts
from tests.engine.vision_pixtral_models import (
    BREAK_TOKEN,
    END_TOKEN,
    IMAGE_TOKEN,
    PIXTRAL_CHAT_TEMPLATE,
    sample_images,
    save_tiny_mistral3,
    save_tiny_pixtral_llava,
)

# name -> (builder, its variant, transformers class)
VARIANTS = {
    "mistral3": (save_tiny_mistral3, {}, transformers.Mistral3ForConditionalGeneration),
    "mistral3_layer_bias_silu": (
        save_tiny_mistral3,
        dict(
            vision_feature_layer=-2,
            multimodal_projector_bias=True,
            projector_hidden_act="silu",
            vision_act="silu",
            rope_theta=100.0,
        ),
        transformers.Mistral3ForConditionalGeneration,
    ),
    "mistral3_no_merge": (
        save_tiny_mistral3,
        dict(patch_size=8, spatial_merge_size=1),
        transformers.Mistral3ForConditionalGeneration,
    ),
    "llava_pixtral": (save_tiny_pixtral_llava, {}, transformers.LlavaForConditionalGeneration),
    "llava_pixtral_layers": (
        save_tiny_pixtral_llava,
        dict(vision_feature_layer=[0, -1], multimodal_projector_bias=False, vision_act="gelu"),
        transformers.LlavaForConditionalGeneration,
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    saved: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in saved:
            builder, variant, _ = VARIANTS[name]
            saved[name] = builder(str(tmp_path_factory.mktemp(name)), **variant)
        return saved[name]

    return get


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    loaded = {}

    def get(name: str):
        if name not in loaded:
            cls = VARIANTS[name][2]
            loaded[name] = cls.from_pretrained(checkpoints(name), dtype=torch.float32).eval()
        return loaded[name]

    return get


def _config(path):
    return transformers.AutoConfig.from_pretrained(path)


def _processor(path):
    return pixtral.pixtral_make_processor(path, _config(path))


def _tower(path):
    config = _config(path)
    if config.architectures[0] == "LlavaForConditionalGeneration":
        tower = pixtral.pixtral_llava_tower(config, torch.float32)
    else:
        tower = VISION_FAMILIES[config.architectures[0]].build_tower(config, torch.float32)
    weights = load_file(f"{path}/model.safetensors")
    tower.load_weights((k, v) for k, v in weights.items() if k.startswith(pixtral.TOWER_PREFIXES))
    return tower


def _prompt(n: int) -> str:
    return "[INST]Look at" + "".join(f" this {IMAGE_TOKEN} and" for _ in range(n)) + " tell[/INST]"


def test_registry_and_processor_without_torchvision(checkpoints):
    assert importlib.util.find_spec("torchvision") is None
    path = checkpoints("mistral3")
    family = VISION_FAMILIES["Mistral3ForConditionalGeneration"]
    assert isinstance(family, pixtral.Mistral3Family)
    for prefix in ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector."):
        assert prefix in family.tower_prefixes
    processor = family.make_processor(path, _config(path))
    assert type(processor).__name__ == "PixtralProcessor"
    assert type(processor.image_processor).__name__ == "PixtralImageProcessorPil"
    assert (processor.patch_size, processor.spatial_merge_size) == (4, 2)
    assert processor.chat_template == PIXTRAL_CHAT_TEMPLATE
    assert family.image_placeholder(processor) == IMAGE_TOKEN
    # the chat template writes the placeholder for an image part
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    rendered = processor.apply_chat_template(messages, tokenize=False)
    assert rendered.count(IMAGE_TOKEN) == 1


def test_processor_sizes_follow_the_model(checkpoints, tmp_path):
    """A processor whose files leave out the merge size (PixtralProcessor's default 1) is set
    to the model's."""
    import json
    import shutil

    src = checkpoints("mistral3")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    cfg_path = dst / "processor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("spatial_merge_size")
    cfg_path.write_text(json.dumps(cfg))
    processor = pixtral.pixtral_make_processor(str(dst), _config(str(dst)))
    assert (processor.patch_size, processor.spatial_merge_size) == (4, 2)


def _expected_run(processor, height: int, width: int) -> list[int]:
    """The tokens one image of this processed size stands for, written out independently."""
    unit = processor.patch_size * processor.spatial_merge_size
    tok = processor.tokenizer
    img, brk, end = (tok.convert_tokens_to_ids(t) for t in (IMAGE_TOKEN, BREAK_TOKEN, END_TOKEN))
    run = []
    for _ in range(height // unit):
        run += [img] * (width // unit) + [brk]
    run[-1] = end
    return run


@pytest.mark.parametrize("name", ["mistral3", "llava_pixtral"])
@pytest.mark.parametrize("n_images", [0, 1, 2, 3])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_process_ids_spans_and_masks(checkpoints, name, n_images, add_special_tokens):
    path = checkpoints(name)
    processor = _processor(path)
    images = sample_images()[1 : 1 + n_images]
    text = _prompt(n_images)
    mm = pixtral.pixtral_process(processor, text, images, add_special_tokens)
    want = processor(text=[text], images=images or None, add_special_tokens=add_special_tokens)[
        "input_ids"
    ][0]
    want = list(want.tolist() if hasattr(want, "tolist") else want)
    assert mm.token_ids == want
    assert len(mm.items) == n_images
    ids = torch.tensor(mm.token_ids)
    image_id = processor.image_token_id
    covered = torch.zeros(len(ids), dtype=torch.bool)
    # the ids independently: the text with each placeholder replaced by its run
    pieces = text.split(IMAGE_TOKEN)
    tok = processor.tokenizer
    expected = tok(pieces[0], add_special_tokens=False)["input_ids"]
    for item, piece in zip(mm.items, pieces[1:]):
        height, width = (int(v) for v in item.data["image_sizes"][0])
        assert tuple(item.data["pixel_values"].shape) == (1, 3, height, width)
        run = _expected_run(processor, height, width)
        assert item.length == len(run) and mm.token_ids[item.offset : item.end] == run
        expected += run + tok(piece, add_special_tokens=False)["input_ids"]
        mask = ids[item.offset : item.end] == image_id
        assert torch.equal(item.embed_mask, mask)
        unit = processor.patch_size * processor.spatial_merge_size
        assert item.num_embeds == (height // unit) * (width // unit)
        covered[item.offset : item.end] |= item.embed_mask
    bos = [tok.bos_token_id] if add_special_tokens else []
    assert mm.token_ids == bos + expected
    # the embed masks mark exactly the positions where the model writes image features
    assert torch.equal(covered, ids == image_id)
    assert mm.mrope_positions is None


def test_hash_is_the_image_content(checkpoints):
    processor = _processor(checkpoints("mistral3"))
    a, b, c = sample_images()[:3]
    alone = pixtral.pixtral_process(processor, _prompt(1), [c])
    # beside a larger image, c's pixels are padded in the processor's batch: not in its data
    beside = pixtral.pixtral_process(processor, _prompt(2), [a, c])
    assert alone.items[0].hash == beside.items[1].hash
    assert torch.equal(alone.items[0].data["pixel_values"], beside.items[1].data["pixel_values"])
    assert beside.items[0].hash != beside.items[1].hash
    other = pixtral.pixtral_process(processor, _prompt(1), [b])
    assert other.items[0].hash != alone.items[0].hash


@pytest.mark.parametrize("name", list(VARIANTS))
def test_encode_equals_transformers_features(checkpoints, hf_models, name):
    """Every sample image in one encode call (several sizes, two of one size) equals
    transformers' features of the image alone and of the processor's padded batch."""
    path = checkpoints(name)
    processor = _processor(path)
    images = sample_images() + sample_images(seed=1)[:1]  # two 64x64 images
    mm = pixtral.pixtral_process(processor, _prompt(len(images)), images)
    got = _tower(path).encode([item.data for item in mm.items])
    model = hf_models(name)
    batch = processor(text=[_prompt(len(images))], images=images, return_tensors="pt")
    with torch.no_grad():
        together = model.get_image_features(
            pixel_values=batch["pixel_values"], image_sizes=batch["image_sizes"]
        ).pooler_output
        for item, feats, ref_batched in zip(mm.items, got, together):
            ref = model.get_image_features(**item.data).pooler_output[0]
            assert feats.embeds.shape == (item.num_embeds, model.config.text_config.hidden_size)
            assert feats.embeds.dtype == torch.float32 and feats.deepstack is None
            torch.testing.assert_close(feats.embeds, ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(feats.embeds, ref_batched, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["mistral3", "llava_pixtral"])
def test_bfloat16_tower_equals_transformers_in_bfloat16(checkpoints, name):
    """Built in bfloat16, the tower's features are bfloat16 and agree with transformers' model
    run in bfloat16 (to a couple of bfloat16 steps of the largest feature)."""
    path = checkpoints(name)
    config = _config(path)
    if name.startswith("llava"):
        tower = pixtral.pixtral_llava_tower(config, torch.bfloat16)
    else:
        tower = VISION_FAMILIES[config.architectures[0]].build_tower(config, torch.bfloat16)
    weights = load_file(f"{path}/model.safetensors")
    tower.load_weights((k, v) for k, v in weights.items() if k.startswith(pixtral.TOWER_PREFIXES))
    assert {p.dtype for p in tower.parameters()} == {torch.bfloat16}
    images = sample_images()[:3]
    mm = pixtral.pixtral_process(_processor(path), _prompt(3), images)
    got = tower.encode([item.data for item in mm.items])
    model = VARIANTS[name][2].from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for item, feats in zip(mm.items, got):
            ref = model.get_image_features(**item.data).pooler_output[0]
            assert feats.embeds.dtype == torch.bfloat16
            err = (feats.embeds.float() - ref.float()).abs().max()
            assert err <= 0.02 * ref.float().abs().max(), err


@pytest.mark.parametrize("name", ["mistral3", "llava_pixtral"])
def test_features_land_where_the_model_writes_them(checkpoints, hf_models, name):
    """The decoder's input embeddings of transformers' forward equal the token embeddings with
    each image's features written at its span's embed-mask positions."""
    path = checkpoints(name)
    processor = _processor(path)
    images = sample_images()[2:4]
    mm = pixtral.pixtral_process(processor, _prompt(2), images)
    feats = _tower(path).encode([item.data for item in mm.items])
    model = hf_models(name)
    seen = {}

    def grab(module, args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"].detach().clone()

    handle = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    inputs = processor(text=[_prompt(2)], images=images, return_tensors="pt")
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    ids = torch.tensor(mm.token_ids)
    with torch.no_grad():
        want = model.get_input_embeddings()(ids).clone()
    for item, f in zip(mm.items, feats):
        positions = item.offset + torch.nonzero(item.embed_mask).flatten()
        want[positions] = f.embeds
    torch.testing.assert_close(seen["embeds"][0], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["mistral3", "llava_pixtral"])
def test_weights_load_by_both_namings(checkpoints, name):
    path = checkpoints(name)
    weights = load_file(f"{path}/model.safetensors")
    tower_names = [k for k in weights if k.startswith(pixtral.TOWER_PREFIXES)]
    # every tensor is the tower's or the decoder's
    rest = [k for k in weights if k not in tower_names]
    assert all(k.startswith(("language_model.", "model.language_model.", "lm_head.")) for k in rest)
    tower = _tower(path)
    assert len(tower_names) == len(dict(tower.named_parameters()))
    # transformers 5 names (model.vision_tower. ...) load the same
    tower.load_weights(("model." + k, weights[k]) for k in tower_names)
    with pytest.raises(KeyError, match="missing"):
        tower.load_weights((k, weights[k]) for k in tower_names[1:])
    extra = [(k, weights[k]) for k in tower_names] + [
        ("vision_tower.extra.weight", weights[tower_names[0]])
    ]
    with pytest.raises(KeyError, match="unexpected"):
        tower.load_weights(extra)


def test_placeholder_and_image_counts_must_match(checkpoints):
    processor = _processor(checkpoints("mistral3"))
    images = sample_images()[:2]
    with pytest.raises(ValueError, match="placeholder"):
        pixtral.pixtral_process(processor, _prompt(2), images[:1])
    with pytest.raises(ValueError, match="placeholder"):
        pixtral.pixtral_process(processor, _prompt(1), images)
    with pytest.raises(ValueError, match="placeholder"):
        pixtral.pixtral_process(processor, _prompt(1), [])


def test_refused_configs(checkpoints):
    config = _config(checkpoints("llava_pixtral"))
    config.vision_feature_select_strategy = "default"
    with pytest.raises(ValueError, match="full"):
        pixtral.pixtral_llava_tower(config, torch.float32)
    config = _config(checkpoints("mistral3"))
    config.vision_feature_layer = [-2, -1]
    with pytest.raises(ValueError, match="vision_feature_layer"):
        VISION_FAMILIES[config.architectures[0]].build_tower(config, torch.float32)


def test_mistral3_text_prompts_greedy_equal_transformers(checkpoints, hf_models):
    """The composite checkpoint's Mistral decoder through LLM(model=path): text-only prompts'
    greedy tokens equal the Mistral3ForConditionalGeneration's own."""
    path = checkpoints("mistral3")
    model = hf_models("mistral3")
    vocab = model.config.text_config.vocab_size
    prompts = family_prompts(vocab, lengths=(1, 5, 17, 40))
    got = engine_greedy(path, prompts, new_tokens=24)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = [vocab + 1]  # never stops early
    config.pad_token_id = 0
    config.max_new_tokens = 24
    config.do_sample = False
    with torch.no_grad():
        for prompt, tokens in zip(prompts, got):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            assert tokens == out[0, len(prompt) :].tolist(), f"prompt of {len(prompt)} tokens"

"""Gemma 3's vision family against transformers: the processor's ids and image spans, the tower's
features (`get_image_features`), its weight loading, pan-and-scan, the text decoder of the
composite checkpoint served as text, and the two transformers facts the engine's image path
relies on (where image features go relative to the embedding scale, and which tokens attend to
each other both ways)."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file

from serverless_llm.engine.models.vision import gemma3 as g3
from serverless_llm.engine.multimodal import vision_family_of
from tests.engine.family_check import engine_greedy, family_prompts
from tests.engine.vision_check import checkpoint_tower, saved_variants
from tests.engine.vision_gemma3_models import BOI, sample_images, save_tiny_gemma3

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VARIANTS = {
    "pool2": {},  # 8x8 patches pooled 2x2 to 16 soft tokens
    "pool4": dict(mm_tokens_per_image=4),  # pooled 4x4 to 4 soft tokens
    "nopool": dict(image_size=28, patch_size=7, mm_tokens_per_image=16, hidden_act="gelu"),
    "window8": dict(sliding_window=8),  # a sliding window shorter than an image's run
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return saved_variants(tmp_path_factory, save_tiny_gemma3, VARIANTS)


def family_and_config(path: str):
    config = transformers.AutoConfig.from_pretrained(path)
    family = vision_family_of(config.architectures)
    assert isinstance(family, g3.Gemma3Family)
    return family, config


def hf_model(path: str):
    return transformers.Gemma3ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32
    ).eval()


PROMPTS = [
    ("A text-only prompt.", 0),
    (f"Look: {BOI} what is it?", 1),
    (f"{BOI}{BOI}", 2),
    (f"First {BOI}\nthen {BOI} and {BOI}.", 3),
]


def test_processor_builds_without_torchvision(models, monkeypatch):
    path = models("pool2")
    family, config = family_and_config(path)
    processor = family.make_processor(path, config)
    assert isinstance(processor, transformers.Gemma3Processor)
    assert type(processor.image_processor).__name__ == "Gemma3ImageProcessorPil"
    assert family.image_placeholder(processor) == BOI
    assert processor.image_seq_length == config.mm_tokens_per_image
    assert processor.chat_template == transformers.AutoTokenizer.from_pretrained(path).chat_template

    # AutoProcessor failing (a fast image processor that needs torchvision) or the checkpoint
    # lacking its processor files: built from the PIL image processor and the tokenizer
    def fail(*args, **kwargs):
        raise ImportError("torchvision")

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", fail)
    built = family.make_processor(path, config)
    assert isinstance(built, transformers.Gemma3Processor)
    assert built.chat_template == processor.chat_template
    bare = path + "_bare"
    shutil.copytree(path, bare)
    os.remove(os.path.join(bare, "processor_config.json"))
    for p in (built, family.make_processor(bare, config)):
        images = sample_images()[:2]
        text = PROMPTS[2][0]
        assert (
            family.process(p, text, images).token_ids
            == family.process(processor, text, images).token_ids
        )


@pytest.mark.parametrize("name", ["pool2", "pool4"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_process_ids_and_spans_equal_the_processor(models, name, add_special_tokens):
    path = models(name)
    family, config = family_and_config(path)
    processor = family.make_processor(path, config)
    images = sample_images()
    for text, n in PROMPTS:
        mm = family.process(processor, text, images[:n], add_special_tokens=add_special_tokens)
        want = processor(
            text=[text],
            images=images[:n] or None,
            add_special_tokens=add_special_tokens,
            return_tensors="pt",
        )
        assert mm.token_ids == want["input_ids"][0].tolist()
        assert mm.mrope_positions is None
        assert len(mm.items) == n
        # the spans are exactly the image soft tokens, which are exactly transformers'
        # token_type_ids == 1 (the rows `masked_scatter` fills)
        ids = torch.tensor(mm.token_ids)
        covered = torch.zeros(len(ids), dtype=torch.bool)
        for i, item in enumerate(mm.items):
            assert item.embed_mask is None
            assert item.length == item.num_embeds == config.mm_tokens_per_image
            covered[item.offset : item.end] = True
            assert ids[item.offset - 1] == config.boi_token_id
            assert ids[item.end] == config.eoi_token_id
            assert torch.equal(item.data["pixel_values"], want["pixel_values"][i : i + 1])
        assert torch.equal(covered, ids == config.image_token_id)
        assert torch.equal(covered, want["token_type_ids"][0] == 1)


def test_hashes_follow_the_image(models):
    path = models("pool2")
    family, config = family_and_config(path)
    processor = family.make_processor(path, config)
    a, b, c = sample_images()[:3]
    one = family.process(processor, f"{BOI} x {BOI}", [a, b]).items
    two = family.process(processor, f"y {BOI}{BOI} z {BOI}", [b, a, c]).items
    assert one[0].hash == two[1].hash and one[1].hash == two[0].hash
    assert len({one[0].hash, one[1].hash, two[2].hash}) == 3


def test_placeholder_mismatch_is_a_value_error(models):
    path = models("pool2")
    family, config = family_and_config(path)
    processor = family.make_processor(path, config)
    images = sample_images()
    with pytest.raises(ValueError, match="placeholder"):
        family.process(processor, f"{BOI} and {BOI}", images[:1])
    with pytest.raises(ValueError, match="placeholder"):
        family.process(processor, "no image here", images[:1])
    with pytest.raises(ValueError, match="placeholder"):
        family.process(processor, f"{BOI}", [])


@pytest.mark.parametrize("name", ["pool2", "pool4", "nopool"])
def test_encode_equals_transformers_features(models, name):
    path = models(name)
    family, config = family_and_config(path)
    processor = family.make_processor(path, config)
    tower = checkpoint_tower(family, config, path)
    images = sample_images()
    mm = family.process(processor, " ".join([BOI] * len(images)), images)
    feats = tower.encode([item.data for item in mm.items])  # all images in one call
    model = hf_model(path)
    with torch.no_grad():
        for item, f in zip(mm.items, feats):
            want = model.get_image_features(item.data["pixel_values"]).pooler_output[0]
            assert f.embeds.shape == (item.num_embeds, config.text_config.hidden_size)
            assert f.deepstack is None
            torch.testing.assert_close(f.embeds, want, atol=1e-4, rtol=1e-4)


def test_tower_weights_all_loaded_and_checked(models):
    path = models("pool2")
    family, config = family_and_config(path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    tower_names = [k for k in weights if k.startswith(family.tower_prefixes)]
    # every tensor is the tower's or the text decoder's
    rest = [k for k in weights if k not in tower_names]
    assert rest and all(k.startswith(("language_model.", "lm_head.")) for k in rest)
    tower = family.build_tower(config, torch.float32)
    n_params = len(dict(tower.named_parameters()))
    assert len(tower_names) == n_params
    ref = checkpoint_tower(family, config, path)
    pixels = (
        family.process(family.make_processor(path, config), BOI, sample_images()[:1]).items[0].data
    )

    # the names of other layouts: Gemma 3's original checkpoints (`vision_tower.vision_model.`)
    # and a model's state dict (`model.` in front)
    for rename in (
        lambda k: k.replace("vision_tower.", "vision_tower.vision_model."),
        lambda k: "model." + k,
    ):
        other = family.build_tower(config, torch.float32)
        other.load_weights((rename(k), weights[k]) for k in tower_names)
        assert torch.equal(other.encode([pixels])[0].embeds, ref.encode([pixels])[0].embeds)

    # SigLIP's pooling head (a checkpoint saved with vision_use_head) is not Gemma 3's: skipped
    headed = family.build_tower(config, torch.float32)
    headed.load_weights(
        [(k, weights[k]) for k in tower_names] + [("vision_tower.head.probe", torch.zeros(1))]
    )
    with pytest.raises(KeyError, match="missing.*mm_input_projection_weight"):
        family.build_tower(config, torch.float32).load_weights(
            (k, weights[k]) for k in tower_names if "mm_input_projection" not in k
        )
    with pytest.raises(KeyError, match="unexpected.*vision_tower.extra"):
        family.build_tower(config, torch.float32).load_weights(
            [(k, weights[k]) for k in tower_names] + [("vision_tower.extra", torch.zeros(1))]
        )


def test_tower_in_bfloat16_returns_the_model_dtype(models):
    path = models("pool2")
    family, config = family_and_config(path)
    tower = checkpoint_tower(family, config, path, dtype=torch.bfloat16)
    mm = family.process(family.make_processor(path, config), BOI, sample_images()[:1])
    out = tower.encode([mm.items[0].data])[0].embeds
    assert out.dtype == torch.bfloat16
    ref = checkpoint_tower(family, config, path).encode([mm.items[0].data])[0].embeds
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.05)


def test_pan_and_scan_crops_are_images_of_their_own(models):
    path = models("pool2")
    family, config = family_and_config(path)
    settings = dict(pan_and_scan_min_crop_size=16, pan_and_scan_min_ratio_to_activate=1.2)
    processor = g3.enable_pan_and_scan(family.make_processor(path, config), **settings)
    images = sample_images()  # square (no crop), then 2 crops each: 2:1, 4:9, 5:4
    text = f"a {BOI} b {BOI} c {BOI} d {BOI}"
    mm = family.process(processor, text, images)
    want = family.make_processor(path, config)(
        text=[text], images=images, do_pan_and_scan=True, return_tensors="pt", **settings
    )
    assert mm.token_ids == want["input_ids"][0].tolist()
    assert len(mm.items) == want["pixel_values"].shape[0] == 4 + 2 + 2 + 2
    ids = torch.tensor(mm.token_ids)
    covered = torch.zeros(len(ids), dtype=torch.bool)
    for i, item in enumerate(mm.items):
        covered[item.offset : item.end] = True
        assert torch.equal(item.data["pixel_values"], want["pixel_values"][i : i + 1])
    assert torch.equal(covered, want["token_type_ids"][0] == 1)
    # features in prompt order, as transformers scatters them
    feats = checkpoint_tower(family, config, path).encode([item.data for item in mm.items])
    with torch.no_grad():
        ref = hf_model(path).get_image_features(want["pixel_values"]).pooler_output
    torch.testing.assert_close(torch.stack([f.embeds for f in feats]), ref, atol=1e-4, rtol=1e-4)
    # the default processor does not pan and scan
    plain = family.process(family.make_processor(path, config), text, images)
    assert len(plain.items) == 4


def hf_text_greedy(path: str, prompts, new_tokens: int) -> list[list[int]]:
    model = hf_model(path)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = [10**6]  # never stops early
    config.pad_token_id = 0
    config.max_new_tokens = new_tokens
    config.do_sample = False
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        out.append(seq[0, len(prompt) :].tolist())
    return out


@pytest.mark.parametrize("name", ["pool2", "window8"])
def test_text_decoder_of_the_composite_equals_transformers(models, name):
    path = models(name)
    config = transformers.AutoConfig.from_pretrained(path)
    # text ids only (no image tokens): the composite served as its Gemma 3 text decoder
    prompts = family_prompts(config.boi_token_id, lengths=(1, 7, 20, 45))
    got = engine_greedy(path, prompts, new_tokens=24)
    assert got == hf_text_greedy(path, prompts, 24)


def captured_language_model_inputs(model, **inputs):
    """What Gemma3ForConditionalGeneration hands its text decoder: inputs_embeds and the
    per-layer-kind attention masks."""
    seen = {}

    def hook(module, args, kwargs):
        seen.update(kwargs)

    handle = model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            logits = model(**inputs).logits
    finally:
        handle.remove()
    return seen, logits


def test_image_features_replace_the_scaled_text_embeddings(models):
    """transformers scales every token's embedding by sqrt(hidden) (in the model dtype), then
    writes the image features, unscaled, over the soft tokens' rows."""
    path = models("pool2")
    family, config = family_and_config(path)
    mm = family.process(family.make_processor(path, config), f"x {BOI} y", sample_images()[:1])
    model = hf_model(path)
    item = mm.items[0]
    ids = torch.tensor([mm.token_ids])
    seen, _ = captured_language_model_inputs(model, input_ids=ids, **item.data)
    embeds = seen["inputs_embeds"][0]
    table = model.model.language_model.embed_tokens.weight
    scale = config.text_config.hidden_size**0.5
    feats = checkpoint_tower(family, config, path).encode([item.data])[0].embeds
    torch.testing.assert_close(embeds[item.offset : item.end], feats, atol=1e-4, rtol=1e-4)
    text_rows = torch.ones(len(mm.token_ids), dtype=torch.bool)
    text_rows[item.offset : item.end] = False
    torch.testing.assert_close(embeds[text_rows], table[ids[0, text_rows]] * scale)


def reference_mask(n: int, blocks: list[tuple[int, int]], window: int | None) -> torch.Tensor:
    """The rule: causal, or both tokens in the same run of image soft tokens; on a sliding
    layer, and also kv > q - window (so a run's later tokens stay visible to its earlier ones
    however long the run, its earlier ones leave the window of its later ones)."""
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    block = torch.full((n,), -1)
    for i, (offset, length) in enumerate(blocks):
        block[offset : offset + length] = i
    allowed = (k <= q) | ((block[:, None] == block[None, :]) & (block[:, None] >= 0))
    if window is not None:
        allowed &= k > q - window
    return allowed[None, None]


@pytest.mark.parametrize("name", ["pool2", "window8"])
def test_bidirectional_rule_is_each_run_of_soft_tokens(models, name):
    """transformers' prefill mask with the processor's token_type_ids equals the rule above built
    from our spans alone; without token_type_ids it is causal and the logits differ."""
    path = models(name)
    family, config = family_and_config(path)
    processor = family.make_processor(path, config)
    text = f"Two: {BOI} and {BOI} done"
    images = sample_images()[:2]
    mm = family.process(processor, text, images)
    out = processor(text=[text], images=images, return_tensors="pt")
    model = hf_model(path)
    inputs = dict(input_ids=out["input_ids"], pixel_values=out["pixel_values"])
    seen, want = captured_language_model_inputs(
        model, token_type_ids=out["token_type_ids"], **inputs
    )
    n = len(mm.token_ids)
    blocks = [(item.offset, item.length) for item in mm.items]
    masks = {
        "full_attention": reference_mask(n, blocks, None),
        "sliding_attention": reference_mask(n, blocks, config.text_config.sliding_window),
    }
    with torch.no_grad():
        got = model.model.language_model(
            inputs_embeds=seen["inputs_embeds"], attention_mask=masks
        ).last_hidden_state
        got = model.lm_head(got)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    _, causal = captured_language_model_inputs(model, **inputs)
    assert not torch.allclose(causal, want, atol=1e-3)

"""Gemma 4's vision family against transformers: the processor (built without torchvision), its
ids and image spans, the tower's features (`get_image_features`) for several tower variants,
its weight loading; and the transformers facts the engine's image path relies on: where the
image features go (after the embedding scale), what the per-layer inputs of the image rows are
(the pad token's per-layer embedding mixed with the features' projection: the decoder's
`per_layer_image_id`), and which tokens attend to each other both ways (only with
`use_bidirectional_attention: "vision"`, and then on the sliding layers only: the engine's key
limits on the sliding layers' cache groups alone). End to end: chunked prefill cutting through
the images equals one-shot prefill (transformers' tokens: test_vision_engine.py's "gemma4"); a
"vision" checkpoint's batched greedy tokens equal transformers', chunked or not."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

from serverless_llm.engine.errors import InvalidRequestError
from serverless_llm.engine.kernels.paged_attention import attention_mask
from serverless_llm.engine.loader.multimodal import text_part
from serverless_llm.engine.models import decoder as decoder_module
from serverless_llm.engine.models import describe_model
from serverless_llm.engine.models.vision import gemma4 as g4
from serverless_llm.engine.multimodal import vision_family_of
from tests.engine.vision_check import (
    checkpoint_tower,
    engine_greedy,
    hf_vision_greedy,
    make_llm,
    saved_variants,
    vision_prompts,
)
from tests.engine.vision_gemma4_models import (
    AUDIO_TOKEN,
    BOI,
    EOI,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    build_gemma4_tokenizer,
    gemma4_config,
    sample_images,
    save_tiny_gemma4,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VARIANTS = {
    "base": {},  # pooled 2x2, standardized soft tokens, per-layer inputs in the decoder
    "clipped": dict(use_clipped_linears=True),  # every tower linear clamped in and out
    "gqa": dict(vision_kv_heads=2, standardize=False),  # fewer key heads, no standardization
    "pool3": dict(pooling_kernel_size=3, vision_layers=1),  # the real models' 3x3 pooling
    "bidirectional": dict(bidirectional="vision"),  # the 26B / 31B models' image attention
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return saved_variants(tmp_path_factory, save_tiny_gemma4, VARIANTS)


def family_and_config(path: str):
    config = transformers.AutoConfig.from_pretrained(path)
    family = vision_family_of(config.architectures)
    assert isinstance(family, g4.Gemma4Family)
    return family, config


def hf_model(path: str):
    return transformers.Gemma4ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32
    ).eval()


PROMPTS = [
    ("A text-only prompt.", 0),
    (f"Look: {IMAGE_TOKEN} what is it?", 1),
    (f"{IMAGE_TOKEN}{IMAGE_TOKEN}", 2),
    (f"First {IMAGE_TOKEN}\nthen {IMAGE_TOKEN} and {IMAGE_TOKEN}.", 3),
]


def test_processor_builds_without_torchvision(models):
    path = models("base")
    family, config = family_and_config(path)
    if importlib.util.find_spec("torchvision") is None:
        # Gemma4Processor's video processor needs torchvision: AutoProcessor cannot build it
        with pytest.raises(ImportError, match="Torchvision"):
            transformers.AutoProcessor.from_pretrained(path)
    processor = family.make_processor(path, config)
    assert isinstance(processor, transformers.Gemma4Processor)
    assert type(processor.image_processor).__name__ == "Gemma4ImageProcessorPil"
    assert not hasattr(processor, "video_processor")
    assert family.image_placeholder(processor) == IMAGE_TOKEN
    assert processor.image_token_id == config.image_token_id
    assert processor.video_token_id == config.video_token_id
    assert processor.image_processor.max_soft_tokens == 70
    assert processor.chat_template == transformers.AutoTokenizer.from_pretrained(path).chat_template
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    rendered = processor.apply_chat_template(messages, tokenize=False)
    assert rendered.count(IMAGE_TOKEN) == 1


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_process_ids_and_spans_equal_the_processor(models, add_special_tokens):
    path = models("base")
    family, config = family_and_config(path)
    processor = family.make_processor(path, config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    k2 = config.vision_config.pooling_kernel_size**2
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
        # the expansion, independently: each placeholder becomes BOI, the image's own number of
        # soft tokens (its patches over k^2, from the image processor alone), EOI
        counts = []
        if n:
            alone = processor.image_processor(images[:n])
            counts = list(alone["num_soft_tokens_per_image"])
        expanded = text
        for c in counts:
            expanded = expanded.replace(IMAGE_TOKEN, BOI + "\0" * c + EOI, 1)
        expanded = expanded.replace("\0", IMAGE_TOKEN)
        assert (
            mm.token_ids == tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]
        )
        # the spans are exactly the image soft tokens: transformers' mm_token_type_ids == 1
        # (the rows `masked_scatter` fills, and its blocks of bidirectional attention)
        ids = torch.tensor(mm.token_ids)
        covered = torch.zeros(len(ids), dtype=torch.bool)
        for i, item in enumerate(mm.items):
            assert item.embed_mask is None
            assert item.length == item.num_embeds == counts[i]
            covered[item.offset : item.end] = True
            assert ids[item.offset - 1] == config.boi_token_id
            assert ids[item.end] == config.eoi_token_id
            # the image's real patches (the processor's rows before its padding)
            patches = item.data["pixel_values"]
            assert patches.shape[0] == counts[i] * k2
            torch.testing.assert_close(patches, want["pixel_values"][i, : patches.shape[0]])
            positions = want["image_position_ids"][i]
            assert torch.equal(item.data["image_position_ids"], positions[: patches.shape[0]])
            assert (positions[patches.shape[0] :] == -1).all()
        assert torch.equal(covered, ids == config.image_token_id)
        assert torch.equal(covered, torch.as_tensor(want["mm_token_type_ids"][0]) == 1)


def test_hashes_follow_the_image(models):
    path = models("base")
    family, config = family_and_config(path)
    processor = family.make_processor(path, config)
    a, b, c = sample_images()[:3]
    one = family.process(processor, f"{IMAGE_TOKEN} x {IMAGE_TOKEN}", [a, b]).items
    two = family.process(processor, f"y {IMAGE_TOKEN}{IMAGE_TOKEN} z {IMAGE_TOKEN}", [b, a, c])
    two = two.items
    assert one[0].hash == two[1].hash and one[1].hash == two[0].hash
    assert len({one[0].hash, one[1].hash, two[2].hash}) == 3


def test_placeholder_mismatch_and_other_media_are_value_errors(models):
    path = models("base")
    family, config = family_and_config(path)
    processor = family.make_processor(path, config)
    images = sample_images()
    with pytest.raises(ValueError, match="placeholder"):
        family.process(processor, f"{IMAGE_TOKEN} and {IMAGE_TOKEN}", images[:1])
    with pytest.raises(ValueError, match="placeholder"):
        family.process(processor, "no image here", images[:1])
    with pytest.raises(ValueError, match="placeholder"):
        family.process(processor, IMAGE_TOKEN, [])
    for token in (VIDEO_TOKEN, AUDIO_TOKEN):
        with pytest.raises(ValueError, match="only images"):
            family.process(processor, f"{IMAGE_TOKEN} {token}", images[:1])


@pytest.mark.parametrize("name", ["base", "clipped", "gqa", "pool3"])
def test_encode_equals_transformers_features(models, name):
    path = models(name)
    family, config = family_and_config(path)
    processor = family.make_processor(path, config)
    tower = checkpoint_tower(family, config, path)
    images = sample_images()
    text = " ".join([IMAGE_TOKEN] * len(images))
    mm = family.process(processor, text, images)
    feats = tower.encode([item.data for item in mm.items])  # all images in one call
    model = hf_model(path)
    out = processor(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        want = model.get_image_features(
            out["pixel_values"], out["image_position_ids"]
        ).pooler_output
    assert len(want) == len(feats) == len(images)
    for item, f, w in zip(mm.items, feats, want):
        assert f.embeds.shape == (item.num_embeds, config.text_config.hidden_size)
        assert f.deepstack is None
        torch.testing.assert_close(f.embeds, w, atol=1e-4, rtol=1e-4)
    # one image alone gives the same rows as among others
    alone = tower.encode([mm.items[1].data])[0].embeds
    torch.testing.assert_close(alone, feats[1].embeds, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["base", "clipped"])
def test_tower_weights_all_loaded_and_checked(models, name):
    path = models(name)
    family, config = family_and_config(path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    tower_names = [k for k in weights if k.startswith(family.tower_prefixes)]
    # every tensor is the tower's or the text decoder's (no audio tower in these)
    rest = [k for k in weights if k not in tower_names]
    assert rest and all(k.startswith("model.language_model.") for k in rest)
    tower = family.build_tower(config, torch.float32)
    state = tower.state_dict()  # parameters, the clamp bounds and the standardization
    assert len(tower_names) == len(state)
    ref = checkpoint_tower(family, config, path)
    processor = family.make_processor(path, config)
    data = family.process(processor, IMAGE_TOKEN, sample_images()[:1]).items[0].data
    # a bare Gemma4Model's state dict (no `model.` in front)
    other = family.build_tower(config, torch.float32)
    other.load_weights((k.removeprefix("model."), weights[k]) for k in tower_names)
    assert torch.equal(other.encode([data])[0].embeds, ref.encode([data])[0].embeds)
    with pytest.raises(KeyError, match="missing.*embedding_projection"):
        family.build_tower(config, torch.float32).load_weights(
            (k, weights[k]) for k in tower_names if "embedding_projection" not in k
        )
    with pytest.raises(KeyError, match="unexpected.*vision_tower.extra"):
        family.build_tower(config, torch.float32).load_weights(
            [(k, weights[k]) for k in tower_names] + [("model.vision_tower.extra", torch.zeros(1))]
        )
    with pytest.raises(ValueError, match="shape"):
        family.build_tower(config, torch.float32).load_weights(
            (k, weights[k][:1] if "input_proj" in k else weights[k]) for k in tower_names
        )


def test_tower_in_bfloat16_returns_the_model_dtype(models):
    path = models("base")
    family, config = family_and_config(path)
    tower = checkpoint_tower(family, config, path, dtype=torch.bfloat16)
    mm = family.process(family.make_processor(path, config), IMAGE_TOKEN, sample_images()[:1])
    out = tower.encode([mm.items[0].data])[0].embeds
    assert out.dtype == torch.bfloat16
    ref = checkpoint_tower(family, config, path).encode([mm.items[0].data])[0].embeds
    torch.testing.assert_close(out.float(), ref, atol=0.15, rtol=0.05)


def language_model_inputs(model, **inputs):
    """What Gemma4Model hands its text decoder (inputs_embeds, per_layer_inputs, the masks)."""
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
    """transformers scales every token's embedding by sqrt(hidden), then writes the image
    features, unscaled, over the soft tokens' rows."""
    path = models("base")
    family, config = family_and_config(path)
    processor = family.make_processor(path, config)
    mm = family.process(processor, f"x {IMAGE_TOKEN} y", sample_images()[:1])
    out = processor(text=[f"x {IMAGE_TOKEN} y"], images=sample_images()[:1], return_tensors="pt")
    model = hf_model(path)
    item = mm.items[0]
    seen, _ = language_model_inputs(model, **out)
    embeds = seen["inputs_embeds"][0]
    feats = checkpoint_tower(family, config, path).encode([item.data])[0].embeds
    torch.testing.assert_close(embeds[item.offset : item.end], feats, atol=1e-4, rtol=1e-4)
    ids = torch.tensor(mm.token_ids)
    text_rows = ids != config.image_token_id
    table = model.model.language_model.embed_tokens.weight
    scale = config.text_config.hidden_size**0.5
    torch.testing.assert_close(embeds[text_rows], table[ids[text_rows]] * scale)


def test_per_layer_inputs_of_image_rows_equal_transformers(models, monkeypatch):
    """At the rows taking image features transformers' per-layer inputs are the pad token's
    per-layer embedding (not the image token's) mixed with the projection of the features; the
    engine's decoder (`per_layer_image_id`) gives the same for every row of the prompt."""
    path = models("base")
    family, config = family_and_config(path)
    text_config = config.text_config
    spec = describe_model(text_part(config))  # the decoder the engine serves
    assert spec.per_layer_image_id == text_config.pad_token_id != config.image_token_id
    processor = family.make_processor(path, config)
    text, images = f"Two {IMAGE_TOKEN} and {IMAGE_TOKEN}.", sample_images()[:2]
    out = processor(text=[text], images=images, return_tensors="pt")
    model = hf_model(path)
    seen, _ = language_model_inputs(model, **out)
    lm = model.model.language_model
    ids = out["input_ids"][0]
    image_rows = ids == config.image_token_id
    own = seen["per_layer_inputs"][0]
    pad_own = lm.embed_tokens_per_layer(torch.tensor([text_config.pad_token_id]))
    torch.testing.assert_close(
        own[image_rows], pad_own.view(1, *own.shape[1:]).expand_as(own)[image_rows]
    )
    with torch.no_grad():
        want = lm.project_per_layer_inputs(seen["inputs_embeds"], seen["per_layer_inputs"])[0]

    got = []
    original = decoder_module.DecoderModel._per_layer_inputs

    def record(self, input_ids, x):
        result = original(self, input_ids, x)
        got.append(result.detach().clone())
        return result

    monkeypatch.setattr(decoder_module.DecoderModel, "_per_layer_inputs", record)
    llm = make_llm(path)
    engine_greedy(llm, [(text, images)], new_tokens=1)
    assert got[0].shape == want.shape  # the prompt's one prefill step
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=1e-4)


def _spans_limits(n: int, spans) -> list[int]:
    """The engine's key limits (model_runner): per token, the last key it sees, its own
    position outside an image span, the span's last inside."""
    limits = list(range(n))
    for offset, length in spans:
        limits[offset : offset + length] = [offset + length - 1] * length
    return limits


def test_bidirectional_images_are_the_sliding_layers_only():
    """With use_bidirectional_attention "vision", transformers' prefill masks are: the global
    layers causal, the sliding layers causal-or-same-run-of-image-tokens inside the window,
    which is the engine's key-limit rule (attention_mask with the spans' limits). Without it
    (E2B, E4B) both are causal."""
    tok = build_gemma4_tokenizer()
    window = 4
    for setting in ("vision", None):
        config = gemma4_config(tok, bidirectional=setting, sliding_window=window)
        config._attn_implementation = "eager"  # explicit masks
        config.text_config._attn_implementation = "eager"
        img, boi, eoi = config.image_token_id, config.boi_token_id, config.eoi_token_id
        ids = [5, 6, boi, *[img] * 6, eoi, 7, boi, img, img, eoi, 8]
        spans = [(3, 6), (12, 2)]
        n = len(ids)
        ids_t = torch.tensor([ids])
        masks = transformers.Gemma4ForConditionalGeneration.create_masks_for_generate(
            config,
            torch.zeros(1, n, config.text_config.hidden_size),
            torch.ones(1, n, dtype=torch.long),
            None,
            torch.arange(n)[None],
            mm_token_type_ids=(ids_t == img).long(),
        )
        pos = torch.arange(n)
        limits = _spans_limits(n, spans) if setting == "vision" else None
        full = masks["full_attention"][0, 0] == 0
        sliding = masks["sliding_attention"][0, 0] == 0
        assert torch.equal(full, attention_mask(pos, n, None))
        assert torch.equal(sliding, attention_mask(pos, n, window, limits))
        if setting == "vision":  # the image's first token sees its last one on sliding layers
            assert sliding[3, 8] and not full[3, 8]


def test_bidirectional_checkpoint_batched_greedy_equals_transformers(models):
    """A "vision" checkpoint (the 26B / 31B models' image attention): its images' soft tokens
    attend both ways on the sliding layers (a window shorter than an image's run), causally on
    the global ones; batched greedy equals transformers', and so does a run of 80-token steps
    (never ending inside an image: whole images). Both ways on every layer would not."""
    path = models("bidirectional")
    family, config = family_and_config(path)
    assert family.bidirectional(config) == "sliding"
    prompts = vision_prompts(IMAGE_TOKEN, sample_images())
    want = hf_vision_greedy(path, prompts)
    llm = make_llm(path)
    assert llm.engine.scheduler.whole_images
    assert engine_greedy(llm, prompts) == want
    chunked = make_llm(path, max_num_batched_tokens=80, enable_prefix_caching=False)
    assert engine_greedy(chunked, prompts) == want
    # every layer both ways (Gemma 3's rule) is another model: the global layers matter
    everywhere = make_llm(path)
    everywhere.engine.runner._limited_groups = None
    assert engine_greedy(everywhere, prompts) != want


def test_bidirectional_checkpoint_with_one_cache_group_serves_text(models, caplog):
    """Sliding and global layers in one cache group (the hybrid cache disabled): the key
    limits cannot be the sliding layers' alone, so the images are refused, the text served."""
    path = models("bidirectional")
    llm = make_llm(path, disable_hybrid_kv_cache_manager=True)
    assert llm.engine.cache_layout.num_groups == 1
    assert llm.engine.inputs.images is None
    assert "serving it for text only" in caplog.text
    prompts = vision_prompts(IMAGE_TOKEN, sample_images())
    assert engine_greedy(llm, [prompts[2]], new_tokens=8)[0]
    with pytest.raises(InvalidRequestError, match="does not take images"):
        engine_greedy(llm, [prompts[0]], new_tokens=1)


def test_chunked_prefill_across_images_equals_one_shot(models):
    """Steps of 24 tokens cut through the images' spans (Gemma 4 is causal there: a chunk may
    end inside one), their per-layer inputs included; each image is encoded once."""
    path = models("base")
    prompts = vision_prompts(IMAGE_TOKEN, sample_images())
    whole = engine_greedy(make_llm(path), prompts)
    llm = make_llm(path, max_num_batched_tokens=24, enable_prefix_caching=False)
    assert engine_greedy(llm, prompts) == whole
    distinct = {id(img) for _, imgs in prompts for img in imgs}
    assert llm.engine.runner.encoder_cache.encoded == len(distinct)

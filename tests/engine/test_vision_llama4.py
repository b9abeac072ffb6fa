"""Llama 4's vision family against transformers: the image processor written here (transformers'
needs torchvision) against the tiling rules worked out by hand and against transformers' own
Llama4ImageProcessor code run with a stand-in for the three torchvision functions it calls;
the processor's ids, the prompt expansion and the image spans; the tower's features
(`get_image_features` + the projector, what transformers scatters over `<|patch|>`); weight
loading; hashes; placeholder mismatches; a checkpoint whose tower cannot run is served as text;
the engine's prefill chunks and prefix cache through tiled images."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from PIL import Image
from safetensors.torch import load_file
from transformers.image_utils import PILImageResampling, SizeDict

from serverless_llm.engine.models.vision import llama4 as l4
from serverless_llm.engine.models.vision.llama4_image import (
    Llama4ImageProcessorPil,
    best_canvas,
    canvas_grids,
    fit_without_distortion,
    resize_like_torchvision,
)
from serverless_llm.engine.multimodal import vision_family_of
from tests.engine.vision_check import checkpoint_tower, saved_variants
from tests.engine.vision_llama4_models import (
    IMAGE,
    IMAGE_END,
    IMAGE_START,
    PATCH,
    TILE_X,
    TILE_Y,
    llama4_config,
    llama4_tokenizer,
    sample_images,
    save_tiny_llama4,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VARIANTS = {
    "base": {},  # 56 px tiles of 7 px patches: 8x8 patches, 16 tokens a tile; up to 4 tiles
    # wider heads (4 of 16), another rotary base, 28 px tiles (4 tokens), up to 6 tiles
    "wide": dict(vision_hidden=64, vision_heads=4, rope_theta=500.0, tile=28, max_patches=6),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return saved_variants(tmp_path_factory, save_tiny_llama4, VARIANTS)


def family_and_config(path: str):
    config = transformers.AutoConfig.from_pretrained(path)
    family = vision_family_of(config.architectures)
    assert isinstance(family, l4.Llama4Family)
    return family, config


def processor_of(path: str):
    family, config = family_and_config(path)
    return family, config, family.make_processor(path, config)


def hf_model(path: str):
    return transformers.Llama4ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32
    ).eval()


def noise(w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), mode="RGB")


# --- the tiling rules, worked out by hand -------------------------------------------------------


def test_canvas_grids_in_transformers_order():
    # tile counts 4, 3, 2, 1, each by rows ascending, grouped by aspect ratio as first met:
    # 1/4: (1,4); 1: (2,2), (1,1); 4: (4,1); 1/3: (1,3); 3: (3,1); 1/2: (1,2); 2: (2,1)
    assert canvas_grids(4) == [(1, 4), (2, 2), (1, 1), (4, 1), (1, 3), (3, 1), (1, 2), (2, 1)]
    assert canvas_grids(1) == [(1, 1)]
    grids = canvas_grids(16)
    assert (
        len(grids)
        == len(set(grids))
        == sum(1 for n in range(1, 17) for r in range(1, n + 1) if n % r == 0)
    )
    assert all(r * c <= 16 for r, c in grids)


# (height, width) of the image -> the canvas (height, width) and the resized size, tiles of
# 56 px, at most 4 tiles
CANVAS_CASES = [
    # grows to one tile: every canvas takes >= 1.4x, 56x56 the least area among those
    ((40, 40), (56, 56), (56, 56)),
    # 1x2 fits at 7/6 (the least growth; 2x2 and 1x3 too, but larger); not grown: a side
    # only grows up to max(its length, 56), so it stays 48x96 and is padded
    ((48, 96), (56, 112), (48, 96)),
    # too large for any canvas: 2x2 shrinks it least (0.747); width to 112, height
    # floor(100 * 112 / 150) = 74
    ((100, 150), (112, 112), (74, 112)),
    ((80, 36), (112, 56), (80, 36)),  # 2x1 at 1.4 (the height's), kept, padded
    ((56, 70), (56, 112), (56, 70)),  # 1x2 at exactly 1
    ((56, 56), (56, 56), (56, 56)),  # every canvas takes it at >= 1: the smallest
    # 2x2 shrinks it least (min(112/300, 112/200) = 0.373; 4x1 only 0.28): height to 112,
    # width floor(200 * 112 / 300) = 74
    ((300, 200), (112, 112), (112, 74)),
    ((10, 300), (56, 224), (7, 224)),  # a strip: 1x4 (0.747), floor(10 * 224 / 300) = 7
]


@pytest.mark.parametrize("image_size,canvas,resized", CANVAS_CASES)
def test_canvas_and_fit_by_hand(image_size, canvas, resized):
    canvases = [(r * 56, c * 56) for r, c in canvas_grids(4)]
    assert best_canvas(image_size, canvases) == canvas
    assert fit_without_distortion(image_size, canvas, 56) == resized


def test_resize_to_max_canvas_grows_into_the_largest():
    canvases = [(r * 56, c * 56) for r, c in canvas_grids(4)]
    # 40x40: the largest growth without distortion is 2x2 (2.8x), filled
    assert best_canvas((40, 40), canvases, grow_most=True) == (112, 112)
    assert fit_without_distortion((40, 40), (112, 112), 56, grow_most=True) == (112, 112)
    # 40x60: 2x2 grows it most (min(112/40, 112/60) = 1.87; 1x2, 1x3, 1x4 only 1.4): the
    # width to 112, the height floor(40 * 112 / 60) = 74
    assert best_canvas((40, 60), canvases, grow_most=True) == (112, 112)
    assert fit_without_distortion((40, 60), (112, 112), 56, grow_most=True) == (74, 112)
    # 48x96: 7/6 is the most any canvas grows it (1x2, 1x3, 1x4, 2x2): the smallest, 1x2
    assert best_canvas((48, 96), canvases, grow_most=True) == (56, 112)


def expansion(grid: tuple[int, int], per_tile: int) -> str:
    """Llama 4's text for one image of `grid` (rows, cols) tiles, written from the rule."""
    rows, cols = grid
    text = IMAGE_START
    if rows * cols > 1:
        for _ in range(rows):
            text += TILE_X.join([PATCH * per_tile] * cols) + TILE_Y
    return text + IMAGE + PATCH * per_tile + IMAGE_END


def test_image_processor_tiles_by_hand(models):
    """The sample images' grids, tiles and global tile: the padding is -1 (black normalized),
    the global tile is the whole image squeezed to 56x56, tiles are cut row by row."""
    _, _, processor = processor_of(models("base"))
    ip = processor.image_processor
    images = sample_images()
    out = ip(images, return_tensors="pt")
    assert out["aspect_ratios"].tolist() == [[1, 1], [1, 2], [2, 2], [2, 1], [1, 2]]
    tiles = [1, 3, 5, 3, 3]
    assert out["pixel_values"].shape == (sum(tiles), 3, 56, 56)
    assert out["pixel_values"].dtype == torch.float32
    # bfloat16 numbers: casting to bfloat16 and back changes nothing
    pv = out["pixel_values"]
    assert torch.equal(pv.to(torch.bfloat16).float(), pv)
    # 96x48 on a 56x112 canvas, not resized: rows 48..55 are padding, the two tiles are its
    # left and right halves, then the global tile
    image = torch.from_numpy(np.array(images[1])).permute(2, 0, 1)
    norm = ((image.to(torch.bfloat16) * (1 / 255)) - 0.5) / 0.5
    first = 1
    torch.testing.assert_close(pv[first, :, :48, :], norm[:, :, :56].float(), atol=0, rtol=0)
    torch.testing.assert_close(pv[first + 1, :, :48, :40], norm[:, :, 56:].float(), atol=0, rtol=0)
    assert (pv[first, :, 48:] == -1).all() and (pv[first + 1, :, :, 40:] == -1).all()
    squeezed = resize_like_torchvision(image, (56, 56), "bilinear")
    glob = ((squeezed.to(torch.bfloat16) * (1 / 255)) - 0.5) / 0.5
    torch.testing.assert_close(pv[first + 2], glob.float(), atol=0, rtol=0)


def test_resize_follows_torchvisions_path():
    """Unchanged sizes are left alone; the uint8 interpolation and the float32 one rounded
    back (torchvision's two CPU paths) agree within one level; bilinear upscaling of a
    constant image is constant."""
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.integers(0, 256, (3, 30, 50), dtype=np.uint8))
    assert resize_like_torchvision(x, (30, 50), "bilinear") is x
    for size in ((17, 23), (56, 90)):
        native = F.interpolate(x[None], size=size, mode="bilinear", antialias=True)[0]
        float_path = F.interpolate(x[None].float(), size=size, mode="bilinear", antialias=True)
        ours = resize_like_torchvision(x, size, "bilinear")
        assert ours.dtype == torch.uint8 and ours.shape == (3, *size)
        assert (ours.int() - native.int()).abs().max() <= 1
        assert (ours.int() - float_path[0].round().int()).abs().max() <= 1
    flat = torch.full((3, 10, 10), 77, dtype=torch.uint8)
    assert (resize_like_torchvision(flat, (33, 21), "bilinear") == 77).all()


# --- against transformers' own image processor code ---------------------------------------------


@pytest.fixture
def transformers_llama4_image_processor(monkeypatch):
    """transformers' Llama4ImageProcessor module, imported with a stand-in for torchvision's
    `transforms.v2.functional` (resize: torchvision's tensor path as llama4_image writes it;
    pad: zeros right and bottom; normalize: (x - mean) / std in the image's dtype): everything
    else (canvas choice, sizes, padding amounts, bfloat16 rescale and normalize, tile order,
    the global tile) is transformers' own code."""
    import transformers.image_processing_backends as backends

    fn = types.ModuleType("torchvision.transforms.v2.functional")

    def resize(image, size, interpolation="bilinear", antialias=True):
        size = [int(s) for s in size]
        flat = image.reshape(-1, *image.shape[-3:])
        out = torch.stack([resize_like_torchvision(x, size, interpolation) for x in flat])
        return out.reshape(*image.shape[:-2], *size)

    def pad(image, padding, fill=0):
        left, top, right, bottom = (int(p) for p in padding)
        assert not any(fill if isinstance(fill, (list, tuple)) else [fill])
        return F.pad(image, (left, right, top, bottom), value=0)

    def normalize(image, mean, std, inplace=False):
        m = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
        s = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
        return image.sub(m).div_(s)

    class InterpolationMode:  # the names transformers compares against
        BILINEAR, BICUBIC, LANCZOS = "bilinear", "bicubic", "lanczos"

    fn.resize, fn.pad, fn.normalize = resize, pad, normalize
    fn.InterpolationMode = InterpolationMode
    tv = types.ModuleType("torchvision")
    tv.transforms = types.ModuleType("torchvision.transforms")
    tv.transforms.v2 = types.ModuleType("torchvision.transforms.v2")
    tv.transforms.v2.functional = fn
    for name, mod in (
        ("torchvision", tv),
        ("torchvision.transforms", tv.transforms),
        ("torchvision.transforms.v2", tv.transforms.v2),
        ("torchvision.transforms.v2.functional", fn),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(backends, "tvF", fn, raising=False)
    modes = {PILImageResampling.BILINEAR: "bilinear", PILImageResampling.BICUBIC: "bicubic"}
    monkeypatch.setattr(backends, "pil_torch_interpolation_mapping", modes, raising=False)
    path = os.path.join(
        os.path.dirname(transformers.__file__), "models", "llama4", "image_processing_llama4.py"
    )
    name = "transformers.models.llama4._image_processing_llama4_under_test"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_geometry_equals_transformers_functions(transformers_llama4_image_processor):
    tm = transformers_llama4_image_processor
    for max_patches in (1, 4, 6, 16):
        for side in (28, 336):
            want = tm.find_supported_resolutions(max_patches, SizeDict(height=side, width=side))
            tm.find_supported_resolutions.cache_clear()
            assert [(r * side, c * side) for r, c in canvas_grids(max_patches)] == [
                tuple(x) for x in want
            ]
    rng = np.random.default_rng(0)
    canvases = [(r * 56, c * 56) for r, c in canvas_grids(6)]
    table = torch.tensor(canvases)
    for _ in range(400):
        h, w = (int(v) for v in rng.integers(1, 600, 2))
        for grow in (False, True):
            want = tm.get_best_fit((h, w), table, resize_to_max_canvas=grow)
            assert best_canvas((h, w), canvases, grow) == tuple(int(v) for v in want)


@pytest.mark.parametrize(
    "settings",
    [
        dict(size=56, max_patches=4),
        dict(size=28, max_patches=6),
        dict(size=28, max_patches=5, resize_to_max_canvas=True),
        dict(size=56, max_patches=4, resample=PILImageResampling.BICUBIC),
    ],
    ids=["56px-4", "28px-6", "max-canvas", "bicubic"],
)
def test_image_processor_equals_transformers(transformers_llama4_image_processor, settings):
    """Images of many sizes and aspect ratios (exact multiples of the tile among them, where
    float32 and float64 scales could floor differently), alone and batched: the same pixel
    values bit for bit (transformers' bfloat16, ours the same numbers in float32) and grids."""
    settings = dict(settings)
    side = settings.pop("size")
    kw = dict(size={"height": side, "width": side}, **settings)
    theirs = transformers_llama4_image_processor.Llama4ImageProcessor(**kw)
    ours = Llama4ImageProcessorPil(**kw)
    rng = np.random.default_rng(side + settings["max_patches"])
    sizes = [(40, 40), (96, 48), (150, 100), (36, 80), (70, 56), (600, 300), (300, 600), (1, 1)]
    sizes += [(side, side), (3 * side, side), (2 * side + 1, 3 * side - 1), (7, 200)]
    sizes += [tuple(int(v) for v in rng.integers(1, 260, 2)) for _ in range(24)]
    images = [noise(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    for batch in ([im] for im in images):
        want, got = theirs(batch, return_tensors="pt"), ours(batch, return_tensors="pt")
        assert want["pixel_values"].dtype == torch.bfloat16
        assert torch.equal(want["aspect_ratios"], got["aspect_ratios"])
        assert torch.equal(want["pixel_values"].float(), got["pixel_values"])
    want, got = theirs(images, return_tensors="pt"), ours(images, return_tensors="pt")
    assert torch.equal(want["aspect_ratios"], got["aspect_ratios"])
    assert torch.equal(want["pixel_values"].float(), got["pixel_values"])


# --- the processor and the family's processing --------------------------------------------------


def test_processor_builds_without_torchvision(models, monkeypatch, tmp_path):
    path = models("base")
    family, config, processor = processor_of(path)
    assert isinstance(processor, transformers.Llama4Processor)
    assert isinstance(processor.image_processor, Llama4ImageProcessorPil)
    assert processor.image_processor.max_patches == 4
    assert processor.image_processor.size["height"] == 56
    assert processor.patch_size == 7 and processor.downsample_ratio == 4
    assert family.image_placeholder(processor) == IMAGE
    with open(os.path.join(path, "chat_template.jinja"), encoding="utf-8") as f:
        assert processor.chat_template == f.read()
    # the chat template writes an image part as the placeholder
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.count(IMAGE) == 1
    images = sample_images()[:1]
    assert family.process(processor, rendered, images, add_special_tokens=False).items

    # AutoProcessor fails here (the checkpoint names the torchvision image processor)
    with pytest.raises(ImportError):
        transformers.AutoProcessor.from_pretrained(path)

    # processor_config.json gone: the image processor's settings from preprocessor_config.json
    # and the patch size from the model
    moved = str(tmp_path / "preprocessor")
    shutil.copytree(path, moved)
    with open(os.path.join(moved, "processor_config.json"), encoding="utf-8") as f:
        saved = json.load(f)
    os.remove(os.path.join(moved, "processor_config.json"))
    with open(os.path.join(moved, "preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump(saved["image_processor"], f)
    other = family.make_processor(moved, config)
    text = f"a {IMAGE} b {IMAGE}"
    two = sample_images()[1:3]
    assert (
        family.process(other, text, two).token_ids == family.process(processor, text, two).token_ids
    )

    # no image processor settings at all: no processor (the engine serves text only)
    bare = str(tmp_path / "bare")
    shutil.copytree(path, bare)
    os.remove(os.path.join(bare, "processor_config.json"))
    with pytest.raises(OSError):
        family.make_processor(bare, config)


PROMPTS = [
    ("A text-only prompt.", 0),
    (f"Look: {IMAGE} what is it?", 1),
    (f"{IMAGE}{IMAGE}", 2),
    (f"First {IMAGE}\nthen {IMAGE} and {IMAGE}.", 3),
]


@pytest.mark.parametrize("name", ["base", "wide"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_process_ids_and_spans_equal_the_processor(models, name, add_special_tokens):
    path = models(name)
    family, config, processor = processor_of(path)
    images = sample_images()
    patch_id = config.image_token_id
    for text, n in PROMPTS:
        chosen = images[:n] if n != 3 else [images[2], images[0], images[3]]
        mm = family.process(processor, text, chosen, add_special_tokens=add_special_tokens)
        want = processor(
            text=[text],
            images=chosen or None,
            add_special_tokens=add_special_tokens,
            return_tensors="pt",
        )
        assert mm.token_ids == want["input_ids"][0].tolist()
        assert mm.mrope_positions is None
        assert len(mm.items) == n
        ids = torch.tensor(mm.token_ids)
        covered = torch.zeros(len(ids), dtype=torch.bool)
        row = 0
        for item in mm.items:
            mask = torch.ones(item.length, dtype=torch.bool)
            if item.embed_mask is not None:
                mask = item.embed_mask
            covered[item.offset : item.end] |= mask
            span = ids[item.offset : item.end]
            assert span[0] == patch_id and span[-1] == patch_id
            assert torch.equal(span == patch_id, mask)
            tiles = item.data["pixel_values"].shape[0]
            assert item.num_embeds == tiles * l4.tokens_per_tile(processor)
            assert torch.equal(item.data["pixel_values"], want["pixel_values"][row : row + tiles])
            row += tiles
        # the rows that take features are exactly transformers' image token positions
        assert torch.equal(covered, ids == patch_id)
        assert row == (0 if n == 0 else want["pixel_values"].shape[0])


def test_prompt_expansion_by_hand(models):
    """Each image's text, written from the rule with the grids worked out by hand."""
    path = models("base")
    family, _, processor = processor_of(path)
    images = sample_images()
    grids = [(1, 1), (1, 2), (2, 2), (2, 1), (1, 2)]
    text = "x " + " y ".join([IMAGE] * len(images)) + " z"
    expanded = "x " + " y ".join(expansion(g, 16) for g in grids) + " z"
    mm = family.process(processor, text, images)
    assert mm.token_ids == processor.tokenizer(expanded)["input_ids"]
    # one tile: <|image_start|><|image|> + 16 patches + <|image_end|>; its span is all patches
    assert mm.items[0].embed_mask is None and mm.items[0].length == 16
    # 2x2: 4 tiles and the global one; inside the span an x and a y separator per row of
    # tiles and the <|image|> before the global tile
    item = mm.items[2]
    assert item.num_embeds == 5 * 16
    assert item.length == 5 * 16 + 2 * 2 + 1


def test_hashes_follow_the_image(models):
    family, _, processor = processor_of(models("base"))
    a, b, c = sample_images()[:3]
    one = family.process(processor, f"{IMAGE} x {IMAGE}", [a, b]).items
    two = family.process(processor, f"y {IMAGE}{IMAGE} z {IMAGE}", [b, a, c]).items
    assert one[0].hash == two[1].hash and one[1].hash == two[0].hash
    assert len({one[0].hash, one[1].hash, two[2].hash}) == 3


def test_placeholder_mismatch_is_a_value_error(models):
    family, _, processor = processor_of(models("base"))
    images = sample_images()
    with pytest.raises(ValueError, match="placeholder"):
        family.process(processor, f"{IMAGE} and {IMAGE}", images[:1])
    with pytest.raises(ValueError, match="placeholder"):
        family.process(processor, "no image here", images[:1])
    with pytest.raises(ValueError, match="placeholder"):
        family.process(processor, f"{IMAGE}", [])
    # a patch token written in the text: transformers' count of image rows would not match
    with pytest.raises(ValueError, match="patch"):
        family.process(processor, f"{PATCH} {IMAGE}", images[:1])


# --- the tower --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["base", "wide"])
def test_encode_equals_transformers_features(models, name):
    path = models(name)
    family, config, processor = processor_of(path)
    tower = checkpoint_tower(family, config, path)
    images = sample_images()
    mm = family.process(processor, " ".join([IMAGE] * len(images)), images)
    feats = tower.encode([item.data for item in mm.items])  # all images in one call
    model = hf_model(path)
    with torch.no_grad():
        for item, f in zip(mm.items, feats):
            hidden = model.get_image_features(item.data["pixel_values"]).last_hidden_state
            want = model.multi_modal_projector(hidden.reshape(-1, hidden.shape[-1]))
            assert f.embeds.shape == (item.num_embeds, config.text_config.hidden_size)
            assert f.deepstack is None
            torch.testing.assert_close(f.embeds, want, atol=1e-4, rtol=1e-4)
        # and what the model writes over the patch tokens of a prompt with all of them
        ids = torch.tensor([mm.token_ids])
        pixels = torch.cat([item.data["pixel_values"] for item in mm.items])
        seen = {}
        hook = model.language_model.register_forward_pre_hook(
            lambda m, a, kw: seen.update(kw), with_kwargs=True
        )
        try:
            model(input_ids=ids, pixel_values=pixels)
        finally:
            hook.remove()
        embeds = seen["inputs_embeds"][0]
        for item, f in zip(mm.items, feats):
            rows = torch.arange(item.offset, item.end)
            if item.embed_mask is not None:
                rows = rows[item.embed_mask]
            torch.testing.assert_close(embeds[rows], f.embeds, atol=1e-4, rtol=1e-4)


def test_tower_in_bfloat16_equals_transformers_in_bfloat16(models):
    """In bfloat16 (Llama 4's dtype) against transformers' model in bfloat16 fed its own
    processor's bfloat16 pixels (ours cast to bfloat16: the same numbers): the rotary in
    float32 and cast back, as transformers does it."""
    path = models("base")
    family, config, processor = processor_of(path)
    tower = checkpoint_tower(family, config, path, dtype=torch.bfloat16)
    images = sample_images()[:3]
    mm = family.process(processor, " ".join([IMAGE] * 3), images)
    feats = tower.encode([item.data for item in mm.items])
    model = transformers.Llama4ForConditionalGeneration.from_pretrained(
        path, dtype=torch.bfloat16
    ).eval()
    with torch.no_grad():
        for item, f in zip(mm.items, feats):
            assert f.embeds.dtype == torch.bfloat16
            pixels = item.data["pixel_values"].to(torch.bfloat16)
            hidden = model.get_image_features(pixels).last_hidden_state
            want = model.multi_modal_projector(hidden.reshape(-1, hidden.shape[-1]))
            err = (f.embeds.float() - want.float()).abs().max()
            assert err <= 0.02 * want.float().abs().max(), err


def test_pixel_shuffle_and_rotary_equal_transformers(models):
    from transformers.models.llama4 import modeling_llama4 as ml

    config = transformers.AutoConfig.from_pretrained(models("base"))
    for side, width in ((8, 32), (4, 6), (16, 3)):
        x = torch.randn(3, side * side, width)
        assert torch.equal(l4.pixel_shuffle(x, 2), ml.pixel_shuffle(x, 0.5))
    ours = torch.polar(torch.ones(65, 8), l4.rotary_angles(config.vision_config))
    want = ml.Llama4VisionRotaryEmbedding._compute_freqs_ci(config.vision_config)[:, 0]
    torch.testing.assert_close(ours, want, atol=1e-6, rtol=1e-6)


def test_tower_weights_all_loaded_and_checked(models):
    path = models("base")
    family, config, processor = processor_of(path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    tower_names = [k for k in weights if k.startswith(family.tower_prefixes)]
    rest = [k for k in weights if k not in tower_names]
    assert rest and all(k.startswith("language_model.") for k in rest)
    tower = family.build_tower(config, torch.float32)
    assert len(tower_names) == len(dict(tower.named_parameters()))
    ref = checkpoint_tower(family, config, path)
    data = family.process(processor, IMAGE, sample_images()[1:2]).items[0].data
    # a wrapped state dict's names (`model.` in front)
    other = family.build_tower(config, torch.float32)
    other.load_weights(("model." + k, weights[k]) for k in tower_names)
    assert torch.equal(other.encode([data])[0].embeds, ref.encode([data])[0].embeds)
    with pytest.raises(KeyError, match="missing"):
        family.build_tower(config, torch.float32).load_weights(
            (k, weights[k]) for k in tower_names[1:]
        )
    with pytest.raises(KeyError, match="unexpected"):
        family.build_tower(config, torch.float32).load_weights(
            [*((k, weights[k]) for k in tower_names), ("vision_model.extra.weight", torch.ones(1))]
        )
    name = "vision_model.patch_embedding.linear.weight"
    with pytest.raises(ValueError, match="shape"):
        family.build_tower(config, torch.float32).load_weights([(name, torch.ones(2, 2))])


def test_a_tower_that_cannot_run_serves_text_only(tmp_path):
    """A composite whose vision widths do not chain (as transformers' own text-only tests
    write them): its tower still builds and loads, its processor is refused."""
    tokenizer = llama4_tokenizer()
    config = llama4_config(tokenizer)
    config.vision_config.intermediate_size = 64  # the adapter reads 128-wide shuffled patches
    family = l4.Llama4Family()
    tower = family.build_tower(config, torch.float32)
    assert tower.vision.vision_adapter.mlp.fc1.weight.shape == (48, 64)
    assert "intermediate_size" in l4.vision_config_problem(config)
    path = str(tmp_path / "broken")
    save_tiny_llama4(path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    raw["vision_config"]["intermediate_size"] = 64
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match="cannot run"):
        family.make_processor(path, transformers.AutoConfig.from_pretrained(path))


def test_engine_chunks_and_prefix_cache_through_tiled_images(models):
    """Prefill steps of 24 tokens cut through the images' spans (separators inside them) and
    through the 24-token attention chunks: the same tokens as one-shot prefill, each image
    encoded once; prefix caching reuses the blocks of a repeated prompt with the same tokens."""
    from tests.engine.vision_check import engine_greedy, make_llm, vision_prompts

    path = models("base")
    prompts = vision_prompts(IMAGE, sample_images())
    whole = engine_greedy(make_llm(path), prompts)
    llm = make_llm(path, max_num_batched_tokens=24, enable_prefix_caching=False)
    assert engine_greedy(llm, prompts) == whole
    distinct = {id(img) for _, imgs in prompts for img in imgs}
    assert llm.engine.runner.encoder_cache.encoded == len(distinct)
    llm = make_llm(path, enable_prefix_caching=True, block_size=8)
    assert engine_greedy(llm, prompts) == whole
    hits = llm.engine.block_pool.hits
    assert engine_greedy(llm, prompts) == whole
    assert llm.engine.block_pool.hits > hits


def test_scout_vision_widths_equal_transformers():
    """Llama 4 Scout's vision widths (336 px tiles of 14 px patches: a 24 x 24 grid; hidden
    1408 in 16 heads of 88, so 22 rotary pairs an axis; adapter 5632 -> 4096) with one encoder
    layer, random weights: one tile's features equal transformers'."""
    vision = dict(
        hidden_size=1408,
        num_hidden_layers=1,
        num_attention_heads=16,
        intermediate_size=5632,
        image_size=336,
        patch_size=14,
        projector_input_dim=4096,
        projector_output_dim=4096,
        vision_output_dim=4096,
        pixel_shuffle_ratio=0.5,
    )
    text = dict(
        hidden_size=64,
        intermediate_size=32,
        intermediate_size_mlp=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=64,
    )
    config = transformers.Llama4Config(vision_config=vision, text_config=text)
    assert l4.vision_config_problem(config) is None
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    family = l4.Llama4Family()
    tower = family.build_tower(config, torch.float32)
    tower.load_weights(
        (k, v) for k, v in model.state_dict().items() if k.startswith(family.tower_prefixes)
    )
    pixels = torch.randn(2, 3, 336, 336)
    with torch.no_grad():
        hidden = model.get_image_features(pixels).last_hidden_state
        want = model.multi_modal_projector(hidden).reshape(-1, 64)
        got = tower.encode([{"pixel_values": pixels}])[0].embeds
    assert got.shape == (2 * 144, 64)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

"""The Qwen2.5-VL, Qwen3-VL and Qwen3.5 (dense and MoE) vision families
(engine/models/vision/qwen_vl.py) against transformers: processor ids, image spans and M-RoPE
positions (`get_rope_index`), per-image data and hashes, the tower's features (and Qwen3-VL's
DeepStack features; Qwen3.5 has none) against what transformers' model writes over the image
tokens and adds to its decoder layers, the decoder's M-RoPE rotation (Qwen3.5: over the partial
rotary part), and the text decoders' descriptions (models/families_vl.py, Qwen3.5's in
models/families_linear.py) through the engine on text-only prompts."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.layers.rotary import apply_rotary
from serverless_llm.engine.loader.multimodal import text_part
from serverless_llm.engine.models.families import head_dim_of
from serverless_llm.engine.models.registry import describe_model
from serverless_llm.engine.models.vision import qwen_vl as qwen_vl_module
from serverless_llm.engine.models.vision.qwen_vl import mrope_positions
from serverless_llm.engine.multimodal import VISION_FAMILIES
from tests.engine.family_check import family_prompts
from tests.engine.vision_check import engine_greedy, hf_vision_greedy, make_llm, vision_prompts
from tests.engine.vision_qwen_vl_models import (
    QWEN_VL_CHAT_TEMPLATE,
    sample_images,
    save_tiny_qwen2_5_vl,
    save_tiny_qwen3_5_moe_vl,
    save_tiny_qwen3_5_vl,
    save_tiny_qwen3_vl,
)

# name -> (builder, its options, transformers' class)
VARIANTS = {
    "qwen2_5_vl": (save_tiny_qwen2_5_vl, {}, transformers.Qwen2_5_VLForConditionalGeneration),
    # one-cell windows, the full-attention layer last, tied embeddings
    "qwen2_5_vl_small_windows": (
        save_tiny_qwen2_5_vl,
        dict(window_size=28, fullatt_block_indexes=(2,), tie_word_embeddings=True),
        transformers.Qwen2_5_VLForConditionalGeneration,
    ),
    "qwen3_vl": (save_tiny_qwen3_vl, {}, transformers.Qwen3VLForConditionalGeneration),
    # DeepStack from the later layers, a 6 x 6 position grid (resampled down and up), exact GELU
    "qwen3_vl_late_deepstack": (
        save_tiny_qwen3_vl,
        dict(deepstack_visual_indexes=(1, 2), num_position_embeddings=36, hidden_act="gelu"),
        transformers.Qwen3VLForConditionalGeneration,
    ),
    # a hybrid decoder; half of each head rotates, interleaved sections [3, 3, 2]
    "qwen3_5": (save_tiny_qwen3_5_vl, {}, transformers.Qwen3_5ForConditionalGeneration),
    # MoE; a quarter of each head (4 frequencies), no sections in the config: transformers'
    # [11, 11, 10], cut at the 4 frequencies; attention layers first and last, tied embeddings
    "qwen3_5_moe": (
        save_tiny_qwen3_5_moe_vl,
        dict(
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            layer_types=("full_attention", "linear_attention", "full_attention"),
            tie_word_embeddings=True,
        ),
        transformers.Qwen3_5MoeForConditionalGeneration,
    ),
}


class Checkpoint:
    """A tiny checkpoint with its family, processor, tower and transformers model."""

    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self.path = path
        self.config = transformers.AutoConfig.from_pretrained(path)
        self.family = VISION_FAMILIES[self.config.architectures[0]]
        assert type(self.family).__module__ == qwen_vl_module.__name__
        self.processor = self.family.make_processor(path, self.config)
        self.weights = load_file(os.path.join(path, "model.safetensors"))
        self.tower = self.family.build_tower(self.config, torch.float32)
        self.tower.load_weights(self.tower_weights())
        self.model = VARIANTS[name][2].from_pretrained(path, dtype=torch.float32).eval()
        self.placeholder = self.family.image_placeholder(self.processor)

    def tower_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(k, v) for k, v in self.weights.items() if k.startswith(self.family.tower_prefixes)]

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    def prompt(self, template: str) -> str:
        return template.replace("<image>", self.placeholder)

    def run(self, text: str, images) -> dict:
        """What transformers' model hands its decoder for this prompt (input ids, embeddings,
        positions, DeepStack rows and mask), and each decoder layer's input and output."""
        inputs = self.processor(text=[text], images=images or None, return_tensors="pt")
        seen = {"inputs": inputs, "layer_in": [], "layer_out": []}
        lm = self.model.model.language_model

        def grab(module, args, kwargs):
            seen.update(kwargs)

        def layer_in(module, args, kwargs):
            seen["layer_in"].append((args[0] if args else kwargs["hidden_states"])[0].clone())

        def layer_out(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            seen["layer_out"].append(out[0].clone())

        hooks = [lm.register_forward_pre_hook(grab, with_kwargs=True)]
        for layer in lm.layers:
            hooks.append(layer.register_forward_pre_hook(layer_in, with_kwargs=True))
            hooks.append(layer.register_forward_hook(layer_out))
        hooks.append(lm.norm.register_forward_pre_hook(layer_in, with_kwargs=True))
        try:
            with torch.no_grad():
                self.model(**inputs)
        finally:
            for hook in hooks:
                hook.remove()
        return seen


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def ckpt(request, tmp_path_factory) -> Checkpoint:
    save, options, _ = VARIANTS[request.param]
    path = save(str(tmp_path_factory.mktemp(request.param)), **options)
    return Checkpoint(request.param, path)


PROMPTS = [
    ("Hello world!", 0),
    ("", 0),
    ("Describe <image> please.", 1),
    ("<image>", 1),
    ("<image>First, then the second <image>\nDone.", 2),
    ("Two at once <image><image> and text.", 2),
    ("a <image> b <image> c <image>", 3),
]


def rope_index(ckpt: Checkpoint, inputs) -> tuple[torch.Tensor, int]:
    pos, delta = ckpt.model.model.get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs.get("image_grid_thw"),
        attention_mask=inputs["attention_mask"],
    )
    return pos[:, 0], int(delta[0, 0])


def check_prompt(ckpt: Checkpoint, text: str, images, add_special_tokens: bool) -> None:
    mm = ckpt.family.process(ckpt.processor, text, images, add_special_tokens=add_special_tokens)
    inputs = ckpt.processor(
        text=[text],
        images=images or None,
        add_special_tokens=add_special_tokens,
        return_tensors="pt",
    )
    assert mm.token_ids == inputs["input_ids"][0].tolist()
    assert len(mm.items) == len(images)
    ids = torch.tensor(mm.token_ids, dtype=torch.long)
    covered = []
    row = 0
    for i, item in enumerate(mm.items):
        assert item.embed_mask is None
        assert bool((ids[item.offset : item.end] == ckpt.image_token_id).all())
        covered += list(range(item.offset, item.end))
        grid = inputs["image_grid_thw"][i]
        assert torch.equal(item.data["image_grid_thw"], grid.view(1, 3))
        patches = int(grid.prod())
        assert item.num_embeds == patches // ckpt.config.vision_config.spatial_merge_size**2
        assert torch.equal(item.data["pixel_values"], inputs["pixel_values"][row : row + patches])
        row += patches
    assert covered == (ids == ckpt.image_token_id).nonzero().flatten().tolist()
    assert covered == inputs["mm_token_type_ids"][0].nonzero().flatten().tolist()
    # M-RoPE: the three streams and the offset of generated tokens, as get_rope_index gives
    if not mm.token_ids:  # (which fails on an empty prompt)
        assert mm.mrope_positions.shape == (3, 0) and mm.mrope_delta == 0
        return
    want, delta = rope_index(ckpt, inputs)
    assert mm.mrope_positions.dtype == torch.long
    assert torch.equal(mm.mrope_positions, want)
    assert mm.mrope_delta == delta


def test_processor_builds_without_torchvision(ckpt):
    assert importlib.util.find_spec("torchvision") is None
    stock = getattr(transformers, ckpt.family.processor_class_name)
    assert isinstance(ckpt.processor, stock)
    assert type(ckpt.processor).__name__ == stock.__name__
    assert type(ckpt.processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert ckpt.processor.chat_template == QWEN_VL_CHAT_TEMPLATE
    assert ckpt.placeholder == "<|vision_start|><|image_pad|><|vision_end|>"
    rendered = ckpt.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}],
        add_generation_prompt=True,
    )
    assert rendered.count(ckpt.placeholder) == 1
    mm = ckpt.family.process(ckpt.processor, rendered, sample_images()[:1], False)
    assert len(mm.items) == 1


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_process_matches_processor(ckpt, add_special_tokens):
    images = sample_images()
    for template, n in PROMPTS:
        check_prompt(ckpt, ckpt.prompt(template), images[1 : 1 + n], add_special_tokens)
        check_prompt(ckpt, ckpt.prompt(template), images[::-1][:n], add_special_tokens)


def test_positions_are_what_the_decoder_gets(ckpt):
    """The positions transformers' forward hands its decoder (and its rope_deltas) are the ones
    process() gives, and generated tokens continue from max + 1."""
    images = sample_images()[:2]
    text = ckpt.prompt("x <image> y <image> z")
    mm = ckpt.family.process(ckpt.processor, text, images)
    seen = ckpt.run(text, images)
    got = seen["position_ids"]
    if got.shape[0] == 4:  # transformers' text positions first
        got = got[1:]
    assert torch.equal(got[:, 0], mm.mrope_positions)
    assert int(ckpt.model.model.rope_deltas[0, 0]) == mm.mrope_delta
    assert int(mm.mrope_positions.max()) + 1 == len(mm.token_ids) + mm.mrope_delta


def test_mrope_positions_by_hand():
    # 2 text tokens, a 1 x 4 x 6 patch grid (2 x 3 merged), 1 text token
    pos, delta = mrope_positions(9, [(2, (1, 4, 6))], merge_size=2)
    assert pos.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5],
        [0, 1, 2, 2, 2, 3, 3, 3, 5],
        [0, 1, 2, 3, 4, 2, 3, 4, 5],
    ]
    assert delta == 6 - 9
    pos, delta = mrope_positions(3, [], merge_size=2)
    assert pos.tolist() == [[0, 1, 2]] * 3 and delta == 0
    assert mrope_positions(0, [], 2)[0].shape == (3, 0)
    with pytest.raises(ValueError):
        mrope_positions(4, [(2, (1, 4, 6))], merge_size=2)


def test_image_data_and_hash(ckpt):
    a, b, c = sample_images()[:3]
    fam, proc = ckpt.family, ckpt.processor
    one = fam.process(proc, ckpt.prompt("x <image> y <image>"), [a, b])
    two = fam.process(proc, ckpt.prompt("other text <image>"), [b])
    three = fam.process(proc, ckpt.prompt("<image>"), [c])
    assert one.items[1].hash == two.items[0].hash
    assert len({one.items[0].hash, one.items[1].hash, three.items[0].hash}) == 3
    assert torch.equal(one.items[1].data["pixel_values"], two.items[0].data["pixel_values"])
    assert set(one.items[0].data) == {"pixel_values", "image_grid_thw"}


def test_mismatch_and_video_refused(ckpt):
    images = sample_images()[:2]
    fam, proc = ckpt.family, ckpt.processor
    with pytest.raises(ValueError, match="placeholder"):
        fam.process(proc, ckpt.prompt("one <image> only"), images)
    with pytest.raises(ValueError, match="placeholder"):
        fam.process(proc, ckpt.prompt("<image> <image>"), images[:1])
    with pytest.raises(ValueError, match="placeholder"):
        fam.process(proc, "no image here", images[:1])
    with pytest.raises(ValueError, match="video"):
        fam.process(proc, "a clip <|vision_start|><|video_pad|><|vision_end|>", [])


def test_encode_matches_transformers(ckpt):
    images = sample_images()
    text = ckpt.prompt("First <image> then <image> and <image><image> and <image>.")
    mm = ckpt.family.process(ckpt.processor, text, images)
    with torch.no_grad():
        ours = ckpt.tower.encode([item.data for item in mm.items])
    seen = ckpt.run(text, images)
    inputs = seen["inputs"]
    with torch.no_grad():
        ref = ckpt.model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    hidden = ckpt.config.text_config.hidden_size
    assert len(ours) == len(ref.pooler_output) == 5
    deepstack = getattr(ref, "deepstack_features", None)
    for i, (feats, want, item) in enumerate(zip(ours, ref.pooler_output, mm.items)):
        assert feats.embeds.shape == want.shape == (item.num_embeds, hidden)
        torch.testing.assert_close(feats.embeds, want, atol=1e-4, rtol=1e-4)
        if deepstack is None:
            assert feats.deepstack is None
        else:
            assert len(feats.deepstack) == len(deepstack)
            for got, layer in zip(feats.deepstack, deepstack):
                torch.testing.assert_close(got, layer[i], atol=1e-4, rtol=1e-4)
    # exactly the rows transformers writes over the image tokens
    embeds = seen["inputs_embeds"][0]
    for feats, item in zip(ours, mm.items):
        torch.testing.assert_close(
            feats.embeds, embeds[item.offset : item.end], atol=1e-4, rtol=1e-4
        )
    # one image alone gives what it gives in a batch
    with torch.no_grad():
        alone = ckpt.tower.encode([mm.items[2].data])[0]
    torch.testing.assert_close(alone.embeds, ours[2].embeds, atol=1e-5, rtol=1e-5)


def test_deepstack_is_added_after_decoder_layer_i(ckpt):
    """Qwen3-VL: the decoder's layer i + 1 (after the last layer, the final norm) takes layer
    i's output plus DeepStack feature i at the image positions, unchanged elsewhere. Qwen3.5:
    no DeepStack, every layer takes the one before's output unchanged."""
    if not ckpt.name.startswith("qwen3"):
        pytest.skip("DeepStack is Qwen3-VL's")
    images = sample_images()[:2]
    text = ckpt.prompt("a <image> b <image> c")
    mm = ckpt.family.process(ckpt.processor, text, images)
    with torch.no_grad():
        ours = ckpt.tower.encode([item.data for item in mm.items])
    seen = ckpt.run(text, images)
    layers = ckpt.config.text_config.num_hidden_layers
    inputs, outputs = seen["layer_in"], seen["layer_out"]
    assert len(inputs) == layers + 1 and len(outputs) == layers
    if ckpt.name.startswith("qwen3_5"):
        assert all(feats.deepstack is None for feats in ours)
    for i in range(layers):
        added = inputs[i + 1] - outputs[i]
        want = torch.zeros_like(added)
        if i < len(ours[0].deepstack or ()):
            for feats, item in zip(ours, mm.items):
                want[item.offset : item.end] = feats.deepstack[i]
        torch.testing.assert_close(added, want, atol=1e-4, rtol=1e-4)


def test_weights(ckpt):
    weights = ckpt.tower_weights()
    assert weights and all(k.startswith(("visual.", "model.visual.")) for k, _ in weights)
    fresh = ckpt.family.build_tower(ckpt.config, torch.float32)
    # every tower parameter, in the other naming
    other = [
        (k[len("model.") :] if k.startswith("model.") else "model." + k, v) for k, v in weights
    ]
    fresh.load_weights(other)
    want = ckpt.tower.state_dict()
    assert fresh.state_dict().keys() == want.keys()
    for name, param in fresh.state_dict().items():
        assert torch.equal(param, want[name]), name
    missing = [(k, v) for k, v in weights if "blocks.1.attn.qkv.bias" not in k]
    with pytest.raises(KeyError, match=r"blocks\.1\.attn\.qkv\.bias"):
        ckpt.family.build_tower(ckpt.config, torch.float32).load_weights(missing)
    extra = weights + [("model.visual.blocks.9.attn.qkv.weight", torch.zeros(2))]
    with pytest.raises(KeyError, match=r"blocks\.9"):
        ckpt.family.build_tower(ckpt.config, torch.float32).load_weights(extra)


def test_tower_dtype(ckpt):
    tower = ckpt.family.build_tower(ckpt.config, torch.bfloat16)
    tower.load_weights(ckpt.tower_weights())
    assert {p.dtype for p in tower.parameters()} == {torch.bfloat16}
    mm = ckpt.family.process(ckpt.processor, ckpt.prompt("<image>"), sample_images()[:1])
    with torch.no_grad():
        out = tower.encode([mm.items[0].data])[0]
    assert out.embeds.dtype == torch.bfloat16 and out.num_rows == mm.items[0].num_embeds
    assert all(d.dtype == torch.bfloat16 for d in out.deepstack or ())


def test_text_description_keeps_mrope(ckpt):
    """Every rotating layer (Qwen3.5: its attention layers; its Gated DeltaNet layers have no
    rope) keeps the sections (transformers' default where the config names none) and the
    layout, over rot_dim = head_dim * partial_rotary_factor."""
    spec = describe_model(text_part(ckpt.config))
    text_config = ckpt.config.text_config
    ropes = {rope for rope in spec.rope if rope is not None}
    attention = [t for t in getattr(text_config, "layer_types", None) or () if "attention" in t]
    if attention:
        assert len(ropes) == 1
        kinds = [rope is not None for rope in spec.rope]
        assert kinds == [t == "full_attention" for t in text_config.layer_types]
    (spec_rope,) = ropes
    rope = spec_rope.params_dict()
    text = text_config.rope_parameters
    assert rope["mrope_section"] == list(text.get("mrope_section") or [11, 11, 10])
    assert rope.get("mrope_interleaved", False) == ckpt.name.startswith("qwen3")
    assert rope["rope_type"] == "default" and "type" not in rope
    partial = text.get("partial_rotary_factor", 1.0)
    assert spec_rope.rot_dim == int(head_dim_of(text_config) * partial)
    assert spec_rope.rot_dim == {"qwen3_5": 16, "qwen3_5_moe": 8}.get(ckpt.name, 16)


def test_mrope_rotation_equals_transformers(ckpt):
    """The decoder's rotary for [3, T] positions (`_mrope_step` over layers/rotary.py's
    `mrope_table`) turns queries and keys as transformers' text rotary and its
    apply_rotary_pos_emb do at a prompt's multimodal positions: Qwen3-VL over whole heads,
    Qwen3.5 over the partial rotary part of each head, the rest passed through."""
    if ckpt.name.startswith("qwen2_5"):
        pytest.skip("Qwen2.5-VL's contiguous sections are checked end to end")
    images = sample_images()[:2]
    mm = ckpt.family.process(ckpt.processor, ckpt.prompt("a <image> b <image> c"), images)
    positions = mm.mrope_positions
    llm = LLM(ckpt.path, block_size=8, num_kv_blocks=16, max_model_len=128, dtype="float32")
    model = llm.engine.runner.model
    ((cache, rope),) = list(model._ropes())
    text_config = ckpt.config.text_config
    heads, head_dim = text_config.num_attention_heads, head_dim_of(text_config)
    torch.manual_seed(0)
    q = torch.randn(positions.shape[1], heads, head_dim)
    k = torch.randn(positions.shape[1], text_config.num_key_value_heads, head_dim)
    step = model._mrope_step(cache, rope, positions, torch.float32)
    got_q, got_k = apply_rotary(q.clone(), k.clone(), step)
    hf = ckpt.model.model.language_model
    cos, sin = hf.rotary_emb(q, positions[:, None, :])  # [1, T, rot_dim]
    assert cos.shape[-1] == rope.rot_dim
    apply = sys.modules[type(hf).__module__].apply_rotary_pos_emb
    want_q, want_k = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    # the three streams differ on the image tokens, and it matters there
    plain_q, _ = apply(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        *hf.rotary_emb(q, positions[:1, None, :].expand(3, 1, -1)),
    )
    assert not torch.allclose(plain_q[0].transpose(0, 1), got_q, atol=1e-3)


def hf_text_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=[model.config.text_config.vocab_size + 1],
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_text_only_greedy_equals_transformers(ckpt):
    """The text decoder (families_vl.py) loads from the composite checkpoint; on text alone the
    three position streams are equal, so the plain rotation is exact."""
    prompts = family_prompts(ckpt.config.text_config.vocab_size, lengths=(1, 5, 12, 30))
    llm = LLM(ckpt.path, block_size=8, num_kv_blocks=64, max_model_len=128, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_text_greedy(ckpt.model, prompt, 24)


def test_images_through_the_engine_equal_transformers(ckpt):
    """End to end (the engine's image path, M-RoPE positions, DeepStack rows): prompts with 0-2
    images batched, greedy, token for token against transformers' generate; and again with
    prefill chunks of 24 tokens that cut through the images' spans."""
    if ckpt.name not in ("qwen2_5_vl", "qwen3_vl"):
        pytest.skip("the engine path is checked on one variant of each family")
    prompts = vision_prompts(ckpt.placeholder, sample_images())
    want = hf_vision_greedy(ckpt.path, prompts)
    llm = make_llm(ckpt.path)
    assert engine_greedy(llm, prompts) == want
    # the image matters: the same text with another image goes elsewhere
    assert engine_greedy(llm, [(prompts[0][0], [sample_images()[3]])])[0] != want[0]
    chunked = make_llm(ckpt.path, max_num_batched_tokens=24, enable_prefix_caching=False)
    assert engine_greedy(chunked, prompts) == want

"""Gemma 4 against transformers: tiny checkpoints with its characteristic options on (sliding and
global layers with a window shorter than the prompts, the global layers' wider heads and fewer
KV heads, `attention_k_eq_v`, KV shared by the last layers, double-wide MLPs there, per-layer
input embeddings, the proportional rope, a final soft-cap), 8 prompts batched, 48 greedy tokens
equal to `generate`; the cache: shared layers keep none, global layers' narrower or wider
entries are views; chunked prefill, prefix caching and preemption change nothing; the text part
of Gemma4ForConditionalGeneration; the MoE block beside the MLP (26B-A4B's); bidirectional text
attention is refused by name. Two ranks: test_tensor_parallel_gemma4.py."""

from __future__ import annotations

import pytest
import torch
import transformers

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.kernels import paged_attention as pa
from serverless_llm.engine.kernels.kv_write import reshape_and_cache_reference
from serverless_llm.engine.kv_cache import allocate_kv_cache, layer_view
from serverless_llm.engine.kv_cache_manager import FullAttentionSpec
from serverless_llm.engine.models import describe_model
from serverless_llm.engine.models.registry import UnsupportedModelError
from tests.engine.family_check import (
    NEW_TOKENS,
    assert_pool_whole,
    check_cache_paths_change_nothing,
    family_prompts,
    greedy_family_test,
    save_family_model,
    tiny_dims,
)
from tests.engine.reference import hf_greedy
from tests.tiny_models import build_tokenizer

WINDOW = 16
BLOCK = 8
SIX = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def _text(tok, **kw) -> dict:
    """Six layers, two sliding to one global; the global layers' heads 32 wide with one KV head
    (the sliding ones 16 wide with two), values = keys there; the last two layers read the KV
    of layers 3 and 2; per-layer inputs 8 wide."""
    args = dict(
        **tiny_dims(tok, num_hidden_layers=6, intermediate_size=96),
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=WINDOW,
        layer_types=SIX,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=len(tok),
        final_logit_softcapping=30.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
            },
        },
    )
    args.update(kw)
    return args


def _gemma4(tok, **kw):
    return transformers.Gemma4TextConfig(**_text(tok, **kw), architectures=["Gemma4ForCausalLM"])


CONFIGS = {
    "gemma4": _gemma4,
    # no sharing, no per-layer inputs, separate values: the 31B-style dense decoder
    "gemma4_plain": lambda tok: _gemma4(
        tok,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        attention_k_eq_v=False,
        use_double_wide_mlp=False,
        global_head_dim=48,  # entries 2 x 48: the sliding layers' 2 x 16 are views into them
    ),
    # the 26B-A4B shape: the MoE block beside every dense MLP (top-2 of 4), no sharing or PLE
    "gemma4_moe": lambda tok: _gemma4(
        tok,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        use_double_wide_mlp=False,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
}


def save_gemma4(path: str, config) -> str:
    """`save_family_model`, then every layer's `layer_scalar` (a buffer, which the random
    widening of parameters leaves at 1) set to a random value near 1."""
    save_family_model(path, config)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=g))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    tok = build_tokenizer()
    saved: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in saved:
            saved[name] = save_gemma4(str(tmp_path_factory.mktemp(name)), CONFIGS[name](tok))
        return saved[name]

    return get


test_family_greedy_equals_transformers = greedy_family_test(CONFIGS)

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def engine(path: str, **kw) -> LLM:
    args = dict(block_size=BLOCK, num_kv_blocks=240, max_model_len=256, dtype="float32")
    args.update(kw)
    return LLM(path, **args)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return family_prompts(len(build_tokenizer()), seed=5, lengths=(WINDOW, 5, 2 * WINDOW + 3, 40))


@pytest.fixture(scope="module")
def reference(family_models, prompts) -> list[list[int]]:
    return [hf_greedy(family_models("gemma4"), p, NEW_TOKENS) for p in prompts]


def test_shared_layers_keep_no_cache_and_global_entries_are_views(family_models):
    """Layers 4 and 5 read the KV of layers 3 and 2: no group holds them, and their caches are
    their sources'. The global layers' entries (one KV head of 32) and the sliding layers' (two
    of 16) are the same width here; in gemma4_plain the global layers' are wider (2 x 48) and
    the sliding layers see views of them."""
    llm = engine(family_models("gemma4"))
    layout = llm.engine.cache_layout
    held = sorted(i for g in layout.groups for i in g.layers)
    assert held == [0, 1, 2, 3]
    assert {g.spec: g.layers for g in layout.groups}[FullAttentionSpec()] == (2,)
    model = llm.engine.model
    assert [i for i, layer in enumerate(model.layers) if layer.self_attn.qkv_parts == 1] == [4, 5]
    assert model.layers[2].self_attn.qkv_parts == 2  # k_eq_v: [q | k]
    assert model.kv_cache_shape() == (2, 2, 16)
    plain = engine(family_models("gemma4_plain"))
    assert plain.engine.model.kv_cache_shape() == (2, 2, 48)
    caches = plain.engine.runner.kv_caches
    assert caches[0].shape[-2:] == (2, 16) and caches[2].shape[-2:] == (2, 48)
    assert caches[0].untyped_storage().data_ptr() == caches[2].untyped_storage().data_ptr()


def test_prefix_cache_chunked_prefill_and_preemption_change_nothing(
    family_models, prompts, reference
):
    check_cache_paths_change_nothing(engine, family_models("gemma4"), prompts, GREEDY, reference)


def test_bidirectional_text_is_refused_by_name():
    both = _gemma4(build_tokenizer(), use_bidirectional_attention="all")
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        describe_model(both)


def _composite(tok):
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16, patch_size=4,
                  pooling_kernel_size=2, position_embedding_size=64)  # fmt: skip
    audio = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                 subsampling_conv_channels=[8, 4], output_proj_dims=32,
                 conv_kernel_size=3)  # fmt: skip
    return transformers.Gemma4Config(
        text_config=_text(tok),
        vision_config=vision,
        audio_config=audio,
        architectures=["Gemma4ForConditionalGeneration"],
    )


def test_text_part_of_the_composite_equals_transformers(tmp_path):
    """Gemma4ForConditionalGeneration (vision and audio towers beside the decoder) served for
    text: the decoder under model.language_model.*, the towers skipped; the composite's own
    text-only generate is the reference."""
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(_composite(tok)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    path = str(tmp_path / "m")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    prompts = family_prompts(len(tok), seed=2, lengths=(3, 20, 41))
    llm = engine(path)
    # no processor files: served for text, its image prompts refused (the tower loads)
    assert llm.engine.inputs.images is None
    assert llm.engine.vision is not None
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    config = model.generation_config
    config.eos_token_id = [len(tok) + 1]
    config.pad_token_id = 0
    config.max_new_tokens = NEW_TOKENS
    config.do_sample = False
    for prompt, tokens in zip(prompts, got):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        assert tokens == out[0, len(prompt) :].tolist()
    assert_pool_whole(llm)


@pytest.mark.parametrize("name", ["gemma4", "gemma4_plain"])
def test_torch_backend_equals_transformers(family_models, prompts, reference, name):
    """The torch backend (the default CPU step may be the native one): strided views included."""
    path = family_models(name)
    llm = engine(path, attention_backend="torch")
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    want = reference if name == "gemma4" else [hf_greedy(path, p, NEW_TOKENS) for p in prompts]
    assert outs == want
    assert_pool_whole(llm)


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
def test_layer_view_holds_its_own_entries(head_major):
    """A narrower layer's view of a cache tensor: what is written at a slot reads back there,
    and within a block it stays inside that block's page."""
    wide = allocate_kv_cache(1, 6, 4, 2, 24, torch.float32, torch.device("cpu"), head_major)[0]
    wide.zero_()
    view = layer_view(wide, 3, 8)
    assert view.shape == (2, 6, 4, 3, 8)
    k, v = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
    slots = torch.tensor([0, 5, 9, 14, 23])
    reshape_and_cache_reference(k, v, view, slots)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(view[0, slot // 4, slot % 4], k[t])
        assert torch.equal(view[1, slot // 4, slot % 4], v[t])
    # block 1 (slots 4-7) holds only slot 5's entry: the other blocks' writes stay out of it
    assert int((wide[:, 1] != 0).sum()) == 2 * 3 * 8
    with pytest.raises(ValueError):
        layer_view(wide, 4, 16)  # 64 values a token do not fit in 48


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
def test_layer_view_keeps_each_token_inside_its_wider_entry(head_major):
    """Heads that fit (no more, none wider) map head to head: a token's narrow entry lies in the
    same token's wide entry, so a wide write elsewhere never reaches it."""
    wide = allocate_kv_cache(1, 3, 4, 2, 24, torch.float32, torch.device("cpu"), head_major)[0]
    wide.zero_()
    view = layer_view(wide, 2, 8)
    view[0, 1, 2].fill_(1.0)  # block 1, token 2
    hit = (wide[0] != 0).nonzero().tolist()
    assert {(b, t) for b, t, _, _ in hit} == {(1, 2)}


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize("wide", [(2, 24), (1, 32), (2, 16), (1, 128)], ids=str)
def test_layer_views_gather_their_own_keys(head_major, wide):
    """The torch decode's gather (`gather_blocks`) of a layer view reads, at every block and
    head, what logical indexing reads, in the [..., heads, keys, dim] order; on the head-major
    cache by whole rows of the wide tensor (`head_layout`) where the view's rows lie at fixed
    offsets in it (heads inside heads, or packed at the block's start in whole tiles)."""
    cache = allocate_kv_cache(1, 7, 4, *wide, torch.float32, torch.device("cpu"), head_major)[0]
    cache.copy_(torch.randn(cache.shape))
    blocks = torch.tensor([[3, 0, 6], [1, 1, 2]])
    for kvh, d in [
        (k, d) for k in (1, 2, 3) for d in (8, 16, 24, 32) if k * d <= wide[0] * wide[1]
    ]:
        view = layer_view(cache, kvh, d)
        for half in (view[0], view[1]):
            want = half[blocks].movedim(-2, -4).reshape(2, kvh, 3 * 4, d)
            got = pa.gather_blocks(half, blocks)
            assert torch.equal(got, want)
            if head_major and kvh <= wide[0] and d <= wide[1]:  # heads inside heads: rows
                assert pa.head_layout(half) == (wide[0], wide[1])


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("name", ["gemma4", "gemma4_plain"])
def test_captured_decodes_equal_transformers(family_models, prompts, reference, name, backend):
    """The captured-decode twin (replayed on CPU): its self-check passes with the layers' views
    of another head shape, both where the sliding layers' heads nest in the global layers'
    (gemma4_plain: 2 x 16 in 2 x 48) and where they do not (gemma4: one head of 32 packed in
    2 x 16 entries, whose writes in a block cover other tokens' entries, so the check's probe
    must give each cache group blocks of its own as serving does), and its steps give
    transformers' tokens."""
    path = family_models(name)
    llm = engine(path, decode_capture="replay", max_num_seqs=4, attention_backend=backend)
    assert llm.engine.runner.backend.name == backend
    captured = llm.engine.runner.captured
    assert captured is not None and captured.enabled
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    want = reference if name == "gemma4" else [hf_greedy(path, p, NEW_TOKENS) for p in prompts]
    assert outs == want
    assert captured.replays > 0
    assert_pool_whole(llm)


def test_lora_targets_follow_each_layers_projection(family_models):
    """Adapters' parts follow each layer's own q/k/v sizes; a layer without v rows (values =
    keys) or without K/V (shared) refuses an adapter for them by name."""
    llm = engine(family_models("gemma4"), enable_lora=True, max_lora_rank=4)
    model = llm.engine.model
    assert model.lora_target("model.layers.2.self_attn.k_proj")[1:] == (1, 64, 32)
    assert model.lora_target("model.layers.0.self_attn.v_proj")[1:] == (2, 64, 32)
    for module in ("model.layers.2.self_attn.v_proj", "model.layers.4.self_attn.k_proj"):
        with pytest.raises(KeyError, match="no (v|k) projection of its own"):
            model.lora_target(module)

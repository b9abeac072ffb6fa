"""Vision-language families end to end: prompts with none, one and two images of different
sizes and aspect ratios, batched together through the engine, greedy, token for token against
transformers' `generate` with the processor's inputs (vision_check.py); and what the engine
promises around images: chunked prefill across an image equals one-shot prefill and encodes it
once, prefix caching never mixes two images and reuses one, preemption recomputes the same."""

from __future__ import annotations

import importlib

import pytest

from serverless_llm import SamplingParams
from serverless_llm.engine import MultiModalInput
from tests.engine.vision_check import (
    NEW_TOKENS,
    engine_greedy,
    family_processor,
    hf_vision_greedy,
    make_llm,
    vision_prompts,
)

# case -> (module under tests/engine, builder, its keyword arguments)
CASES = {
    "gemma3": ("vision_gemma3_models", "save_tiny_gemma3", {"tie_word_embeddings": False}),
    # per-layer inputs at the image rows, a window shorter than an image's run
    "gemma4": ("vision_gemma4_models", "save_tiny_gemma4", {}),
    "idefics3": ("vision_idefics3_models", "save_tiny_idefics3", {}),
    "smolvlm": ("vision_idefics3_models", "save_tiny_smolvlm", {}),
    # Llama 4: tiles + a global tile, separators inside an image's span, chunked attention
    "llama4": ("vision_llama4_models", "save_tiny_llama4", {}),
    "llava": ("vision_llava_models", "save_tiny_llava", {}),
    "llava_next": ("vision_llava_models", "save_tiny_llava_next", {}),
    "mistral3": ("vision_pixtral_models", "save_tiny_mistral3", {}),
    "pixtral_llava": ("vision_pixtral_models", "save_tiny_pixtral_llava", {}),
    "qwen2_5_vl": ("vision_qwen_vl_models", "save_tiny_qwen2_5_vl", {}),
    "qwen3_vl": ("vision_qwen_vl_models", "save_tiny_qwen3_vl", {}),
    # Gated DeltaNet hybrids: recurrent state beside the KV cache, no prefix caching
    "qwen3_5": ("vision_qwen_vl_models", "save_tiny_qwen3_5_vl", {}),
    "qwen3_5_moe": ("vision_qwen_vl_models", "save_tiny_qwen3_5_moe_vl", {}),
}


def _build(case: str, path: str) -> tuple[str, list]:
    module, builder, kwargs = CASES[case]
    mod = importlib.import_module(f"tests.engine.{module}")
    getattr(mod, builder)(path, **kwargs)
    return path, mod.sample_images()


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory):
    built: dict[str, tuple[str, list]] = {}

    def get(case: str) -> tuple[str, list]:
        if case not in built:
            built[case] = _build(case, str(tmp_path_factory.mktemp(case)))
        return built[case]

    return get


def _prompts(path: str, images: list):
    family, processor = family_processor(path)
    return vision_prompts(family.image_placeholder(processor), images)


@pytest.mark.parametrize("case", sorted(CASES))
def test_images_batched_greedy_equals_transformers(vision_model, case):
    path, images = vision_model(case)
    prompts = _prompts(path, images)
    llm = make_llm(path)
    got = engine_greedy(llm, prompts)
    assert got == hf_vision_greedy(path, prompts)
    # the images change the output: the same text with another image goes elsewhere
    text, _ = prompts[0]
    other = engine_greedy(llm, [(text, [images[3]])])
    assert other[0] != got[0]


def test_chunked_prefill_across_an_image_equals_one_shot(vision_model):
    """Steps of 24 tokens cut through the images' spans (Gemma 3: never inside one, which
    attends both ways; Idefics3 and Qwen3.5, whose recurrent state crosses the chunks:
    anywhere); each image is encoded once all the same."""
    for case in ("gemma3", "idefics3", "qwen3_5"):
        path, images = vision_model(case)
        prompts = _prompts(path, images)
        whole = engine_greedy(make_llm(path), prompts)
        llm = make_llm(path, max_num_batched_tokens=24, enable_prefix_caching=False)
        assert engine_greedy(llm, prompts) == whole, case
        cache = llm.engine.runner.encoder_cache
        # prompts 2 and 4 share an image: encoded once, found in the cache the second time
        distinct = {id(img) for _, imgs in prompts for img in imgs}
        assert cache.encoded == len(distinct), case


def test_prefix_caching_keys_blocks_by_image(vision_model):
    path, images = vision_model("idefics3")
    family, processor = family_processor(path)
    ph = family.image_placeholder(processor)
    text = f"Hello world! How are you today? {ph} Describe it."
    llm = make_llm(path, enable_prefix_caching=True, block_size=8)
    alone = [engine_greedy(make_llm(path), [(text, [img])])[0] for img in images[:2]]
    pool = llm.engine.block_pool
    first = engine_greedy(llm, [(text, [images[0]])])[0]
    hits = pool.hits
    second = engine_greedy(llm, [(text, [images[1]])])[0]
    assert first == alone[0] and second == alone[1] and first != second
    # blocks before the image may be shared; none from the image on
    item = llm.engine.inputs.prepare(
        MultiModalInput(text, [images[1]]), SamplingParams(max_tokens=NEW_TOKENS)
    ).mm.items[0]
    assert pool.hits - hits <= item.offset // 8
    hits = pool.hits
    encoded = llm.engine.runner.encoder_cache.encoded
    again = engine_greedy(llm, [(text, [images[0]])])[0]
    assert again == first
    assert pool.hits - hits >= item.end // 8  # the same image again: its blocks are hits
    # ... and its features were not needed (the prefill starts after the image)
    assert llm.engine.runner.encoder_cache.encoded == encoded


def test_preemption_recomputes_image_prompts(vision_model):
    path, images = vision_model("gemma3")
    prompts = _prompts(path, images) * 2
    want = engine_greedy(make_llm(path), prompts)
    small = make_llm(
        path, num_kv_blocks=48, block_size=8, max_model_len=160, enable_prefix_caching=False
    )
    assert engine_greedy(small, prompts) == want
    assert small.engine.scheduler.num_preemptions > 0
    assert not small.engine.kv.owners()  # every block given back


def test_missing_processor_files_serve_text_only(vision_model, tmp_path, caplog):
    """A vision checkpoint stripped of its processor files still serves text (with a warning);
    an image prompt to it is a clear error, not a crash."""
    import logging
    import os
    import shutil

    from serverless_llm.engine.errors import InvalidRequestError

    path, images = vision_model("qwen2_5_vl")
    stripped = str(tmp_path / "stripped")
    shutil.copytree(path, stripped)
    for name in ("preprocessor_config.json", "processor_config.json"):
        if os.path.exists(os.path.join(stripped, name)):
            os.remove(os.path.join(stripped, name))
    with caplog.at_level(logging.WARNING):
        llm = make_llm(stripped)
    assert any("text only" in r.getMessage() for r in caplog.records)
    text_only = _prompts(path, images)[2]
    assert engine_greedy(llm, [text_only]) == engine_greedy(make_llm(path), [text_only])
    with pytest.raises(InvalidRequestError, match="does not take images"):
        engine_greedy(llm, [_prompts(path, images)[0]])

"""Images under tensor parallelism, as the engine runs it (rank 0 here, rank 1 a spawned
process, gloo between them). The vision tower is replicated on every rank (model_builder.
load_vision): each rank encodes the step's images itself from the processor outputs rank 0
sends in the step's HostBatch (`mm_parts`), keeps its own encoder cache (the same on every
rank: the same puts in the same order), and writes the features over its own embedding rows
before the sharded decoder. Greedy tokens at two ranks equal one rank's for LLaVA (CLIP tower),
Qwen2.5-VL (multimodal rotary positions: `mrope_runs` reach the peer too) and Gemma 4 (the image
rows' per-layer inputs the pad token's, from the vocab-split per-layer embedding), with prompts of
none, one and two images batched; and again with prefill chunks that cut through the images'
spans, so the peer's encoder cache serves an image across chunks."""

from __future__ import annotations

import logging
import re

import pytest

from tests.engine.vision_check import engine_greedy, family_processor, make_llm, vision_prompts
from tests.engine.vision_gemma4_models import sample_images as gemma4_images
from tests.engine.vision_gemma4_models import save_tiny_gemma4
from tests.engine.vision_llava_models import sample_images as llava_images
from tests.engine.vision_llava_models import save_tiny_llava
from tests.engine.vision_qwen_vl_models import sample_images as qwen_images
from tests.engine.vision_qwen_vl_models import save_tiny_qwen2_5_vl

# case -> (checkpoint builder, sample images, the family the start-up line names)
CASES = {
    "gemma4": (save_tiny_gemma4, gemma4_images, "Gemma4"),
    "llava": (save_tiny_llava, llava_images, "Llava"),
    "qwen2_5_vl": (save_tiny_qwen2_5_vl, qwen_images, "Qwen2_5VL"),
}
ENGINE = dict(block_size=8, num_kv_blocks=160, max_model_len=256)


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_with_images_equal_one_rank(case, tmp_path, caplog):
    save, images, name = CASES[case]
    path = save(str(tmp_path / case))
    family, processor = family_processor(path)
    prompts = vision_prompts(family.image_placeholder(processor), images())
    assert [len(imgs) for _, imgs in prompts] == [1, 2, 0, 1]
    with caplog.at_level(logging.INFO, logger="serverless_llm.engine.llm_engine"):
        one_rank = make_llm(path, **ENGINE)
    # the start-up line says the model takes images: 4096 rows of 64 floats in the cache
    ready = [r.getMessage() for r in caplog.records if "engine ready" in r.getMessage()]
    assert re.search(rf"images={name} \(tower \d+\.\d MiB, encoder cache 1\.0 MiB\)", ready[0])
    one = engine_greedy(one_rank, prompts)
    with make_llm(path, tensor_parallel_size=2, **ENGINE) as llm:
        assert engine_greedy(llm, prompts) == one
        pool = llm.engine.block_pool
        assert pool.num_free == pool.num_blocks, "KV blocks leaked"
        assert all(r["alive"] for r in llm.engine.rank_state())
    # Chunks of 8 tokens: every image's span is cut (LLaVA's 16 rows; Qwen's 1-16), and the
    # step that ends an image finds its features in each rank's encoder cache.
    chunked = dict(ENGINE, max_num_batched_tokens=8, enable_prefix_caching=False)
    with make_llm(path, tensor_parallel_size=2, **chunked) as llm:
        assert engine_greedy(llm, prompts) == one
        cache = llm.engine.runner.encoder_cache
        # prompts 2 and 4 share an image: encoded once on rank 0 (and so on rank 1)
        assert cache.encoded == len({id(img) for _, imgs in prompts for img in imgs})

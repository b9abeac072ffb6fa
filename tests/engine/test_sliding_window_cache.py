"""Sliding-window layers in their own cache groups, end to end on a tiny Gemma 3-shaped model
(five local layers to one global, window shorter than the prompts): the local groups hold only
their window while a request four windows long decodes, and the tokens equal transformers'
`generate`, with and without prefix caching, chunked prefill and preemption."""

from __future__ import annotations

import math

import pytest
import transformers

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.kv_cache_manager import FullAttentionSpec, SlidingWindowSpec
from tests.engine.family_check import family_prompts, save_family_model, tiny_dims
from tests.engine.reference import hf_greedy
from tests.tiny_models import build_tokenizer

WINDOW = 16
BLOCK = 8
NEW = 3 * WINDOW  # a 16-token prompt grows to 4 windows


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> str:
    tok = build_tokenizer()
    config = transformers.Gemma3TextConfig(
        **tiny_dims(tok, head_dim=16, num_hidden_layers=12),
        sliding_window=WINDOW,
        sliding_window_pattern=6,  # layers 5 and 11 global, the others local
        query_pre_attn_scalar=24,
        architectures=["Gemma3ForCausalLM"],
    )
    return save_family_model(str(tmp_path_factory.mktemp("gemma3") / "m"), config)


@pytest.fixture(scope="module")
def prompts(gemma3) -> list[list[int]]:
    vocab = transformers.AutoConfig.from_pretrained(gemma3).vocab_size
    return family_prompts(vocab, seed=3, lengths=(WINDOW, 5, 2 * WINDOW + 3, 40))


@pytest.fixture(scope="module")
def reference(gemma3, prompts) -> list[list[int]]:
    return [hf_greedy(gemma3, p, NEW) for p in prompts]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def engine(path: str, **kw) -> LLM:
    args = dict(block_size=BLOCK, num_kv_blocks=240, max_model_len=256, dtype="float32")
    args.update(kw)
    return LLM(path, **args)


def assert_pool_whole(llm: LLM) -> None:
    llm.engine.kv.check()
    pool = llm.engine.block_pool
    assert pool.num_free == pool.num_blocks and not llm.engine.kv.owners()


def test_layers_form_one_full_and_five_window_groups(gemma3):
    layout = engine(gemma3).engine.cache_layout
    assert layout.layers_per_page == 2
    specs = [g.spec for g in layout.groups]
    assert specs.count(FullAttentionSpec()) == 1
    assert specs.count(SlidingWindowSpec(WINDOW)) == 5
    full = next(g for g in layout.groups if g.spec == FullAttentionSpec())
    assert full.layers == (5, 11)


def test_window_groups_hold_only_the_window_while_decoding(gemma3, prompts, reference):
    llm = engine(gemma3)
    eng = llm.engine
    layout = eng.cache_layout
    local = [g for g, grp in enumerate(layout.groups) if grp.spec != FullAttentionSpec()]
    bound = math.ceil(WINDOW / BLOCK) + 1
    most: list[int] = []
    execute = eng.runner.execute

    def watching(batch):  # counted while the step's blocks are all held
        for req, n in zip(batch.requests, batch.num_new_tokens):
            if n == 1:
                most.append(max(eng.kv.num_held(req, g) for g in local))
        return execute(batch)

    eng.runner.execute = watching
    out = llm.generate([prompts[0]], GREEDY)[0].outputs[0].token_ids
    assert out == reference[0]
    assert len(most) == NEW - 1 and max(most) <= bound
    assert_pool_whole(llm)


def test_tokens_equal_transformers_in_a_batch(gemma3, prompts, reference):
    llm = engine(gemma3)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_pool_whole(llm)


def test_prefix_cache_chunked_prefill_and_preemption_change_nothing(gemma3, prompts, reference):
    # Prefix caching: the same prompts again, served from the cache.
    cached = engine(gemma3)
    cached.generate(prompts, GREEDY)
    hits = cached.engine.block_pool.hits
    again = cached.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == reference
    assert cached.engine.block_pool.hits > hits
    assert_pool_whole(cached)

    # Chunked prefill: steps of 6 tokens, shorter than the window and not a block.
    chunked = engine(gemma3, max_num_batched_tokens=6, enable_prefix_caching=False)
    outs = chunked.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_pool_whole(chunked)

    # Preemption: a cache that holds the longest request but not all four at once (steps of at
    # most 16 tokens, so a prefill's window groups hold little more than their window).
    small = engine(
        gemma3,
        num_kv_blocks=50,
        max_model_len=128,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    outs = small.generate(prompts, GREEDY)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_pool_whole(small)


def test_captured_decodes_read_each_groups_table(gemma3, prompts, reference):
    """The captured-decode twin keeps one slot mapping and block table per cache group: its
    replayed steps give transformers' tokens too."""
    llm = engine(gemma3, decode_capture="replay", max_num_seqs=4)
    captured = llm.engine.runner.captured
    assert captured is not None and captured.enabled
    assert captured.static.block_tables.shape[0] == llm.engine.cache_layout.num_groups == 6
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert captured.replays > 0
    assert_pool_whole(llm)


def test_hybrid_cache_off_keeps_every_token_in_one_group(gemma3, prompts, reference):
    """disable_hybrid_kv_cache_manager (vLLM's flag): one group of every layer, windows applied
    by the kernels only; the same tokens (bench/kv_capacity.py's "before")."""
    llm = engine(gemma3, disable_hybrid_kv_cache_manager=True)
    layout = llm.engine.cache_layout
    assert layout.num_groups == 1 and layout.groups[0].spec == FullAttentionSpec()
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_pool_whole(llm)

"""Checking a model family against transformers: a tiny random model built from the family's own
transformers config (its characteristic options switched on), saved with the test tokenizer,
then 8 prompts of different lengths generated together, greedy, token for token against
transformers' `generate` one prompt at a time.

A family test module holds a table, `CONFIGS`: case name -> a function of the test tokenizer
giving that case's config (sized by `tiny_dims`). Two lines make its tests:

    family_models = family_models_fixture(CONFIGS)  # name -> its saved model, once per module
    test_family_greedy_equals_transformers = greedy_family_test(CONFIGS)

so adding a family or a variant of one is one entry in the table.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import pytest
import torch
import transformers

from serverless_llm import LLM, SamplingParams
from tests.engine.reference import hf_greedy
from tests.tiny_models import build_tokenizer
from tests.tiny_models import tiny_dims as tiny_dims  # the family tests' one tiny config builder

NEW_TOKENS = 48
LENGTHS = (1, 3, 7, 12, 20, 31, 45, 60)

# case name -> its tiny config, from the test tokenizer
FamilyConfigs = dict[
    str, Callable[[transformers.PreTrainedTokenizerBase], transformers.PretrainedConfig]
]


def save_family_model(path: str, config, seed: int = 0, std: float = 0.2) -> str:
    """A random model of `config` (the test tokenizer's vocabulary) saved into `path`. Weights
    are widened so greedy picks are clear; norm weights stay near their init plus noise so
    options like Gemma's (1 + w) are exercised."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def family_prompts(vocab: int, seed: int = 0, lengths=LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


def engine_greedy(path: str, prompts, new_tokens: int = NEW_TOKENS, **engine_kw) -> list[list[int]]:
    kw = dict(block_size=8, num_kv_blocks=160, max_model_len=256, dtype="float32")
    kw.update(engine_kw)
    llm = LLM(path, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params)
    pool = llm.engine.block_pool
    assert pool.num_free == pool.num_blocks, "KV blocks leaked"
    states = llm.engine.state_pool
    assert states is None or states.num_free == states.num_slots - 1, "state slots leaked"
    return [o.outputs[0].token_ids for o in outs]


def assert_matches_transformers(
    path: str,
    new_tokens: int = NEW_TOKENS,
    lengths=LENGTHS,
    reference: str | None = None,
    vocab: int | None = None,
    **engine_kw,
):
    """The engine's greedy tokens on `path` equal transformers' on `reference` (default: the
    same checkpoint) for every prompt: `family_prompts` of `lengths` from ids below `vocab`
    (default: the config's vocabulary)."""
    if vocab is None:
        vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    prompts = family_prompts(vocab, lengths=lengths)
    got = engine_greedy(path, prompts, new_tokens, **engine_kw)
    for prompt, tokens in zip(prompts, got):
        want = hf_greedy(reference or path, prompt, new_tokens)
        assert tokens == want, f"prompt of {len(prompt)} tokens"


def family_models_fixture(configs: FamilyConfigs):
    """A module-scoped fixture `family_models` over a table of families: `family_models(name)` is
    the path of the tiny model of configs[name] (`save_family_model`), saved the first time a
    test of the module asks for it, so later tests reuse it (they must not modify it)."""

    @pytest.fixture(scope="module", name="family_models")
    def fixture(tmp_path_factory) -> Callable[[str], str]:
        tokenizer = build_tokenizer()
        saved: dict[str, str] = {}

        def get(name: str) -> str:
            if name not in saved:
                path = str(tmp_path_factory.mktemp(name))
                saved[name] = save_family_model(path, configs[name](tokenizer))
            return saved[name]

        return get

    return fixture


def greedy_family_test(configs: FamilyConfigs):
    """The test of a table of families, parametrised by its names: each model (from the module's
    `family_models` fixture) generates 48 greedy tokens for 8 prompts batched together, equal to
    transformers' (`assert_matches_transformers`'s defaults)."""

    @pytest.mark.parametrize("name", list(configs))
    def test(family_models, name):
        assert_matches_transformers(family_models(name))

    return test


def assert_pool_whole(llm: LLM) -> None:
    """Every KV block back in the pool and no owner left (the manager's own check passes)."""
    llm.engine.kv.check()
    pool = llm.engine.block_pool
    assert pool.num_free == pool.num_blocks and not llm.engine.kv.owners()


def check_cache_paths_change_nothing(engine, path: str, prompts, params, reference) -> None:
    """Prefix-cache hits, prefill in steps of 6 tokens and preemption (room for the longest
    request, not for all at once) each give `reference`'s tokens and leave the pool whole.
    `engine(path, **overrides)` builds the family's LLM."""
    cached = engine(path)
    cached.generate(prompts, params)
    hits = cached.engine.block_pool.hits
    again = cached.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in again] == reference
    assert cached.engine.block_pool.hits > hits
    assert_pool_whole(cached)

    chunked = engine(path, max_num_batched_tokens=6, enable_prefix_caching=False)
    outs = chunked.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_pool_whole(chunked)

    small = engine(
        path,
        num_kv_blocks=40,
        max_model_len=128,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    outs = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_pool_whole(small)

"""Speculative decoding on models with recurrent layers (issue 40 item 3, issue 35's families): a
speculating request's state slot is copied aside before the step that verifies its drafts
(kv_cache_manager.snapshot_state); when a draft is rejected, its KV and state go back to that
copy and the kept tokens are computed again in the next step, so the state never holds a
rejected token. Greedy tokens equal plain decoding's for every kind of recurrent layer (short
convolutions, Mamba-2, Mamba-1, Gated DeltaNet, KDA), under chunked prefill and preemption; every
block and slot (snapshots included) goes back to its pool; drafts never keep a waiting request
from its slot; a draft model with recurrent layers is refused at start."""

from __future__ import annotations

import pytest
import transformers

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine import speculative
from serverless_llm.engine.config import ConfigError
from serverless_llm.engine.kv_cache import StateCopy
from tests.engine.family_check import family_prompts, save_family_model
from tests.engine.test_hybrid_engine import HYBRIDS, assert_books_whole, engine, space_for_slots
from tests.engine.test_speculative import NGRAM, oracle, repeating_prompts, tokens
from tests.tiny_models import build_tiny_model, build_tokenizer

NEW = 24
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    """The backoff after poor drafts off (tested in test_speculative.py): these tests need
    drafts verified."""
    monkeypatch.setattr(speculative, "BACKOFF_RATE", 0.0)


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid(request, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp(request.param))
    return save_family_model(path, HYBRIDS[request.param](build_tokenizer()))


def _prompts(path: str) -> list[list[int]]:
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    return family_prompts(vocab)[:6]


def test_rejected_drafts_leave_no_trace_in_the_state(hybrid):
    """Right drafts with one spoiled now and then (k = 3): every partly rejected run goes back
    to its snapshot; with a small step budget (chunked prefill) and too few KV blocks
    (preemption) the tokens are still plain decoding's."""
    prompts = _prompts(hybrid)
    full = tokens(engine(hybrid).generate(prompts, PARAMS))
    spec = dict(NGRAM, num_speculative_tokens=3)
    kw = dict(num_kv_blocks=24, max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4)
    llm = engine(hybrid, speculative_config=spec, **kw)
    assert llm.engine.spec is not None, "speculation off for a recurrent model"
    oracle(llm, prompts, full)
    restores = 0
    rollback = llm.engine.kv.rollback

    def counting(owner, num_tokens):
        nonlocal restores
        computed, copies = rollback(owner, num_tokens)
        restores += sum(isinstance(c, StateCopy) for c in copies)
        return computed, copies

    llm.engine.kv.rollback = counting
    assert tokens(llm.generate(prompts, PARAMS)) == full
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens > 0 and restores > 0
    assert stats.spec_accepted_tokens < stats.spec_draft_tokens  # some runs were cut
    assert_books_whole(llm)


def test_prompt_lookup_on_a_recurrent_model(hybrid):
    """ngram's own drafts (down to one-token matches) on repeating prompts, no backoff: tokens
    as without speculation."""
    vocab = transformers.AutoConfig.from_pretrained(hybrid).vocab_size
    prompts = repeating_prompts(vocab, 4)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    full = tokens(engine(hybrid).generate(prompts, params))
    llm = engine(hybrid, speculative_config=dict(NGRAM, prompt_lookup_min=1))
    assert tokens(llm.generate(prompts, params)) == full
    assert llm.engine.stats().spec_drafts > 0
    assert_books_whole(llm)


def test_spare_slots_and_waiting_requests(tmp_path):
    """Speculation gives a model with recurrent layers one spare slot per request that may
    speculate (up to disable_by_batch_size); with no room for spares, requests still run
    (drafts wait for a free slot, never a waiting request) and the tokens are plain decoding's."""
    tok = build_tokenizer()
    path = save_family_model(str(tmp_path), HYBRIDS["lfm2"](tok))
    spec = dict(NGRAM, disable_by_batch_size=2)
    assert engine(path, max_num_seqs=5).engine.state_pool.num_slots == 6
    assert engine(path, max_num_seqs=5, speculative_config=spec).engine.state_pool.num_slots == 8
    prompts = _prompts(path)[:5]  # two by two, then the last alone with a slot to spare
    full = tokens(engine(path).generate(prompts, PARAMS))
    # memory for 2 requests' states only: no spare slot while others wait
    llm = engine(
        path,
        kv_cache_space_gib=space_for_slots(path, 3),
        max_num_seqs=8,
        speculative_config=NGRAM,
    )
    assert llm.engine.state_pool.num_slots == 3
    oracle(llm, prompts, full)
    e = llm.engine
    snapshot = e.kv.snapshot_state
    left = []  # per snapshot taken: slots still free, requests waiting

    def watched(owner, num_computed):
        copy = snapshot(owner, num_computed)
        if copy is not None:
            left.append((e.state_pool.num_free, len(e.scheduler.waiting)))
        return copy

    e.kv.snapshot_state = watched
    assert tokens(llm.generate(prompts, PARAMS)) == full
    assert left and all(free >= waiting for free, waiting in left), left
    assert llm.engine.stats().spec_drafts > 0  # the last request, alone
    assert_books_whole(llm)


def test_a_draft_model_for_a_recurrent_target_and_a_recurrent_draft_refused(tmp_path):
    tok = build_tokenizer()
    target = save_family_model(str(tmp_path / "lfm2"), HYBRIDS["lfm2"](tok))
    draft = build_tiny_model(str(tmp_path / "llama"), "llama")
    prompts = _prompts(target)
    full = tokens(engine(target).generate(prompts, PARAMS))
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    llm = engine(target, speculative_config=spec)
    assert tokens(llm.generate(prompts, PARAMS)) == full
    assert llm.engine.stats().spec_draft_tokens > 0
    assert_books_whole(llm)
    with pytest.raises(ConfigError, match="recurrent layers"):
        LLM(draft, speculative_config=dict(spec, model=target), dtype="float32")

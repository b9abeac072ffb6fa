"""Speculative decoding with tensor parallelism (issue 40 item 3): rank 0 proposes (ngram's
prompt lookup; a draft model loaded whole on rank 0, vLLM's draft_tensor_parallel_size 1) and
the other rank computes the drafts' rows as any other rows of the step. Greedy tokens equal one
rank's plain decoding, drafts are verified and kept, and no KV block of either cache is left
behind; a model with recurrent layers restores its state snapshots on both ranks. eagle and mtp
heads run on rank 0 with whole copies of the target's embedding and LM head (the ranks hold
them in vocab shares) and propose there what they propose on one rank."""

from __future__ import annotations

import types

import pytest

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine import speculative
from serverless_llm.engine.llm_engine import LLMEngine
from tests.engine.family_check import save_family_model
from tests.engine.test_hybrid_engine import HYBRIDS
from tests.engine.test_speculative import NGRAM, oracle, random_prompts, repeating_prompts, tokens
from tests.engine.test_speculative_eagle import eagle3_models  # noqa: F401 (a fixture)
from tests.tiny_models import build_tokenizer

BASE = dict(block_size=8, max_model_len=256, dtype="float32", num_kv_blocks=160)


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    """The backoff after poor drafts off (tested in test_speculative.py): these tests need
    drafts verified."""
    monkeypatch.setattr(speculative, "BACKOFF_RATE", 0.0)


def _plain(model: str, prompts, params) -> list[list[int]]:
    return tokens(LLM(model, **BASE).generate(prompts, params))


def test_ngram_on_two_ranks_equals_plain_decoding(tiny_llama):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    probe = LLM(tiny_llama, **BASE)
    vocab = probe.engine.vocab_size
    prompts = random_prompts(vocab, 6) + repeating_prompts(vocab, 4)
    full = tokens(probe.generate(prompts, params))
    with LLM(tiny_llama, tensor_parallel_size=2, speculative_config=NGRAM, **BASE) as llm:
        assert llm.engine.spec is not None, "speculation turned off with two ranks"
        assert tokens(llm.generate(prompts, params)) == full  # prompt lookup's own drafts
        oracle(llm, prompts, full)  # right drafts with one spoiled now and then
        assert tokens(llm.generate(prompts, params)) == full
        stats = llm.engine.stats()
        assert stats.spec_drafts > 0 and stats.spec_accepted_tokens > 0
        pool = llm.engine.block_pool
        assert pool.num_free == pool.num_blocks, "KV blocks leaked"


def test_a_draft_model_on_two_ranks_equals_plain_decoding(tiny_llama):
    """The draft is the target itself, whole on rank 0: every draft is kept."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = random_prompts(LLM(tiny_llama, **BASE).engine.vocab_size, 5)
    full = _plain(tiny_llama, prompts, params)
    spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3}
    with LLM(tiny_llama, tensor_parallel_size=2, speculative_config=spec, **BASE) as llm:
        assert tokens(llm.generate(prompts, params)) == full
        stats = llm.engine.stats()
        assert stats.spec_draft_tokens > 0
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens  # the target's own argmax
        drafter = llm.engine.drafter
        assert drafter.pool.num_free == drafter.pool.num_blocks, "draft KV blocks leaked"
        pool = llm.engine.block_pool
        assert pool.num_free == pool.num_blocks, "KV blocks leaked"


def test_a_recurrent_model_on_two_ranks_goes_back_to_its_snapshots(tmp_path):
    """lfm2's short convolutions split over two ranks: the snapshot copies and their restores
    travel to the other rank with the next step's block copies."""
    path = save_family_model(str(tmp_path), HYBRIDS["lfm2"](build_tokenizer()))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    probe = LLM(path, **BASE)
    prompts = random_prompts(probe.engine.vocab_size, 5)
    full = tokens(probe.generate(prompts, params))
    spec = dict(NGRAM, num_speculative_tokens=3)
    with LLM(path, tensor_parallel_size=2, speculative_config=spec, **BASE) as llm:
        oracle(llm, prompts, full)  # some drafts spoiled: runs cut, states restored
        assert tokens(llm.generate(prompts, params)) == full
        stats = llm.engine.stats()
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
        e = llm.engine
        e.kv.check()
        assert e.state_pool.num_free == e.state_pool.num_slots - 1, "state slots leaked"


def _recording(llm) -> list[list[int]]:
    """Every draft run the engine's head proposes, in order."""
    drafter = llm.engine.drafter
    seen: list[list[int]] = []
    propose = drafter.propose_for

    def recording(wanted):
        propose(wanted)
        seen.extend(list(v) for v in drafter.proposals.values())

    drafter.propose_for = recording
    return seen


def _two_ranks_like_one(path: str, spec: dict, prompts, params, **kw) -> None:
    """Greedy tokens on two ranks equal one rank's plain decoding, and the head (on rank 0 with
    whole copies of the target's embedding and LM head) proposes what it proposes on one rank;
    no block of either cache, nor a state slot, is left."""
    full = tokens(LLM(path, **BASE, **kw).generate(prompts, params))
    one = LLM(path, speculative_config=spec, **BASE, **kw)
    one_seen = _recording(one)
    assert tokens(one.generate(prompts, params)) == full
    with LLM(path, tensor_parallel_size=2, speculative_config=spec, **BASE, **kw) as llm:
        e = llm.engine
        assert e.spec is not None and e.drafter.head.vocab is not None
        seen = _recording(llm)
        assert tokens(llm.generate(prompts, params)) == full
        assert e.stats().spec_draft_tokens > 0
        assert seen == one_seen
        assert e.block_pool.num_free == e.block_pool.num_blocks, "KV blocks leaked"
        assert e.drafter.pool.num_free == e.drafter.num_blocks and not e.drafter.fed
        if e.state_pool is not None:
            assert e.state_pool.num_free == e.state_pool.num_slots - 1, "state slots leaked"


def test_an_eagle_head_on_two_ranks(tiny_llama, tmp_path):
    import transformers

    from tests.engine.test_speculative_eagle_hybrid import _head

    config = transformers.AutoConfig.from_pretrained(tiny_llama)
    head = _head(str(tmp_path / "head"), config.hidden_size, config.vocab_size, False, 1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = random_prompts(config.vocab_size, 5)
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 3}
    _two_ranks_like_one(tiny_llama, spec, prompts, params)


def test_an_eagle3_head_on_two_ranks(eagle3_models):  # noqa: F811 (the fixture)
    """EAGLE-3's streams entering three target layers, caught on rank 0 (its layers' inputs are
    whole there: the residual stream is all-reduced), and its own reduced-vocabulary head."""
    target = eagle3_models["target"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = random_prompts(LLM(target, **BASE).engine.vocab_size, 5)
    spec = {"method": "eagle3", "model": eagle3_models["head"], "num_speculative_tokens": 3}
    _two_ranks_like_one(target, spec, prompts, params)


def test_qwen3_next_mtp_on_two_ranks(tmp_path):
    """Qwen3-Next's own MTP layer (test_speculative_mtp_qwen.py) beside its Gated DeltaNet
    layers split over two ranks: snapshots restored on both, drafts as on one rank."""
    from tests.engine.test_speculative_mtp_qwen import _prompts, _with_mtp

    path = _with_mtp("qwen3_next", tmp_path)["target"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    # no prefix cache: every state slot but the scratch one comes back
    _two_ranks_like_one(path, spec, _prompts(path)[:4], params, enable_prefix_caching=False)


def test_every_method_may_run_with_tensor_parallelism_and_recurrent_layers():
    layout = types.SimpleNamespace(has_state=False)
    recurrent = types.SimpleNamespace(has_state=True)  # test_speculative_hybrid.py
    for ranks in (object(), None):
        engine = types.SimpleNamespace(ranks=ranks)
        for method in ("ngram", "draft_model", "eagle", "eagle3", "mtp"):
            assert LLMEngine._speculation_off(engine, layout, method) is None
            assert LLMEngine._speculation_off(engine, recurrent, method) is None

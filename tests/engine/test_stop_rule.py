"""The one stop rule (stop_rule.py) on its own, and the step's update that applies it: any number
of new tokens per request (a speculative step's), the first that stops the request keeps it and
drops the rest, and a roll-back releases the blocks of forgotten tokens. The engine tests of EOS,
stop ids, stop strings, min_tokens, max_tokens and ignore_eos reach the same `StopRule.check`
through this update; beam search reaches it through `BeamSearch`."""

from __future__ import annotations

import random

import pytest

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.output_processor import process_token
from serverless_llm.engine.request import FinishReason
from serverless_llm.engine.scheduler import Sampled
from serverless_llm.engine.stop_rule import Stop, StopRule

EOS = 2
STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH


def rule(**kw) -> StopRule:
    max_output = kw.pop("max_output", 10)
    return StopRule.of(SamplingParams(**kw), {EOS}, max_output)


def test_eos_and_stop_ids_end_the_output_once_min_tokens_are_out():
    r = rule(stop_token_ids=[7], min_tokens=3)
    assert r.check(EOS, 2) is None and r.check(7, 2) is None  # masked before, never counted
    assert r.check(EOS, 3) == Stop(STOP, None, by_token=True)
    assert r.check(7, 3) == Stop(STOP, 7, by_token=True)
    assert r.masked_ids(2) == {EOS, 7} and r.masked_ids(3) == frozenset()
    assert r.check(5, 3) is None


def test_ignore_eos_keeps_stop_ids():
    r = rule(ignore_eos=True, stop_token_ids=[7])
    assert r.check(EOS, 1) is None and r.check(7, 1) == Stop(STOP, 7, by_token=True)
    assert r.stop_ids == {7}


def test_length_and_stop_strings():
    r = rule(max_output=4, min_tokens=2)
    assert r.check(5, 3) is None and r.check(5, 4) == Stop(LENGTH)
    assert r.check(EOS, 4) == Stop(STOP, None, by_token=True)  # EOS wins over length
    assert r.check(5, 4, stop_string="END") == Stop(STOP, "END")  # so does a stop string
    assert not r.strings_active(1) and r.strings_active(2)
    assert rule(max_output=None).check(5, 10**6) is None


# -- the update ---------------------------------------------------------------------------------


@pytest.fixture
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=64, block_size=8, max_model_len=256)


def prompt(llm, n=13, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(5, llm.engine.vocab_size) for _ in range(n)]


def one_step(llm, sampled_for):
    """Runs one real step and applies `sampled_for(request)` (token ids, rollback) instead of
    what the sampler would have drawn."""
    eng = llm.engine
    batch = eng.scheduler.schedule()
    eng.runner.execute(batch)
    sampled = []
    for r in batch.requests:
        tokens, *rollback = sampled_for(r)
        sampled.append(Sampled(r, tokens, rollback=rollback[0] if rollback else 0))
    return eng.scheduler.update(batch, sampled, process_token)


def assert_whole(llm):
    eng = llm.engine
    eng.kv.check()
    assert eng.block_pool.num_free == eng.block_pool.num_blocks


def test_several_tokens_at_once_stop_at_the_first_stop(llm):
    eng = llm.engine
    req = eng.add_request(prompt(llm), SamplingParams(stop_token_ids=[9], max_tokens=20))
    (up,) = one_step(llm, lambda r: ([5, 6, 9, 8],))
    assert up.token_ids == [5, 6, 9] and req.output_token_ids == [5, 6, 9]
    assert req.finished and req.finish_reason is STOP and req.stop_reason == 9
    assert_whole(llm)


def test_several_tokens_at_once_stop_at_max_tokens(llm):
    eng = llm.engine
    req = eng.add_request(prompt(llm), SamplingParams(max_tokens=3, ignore_eos=True))
    (up,) = one_step(llm, lambda r: ([5, 6, 7, 8, 9],))
    assert up.token_ids == [5, 6, 7] and req.finish_reason is LENGTH
    assert_whole(llm)


def test_min_tokens_and_stop_strings_over_several_tokens(llm):
    eng = llm.engine
    tok = eng.tokenizer
    ids = tok.encode("ab cd ef gh", add_special_tokens=False)
    params = SamplingParams(min_tokens=2, stop=["ef"], max_tokens=50, stop_token_ids=[ids[0]])
    req = eng.add_request(prompt(llm), params)
    # The first token is a stop id, but min_tokens keeps it going; "ef" then stops the text.
    (up,) = one_step(llm, lambda r: (ids + ids,))
    assert req.finished and req.finish_reason is STOP and req.stop_reason == "ef"
    assert "ef" not in up.text and up.text.startswith("ab")
    assert_whole(llm)


def test_a_rollback_releases_blocks_and_the_output_continues_alike(llm):
    eng = llm.engine
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    p = prompt(llm, n=30)
    want = llm.generate([p], params)[0].outputs[0].token_ids
    req = eng.add_request(p, params)
    # Prefill (30 tokens: 4 blocks of 8); then a decode step whose token is rejected, with 12
    # computed tokens forgotten: 31 -> 19 computed, block 3 freed, block 2 keeps 3 tokens.
    eng.step()
    assert req.num_computed_tokens == 30 and eng.kv.num_held(req) == 4
    (up,) = one_step(llm, lambda r: ([], 12))
    assert up.token_ids == [] and req.num_computed_tokens == 19
    assert eng.kv.num_held(req) == 3 and len(req.output_token_ids) == 1
    eng.kv.check()
    while eng.has_unfinished_requests():
        eng.step()
    assert req.output_token_ids == want
    assert_whole(llm)


def test_beam_search_ends_hypotheses_by_the_same_rule(llm):
    from serverless_llm.engine.sampling.beam_search import BeamSearch
    from serverless_llm.engine.sampling.logprobs import TokenLogprob

    r = rule(stop_token_ids=[7], min_tokens=1, max_output=3)
    search = BeamSearch(width=1, stop_rule=r)
    top = TokenLogprob(7, -0.1, 1, [7, 5, 6, EOS], [-0.1, -0.5, -2.0, -3.0])
    search.step([top])  # token 1: 7 and EOS masked by min_tokens
    assert search.live[0].token_ids == [5]
    done = search.step([top])  # token 2: 7 ends a hypothesis with its stop reason
    assert search.finished[0].stop_reason == 7 and search.finished[0].finish_reason == "stop"
    assert not done or search.finished

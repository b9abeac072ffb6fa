"""Request priority (SCHEDULING_POLICY=priority): the queue in (priority, arrival) order, the
worst running request preempted when the cache runs out, and FCFS refusing priorities."""

from __future__ import annotations

import pytest

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.config import ConfigError, EngineConfig
from serverless_llm.engine.errors import InvalidRequestError
from serverless_llm.engine.request import FinishReason

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPT_LEN, MAX_TOKENS = 20, 40  # 60 tokens: 8 blocks of 8 each; two need 16 of the 12


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    vocab = LLM(tiny_llama, num_kv_blocks=4, block_size=8, max_model_len=32).engine.vocab_size
    return [[5 + (i * 7 + j * 13) % (vocab - 5) for j in range(PROMPT_LEN)] for i in range(4)]


@pytest.fixture(scope="module")
def alone(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64, block_size=8, max_model_len=128)

    def run(prompt):
        p = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
        return llm.generate([prompt], p)[0].outputs[0].token_ids

    return run


def _cache_race(tiny_llama, prompts, policy: str, low: int, high: int, solo_steps: int = 3):
    """A request started first and run `solo_steps` steps alone, then a second one; the
    12-block cache cannot hold both to the end. Returns both requests and their tokens."""
    llm = LLM(
        tiny_llama,
        num_kv_blocks=12,
        block_size=8,
        max_model_len=96,
        scheduling_policy=policy,
    )
    engine = llm.engine
    p = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
    tokens: dict[str, list[int]] = {"first": [], "second": []}

    def step():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids

    first = engine.add_request(prompts[0], p, "first", priority=low)
    for _ in range(solo_steps):
        step()
    assert first.num_computed_tokens > PROMPT_LEN  # it is decoding
    second = engine.add_request(prompts[1], p, "second", priority=high)
    while engine.has_unfinished_requests():
        step()
    assert engine.block_pool.num_free == 12
    return first, second, tokens


# 3 solo steps: the low one is short of a block first and gives way itself; 9: the high one is,
# and the low one, already granted this step's token, is taken out of the step.
@pytest.mark.parametrize("solo_steps", [3, 9])
def test_high_priority_preempts_the_low_one_started_first(tiny_llama, prompts, alone, solo_steps):
    low, high, tokens = _cache_race(tiny_llama, prompts, "priority", 5, 0, solo_steps)
    assert low.num_preemptions >= 1  # older, but worse: it gave way
    assert high.num_preemptions == 0
    assert low.finish_reason is FinishReason.LENGTH and high.finish_reason is FinishReason.LENGTH
    assert tokens["first"] == alone(prompts[0])
    assert tokens["second"] == alone(prompts[1])


def test_fcfs_preempts_the_newest_instead(tiny_llama, prompts, alone):
    first, second, tokens = _cache_race(tiny_llama, prompts, "fcfs", low=0, high=0)
    assert first.num_preemptions == 0
    assert second.num_preemptions >= 1
    assert tokens["first"] == alone(prompts[0])
    assert tokens["second"] == alone(prompts[1])


def test_equal_priorities_preempt_the_latest_arrival(tiny_llama, prompts, alone):
    first, second, tokens = _cache_race(tiny_llama, prompts, "priority", low=3, high=3)
    assert first.num_preemptions == 0
    assert second.num_preemptions >= 1
    assert tokens["first"] == alone(prompts[0])


def test_waiting_requests_are_served_by_priority_then_arrival(tiny_llama, prompts):
    llm = LLM(
        tiny_llama,
        num_kv_blocks=64,
        block_size=8,
        max_model_len=128,
        max_num_seqs=1,
        scheduling_policy="priority",
    )
    engine = llm.engine
    p = SamplingParams(max_tokens=3, **GREEDY)
    for rid, prio, prompt in [("a", 5, 0), ("b", 1, 1), ("c", 1, 2), ("d", -2, 3)]:
        engine.add_request(prompts[prompt], p, rid, priority=prio)
    assert [r.request_id for r in engine.scheduler.waiting] == ["d", "b", "c", "a"]
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["d", "b", "c", "a"]


def test_offline_generate_takes_priorities(tiny_llama, prompts, alone):
    llm = LLM(
        tiny_llama, num_kv_blocks=64, block_size=8, max_model_len=128, scheduling_policy="priority"
    )
    outs = llm.generate(
        prompts[:2], SamplingParams(max_tokens=MAX_TOKENS, **GREEDY), priority=[3, 1]
    )
    assert [o.outputs[0].token_ids for o in outs] == [alone(prompts[0]), alone(prompts[1])]
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        llm.generate(prompts[:2], priority=[1])


def test_fcfs_refuses_a_priority_naming_the_setting(tiny_llama, prompts):
    llm = LLM(tiny_llama, num_kv_blocks=16, block_size=8, max_model_len=96)
    with pytest.raises(InvalidRequestError, match="SCHEDULING_POLICY=priority") as info:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), priority=[1])
    assert info.value.param == "priority"
    with pytest.raises(InvalidRequestError, match="SCHEDULING_POLICY=priority"):
        llm.engine.add_request(prompts[0], SamplingParams(max_tokens=2), priority=-1)
    assert not llm.engine.has_unfinished_requests()
    # Zero is every request's priority: accepted.
    assert llm.generate(prompts[:1], SamplingParams(max_tokens=2), priority=[0])[0].finished


def test_unknown_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="scheduling_policy='lifo'"):
        EngineConfig(scheduling_policy="lifo")


def test_beam_search_and_plain_requests_under_the_priority_policy(tiny_llama, prompts):
    """A beam search's steps queue their next beams ahead of their priority class: mixed with
    plain requests of other priorities in a cache too small for all, every result equals the
    FCFS engine's."""
    beams = SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0.0, max_tokens=8)
    plain = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
    params = [beams, plain, beams, plain]
    results = {}
    for policy, priority in (("fcfs", None), ("priority", [2, 0, -1, 1])):
        llm = LLM(
            tiny_llama,
            num_kv_blocks=14,
            block_size=8,
            max_model_len=96,
            max_num_seqs=6,
            scheduling_policy=policy,
        )
        outs = llm.generate(prompts, params, priority=priority)
        results[policy] = [[o.token_ids for o in out.outputs] for out in outs]
        assert llm.engine.block_pool.num_free == 14
        assert llm.engine.scheduler.num_preemptions > 0  # the cache was short under both
    assert results["priority"] == results["fcfs"]

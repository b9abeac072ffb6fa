"""Engine behaviour on the tiny Llama: preemption, chunked prefill, aborts, limits, errors."""

from __future__ import annotations

import random

import pytest

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.llm_engine import InvalidRequestError
from serverless_llm.engine.sampling import SamplingParamsError

GREEDY = dict(temperature=0.0, ignore_eos=True)


def random_prompts(n: int, vocab: int, seed: int, lo: int = 2, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def alone(tiny_llama):
    """Greedy outputs of requests run one at a time, with a roomy cache."""
    llm = LLM(tiny_llama, num_kv_blocks=64, block_size=16, max_model_len=256)

    def run(prompt, max_tokens):
        p = SamplingParams(max_tokens=max_tokens, **GREEDY)
        return llm.generate([prompt], p)[0].outputs[0].token_ids

    return run


def test_preemption_keeps_outputs_identical(tiny_llama, alone):
    # 64 requests of up to 40 + 32 tokens need up to 64 * 9 blocks of 8; the pool has 40.
    llm = LLM(tiny_llama, num_kv_blocks=40, block_size=8, max_model_len=128, max_num_seqs=64)
    prompts = random_prompts(64, llm.engine.vocab_size, seed=1)
    params = [SamplingParams(max_tokens=16 + i % 17, **GREEDY) for i in range(64)]
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, p, out in zip(prompts, params, outs):
        assert out.outputs[0].token_ids == alone(prompt, p.max_tokens)
    assert llm.engine.block_pool.num_free == 40


def test_chunked_prefill_matches_unchunked(tiny_llama, alone):
    llm = LLM(
        tiny_llama, num_kv_blocks=64, block_size=8, max_model_len=256, max_num_batched_tokens=16
    )
    prompts = random_prompts(3, llm.engine.vocab_size, seed=2, lo=50, hi=90)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    for prompt, out in zip(prompts, outs):
        assert len(prompt) > 16
        assert out.outputs[0].token_ids == alone(prompt, 24)


def test_step_token_budget_is_respected(tiny_llama):
    llm = LLM(
        tiny_llama,
        num_kv_blocks=64,
        block_size=8,
        max_model_len=256,
        max_num_batched_tokens=10,
        max_num_seqs=3,
    )
    eng = llm.engine
    seen = []
    schedule = eng.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        seen.append((batch.total_tokens, len(eng.scheduler.running)))
        return batch

    eng.scheduler.schedule = recording_schedule
    prompts = random_prompts(5, eng.vocab_size, seed=3, lo=8, hi=30)
    llm.generate(prompts, SamplingParams(max_tokens=5, **GREEDY))
    assert seen and all(tokens <= 10 and running <= 3 for tokens, running in seen)
    assert max(tokens for tokens, _ in seen) == 10  # the budget was used, not just respected
    assert eng.block_pool.num_free == 64


def test_abort_frees_blocks_at_once(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64, block_size=8, max_model_len=256)
    eng = llm.engine
    reqs = [
        eng.add_request(p, SamplingParams(max_tokens=50, **GREEDY))
        for p in random_prompts(6, eng.vocab_size, 4)
    ]
    for _ in range(3):
        eng.step()
    assert eng.block_pool.num_free < 64
    for r in reqs[:3]:
        out = eng.abort_request(r.request_id)
        assert out.finished and out.finish_reason == "abort"
    held = sum(eng.kv.num_held(r) for r in reqs[3:])
    assert eng.block_pool.num_free == 64 - held
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.block_pool.num_free == 64
    assert eng.abort_request("no-such-request") is None


def test_eos_and_stop_token_ids(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64, max_model_len=256)
    prompt = random_prompts(1, llm.engine.vocab_size, 5)[0]
    free_run = llm.generate([prompt], SamplingParams(max_tokens=20, **GREEDY))[0].outputs[0]
    stop_tok = free_run.token_ids[5]
    first = free_run.token_ids.index(stop_tok)
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_tok])
    )[0].outputs[0]
    assert out.token_ids == free_run.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # The same token as EOS (without ignore_eos) stops too, with no stop_reason.
    llm.engine.eos_token_ids = {stop_tok}
    out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids == free_run.token_ids[: first + 1]


def test_length_limits_and_empty_prompt(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64, max_model_len=64)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([[7] * 50], SamplingParams(max_tokens=20))
    msg = str(e.value)
    assert "64" in msg and "50" in msg and "20" in msg and "max_model_len" in msg
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([""], SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(InvalidRequestError, match="out of range"):
        llm.generate([[10**6]], SamplingParams())
    with pytest.raises(InvalidRequestError, match="no room"):
        llm.generate([[7] * 64], SamplingParams(max_tokens=None))
    # max_tokens=None runs to max_model_len.
    out = llm.generate([[7] * 60], SamplingParams(max_tokens=None, **GREEDY))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    # Nothing of the rejected requests stayed behind.
    assert llm.engine.block_pool.num_free == 64 and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=0),
        dict(max_tokens=-3),
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-2),
    ],
)
def test_bad_sampling_params_are_rejected(kwargs):
    with pytest.raises(SamplingParamsError):
        SamplingParams(**kwargs)


def test_sampling_is_seeded_and_batch_independent(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=128, max_model_len=256)
    prompts = random_prompts(8, llm.engine.vocab_size, 6)
    seeded = SamplingParams(
        max_tokens=30, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    alone_out = llm.generate([prompts[0]], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True) for _ in prompts[1:]]
    batch_out = llm.generate(prompts, [seeded, *others])[0].outputs[0].token_ids
    assert alone_out == batch_out
    greedy = (
        llm.generate([prompts[0]], SamplingParams(max_tokens=30, **GREEDY))[0].outputs[0].token_ids
    )
    assert alone_out != greedy  # sampling did sample


def test_block_sizes(tiny_llama, alone):
    prompt = random_prompts(1, 300, 7, lo=30, hi=30)[0]
    want = alone(prompt, 40)
    for bs in (8, 16, 32):
        llm = LLM(tiny_llama, num_kv_blocks=256 // bs, block_size=bs, max_model_len=256)
        assert (
            llm.generate([prompt], SamplingParams(max_tokens=40, **GREEDY))[0].outputs[0].token_ids
            == want
        )


def test_uninitialised_cache_memory_is_never_read(tiny_llama, alone):
    """The CPU cache is allocated without zero-filling; poison everything but block 0 with NaN
    and the outputs must not change (no slot is read before it is written)."""
    llm = LLM(tiny_llama, num_kv_blocks=40, block_size=8, max_model_len=128, max_num_seqs=16)
    for cache in llm.engine.kv_caches:
        cache[:, 1:].fill_(float("nan"))
    prompts = random_prompts(16, llm.engine.vocab_size, seed=13)
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, **GREEDY))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == alone(prompt, 20)

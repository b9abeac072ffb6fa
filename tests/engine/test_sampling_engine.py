"""Sampling parameters through the engine on the tiny random Llama: seeds, logprobs against
transformers, stop strings, min_tokens, truncation of the prompt, n and best_of."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.async_engine import AsyncEngine
from serverless_llm.engine.llm_engine import InvalidRequestError
from serverless_llm.engine.sampling.params import sequence_params
from tests.engine.reference import hf_model

EVERYTHING = dict(
    temperature=0.9,
    top_k=50,
    top_p=0.95,
    min_p=0.02,
    top_a=0.05,
    tfs=0.98,
    eta_cutoff=2.0,
    epsilon_cutoff=1.0,
    typical_p=0.98,
    smoothing_factor=0.2,
    smoothing_curve=1.5,
    presence_penalty=0.4,
    frequency_penalty=0.3,
    repetition_penalty=1.2,
    logit_bias={20: 2.0, 21: -3.0},
    min_tokens=3,
    ignore_eos=True,
)


def prompts(n: int, vocab: int, seed: int, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=128, block_size=16, max_model_len=256, max_num_seqs=64)


def various_params(i: int) -> SamplingParams:
    """Sixteen different requests: greedy, plain, truncated, penalised, with logprobs."""
    options = [
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.8),
        dict(temperature=1.2, top_k=5),
        dict(min_p=0.1),
        dict(typical_p=0.9, seed=99),
        dict(tfs=0.9),
        dict(repetition_penalty=1.5, temperature=0.0),
        dict(presence_penalty=1.0, top_a=0.2),
        dict(eta_cutoff=5.0, logprobs=3),
        dict(epsilon_cutoff=3.0, allowed_token_ids=list(range(5, 200))),
        dict(smoothing_factor=0.5),
        dict(temperature=0.5, top_k=3, top_p=0.5),
        dict(frequency_penalty=1.5, seed=7),
        dict(logit_bias={9: 50.0}),
        dict(temperature=2.0, min_p=0.3, seed=5),
    ]
    return SamplingParams(max_tokens=24, ignore_eos=True, **options[i % len(options)])


def test_seeded_text_is_the_same_alone_in_a_batch_and_under_preemption(llm, tiny_llama):
    vocab = llm.engine.vocab_size
    prompt = prompts(1, vocab, 1)[0]
    seeded = SamplingParams(max_tokens=40, seed=1234, **EVERYTHING)
    alone = llm.generate([prompt], seeded)[0].outputs[0]
    others = prompts(15, vocab, 2)
    batch = llm.generate(
        [*others[:7], prompt, *others[7:]],
        [
            *[various_params(i) for i in range(7)],
            seeded,
            *[various_params(i) for i in range(7, 15)],
        ],
    )
    assert batch[7].outputs[0].token_ids == alone.token_ids
    assert batch[7].outputs[0].text == alone.text
    # A tiny KV pool: requests get preempted and recomputed mid-generation.
    small = LLM(tiny_llama, num_kv_blocks=24, block_size=8, max_model_len=128, max_num_seqs=16)
    again = small.generate(
        [*others[:7], prompt, *others[7:]],
        [
            *[various_params(i) for i in range(7)],
            seeded,
            *[various_params(i) for i in range(7, 15)],
        ],
    )
    assert small.engine.scheduler.num_preemptions > 0
    assert again[7].outputs[0].token_ids == alone.token_ids
    # Every seeded request of the batch is reproducible too.
    for i, out in enumerate(again):
        if i != 7 and out is not None:
            p = various_params(i if i < 7 else i - 1)
            if p.seed is not None or p.greedy:
                assert out.outputs[0].token_ids == batch[i].outputs[0].token_ids
    other_seed = dataclasses.replace(seeded, seed=4321)
    assert llm.generate([prompt], other_seed)[0].outputs[0].token_ids != alone.token_ids


def hf_log_softmax(path: str, ids: list[int]) -> torch.Tensor:
    model = hf_model(path)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("chunked", [False, True])
def test_logprobs_and_prompt_logprobs_equal_transformers(tiny_llama, chunked):
    kwargs = dict(max_num_batched_tokens=16) if chunked else {}
    llm = LLM(tiny_llama, num_kv_blocks=64, block_size=8, max_model_len=256, **kwargs)
    vocab = llm.engine.vocab_size
    prompt = prompts(1, vocab, 3, lo=40, hi=40)[0]
    params = SamplingParams(
        max_tokens=12,
        logprobs=5,
        prompt_logprobs=4,
        seed=3,
        temperature=1.0,
        top_k=20,
        repetition_penalty=1.3,
        ignore_eos=True,
    )
    # Twice: the second run finds the prompt's blocks cached and must still compute them.
    for _ in range(2):
        out = llm.generate([prompt], params)[0]
        seq = out.outputs[0]
        ref = hf_log_softmax(tiny_llama, prompt + seq.token_ids)
        assert len(seq.logprobs) == len(seq.token_ids) == 12
        total = 0.0
        for j, (tok, entry) in enumerate(zip(seq.token_ids, seq.logprobs)):
            row = ref[len(prompt) - 1 + j]
            assert abs(entry[tok].logprob - float(row[tok])) < 1e-4
            total += float(row[tok])
            top = row.topk(5)
            ranked = sorted(
                ((t, lp) for t, lp in entry.items() if lp.rank is not None),
                key=lambda kv: kv[1].rank,
            )
            assert [t for t, _ in ranked][:5] == top.indices.tolist()
            for (_, lp), want in zip(ranked, top.values.tolist()):
                assert abs(lp.logprob - want) < 1e-4
            assert len(entry) in (5, 6)  # the sampled token is always there
        assert abs(seq.cumulative_logprob - total) < 1e-3
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            entry = out.prompt_logprobs[i]
            row = ref[i - 1]
            tok = prompt[i]
            assert abs(entry[tok].logprob - float(row[tok])) < 1e-4
            assert entry[tok].rank == int((row > row[tok]).sum()) + 1
            assert len([t for t, lp in entry.items() if lp.rank is not None]) >= 4
        assert llm.engine.block_pool.num_free == 64


def test_logprobs_through_the_async_engine_arrive_per_token(llm):
    prompt = prompts(1, llm.engine.vocab_size, 4)[0]
    params = SamplingParams(
        max_tokens=6, logprobs=2, prompt_logprobs=0, temperature=0.0, ignore_eos=True
    )

    async def run():
        engine = AsyncEngine(llm.engine)
        outs = [o async for o in engine.generate(prompt, params)]
        await engine.shutdown()
        return outs

    outs = asyncio.run(run())
    assert all(len(o.logprobs) == len(o.new_token_ids) for o in outs)
    assert [o.logprobs[0].token_id for o in outs] == [o.new_token_ids[0] for o in outs]
    assert all(o.logprobs[0].rank == 1 for o in outs)  # greedy picks the top token
    assert outs[0].prompt_logprobs is not None and len(outs[0].prompt_logprobs) == len(prompt)
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert outs[-1].cumulative_logprob == pytest.approx(sum(o.logprobs[0].logprob for o in outs))


# -- stop strings -----------------------------------------------------------------------------


def free_run(llm, prompt, n=40):
    p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    req = llm.engine.add_request(prompt, p)
    pieces = []
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            pieces.append(out.new_text)
    return req.output_token_ids, pieces


def spanning_stop(pieces: list[str]) -> tuple[str, int]:
    """A stop string that starts inside one token's text and ends inside a later one's."""
    text = "".join(pieces)
    pos = 0
    for a, b in zip(pieces, pieces[1:]):
        pos += len(a)
        if len(a) >= 2 and len(b) >= 2 and text.find(a[-2:] + b[:2]) == pos - 2:
            return a[-2:] + b[:2], pos - 2
    raise AssertionError(f"no two neighbouring tokens with 2+ characters: {pieces}")


def find_prompt_with_spanning_stop(llm):
    for seed in range(50):
        prompt = prompts(1, llm.engine.vocab_size, 100 + seed)[0]
        _, pieces = free_run(llm, prompt)
        try:
            return prompt, pieces, spanning_stop(pieces)
        except AssertionError:
            continue
    raise AssertionError("no prompt gives a stop string spanning tokens")


def test_stop_string_spanning_tokens_is_cut_exactly(llm):
    prompt, pieces, (stop, at) = find_prompt_with_spanning_stop(llm)
    text = "".join(pieces)
    base = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    out = llm.generate([prompt], SamplingParams(stop=[stop], **base))[0].outputs[0]
    assert out.text == text[:at]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate(
        [prompt],
        SamplingParams(stop=["never there", stop], include_stop_str_in_output=True, **base),
    )[0].outputs[0]
    assert out.text == text[: at + len(stop)]
    assert out.stop_reason == stop
    # The earliest of several stop strings wins.
    late = text[at + 2 : at + 6]
    if late and late not in text[: at + 2]:
        out = llm.generate([prompt], SamplingParams(stop=[late, stop], **base))[0].outputs[0]
        assert out.stop_reason == stop


def test_streamed_text_never_shows_a_stop_string(llm):
    prompt, pieces, (stop, at) = find_prompt_with_spanning_stop(llm)
    text = "".join(pieces)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])

    async def run():
        engine = AsyncEngine(llm.engine)
        outs = [o async for o in engine.generate(prompt, params)]
        await engine.shutdown()
        return outs

    outs = asyncio.run(run())
    shown = ""
    for o in outs:
        shown += o.new_text
        assert stop not in shown
        # What was shown is never taken back: it stays a prefix of the final text.
        assert text[:at].startswith(shown)
    assert shown == text[:at]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop


def test_stop_token_text_is_left_out_unless_asked(llm):
    prompt = prompts(1, llm.engine.vocab_size, 5)[0]
    ids, pieces = free_run(llm, prompt, 20)
    k = next(i for i in range(3, 20) if pieces[i] and ids[i] not in ids[:i])
    base = dict(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[ids[k]])
    out = llm.generate([prompt], SamplingParams(**base))[0].outputs[0]
    assert out.token_ids == ids[: k + 1] and out.stop_reason == ids[k]
    assert out.text == "".join(pieces[:k])
    out = llm.generate([prompt], SamplingParams(include_stop_str_in_output=True, **base))[0]
    assert out.outputs[0].text == "".join(pieces[: k + 1])


def test_min_tokens_masks_stop_tokens_until_reached(llm):
    prompt = prompts(1, llm.engine.vocab_size, 6)[0]
    ids, _ = free_run(llm, prompt, 20)
    stop = ids[0]
    p = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    assert llm.generate([prompt], p)[0].outputs[0].token_ids == [stop]
    out = llm.generate([prompt], dataclasses.replace(p, min_tokens=4))[0].outputs[0]
    assert stop not in out.token_ids[:4] and len(out.token_ids) >= 4
    if stop in out.token_ids:
        assert out.finish_reason == "stop" and out.token_ids[-1] == stop
    # EOS is masked the same way (the engine's EOS set, unless ignore_eos).
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = {stop}
    try:
        p = SamplingParams(max_tokens=20, temperature=0.0, min_tokens=5)
        out = llm.generate([prompt], p)[0].outputs[0]
        assert stop not in out.token_ids[:5] and len(out.token_ids) >= 5
    finally:
        engine.eos_token_ids = saved


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    prompt = prompts(1, llm.engine.vocab_size, 7, lo=40, hi=40)[0]
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = llm.generate([prompt[-12:]], p)[0]
    got = llm.generate([prompt], dataclasses.replace(p, truncate_prompt_tokens=12))[0]
    assert got.prompt_token_ids == prompt[-12:]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_n_and_best_of(llm):
    prompt = prompts(1, llm.engine.vocab_size, 8)[0]
    p = SamplingParams(max_tokens=10, n=2, best_of=5, seed=11, ignore_eos=True)
    out = llm.generate([prompt], p)[0]
    assert [o.index for o in out.outputs] == [0, 1]
    assert out.outputs[0].logprobs is None  # not asked for
    scores = [o.cumulative_logprob for o in out.outputs]
    assert scores == sorted(scores, reverse=True)
    # The same as running the five sequences by hand and keeping the two most likely.
    singles = [llm.generate([prompt], c)[0].outputs[0] for c in sequence_params(p)]
    best = sorted(singles, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in best]
    assert llm.generate([prompt], p)[0].outputs[0].token_ids == out.outputs[0].token_ids
    # n without best_of: n different seeded sequences, in order.
    many = llm.generate([prompt], SamplingParams(max_tokens=10, n=3, seed=11, ignore_eos=True))
    assert len(many[0].outputs) == 3
    assert many[0].outputs[0].token_ids == singles[0].token_ids
    assert len({tuple(o.token_ids) for o in many[0].outputs}) == 3


def test_token_ids_out_of_the_vocabulary_are_rejected(llm):
    vocab = llm.engine.vocab_size
    for kwargs in (
        dict(stop_token_ids=[vocab]),
        dict(allowed_token_ids=[vocab + 1]),
        dict(logit_bias={vocab: 1.0}),
    ):
        with pytest.raises(InvalidRequestError) as info:
            llm.generate([[5, 6]], SamplingParams(**kwargs))
        assert info.value.param == next(iter(kwargs))
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        llm.generate(
            [[5, 6]], SamplingParams(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=2)
        )
    assert not llm.engine.has_unfinished_requests()


def test_an_engine_request_runs_one_sequence(llm):
    with pytest.raises(InvalidRequestError) as info:
        llm.engine.inputs.make_request([5, 6], SamplingParams(n=2))
    assert info.value.param == "n"

"""Speculative decoding, ngram (speculative.py): greedy output token for token what decoding
without it gives, drafts accepted, runs cut by max_tokens and stop strings where plain decoding
cuts them, preemption and prefix caching, no KV block left behind."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine import speculative
from serverless_llm.engine.config import ConfigError, EngineConfig
from serverless_llm.engine.outputs import SpecDecodeStats
from serverless_llm.engine.speculative import (
    BACKOFF_RATE,
    BACKOFF_TOKENS,
    DISABLE_BY_BATCH_SIZE,
    accept_greedy,
    backing_off,
    note_verified,
    parse_speculative_config,
    probe_drafts,
    propose_ngram,
)

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
    # every batch size speculates here: these tests check what speculation computes, not the
    # rule that turns it off (test_the_off_rules below)
    "disable_by_batch_size": None,
}


@pytest.fixture(autouse=True)
def no_backoff(request, monkeypatch):
    """The backoff after poor drafts (speculative.py) off, but in the test of the off rules:
    the tiny random models' drafts are mostly wrong, and these tests need drafts verified to
    check what verification computes."""
    if request.node.name != "test_the_off_rules":
        monkeypatch.setattr(speculative, "BACKOFF_RATE", 0.0)


def repeating_prompts(vocab: int, n: int) -> list[list[int]]:
    rng = random.Random(40)
    out = []
    for i in range(n):
        motif = [rng.randrange(5, vocab) for _ in range(rng.randint(5, 11))]
        out.append(motif * (3 + i % 3) + motif[: i % 4])
    return out


def random_prompts(vocab: int, n: int) -> list[list[int]]:
    rng = random.Random(41)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(4, 30))] for _ in range(n)]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def engines(model: str, **kw) -> tuple[LLM, LLM]:
    base = dict(block_size=8, max_model_len=256, dtype="float32")
    base.update(kw)
    return LLM(model, **base), LLM(model, speculative_config=NGRAM, **base)


def test_propose_ngram_takes_the_longest_most_recent_match():
    seq = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # "2 3" last occurred at 6..7 (followed by 7 8 5); "5 2 3" never did.
    assert propose_ngram(seq, 2, 4, 3) == [7, 8, 5]
    assert propose_ngram(seq, 2, 4, 10) == [7, 8, 5, 2, 3]
    assert propose_ngram([1, 2, 3, 4], 2, 4, 3) == []
    # A longer match wins over a more recent shorter one.
    seq = [4, 1, 2, 6, 0, 1, 2, 7, 4, 1, 2]
    assert propose_ngram(seq, 2, 3, 1) == [6]
    assert propose_ngram(seq, 2, 2, 1) == [7]


def test_accept_greedy_keeps_the_matching_prefix_and_one_more():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_greedy([5, 6, 7], [1, 6, 7, 8]) == [1]


def test_config_parses_ngram_and_refuses_other_methods():
    spec = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    )
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        3,
        5,
        5,
    )
    assert parse_speculative_config(None) is None
    for bad, says in [
        ({"method": "medusa", "num_speculative_tokens": 3}, "only 'ngram'"),
        ({"num_speculative_tokens": 3}, "needs a method"),
        ({"method": "ngram", "num_speculative_tokens": 0, "prompt_lookup_max": 2}, ">= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2}, "prompt_lookup_max"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 3,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ("{not json", "not valid JSON"),
    ]:
        with pytest.raises(ConfigError, match=says):
            EngineConfig(speculative_config=bad)


def with_k(k: int) -> dict:
    return dict(NGRAM, num_speculative_tokens=k)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_16_prompts_by_64_tokens_identical_under_chunked_prefill(tiny_llama, k):
    # A 24-token step budget: prompts are chunked, and drafts share what a step has left.
    kw = dict(block_size=8, max_model_len=256, dtype="float32", max_num_batched_tokens=24)
    plain = LLM(tiny_llama, **kw)
    spec = LLM(tiny_llama, speculative_config=with_k(k), **kw)
    vocab = plain.engine.vocab_size
    prompts = repeating_prompts(vocab, 10) + random_prompts(vocab, 6)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    assert tokens(spec.generate(prompts, params)) == tokens(plain.generate(prompts, params))
    stats = spec.engine.stats()
    assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_greedy_output_is_identical_and_drafts_are_accepted(tiny_llama):
    plain, spec = engines(tiny_llama)
    vocab = plain.engine.vocab_size
    prompts = repeating_prompts(vocab, 6) + random_prompts(vocab, 4)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = tokens(plain.generate(prompts, params))
    got = tokens(spec.generate(prompts, params))
    assert got == want
    stats = spec.engine.stats()
    assert stats.speculative and 0 < stats.spec_drafts <= stats.spec_draft_tokens
    assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    off = plain.engine.stats()
    assert not off.speculative and off.spec_draft_tokens == 0
    # One at a time as well as batched.
    for p in prompts[:3]:
        assert tokens(spec.generate([p], params)) == tokens(plain.generate([p], params))


def test_max_tokens_and_stop_strings_cut_where_plain_decoding_does(tiny_llama):
    plain, spec = engines(tiny_llama)
    vocab = plain.engine.vocab_size
    prompts = repeating_prompts(vocab, 6)
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = tokens(plain.generate(prompts, free))
    for max_tokens in (1, 2, 3, 5, 7, 13):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        got = tokens(spec.generate(prompts, params))
        assert got == [t[:max_tokens] for t in full]
    # A stop string and a stop token taken from inside each output's accepted runs.
    tok = plain.get_tokenizer()
    for i, p in enumerate(prompts):
        text = tok.decode(full[i])
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        if not stop.strip():
            continue
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
        a = plain.generate([p], params)[0].outputs[0]
        b = spec.generate([p], params)[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        stop_id = full[i][len(full[i]) // 2]
        params = SamplingParams(
            temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id]
        )
        a = plain.generate([p], params)[0].outputs[0]
        b = spec.generate([p], params)[0].outputs[0]
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens > 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_preemption_and_prefix_caching(tiny_llama):
    # A small cache: the batch preempts; the prompts share blocks through the prefix cache.
    plain, spec = engines(tiny_llama, num_kv_blocks=24, max_model_len=96)
    vocab = plain.engine.vocab_size
    prompts = repeating_prompts(vocab, 8)
    prompts = [p[:40] for p in prompts] + [prompts[0][:40]] * 2
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = tokens(plain.generate(prompts, params))
    got = tokens(spec.generate(prompts, params))
    assert got == want
    again = tokens(spec.generate(prompts, params))  # now from cached prefixes
    assert again == want
    stats = spec.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.spec_accepted_tokens > 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_sampled_requests_decode_beside_speculating_ones(tiny_llama):
    plain, spec = engines(tiny_llama)
    vocab = plain.engine.vocab_size
    prompts = repeating_prompts(vocab, 6)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
    mixed = [sampled, greedy] * 3
    assert tokens(spec.generate(prompts, mixed)) == tokens(plain.generate(prompts, mixed))
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens > 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_a_run_cut_by_a_stop_keeps_no_kv_past_it(tiny_llama):
    """A stop inside an accepted run leaves the request as plain decoding would: the KV of
    every token but the last computed, nothing after it (so no block is keyed with it)."""
    plain, spec = engines(tiny_llama)
    vocab = plain.engine.vocab_size
    prompts = repeating_prompts(vocab, 6)
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = tokens(plain.generate(prompts, free))
    engine = spec.engine
    reqs = []
    for p, out in zip(prompts, full):
        for cut in (3, 9, 17):
            params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[out[cut]])
            reqs.append((engine.add_request(p, params), out[: out.index(out[cut]) + 1]))
    while engine.has_unfinished_requests():
        engine.step()
    for req, want in reqs:
        assert req.output_token_ids == want
        assert req.num_computed_tokens == req.num_tokens - 1
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


# The tiny random model rarely repeats itself, so ngram drafts are seldom right. To drive long
# accepted runs through verification, roll-back and stops, these tests swap in a proposer
# that knows plain greedy decoding's output (and spoils one draft in a few, so runs are also
# cut short): whatever the drafts, the output must stay what plain decoding gives.


def oracle(llm: LLM, prompts: list[list[int]], full: list[list[int]]):
    known = {tuple(p): out for p, out in zip(prompts, full)}
    engine = llm.engine
    vocab = engine.vocab_size

    def propose(req, room):
        k = engine.draft_room(req, room)
        out = known.get(tuple(req.prompt_token_ids))
        if k < 1 or out is None:
            return []
        n = len(req.output_token_ids)
        drafts = list(out[n : n + k])
        bad = n % (k + 3)  # spoil one draft in some steps
        if bad < len(drafts):
            drafts[bad] = (drafts[bad] + 1) % vocab
        return drafts

    engine.scheduler.propose = propose


def test_known_drafts_long_runs_identical_with_preemption_and_prefix_cache(tiny_llama):
    kw = dict(num_kv_blocks=30, max_model_len=128, max_num_batched_tokens=32)
    plain, spec = engines(tiny_llama, **kw)
    vocab = plain.engine.vocab_size
    prompts = random_prompts(vocab, 8)
    prompts = prompts + [prompts[0], prompts[1] + prompts[2]]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    full = tokens(plain.generate(prompts, params))
    oracle(spec, prompts, full)
    first = spec.generate(prompts, params)
    assert tokens(first) == full
    after_first = spec.engine.stats().speculation
    assert tokens(spec.generate(prompts, params)) == full  # again, from cached prefixes
    stats = spec.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_accepted_tokens > stats.spec_draft_tokens // 4
    assert stats.spec_accepted_tokens < stats.spec_draft_tokens  # some were rejected
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    # Visibility: each request's counts (its CompletionOutput) add up to the engine's; the
    # rates follow from the counts.
    per_request = [o.outputs[0].speculation for o in first]
    assert all(s is not None and s.verifications > 0 for s in per_request)
    for s in per_request:
        assert s.acceptance_rate == s.accepted_tokens / s.draft_tokens
        assert 1.0 <= s.mean_accepted_length <= 1 + NGRAM["num_speculative_tokens"]
    assert after_first.verifications == sum(s.verifications for s in per_request)
    assert after_first.draft_tokens == sum(s.draft_tokens for s in per_request)
    assert after_first.accepted_tokens == sum(s.accepted_tokens for s in per_request)
    total = stats.speculation
    assert total.mean_accepted_length == pytest.approx(
        (stats.spec_accepted_tokens + stats.spec_drafts) / stats.spec_drafts
    )
    assert tokens(plain.generate(prompts[:1], params)) == full[:1]
    assert plain.generate(prompts[:1], params)[0].outputs[0].speculation is None


def test_the_off_rules(tiny_llama):
    """Speculation turns itself off (issue 40 item 3): in steps with more running requests than
    disable_by_batch_size (default DISABLE_BY_BATCH_SIZE, measured; null: never), and for
    BACKOFF_TOKENS tokens of a request whose recent drafts were mostly rejected. Output is
    plain decoding's either way."""
    spec = parse_speculative_config(dict(NGRAM, disable_by_batch_size=3))
    assert spec.disable_by_batch_size == 3
    default = {k: v for k, v in NGRAM.items() if k != "disable_by_batch_size"}
    assert parse_speculative_config(default).disable_by_batch_size == DISABLE_BY_BATCH_SIZE
    assert parse_speculative_config(NGRAM).disable_by_batch_size is None
    for bad in (0, -1, "4", 2.5):
        with pytest.raises(ConfigError, match="disable_by_batch_size"):
            parse_speculative_config(dict(NGRAM, disable_by_batch_size=bad))

    base = dict(block_size=8, max_model_len=256, dtype="float32")
    plain = LLM(tiny_llama, **base)
    vocab = plain.engine.vocab_size
    prompts = random_prompts(vocab, 3)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    full = tokens(plain.generate(prompts, params))
    for limit, drafts in ((2, False), (3, True)):
        llm = LLM(tiny_llama, speculative_config=dict(NGRAM, disable_by_batch_size=limit), **base)
        oracle(llm, prompts, full)  # right drafts but one spoiled now and then
        assert tokens(llm.generate(prompts, params)) == full
        assert (llm.engine.stats().spec_drafts > 0) is drafts, limit

    # every draft wrong: after the first verification the request stops proposing for
    # BACKOFF_TOKENS tokens, then tries once more, and so on
    llm = LLM(tiny_llama, speculative_config=NGRAM, **base)
    engine = llm.engine

    def wrong(req, room):
        k = engine.draft_room(req, room)
        n = len(req.output_token_ids)
        return [(full[0][n + j] + 1) % vocab for j in range(min(k, len(full[0]) - n - 1))]

    engine.scheduler.propose = wrong
    assert tokens(llm.generate(prompts[:1], params)) == full[:1]
    verifications = engine.stats().spec_drafts
    assert 1 <= verifications <= -(-48 // (BACKOFF_TOKENS + 1)) + 1, verifications

    fields = {
        "output_token_ids": [1] * 10,
        "spec_rate": 0.5,
        "spec_skip_until": 0,
        "spec_counts": SpecDecodeStats(),
    }
    req = type("R", (), dict(fields, spec_misses=0))()
    note_verified(req, 4, 4)
    assert req.spec_rate == 0.75 and not backing_off(req)
    note_verified(req, 4, 2)
    assert req.spec_rate == 0.625 and not backing_off(req)
    note_verified(req, 4, 0)  # one poor run after good ones: not yet a backoff
    assert req.spec_rate == 0.3125 and not backing_off(req)
    note_verified(req, 4, 0)
    assert backing_off(req) and req.spec_skip_until == 10 + BACKOFF_TOKENS
    req.output_token_ids = [1] * (10 + BACKOFF_TOKENS)  # the backoff is over
    assert not backing_off(req)
    note_verified(req, 2, 0)  # another poor run in a row: twice as long
    assert req.spec_skip_until == 10 + 3 * BACKOFF_TOKENS
    # out of a backoff, it probes with one draft; a kept probe gives it k again
    req.output_token_ids = [1] * (10 + 3 * BACKOFF_TOKENS)
    assert not backing_off(req) and probe_drafts(req, 4) == 1
    note_verified(req, 1, 1)
    assert req.spec_rate > BACKOFF_RATE and probe_drafts(req, 4) == 4
    fresh = type("R", (), dict(fields, spec_misses=0))()
    note_verified(fresh, 3, 0)  # a new request's first run, all rejected: a backoff at once
    assert backing_off(fresh)


def test_known_drafts_cut_by_stops_and_max_tokens_where_plain_decoding_does(tiny_llama):
    plain, spec = engines(tiny_llama)
    vocab = plain.engine.vocab_size
    prompts = random_prompts(vocab, 6)
    free = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    full = tokens(plain.generate(prompts, free))
    oracle(spec, prompts, full)
    tok = plain.get_tokenizer()
    cases = []
    for i, out in enumerate(full):
        for cut in (2, 7, 13, 22):
            cases.append((i, SamplingParams(temperature=0.0, max_tokens=cut, ignore_eos=True)))
            cases.append(
                (i, SamplingParams(temperature=0.0, max_tokens=48, stop_token_ids=[out[cut]]))
            )
        text = tok.decode(out)
        for at in (len(text) // 3, len(text) // 2):
            stop = text[at : at + 3]
            if stop.strip():
                for include in (False, True):
                    params = SamplingParams(
                        temperature=0.0,
                        max_tokens=48,
                        ignore_eos=True,
                        stop=[stop],
                        include_stop_str_in_output=include,
                    )
                    cases.append((i, params))
    engine = spec.engine
    reqs = [(engine.add_request(prompts[i], p), i, p) for i, p in cases]
    while engine.has_unfinished_requests():
        engine.step()
    for req, i, p in reqs:
        want = plain.generate([prompts[i]], p)[0].outputs[0]
        assert req.output_token_ids[: len(want.token_ids)] == want.token_ids
        assert req.finish_reason.value == want.finish_reason
        assert req.num_computed_tokens == req.num_tokens - 1  # nothing kept past the stop
    stats = engine.stats()
    assert stats.spec_accepted_tokens > stats.spec_draft_tokens // 4
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    # Through the offline API, text and token ids equal.
    for i, p in cases[:12]:
        a = plain.generate([prompts[i]], p)[0].outputs[0]
        b = spec.generate([prompts[i]], p)[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)


def test_streams_carry_accepted_runs(tiny_llama):
    """Through AsyncEngine, a stream's pieces of accepted runs add up to the offline output."""
    import asyncio

    from serverless_llm.engine.async_engine import AsyncEngine

    plain, spec = engines(tiny_llama)
    vocab = plain.engine.vocab_size
    prompts = random_prompts(vocab, 4)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop_token_ids=[])
    full = tokens(plain.generate(prompts, params))
    oracle(spec, prompts, full)
    want = plain.generate(prompts, params)
    aengine = AsyncEngine(spec.engine)

    async def collect(prompt):
        ids, text = [], ""
        async for out in aengine.generate(prompt, params):
            ids += out.new_token_ids
            text += out.new_text
        return ids, text

    async def main():
        try:
            return await asyncio.gather(*(collect(p) for p in prompts))
        finally:
            await aengine.shutdown()

    results = asyncio.run(main())
    for (ids, text), exp in zip(results, want):
        assert ids == exp.outputs[0].token_ids and text == exp.outputs[0].text
    assert spec.engine.stats().spec_accepted_tokens > 0
    assert spec.engine.block_pool.num_free == spec.engine.block_pool.num_blocks


def test_drafts_never_put_off_another_requests_decode(tiny_llama):
    """With a step budget barely above the batch, every running request still gets its token
    each step; drafts take only what is left."""
    plain, spec = engines(tiny_llama, max_num_batched_tokens=10)
    vocab = plain.engine.vocab_size
    prompts = [p[:2] for p in random_prompts(vocab, 8)]  # all prefilled in the first steps
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    full = tokens(plain.generate(prompts, params))
    oracle(spec, prompts, full)
    engine = spec.engine
    execute = engine.runner.execute
    starved = []

    def watching(batch):
        decoding = [r for r in engine.scheduler.running if r.num_computed_tokens > 0]
        starved.extend(r for r in decoding if r not in batch.requests)
        assert batch.total_tokens <= 10
        return execute(batch)

    engine.runner.execute = watching
    assert tokens(spec.generate(prompts, params)) == full
    assert not starved
    assert engine.stats().spec_accepted_tokens > 0


# -- requests that sample: rejection sampling (sampling/verify.py) ---------------------------

MOTIF = [303, 343, 354, 301, 302, 283, 366]  # ' the', 'jum', 'ps', ' you', ' and', 'lo', 'tion'


@pytest.fixture(scope="module")
def copying_model(tmp_path_factory) -> str:
    """A tiny Llama that is a bigram model (its attention and MLP outputs zeroed) in which each
    token of MOTIF most likely goes on to the next one, less likely to the one after, else
    anywhere: a prompt repeating MOTIF makes ngram propose, and the drafts are accepted or
    rejected often, at temperature 0.7 and 1.0 alike."""
    import torch
    import transformers

    from tests.tiny_models import build_tokenizer, make_config

    tok = build_tokenizer()
    config = make_config("llama", tok, tie_word_embeddings=False)
    torch.manual_seed(40)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    h = config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        embed.normal_(0.0, 1.0)
        head.normal_(0.0, 0.05)
        head[:, : len(MOTIF)] = 0.0
        for i, t in enumerate(MOTIF):
            # After the final norm, token t's state is sqrt(h) along axis i.
            embed[t] = 0.0
            embed[t, i] = 1.0
            head[MOTIF[(i + 1) % len(MOTIF)], i] = 7.0 / h**0.5
            head[MOTIF[(i + 2) % len(MOTIF)], i] = 5.5 / h**0.5
    path = str(tmp_path_factory.mktemp("copying"))
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


SAMPLED = [
    dict(temperature=0.7),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.9, top_k=20, min_p=0.05),
    dict(temperature=1.0, repetition_penalty=1.3),
    dict(temperature=0.8, frequency_penalty=0.5, presence_penalty=0.3, logit_bias={7: 2.0}),
    dict(temperature=0.0, repetition_penalty=1.2),  # greedy, but the penalty changes logits
    dict(temperature=0.7, min_tokens=20),
]


def test_seeded_sampling_gives_the_plain_seeded_output(copying_model):
    """A seeded request keeps its output with speculation on: each kept token is the draw plain
    decoding makes at its position with the same uniform (the rows past the kept run give
    their uniforms back), whatever was proposed, for every sampling parameter; logprobs of
    the kept tokens are plain decoding's."""
    plain, spec = engines(copying_model)
    prompts = [MOTIF * 3 + MOTIF[: i % 5] for i in range(len(SAMPLED))]
    params = [
        SamplingParams(seed=100 + i, max_tokens=40, ignore_eos=True, logprobs=2, **kw)
        for i, kw in enumerate(SAMPLED)
    ]
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    for a, b in zip(want, got):
        a, b = a.outputs[0], b.outputs[0]
        assert b.token_ids == a.token_ids
        assert len(b.logprobs) == len(a.logprobs)
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert lb[t].logprob == pytest.approx(la[t].logprob, abs=1e-5)
                assert lb[t].rank == la[t].rank
    stats = spec.engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def total_variation(a: Counter, b: Counter, n: int) -> float:
    return 0.5 * sum(abs(a[x] - b[x]) for x in a.keys() | b.keys()) / n


# Draws per distribution, compared over the outcomes MOTIF's tokens and "any other" (the rest
# is a thin near-uniform tail whose per-token counts are all noise). Two independent empirical
# distributions of n draws from p differ, per outcome, by a difference of variance
# 2 p(1 - p) / n, so E[TV] <= sum_x sqrt(p_x / (2 n)); one draw moves TV by at most 1 / n, so
# (McDiarmid) P(TV > E[TV] + t) <= exp(-n t^2): with n = 2000 and t = 0.06, 7e-4. The draws are
# seeded (the engines' seeds), so the test gives the same verdict on every run.
DRAWS = 2000
SLACK = 0.06


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.7),
        dict(temperature=1.0),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=1.0, repetition_penalty=1.3),
        dict(temperature=0.8, frequency_penalty=0.7),
    ],
    ids=["t0.7", "t1.0", "top_p", "repetition", "frequency"],
)
def test_sampled_distribution_of_first_and_fifth_token_is_plain_decodings(copying_model, kw):
    """Unseeded requests (engines seeded differently: independent draws): the first and the
    fifth token of DRAWS requests are distributed as without speculation, within sampling
    noise, while most of the fifth tokens went through accepted ngram drafts."""
    base = dict(block_size=8, max_model_len=64, dtype="float32", max_num_seqs=256)
    plain = LLM(copying_model, seed=1, **base)
    spec = LLM(copying_model, seed=2, speculative_config=NGRAM, **base)
    prompt = MOTIF * 3
    params = SamplingParams(max_tokens=5, ignore_eos=True, **kw)
    a = tokens(plain.generate([prompt] * DRAWS, params))
    b = tokens(spec.generate([prompt] * DRAWS, params))
    for pos in (0, 4):
        ca, cb = (Counter(t[pos] if t[pos] in MOTIF else -1 for t in x) for x in (a, b))
        pooled = {x: (ca[x] + cb[x]) / (2 * DRAWS) for x in ca.keys() | cb.keys()}
        bound = sum(math.sqrt(p / (2 * DRAWS)) for p in pooled.values()) + SLACK
        assert total_variation(ca, cb, DRAWS) < bound, (pos, bound)
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens > DRAWS // 8
    assert stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_sampled_runs_cut_by_stops_max_tokens_and_eos_where_plain_decoding_does(copying_model):
    """Seeded sampled requests end where plain seeded decoding ends when a stop token, a stop
    string, max_tokens or EOS (made likely by a logit bias) falls inside an accepted run: same
    tokens, text and finish reason, nothing kept past the stop."""
    plain, spec = engines(copying_model)
    eos = plain.get_tokenizer().eos_token_id
    tok = plain.get_tokenizer()
    prompts = [MOTIF * 3 + MOTIF[: i % 4] for i in range(6)]
    free = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True) for i in range(6)
    ]
    full = tokens(plain.generate(prompts, free))
    cases = []
    for i, out in enumerate(full):
        base = dict(temperature=0.8, seed=i, max_tokens=40)
        for cut in (2, 5, 11, 23):
            cases.append((i, SamplingParams(**dict(base, max_tokens=cut), ignore_eos=True)))
            cases.append((i, SamplingParams(**base, stop_token_ids=[out[cut]], ignore_eos=True)))
        text = tok.decode(out)
        for at in (len(text) // 3, len(text) // 2):
            stop = text[at : at + 3]
            if stop.strip():
                cases.append((i, SamplingParams(**base, ignore_eos=True, stop=[stop])))
        for bias in (2.0, 4.0):
            cases.append((i, SamplingParams(**base, logit_bias={eos: bias})))
    engine = spec.engine
    reqs = [(engine.add_request(prompts[i], p), i, p) for i, p in cases]
    while engine.has_unfinished_requests():
        engine.step()
    reasons = set()
    for req, i, p in reqs:
        want = plain.generate([prompts[i]], p)[0].outputs[0]
        assert req.output_token_ids[: len(want.token_ids)] == want.token_ids
        assert req.finish_reason.value == want.finish_reason
        if want.finish_reason == "stop":
            assert req.num_computed_tokens == req.num_tokens - 1  # nothing kept past the stop
        got = spec.generate([prompts[i]], p)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
        )
        reasons.add((want.finish_reason, want.stop_reason == eos or want.token_ids[-1:] == [eos]))
    assert ("stop", True) in reasons and ("length", False) in reasons  # EOS did cut some
    stats = engine.stats()
    assert stats.spec_accepted_tokens > stats.spec_draft_tokens // 4
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_and_seeded_identical_under_preemption_and_chunked_prefill(copying_model, k):
    """Greedy and seeded sampled requests side by side, with a cache small enough to preempt
    and a step budget that chunks prompts and shares what is left among drafts: every output
    token for token what plain decoding gives, k = 1, 3, 7."""
    kw = dict(
        block_size=8,
        max_model_len=96,
        dtype="float32",
        num_kv_blocks=24,
        max_num_batched_tokens=24,
    )
    plain = LLM(copying_model, **kw)
    spec = LLM(copying_model, speculative_config=with_k(k), **kw)
    prompts = [[5 + i] + MOTIF * (2 + i % 3) + MOTIF[: i % 5] for i in range(10)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        if i % 2
        else SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=40, ignore_eos=True)
        for i in range(10)
    ]
    assert tokens(spec.generate(prompts, params)) == tokens(plain.generate(prompts, params))
    stats = spec.engine.stats()
    assert stats.num_preemptions > 0
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_guided_requests_speculate_with_the_grammar_at_each_draft(copying_model):
    """Guided (regex) requests verify drafts with the grammar's mask at each draft row (its
    matcher advanced through the drafts before, then rolled back): seeded output equal to plain
    decoding's, through runs the grammar cuts (drafts it refuses once the motif may not repeat,
    its end forcing EOS), and the matcher left where the kept tokens put it."""
    pytest.importorskip("xgrammar")
    import re

    plain, spec = engines(copying_model)
    text = plain.get_tokenizer().decode(MOTIF)
    prompts = [MOTIF * 3 + MOTIF[: i % 4] for i in range(6)]
    params = [
        SamplingParams(
            temperature=0.7 + 0.1 * (i % 3),
            seed=i,
            max_tokens=40,
            guided_regex=f"({text}){{1,{1 + i % 3}}}[a-z]{{0,8}}",  # text: letters, spaces
        )
        for i in range(6)
    ]
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    for a, b in zip(want, got):
        a, b = a.outputs[0], b.outputs[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert re.fullmatch(params[0].guided_regex.split("{")[0] + ".*", a.text, re.S)
    stats = spec.engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_verification_steps_run_captured(tiny_model_dirs, kind):
    """A step of decodes and verifications runs in the captured decode graphs (here their
    eager-replay twin): each verification row a decode of its own, row j of a request attending
    to its keys up to its own position through the request's table (mistral: through its
    sliding window too). Greedy tokens equal plain decoding's, drafts are kept and cut, and the
    verifying steps did run captured, in buckets sized by rows, not requests."""
    path = tiny_model_dirs[kind]
    kw = dict(block_size=8, num_kv_blocks=96, max_model_len=128, dtype="float32")
    plain = LLM(path, **kw)
    prompts = random_prompts(plain.engine.vocab_size, 5)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = tokens(plain.generate(prompts, params))
    spec = dict(NGRAM, num_speculative_tokens=3)
    # buckets up to 32 rows: 5 requests' decodes and 3 drafts each fit
    llm = LLM(path, speculative_config=spec, decode_capture="replay", max_num_seqs=32, **kw)
    captured = llm.engine.runner.captured
    assert captured is not None and captured.enabled
    oracle(llm, prompts, full)
    runs = []
    run = captured.run

    def counting(size, input_ids, *args, **kwargs):
        runs.append((size, len(input_ids)))
        return run(size, input_ids, *args, **kwargs)

    captured.run = counting
    assert tokens(llm.generate(prompts, params)) == full
    stats = llm.engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    # steps of more rows than requests (verifications) ran captured
    assert any(rows > 5 for _, rows in runs), runs
    assert all(size >= rows for size, rows in runs)

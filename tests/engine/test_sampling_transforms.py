"""Each logits transform of the sampler against transformers' warper for it, or against its
written-out definition, on random logits: identical -inf masks, equal values.

Logits come at three spreads, so rows end at each level of the sampler (64 candidates, 1024,
the whole vocabulary sorted), and every batch mixes rows with different values, so each row's
parameters are applied on the batch, not one request at a time.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from serverless_llm.engine.sampling.ops import block_argmax, block_topk, draw, row_logsumexp
from serverless_llm.engine.sampling.params import SamplingParams, SamplingParamsError
from tests.engine.sampling_helpers import (
    EOS,
    assert_same_distribution,
    processed,
    ref_penalties,
    ref_smoothing,
    ref_tfs,
    ref_top_a,
    sample,
)

V = 3000
SPREADS = {"peaked": 6.0, "medium": 2.5, "flat": 0.6}


def random_logits(n: int, spread: float, seed: int, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * spread


def hf(warper, row: torch.Tensor, input_ids: list[int] | None = None) -> torch.Tensor:
    ids = torch.tensor([input_ids or [0]])
    return warper(ids, row.unsqueeze(0).clone())[0]


def check_rows(logits, params, reference, **kw):
    got = processed(logits, params, **kw)
    for i in range(len(params)):
        assert_same_distribution(got[i], reference(i, logits[i]))


@pytest.mark.parametrize("spread", SPREADS.values(), ids=SPREADS.keys())
def test_top_k(spread):
    ks = [1, 5, 40, 63, 64, 100, 1023, 1024, 2000, 2999]
    logits = random_logits(len(ks), spread, 1)
    params = [SamplingParams(top_k=k) for k in ks]
    check_rows(logits, params, lambda i, row: hf(TopKLogitsWarper(ks[i]), row))


@pytest.mark.parametrize("spread", SPREADS.values(), ids=SPREADS.keys())
def test_top_p(spread):
    ps = [0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999]
    logits = random_logits(len(ps), spread, 2)
    params = [SamplingParams(top_p=p) for p in ps]
    check_rows(logits, params, lambda i, row: hf(TopPLogitsWarper(ps[i]), row))


@pytest.mark.parametrize("spread", SPREADS.values(), ids=SPREADS.keys())
def test_min_p(spread):
    ms = [0.001, 0.01, 0.05, 0.1, 0.3, 0.6, 0.9, 1.0]
    logits = random_logits(len(ms), spread, 3)
    params = [SamplingParams(min_p=m) for m in ms]
    check_rows(logits, params, lambda i, row: hf(MinPLogitsWarper(ms[i]), row))


@pytest.mark.parametrize("spread", SPREADS.values(), ids=SPREADS.keys())
def test_typical_p(spread):
    masses = [0.1, 0.4, 0.7, 0.9, 0.95, 0.99]
    logits = random_logits(len(masses), spread, 4)
    params = [SamplingParams(typical_p=m) for m in masses]
    check_rows(logits, params, lambda i, row: hf(TypicalLogitsWarper(masses[i]), row))


@pytest.mark.parametrize("spread", SPREADS.values(), ids=SPREADS.keys())
def test_epsilon_cutoff(spread):
    # Aphrodite's unit is 1e-4: 3 means probability 3e-4.
    cutoffs = [0.5, 3.0, 10.0, 100.0, 500.0, 1000.0]
    logits = random_logits(len(cutoffs), spread, 5)
    params = [SamplingParams(epsilon_cutoff=c) for c in cutoffs]
    check_rows(logits, params, lambda i, row: hf(EpsilonLogitsWarper(cutoffs[i] * 1e-4), row))


@pytest.mark.parametrize("spread", SPREADS.values(), ids=SPREADS.keys())
def test_eta_cutoff(spread):
    cutoffs = [0.5, 3.0, 10.0, 100.0, 1000.0, 5000.0]
    logits = random_logits(len(cutoffs), spread, 6)
    params = [SamplingParams(eta_cutoff=c) for c in cutoffs]
    check_rows(logits, params, lambda i, row: hf(EtaLogitsWarper(cutoffs[i] * 1e-4), row))


@pytest.mark.parametrize("spread", SPREADS.values(), ids=SPREADS.keys())
def test_top_a(spread):
    values = [0.01, 0.1, 0.2, 0.5, 0.9, 1.0, 3.0]
    logits = random_logits(len(values), spread, 7)
    params = [SamplingParams(top_a=a) for a in values]
    check_rows(logits, params, lambda i, row: ref_top_a(row, values[i]))


@pytest.mark.parametrize("spread", SPREADS.values(), ids=SPREADS.keys())
def test_tfs(spread):
    values = [0.1, 0.5, 0.9, 0.95, 0.99]
    logits = random_logits(len(values), spread, 8)
    params = [SamplingParams(tfs=z) for z in values]
    check_rows(logits, params, lambda i, row: ref_tfs(row, values[i]))


def test_temperature():
    temps = [0.05, 0.5, 1.0, 1.7, 10.0]
    logits = random_logits(len(temps), 2.0, 9)
    params = [SamplingParams(temperature=t) for t in temps]
    check_rows(logits, params, lambda i, row: hf(TemperatureLogitsWarper(temps[i]), row))


def test_smoothing():
    cases = [(0.2, 1.0), (0.5, 1.0), (0.3, 2.0), (1.5, 3.0), (0.3, 4.0)]
    logits = random_logits(len(cases), 2.0, 10)
    params = [SamplingParams(smoothing_factor=f, smoothing_curve=c) for f, c in cases]
    got = processed(logits, params)
    for i, (f, c) in enumerate(cases):
        torch.testing.assert_close(got[i], ref_smoothing(logits[i], f, c), atol=1e-4, rtol=1e-6)


def test_smoothing_after_truncation_keeps_removed_tokens_removed():
    logits = random_logits(2, 3.0, 11)
    params = [SamplingParams(top_k=10, smoothing_factor=0.4, smoothing_curve=1.5)] * 2
    got = processed(logits, params)
    for i in range(2):
        want = ref_smoothing(hf(TopKLogitsWarper(10), logits[i]), 0.4, 1.5)
        assert_same_distribution(got[i], want, atol=1e-4)


def test_repetition_penalty_over_prompt_and_output():
    rng = random.Random(12)
    penalties = [0.5, 0.9, 1.1, 1.5, 2.0]
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 40))] for _ in penalties]
    outputs = [[rng.randrange(V) for _ in range(rng.randint(0, 30))] for _ in penalties]
    logits = random_logits(len(penalties), 2.0, 12)
    params = [SamplingParams(repetition_penalty=r, temperature=0.0) for r in penalties]
    got = processed(logits, params, prompts=prompts, outputs=outputs)
    for i, r in enumerate(penalties):
        # transformers penalises the ids it is given: prompt and output together.
        want = hf(RepetitionPenaltyLogitsProcessor(r), logits[i], prompts[i] + outputs[i])
        assert torch.equal(got[i], want)


def test_presence_and_frequency_penalties():
    rng = random.Random(13)
    cases = [(0.0, 0.5), (0.5, 0.0), (1.0, -1.0), (-2.0, 2.0), (0.3, 0.7)]
    outputs = [[rng.randrange(50) for _ in range(rng.randint(1, 60))] for _ in cases]
    prompts = [[rng.randrange(50) for _ in range(10)] for _ in cases]
    logits = random_logits(len(cases), 2.0, 13)
    params = [
        SamplingParams(presence_penalty=p, frequency_penalty=f, repetition_penalty=1.3)
        for p, f in cases
    ]
    got = processed(logits, params, prompts=prompts, outputs=outputs)
    for i, (p, f) in enumerate(cases):
        want = ref_penalties(logits[i], prompts[i], outputs[i], p, f, 1.3)
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-6)


def test_logit_bias_allowed_token_ids_and_min_tokens():
    logits = random_logits(4, 2.0, 14)
    bias = {7: 100.0, 8: -100.0, 9: 0.5}
    allowed = [EOS, 7, 9, 11, 500]
    params = [
        SamplingParams(logit_bias=bias),
        SamplingParams(allowed_token_ids=allowed, logit_bias={11: 3.0}),
        SamplingParams(min_tokens=5, stop_token_ids=[9, 10]),
        SamplingParams(min_tokens=2, stop_token_ids=[9]),
    ]
    outputs = [[], [], [3, 4], [3, 4]]  # the last one has reached its min_tokens
    got = processed(logits, params, outputs=outputs)
    want0 = logits[0].clone()
    for t, b in bias.items():
        want0[t] += b
    torch.testing.assert_close(got[0], want0)
    want1 = torch.full((V,), float("-inf"))
    want1[allowed] = logits[1][allowed]
    want1[11] += 3.0
    torch.testing.assert_close(got[1], want1)
    want2 = logits[2].clone()
    want2[[EOS, 9, 10]] = float("-inf")
    assert torch.equal(got[2], want2)
    assert torch.equal(got[3], logits[3])


def test_ignore_eos_leaves_eos_out_of_the_min_tokens_mask():
    logits = random_logits(1, 2.0, 15)
    got = processed(logits, [SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[9])])
    assert torch.isfinite(got[0, EOS]) and torch.isneginf(got[0, 9])


# -- the whole chain against a step-by-step reference -----------------------------------------


def reference_chain(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then each sampler in Aphrodite's order on what the previous ones left."""
    x = hf(TemperatureLogitsWarper(p.temperature), row) if p.temperature != 1.0 else row
    if p.top_k > 0:
        x = hf(TopKLogitsWarper(p.top_k), x)
    if p.top_p < 1.0:
        x = hf(TopPLogitsWarper(p.top_p), x)
    if p.top_a > 0.0:
        x = ref_top_a(x, p.top_a)
    if p.min_p > 0.0:
        x = hf(MinPLogitsWarper(p.min_p), x)
    if p.tfs < 1.0:
        x = ref_tfs(x, p.tfs)
    if p.eta_cutoff > 0.0:
        x = hf(EtaLogitsWarper(p.eta_cutoff * 1e-4), x)
    if p.epsilon_cutoff > 0.0:
        x = hf(EpsilonLogitsWarper(p.epsilon_cutoff * 1e-4), x)
    if p.typical_p < 1.0:
        x = hf(TypicalLogitsWarper(p.typical_p), x)
    if p.smoothing_factor > 0.0:
        x = ref_smoothing(x, p.smoothing_factor, p.smoothing_curve)
    return x


def random_params(rng: random.Random) -> SamplingParams:
    kw: dict = {"temperature": rng.choice([0.7, 1.0, 1.3])}
    options = {
        "top_k": lambda: rng.choice([3, 20, 50, 200, 1500]),
        "top_p": lambda: rng.choice([0.5, 0.9, 0.97]),
        "top_a": lambda: rng.choice([0.05, 0.3]),
        "min_p": lambda: rng.choice([0.02, 0.1]),
        "tfs": lambda: rng.choice([0.9, 0.99]),
        "eta_cutoff": lambda: rng.choice([2.0, 20.0]),
        "epsilon_cutoff": lambda: rng.choice([1.0, 10.0]),
        "typical_p": lambda: rng.choice([0.8, 0.97]),
        "smoothing_factor": lambda: rng.choice([0.2, 0.5]),
    }
    for name in rng.sample(sorted(options), rng.randint(1, 5)):
        kw[name] = options[name]()
    if "smoothing_factor" in kw:
        kw["smoothing_curve"] = rng.choice([1.0, 2.0])
    return SamplingParams(**kw)


@pytest.mark.parametrize("spread", SPREADS.values(), ids=SPREADS.keys())
def test_random_combinations_equal_the_sequential_reference(spread):
    rng = random.Random(int(spread * 100))
    params = [random_params(rng) for _ in range(24)]
    logits = random_logits(len(params), spread, 16)
    got = processed(logits, params)
    for i, p in enumerate(params):
        assert_same_distribution(got[i], reference_chain(logits[i], p), atol=1e-4, rtol=1e-5)


def test_a_row_is_the_same_alone_and_in_any_batch():
    rng = random.Random(17)
    params = [random_params(rng) for _ in range(16)]
    logits = random_logits(len(params), 2.5, 17)
    together = processed(logits, params)
    for i, p in enumerate(params):
        alone = processed(logits[i : i + 1], [p])
        assert torch.equal(alone[0], together[i])


# -- the row primitives -----------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [3000, 4096, 49152, 50257])
def test_block_topk_and_argmax_equal_the_plain_ops(vocab):
    x = random_logits(6, 3.0, 18, vocab)
    for k in (1, 5, 20, 64):
        values, ids = block_topk(x, k)
        want_values, _ = x.topk(k, dim=-1)
        assert torch.equal(values, want_values)
        assert torch.equal(x.gather(1, ids), values)
    assert torch.equal(block_argmax(x), x.argmax(dim=-1))
    ties = torch.zeros(3, vocab)
    ties[:, [100, 900, vocab - 1]] = 1.0
    assert block_argmax(ties).tolist() == [100] * 3
    torch.testing.assert_close(row_logsumexp(x), torch.logsumexp(x, dim=-1))


def test_draw_never_picks_a_removed_token():
    x = torch.full((4, 5000), float("-inf"))
    x[:, [3, 4000, 4999]] = torch.tensor([0.0, 1.0, 2.0])
    for u in (0.0, 0.5, 1.0 - 2**-24, 1.0):
        picks = draw(x, torch.full((4,), u))
        assert set(picks.tolist()) <= {3, 4000, 4999}
    assert draw(x, torch.zeros(4)).tolist() == [3] * 4
    assert draw(x, torch.ones(4)).tolist() == [4999] * 4


def test_greedy_with_penalties_is_the_argmax_of_the_penalised_logits():
    logits = random_logits(2, 2.0, 19)
    top = int(logits[0].argmax())
    bias = {top: -100.0}
    tokens = sample(logits, [SamplingParams(temperature=0.0, logit_bias=bias)] * 2)
    want = logits.clone()
    want[:, top] -= 100
    assert tokens == want.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(min_p=1.5), "min_p must be a number in [0, 1]"),
        (dict(top_a=-0.1), "top_a"),
        (dict(tfs=0.0), "tfs must be a number in (0, 1]"),
        (dict(typical_p=0.0), "typical_p"),
        (dict(eta_cutoff=-1.0), "eta_cutoff"),
        (dict(epsilon_cutoff=1001.0), "epsilon_cutoff must be a number in [0, 1000]"),
        (dict(smoothing_factor=-1.0), "smoothing_factor"),
        (dict(smoothing_curve=0.5), "smoothing_curve must be a number in [1, inf)"),
        (dict(presence_penalty=2.5), "presence_penalty must be a number in [-2, 2]"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be a number in (0, inf)"),
        (dict(temperature=math.nan), "temperature"),
        (dict(logit_bias={5: 101.0}), "logit_bias values must be numbers in [-100, 100]"),
        (dict(logit_bias={"x": 1.0}), "logit_bias keys must be token ids"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
        (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
        (dict(stop=[""]), "stop must not contain an empty string"),
        (dict(stop=[1]), "stop must be a string or a list of strings"),
        (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens must be <= max_tokens (10)"),
        (dict(logprobs=21), "logprobs must be an integer in [0, 20]"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be an integer >= 1"),
        (dict(n=0), "n must be an integer >= 1"),
        (dict(n=3, best_of=2), "best_of must be an integer >= n (3)"),
    ],
)
def test_validation_names_the_parameter_and_range(kwargs, message):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)
    assert info.value.param == message.split()[0]


def test_token_ids_are_checked_against_the_vocabulary():
    for kwargs in (
        dict(stop_token_ids=[V]),
        dict(allowed_token_ids=[1, V + 5]),
        dict(logit_bias={V: 1.0}),
    ):
        with pytest.raises(SamplingParamsError) as info:
            SamplingParams(**kwargs).check_vocab(V)
        assert info.value.param == next(iter(kwargs)) and "out of range" in str(info.value)
    assert SamplingParams(logit_bias={"5": 1}).logit_bias == {5: 1.0}


def test_few_allowed_tokens_with_truncation():
    # Fewer finite logits than top_k: the -inf candidates must not look like ties to follow.
    logits = random_logits(4, 2.0, 20)
    allowed = [3, 50, 700]
    params = [
        SamplingParams(allowed_token_ids=allowed, top_k=5),
        SamplingParams(allowed_token_ids=allowed, top_k=2, top_p=0.9),
        SamplingParams(allowed_token_ids=allowed, min_p=0.2, typical_p=0.9),
        SamplingParams(allowed_token_ids=allowed, tfs=0.5, temperature=0.7),
    ]
    got = processed(logits, params)
    for i, p in enumerate(params):
        masked = torch.full((V,), float("-inf"))
        masked[allowed] = logits[i][allowed]
        assert_same_distribution(got[i], reference_chain(masked, p))
    tokens = sample(logits, params)
    assert set(tokens) <= set(allowed)


def test_an_engine_request_is_one_sequence():
    from serverless_llm.engine.sampling.params import sequence_params

    seqs = sequence_params(SamplingParams(n=2, best_of=3, seed=10, prompt_logprobs=1))
    assert [s.seed for s in seqs] == [10, 11, 12]
    assert [s.prompt_logprobs for s in seqs] == [1, None, None]
    assert all(s.n == 1 and s.best_of is None and s.logprobs == 0 for s in seqs)
    assert [s.seed for s in sequence_params(SamplingParams(n=2, seed=2**64 - 1))] == [2**64 - 1, 0]

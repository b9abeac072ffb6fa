"""Draws follow the distribution the transforms define: chi-square goodness of fit on a tiny
vocabulary, 20,000 draws with a fixed seed, on each path of the sampler (full sort, top-k
candidates, untruncated block draw)."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from serverless_llm.engine.sampling.params import SamplingParams
from tests.engine.sampling_helpers import make_requests, sample

DRAWS = 20_000
BATCH = 2_000

# Upper 0.1% points of the chi-square distribution (scipy.stats.chi2.ppf(0.999, df)), by
# degrees of freedom: a correct sampler fails a test with probability 0.001 for a given seed,
# and the seed is fixed, so the outcome is reproducible.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def draw_counts(logits: torch.Tensor, params: SamplingParams, seed: int) -> torch.Tensor:
    vocab = logits.shape[0]
    counts = torch.zeros(vocab, dtype=torch.int64)
    for b in range(DRAWS // BATCH):
        batch = logits.expand(BATCH, vocab).contiguous()
        tokens = sample(batch, [params] * BATCH, seed=seed + b)
        counts += torch.bincount(torch.tensor(tokens), minlength=vocab)
    return counts


def check_fit(counts: torch.Tensor, probs: torch.Tensor) -> None:
    kept = probs > 0
    assert counts[~kept].sum() == 0, "a removed token was drawn"
    expected = probs[kept].double() * DRAWS
    observed = counts[kept].double()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    df = int(kept.sum()) - 1
    assert chi2 < CHI2_999[df], (chi2, df, observed.tolist(), expected.tolist())


def test_temperature_and_top_p_on_a_tiny_vocabulary():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.2, -0.5, -1.0, -3.0])
    params = SamplingParams(temperature=0.7, top_p=0.9)
    want = TopPLogitsWarper(0.9)(None, (logits / 0.7).unsqueeze(0))[0].softmax(-1)
    assert 3 <= int((want > 0).sum()) < 8  # top-p does cut something
    check_fit(draw_counts(logits, params, seed=1), want)


def test_top_k_candidates_on_a_larger_vocabulary():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2000, generator=g)
    logits[[10, 700, 1999, 1234, 5]] += torch.tensor([4.0, 3.5, 3.0, 2.5, 2.0])
    params = SamplingParams(temperature=1.3, top_k=5)
    want = TopKLogitsWarper(5)(None, (logits / 1.3).unsqueeze(0))[0].softmax(-1)
    check_fit(draw_counts(logits, params, seed=2), want)


def test_untruncated_draw_across_blocks():
    # Untruncated rows over a long vocabulary draw through block sums: mass in several blocks.
    logits = torch.full((5000,), float("-inf"))
    logits[[3, 64, 65, 1000, 2500, 4999]] = torch.tensor([0.0, 0.5, -0.3, 1.0, 0.2, 0.8])
    params = SamplingParams(temperature=0.9)
    check_fit(draw_counts(logits, params, seed=3), (logits / 0.9).softmax(-1))


def test_seeded_draws_repeat_and_unseeded_vary():
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(4))
    seeded = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3, 4)]
    first = [sample(logits, seeded, seed=k) for k in range(3)]
    assert first[0] == first[1] == first[2]
    unseeded = [SamplingParams(temperature=1.0)] * 4
    runs = {tuple(sample(logits, unseeded, seed=k)) for k in range(5)}
    assert len(runs) > 1
    assert len(make_requests(seeded)) == 4

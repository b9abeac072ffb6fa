"""Speculative decoding's accept/resample step (kernels/rejection.py): the reference is rejection
sampling with a one-hot proposal (a draft kept with probability p(draft), the residual on
reject, the last row's distribution after all are kept), its draws are the sampler's
vocabulary-order inverse CDF, and the Triton kernel (interpreted) returns the reference's tokens
on ragged batches.

The kernel sums each row in blocks, the reference with one cumulative sum: a draw within float
rounding of a boundary could differ, so the random batches are seeded and checked for equality
(a fixed verdict, not a flaky one)."""

from __future__ import annotations

import pytest
import torch

from serverless_llm.engine.kernels.rejection import (
    rejection_sample,
    rejection_sample_reference,
    rejection_sample_triton,
)
from serverless_llm.engine.sampling.ops import draw
from tests.kernels.batch import DEVICE


def ragged(seed: int, drafts: list[int], vocab: int, zero_frac: float = 0.3):
    """Random rows for requests with `drafts` drafts each (some tokens of weight 0, as after
    truncation); each request's drafts are its rows' reference draws up to a random row, then
    a random token, so runs of every length are kept."""
    g = torch.Generator().manual_seed(seed)
    rows = sum(k + 1 for k in drafts)
    logits = torch.randn(rows, vocab, generator=g) * 2
    probs = torch.softmax(logits, dim=-1)
    probs[torch.rand(rows, vocab, generator=g) < zero_frac] = 0.0
    probs[:, int(torch.randint(vocab, (1,), generator=g))] += 1e-3  # no row all zero
    u = torch.rand(rows, generator=g)
    u[0] = 0.0
    u[-1] = 1.0 - 2**-24  # the largest float32 below 1: u * total may round up to the total
    cu = torch.tensor([0] + [k + 1 for k in drafts]).cumsum(0)
    # Every row's own draw: each row as a request of no drafts.
    alone = torch.arange(rows + 1)
    drawn, _ = rejection_sample_reference(probs, alone, torch.full((rows,), -1), u)
    ids = torch.full((rows,), -1, dtype=torch.int64)
    for b, k in enumerate(drafts):
        cut = int(torch.randint(k + 1, (1,), generator=g))  # drafts before it are the draws
        for j in range(k):
            r = int(cu[b]) + j
            ids[r] = drawn[r] if j < cut else (drawn[r] + 1) % vocab
    return probs, cu, ids, u


def test_reference_keeps_matching_drafts_and_cuts_at_the_first_other_draw():
    probs = torch.tensor(
        [
            [0.1, 0.6, 0.3, 0.0],  # u 0.5 -> token 1 (cdf 0.1, 0.7)
            [0.5, 0.0, 0.0, 0.5],  # u 0.2 -> token 0
            [0.0, 0.0, 1.0, 0.0],  # -> token 2
            [0.2, 0.2, 0.2, 0.4],  # u 0.99 -> token 3
            [0.0, 1.0, 0.0, 0.0],
        ]
    )
    u = torch.tensor([0.5, 0.2, 0.7, 0.99, 0.3])
    # Request 0: drafts [1, 0] then its last row; request 1: draft [3], its last row.
    cu = torch.tensor([0, 3, 5])
    ids = torch.tensor([1, 0, -1, 2, -1])
    tokens, kept = rejection_sample_reference(probs, cu, ids, u)
    assert kept.tolist() == [3, 1]
    assert tokens.tolist() == [1, 0, 2, 3, -1]  # request 1's draft 2 rejected: its draw 3


def test_reference_is_rejection_sampling_with_a_one_hot_proposal():
    """Over a fine grid of uniforms on the first row: the draft is kept with probability
    p(draft), a rejected row gives the residual (p without the draft, renormalised), and after
    a kept draft the next row's draw follows its own distribution."""
    g = torch.Generator().manual_seed(3)
    vocab, n = 12, 20000
    p0 = torch.softmax(torch.randn(vocab, generator=g), -1)
    p1 = torch.softmax(torch.randn(vocab, generator=g), -1)
    x = int(p0.argsort()[-3])  # a draft of middling probability
    u0 = (torch.arange(n) + 0.5) / n
    u1 = torch.rand(n, generator=g)
    probs = torch.stack([p0, p1]).repeat(n, 1)
    u = torch.stack([u0, u1], dim=1).reshape(-1)
    ids = torch.tensor([x, -1]).repeat(n)
    cu = torch.arange(0, 2 * n + 1, 2)
    tokens, kept = rejection_sample_reference(probs, cu, ids, u)
    first = tokens[0::2]
    accepted = kept == 2
    assert abs(accepted.float().mean().item() - p0[x].item()) < 2 / n
    residual = p0.clone()
    residual[x] = 0
    residual /= residual.sum()
    got = torch.bincount(first[~accepted], minlength=vocab).float() / (~accepted).sum()
    torch.testing.assert_close(got, residual, atol=2 / n / (1 - p0[x].item()), rtol=0)
    assert (first[accepted] == x).all()
    second = torch.bincount(tokens[1::2][accepted], minlength=vocab).float() / accepted.sum()
    assert 0.5 * (second - p1).abs().sum() < 0.05  # ~4000 uniform draws: noise ~0.02


def test_reference_draws_are_the_samplers_vocabulary_order_draws():
    probs, cu, ids, u = ragged(5, [0] * 9, 2000)
    tokens, kept = rejection_sample_reference(probs, cu, ids, u)
    assert kept.tolist() == [1] * 9
    assert tokens.tolist() == draw(probs.log(), u).tolist()


@pytest.mark.parametrize(
    "drafts, vocab",
    [([3, 1, 0, 7, 2], 384), ([4, 4, 4], 2500), ([0], 16), ([7, 5, 1, 3, 2, 6], 1000)],
    ids=["v384", "v2500-blocks", "one-row", "v1000"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kernel_matches_reference(drafts, vocab, dtype):
    pytest.importorskip("triton")
    probs, cu, ids, u = ragged(len(drafts) * vocab, drafts, vocab)
    probs = probs.to(dtype)
    want = rejection_sample_reference(probs, cu, ids, u)
    got = rejection_sample_triton(probs.to(DEVICE), cu.to(DEVICE), ids.to(DEVICE), u.to(DEVICE))
    assert got[1].tolist() == want[1].tolist()
    assert got[0].tolist() == want[0].tolist()
    if sum(drafts) > 3:  # the batch exercises both outcomes
        assert sum(want[1].tolist()) > len(drafts)  # some drafts were kept
        assert sum(want[1].tolist()) < sum(k + 1 for k in drafts)  # and some rejected
    # The dispatcher: the kernel on CUDA, the reference elsewhere.
    again = rejection_sample(probs.to(DEVICE), cu.to(DEVICE), ids.to(DEVICE), u.to(DEVICE))
    assert again[0].tolist() == want[0].tolist()

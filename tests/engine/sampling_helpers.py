"""Helpers for sampler tests: requests built without an engine, and reference implementations
of the samplers transformers has no warper for (written out from their definitions)."""

from __future__ import annotations

import torch

from serverless_llm.engine.request import Request
from serverless_llm.engine.sampling.logits_processors import RequestSamplingState
from serverless_llm.engine.sampling.params import SamplingParams
from serverless_llm.engine.sampling.sampler import Sampler, SamplingBatch
from serverless_llm.engine.stop_rule import StopRule

EOS = 2


def make_requests(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> list[Request]:
    reqs = []
    for i, p in enumerate(params):
        prompt = list(prompts[i]) if prompts else [1]
        req = Request(f"r{i}", prompt, p, max_total_tokens=1 << 30)
        req.stop_rule = StopRule.of(p, {EOS}, None)
        req.sampling = RequestSamplingState(p, prompt, req.stop_rule)
        for t in outputs[i] if outputs else ():
            req.output_token_ids.append(t)
            req.sampling.on_token(t)
        reqs.append(req)
    return reqs


def processed(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> torch.Tensor:
    """What the engine's sampler draws from, for each row, as logits (-inf = removed)."""
    reqs = make_requests(params, prompts, outputs)
    batch = SamplingBatch.build(reqs, logits.shape[1], logits.device)
    return Sampler(0).processed_logits(logits, batch)


def sample(logits: torch.Tensor, params: list[SamplingParams], seed: int = 0, **kw) -> list[int]:
    reqs = make_requests(params, **kw)
    batch = SamplingBatch.build(reqs, logits.shape[1], logits.device)
    return Sampler(seed)(logits.clone(), batch).token_ids


def assert_same_distribution(
    got: torch.Tensor, want: torch.Tensor, atol: float = 1e-6, rtol: float = 0.0
) -> None:
    """Identical -inf masks, and equal values where kept."""
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), (
        torch.isneginf(got) != torch.isneginf(want)
    ).nonzero()[:10]
    kept = ~torch.isneginf(want)
    torch.testing.assert_close(got[kept], want[kept], atol=atol, rtol=rtol)


# -- references for what transformers lacks (one row at a time, straight from the definition) --


def ref_top_a(x: torch.Tensor, a: float) -> torch.Tensor:
    p = x.softmax(-1)
    remove = p < a * p.max() ** 2
    remove[p.argmax()] = False
    return x.masked_fill(remove, float("-inf"))


def ref_tfs(x: torch.Tensor, z: float) -> torch.Tensor:
    """Aphrodite's tail-free sampling: normalised |second differences| of the sorted
    probabilities, cut where their cumulative sum passes z; the first token always stays and
    the last sorted token always goes."""
    vals, order = x.sort(descending=True)
    p = vals.softmax(-1)
    d2 = (p[2:] - 2 * p[1:-1] + p[:-2]).abs()
    cdf = (d2 / d2.sum()).cumsum(-1)
    remove_sorted = torch.cat([torch.tensor([False]), cdf > z, torch.tensor([True])])
    remove = torch.zeros_like(remove_sorted)
    remove[order] = remove_sorted
    return x.masked_fill(remove, float("-inf"))


def ref_smoothing(x: torch.Tensor, factor: float, curve: float) -> torch.Tensor:
    """max - k d^2 + s d^3, d = x - max, k = f (3 - c) / 2, s = f (c - 1) / 2."""
    mx = x[torch.isfinite(x)].max()
    d = x - mx
    k = factor * (3 - curve) / 2
    s = factor * (curve - 1) / 2
    out = mx - k * d**2 + s * d**3
    return torch.where(torch.isfinite(x), out, x)


def ref_penalties(
    x: torch.Tensor,
    prompt: list[int],
    output: list[int],
    presence: float,
    frequency: float,
    repetition: float,
) -> torch.Tensor:
    """vLLM's order: repetition over prompt and output (divide positive logits, multiply
    negative ones), then OpenAI's frequency and presence over the output."""
    x = x.clone()
    seen = set(prompt) | set(output)
    for t in seen:
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    counts: dict[int, int] = {}
    for t in output:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        x[t] -= frequency * c + presence
    return x

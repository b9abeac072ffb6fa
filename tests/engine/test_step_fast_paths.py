"""The step's fast paths for plain decoding give exactly what the general paths give.

- `ModelRunner._decode_inputs` (a step of plain one-token grants) against `_any_inputs`, the
  general host inputs, on every step where the runner takes it: plain attention, a sliding
  window (blocks released into holes), a hybrid model (state slots, prompt rows), several
  requests of different lengths under chunked prefill, preemption and prefix caching.
- The sampler's all-greedy path (numpy's argmax, no tensors) against its batched path, and
  `block_argmax` against torch's `argmax` on ties, NaN, -inf rows and float64.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.model_runner import HostBatch
from serverless_llm.engine.sampling.ops import block_argmax
from serverless_llm.engine.sampling.params import SamplingParams as EngineParams
from serverless_llm.engine.sampling.sampler import Sampler, SamplingBatch
from tests.engine.family_check import save_family_model, tiny_dims
from tests.tiny_models import build_tokenizer


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            _same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    return a == b if not hasattr(a, "request_id") else a is b


def checked_run(llm: LLM, prompts, max_tokens: int) -> tuple[int, int, int]:
    """Generates greedily while comparing the fast host inputs with the general ones on every
    plain-decode step; returns (fast steps, other steps, fast steps whose tables have a hole:
    a released block, HOLE = 0, before a request's last block)."""
    runner = llm.engine.runner
    general = runner.host_inputs
    counts = [0, 0, 0]

    def host_inputs(batch) -> HostBatch:
        h = general(batch)
        if runner._plain_decodes(batch):
            counts[0] += 1
            counts[2] += any(bool((t[:, 0] == 0).any()) for t in h.block_tables)
            slow = runner._any_inputs(batch)
            for f in dataclasses.fields(HostBatch):
                assert _same(getattr(h, f.name), getattr(slow, f.name)), f.name
        else:
            counts[1] += 1
        return h

    runner.host_inputs = host_inputs
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params)
    runner.host_inputs = general
    return counts[0], counts[1], counts[2]


PROMPTS = [[5 + (7 * i + j) % 90 for j in range(n)] for i, n in enumerate((3, 17, 40, 9, 26))]


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_decode_inputs_equal_general_inputs(tiny_model_dirs, kind):
    # Few blocks (preemption), a small budget (chunks beside decodes), prefix caching on, and
    # the tiny mistral's window of 24 (tables with released blocks).
    llm = LLM(
        tiny_model_dirs[kind],
        num_kv_blocks=24,
        block_size=8,
        max_model_len=128,
        max_num_batched_tokens=16,
        dtype="float32",
    )
    fast, other, holes = checked_run(llm, PROMPTS + [PROMPTS[2][:30]], 40)
    assert fast > 20 and other > 3
    if kind == "llama":
        assert llm.engine.scheduler.num_preemptions > 0
    else:
        assert holes > 0


def test_decode_inputs_equal_general_inputs_hybrid(tmp_path):
    config = transformers.Lfm2Config(
        **tiny_dims(build_tokenizer(), num_hidden_layers=4),
        layer_types=["conv", "full_attention", "conv", "conv"],
        conv_L_cache=3,
        conv_bias=True,
        norm_eps=1e-5,
    )
    path = save_family_model(str(tmp_path / "lfm2"), config)
    llm = LLM(
        path,
        num_kv_blocks=160,
        block_size=8,
        max_model_len=256,
        max_num_batched_tokens=16,
        dtype="float32",
    )
    fast, other, _ = checked_run(llm, PROMPTS, 24)
    assert fast > 10 and other > 3


def _request(params: EngineParams, i: int):
    from serverless_llm.engine.request import Request
    from serverless_llm.engine.sampling.logits_processors import RequestSamplingState
    from serverless_llm.engine.stop_rule import StopRule

    req = Request(f"r{i}", [1, 2, 3], params, max_total_tokens=64)
    req.stop_rule = StopRule.of(params, [0], 60)
    req.sampling = RequestSamplingState(params, req.prompt_token_ids, req.stop_rule)
    return req


def test_all_greedy_sampling_equals_the_batched_path():
    vocab = 1000
    reqs = [_request(EngineParams(temperature=0.0), i) for i in range(5)]
    sb = SamplingBatch.build(reqs, vocab, torch.device("cpu"), cache={})
    assert sb.all_greedy and sb.greedy_rows.tolist() == list(range(5))
    logits = torch.randn(5, vocab)
    logits[1, 10] = logits[1, 900] = 50.0  # a tie: the first
    sampler = Sampler()
    fast = sampler(logits.clone(), sb)
    slow = sampler._sample_batch(logits.clone(), sb)
    assert fast.token_ids == slow.token_ids == logits.argmax(dim=-1).tolist()
    assert fast.token_ids[1] == 10
    # A row with a processor (logit bias) leaves the fast path, and its bias counts.
    biased = EngineParams(temperature=0.0, logit_bias={7: 100.0})
    sb = SamplingBatch.build(reqs[:2] + [_request(biased, 9)], vocab, torch.device("cpu"), cache={})
    assert not sb.all_greedy
    assert sampler(logits[:3].clone(), sb).token_ids[2] == 7


def test_block_argmax_is_argmax():
    x = torch.randn(4, 3000)
    x[0, 100] = x[0, 2000] = 9.0  # ties: the first
    x[1, 7] = float("nan")  # NaN counts as the maximum
    x[1, 3] = 99.0
    x[2] = float("-inf")
    assert block_argmax(x).tolist() == x.argmax(dim=-1).tolist() == [100, 7, 0, x[3].argmax()]
    y = x[:, ::3]  # not contiguous
    assert torch.equal(block_argmax(y), y.argmax(dim=-1))
    z = torch.randn(3, 500, dtype=torch.float64)
    assert torch.equal(block_argmax(z), z.argmax(dim=-1))
    h = torch.randn(2, 700).to(torch.bfloat16)  # the torch path
    assert torch.equal(block_argmax(h), h.argmax(dim=-1))

"""Tensor parallelism over NCCL (`pytest -m gpu` on a machine with two or more GPUs): the
CPU tests run the same code over gloo; this checks the NCCL group, the device placement
(rank r on cuda:r) and the Triton backend under it."""

from __future__ import annotations

import pytest
import torch

from serverless_llm import LLM, SamplingParams
from tests.engine.family_check import family_prompts
from tests.gpu_marks import GPU_ONLY

pytestmark = [
    *GPU_ONLY,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two GPUs (NCCL refuses two ranks on one device)",
    ),
]


def test_two_gpus_give_one_gpus_greedy_tokens(tiny_llama):
    prompts = family_prompts(384)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    kw = dict(block_size=16, num_kv_blocks=128, max_model_len=256, dtype="float32")
    one = LLM(tiny_llama, enforce_eager=True, **kw).generate(prompts, params)
    with LLM(tiny_llama, tensor_parallel_size=2, **kw) as llm:
        two = llm.generate(prompts, params)
        state = llm.engine.rank_state()
    assert [r["device"] for r in state] == ["cuda:0", "cuda:1"]
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids

"""CUDA graph capture of decode steps (engine/decode_capture.py, mode "cuda") on a real GPU: every
bucket captured, greedy tokens equal to the eager engine's across bucket boundaries, past the
largest bucket and past the longest captured context, and a mismatching capture turned off by
the self-check. Run with `pytest -m gpu` on a CUDA machine; skipped elsewhere. The CPU twin of
the same buffers and checks is tests/engine/test_decode_capture.py."""

from __future__ import annotations

import logging

import pytest

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine import decode_capture
from tests.gpu_marks import GPU_ONLY

from .test_engine_core import GREEDY, random_prompts

pytestmark = GPU_ONLY


def _llm(model, **kw):
    args = dict(device="cuda", dtype="float32", num_kv_blocks=256, block_size=16, max_model_len=512)
    args.update(kw)
    return LLM(model, **args)


def test_graphs_are_captured_for_every_bucket(tiny_llama):
    llm = _llm(tiny_llama, max_num_seqs=24)
    captured = llm.engine.runner.captured
    assert captured is not None and captured.mode == "cuda" and captured.enabled
    assert captured.sizes == [1, 2, 4, 8, 16, 24]
    assert sorted(captured.graphs) == captured.sizes


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_graph_tokens_equal_eager_tokens(tiny_llama, monkeypatch, dtype):
    monkeypatch.setattr(decode_capture, "CAPTURE_LIMIT", 8)  # batches of 9..12 run eagerly
    eager = _llm(tiny_llama, dtype=dtype, max_num_seqs=12, enforce_eager=True)
    assert eager.engine.runner.captured is None
    graphs = _llm(tiny_llama, dtype=dtype, max_num_seqs=12, max_seq_len_to_capture=64)
    captured = graphs.engine.runner.captured
    assert captured is not None and captured.sizes == [1, 2, 4, 8]
    vocab = eager.engine.vocab_size
    for n in (1, 2, 3, 4, 5, 8, 9, 12, 16):
        prompts = random_prompts(n, vocab, seed=n, lo=2, hi=40)
        params = [SamplingParams(max_tokens=8 + (i * 7) % 40, **GREEDY) for i in range(n)]
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
        got = [o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
        assert got == want, f"{n} requests"
    assert captured.replays > 0
    assert graphs.engine.block_pool.num_free == 256


def test_a_mismatching_graph_turns_capture_off(tiny_llama, monkeypatch, caplog):
    monkeypatch.setattr(decode_capture, "SELF_CHECK_HOOK", lambda hidden: hidden * 2 + 1)
    with caplog.at_level(logging.WARNING, logger="serverless_llm.engine.decode_capture"):
        llm = _llm(tiny_llama, max_num_seqs=4)
    assert llm.engine.runner.captured is None
    assert "self-check" in caplog.text
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY))
    assert len(out[0].outputs[0].token_ids) == 4

"""CUDA graphs of verification steps on models with recurrent layers (engine/decode_capture.py's
verification graphs, mode "cuda") on a real GPU: every bucket captured and self-checked; greedy
tokens with speculation (ngram on Qwen3-Next, Jamba and LFM2 with drafts from plain decoding's
own tokens, one spoiled now and then; Qwen3-Next's MTP layer) equal the eager engine's and plain
decoding's, k = 1 and 3, with requests joining and leaving; every verification and every
rollback's recomputed tokens replay a graph. Run with `pytest -m gpu` (or bench/gpu_checks.sh)
on a CUDA machine; skipped elsewhere; the time is bench/verification_capture.py's. The CPU twin of the same buffers,
padding and checks is tests/engine/test_captured_verification_hybrid.py."""

from __future__ import annotations

import pytest

from serverless_llm import LLM
from serverless_llm.engine import speculative
from tests.engine.family_check import save_family_model
from tests.engine.test_captured_verification_hybrid import (
    _params,
    _prompts,
    count_eager,
    only_long_steps_eager,
    oracle,
    staggered,
)
from tests.engine.test_hybrid_engine import HYBRIDS
from tests.engine.test_speculative import NGRAM
from tests.engine.test_speculative_mtp_qwen import _with_mtp
from tests.gpu_marks import GPU_ONLY
from tests.tiny_models import build_tokenizer

pytestmark = GPU_ONLY

KW = dict(device="cuda", block_size=16, num_kv_blocks=128, max_model_len=256, max_num_seqs=16)


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(speculative, "BACKOFF_RATE", 0.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    tok = build_tokenizer()
    return {
        kind: save_family_model(str(tmp_path_factory.mktemp(kind)), HYBRIDS[kind](tok))
        for kind in ("qwen3_next", "jamba", "lfm2")
    }


def _graphs(path: str, k: int, dtype: str) -> LLM:
    llm = LLM(path, dtype=dtype, speculative_config=dict(NGRAM, num_speculative_tokens=k), **KW)
    captured = llm.engine.runner.captured
    assert captured is not None and captured.mode == "cuda"
    assert captured.verify_enabled, "the verification graphs failed their self-check"
    assert sorted(captured.verify_graphs) == captured.verify_sizes == [2, 4, 8, 16]
    return llm


@pytest.mark.parametrize("kind", ["qwen3_next", "jamba", "lfm2"])
@pytest.mark.parametrize("k", [1, 3])
def test_graph_verification_tokens_equal_eager(models, kind, k):
    """float32: the graphs' tokens are the eager verification's and plain decoding's."""
    path = models[kind]
    prompts = _prompts(path)
    params = _params(len(prompts))
    plain = staggered(LLM(path, dtype="float32", enforce_eager=True, **KW), prompts, params)
    spec = dict(NGRAM, num_speculative_tokens=k)
    eager = LLM(path, dtype="float32", enforce_eager=True, speculative_config=spec, **KW)
    oracle(eager, prompts, plain)
    assert staggered(eager, prompts, params) == plain
    llm = _graphs(path, k, "float32")
    oracle(llm, prompts, plain)
    steps = count_eager(llm)
    assert staggered(llm, prompts, params) == plain
    assert llm.engine.runner.captured.verify_replays > 0
    assert only_long_steps_eager(steps, k + 2, 16), steps


@pytest.mark.parametrize("kind", ["qwen3_next", "jamba", "lfm2"])
def test_graph_verification_in_bfloat16(models, kind):
    """bfloat16: the graphs capture and pass their self-check (graph against the same forward
    run eagerly); served steps replay them (tokens are not compared: the eager step's other
    kernels round differently in bfloat16)."""
    path = models[kind]
    prompts = _prompts(path)
    params = _params(len(prompts))
    plain = staggered(LLM(path, dtype="bfloat16", enforce_eager=True, **KW), prompts, params)
    llm = _graphs(path, 3, "bfloat16")
    oracle(llm, prompts, plain)
    got = staggered(llm, prompts, params)
    assert [len(t) for t in got] == [p.max_tokens for p in params]
    assert llm.engine.runner.captured.verify_replays > 0


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_graph_verification(tmp_path_factory, k):
    target = _with_mtp("qwen3_next", tmp_path_factory.mktemp(f"mtp{k}"))["target"]
    prompts = _prompts(target)
    params = _params(len(prompts))
    spec = {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": None}
    kw = dict(KW, dtype="float32")
    plain = staggered(LLM(target, enforce_eager=True, **kw), prompts, params)
    llm = LLM(target, speculative_config=spec, **kw)
    captured = llm.engine.runner.captured
    assert captured is not None and captured.verify_enabled
    assert staggered(llm, prompts, params) == plain
    assert captured.verify_replays > 0

"""Captured decode steps (engine/decode_capture.py) on CPU, through the eager-replay twin: the
buckets, the padding (padded rows never write the KV cache, never reach the sampler), tokens
equal to eager ones at every bucket boundary and past the largest bucket and the longest
captured context, and the self-check that turns a mismatching capture off. The CUDA graph
capture itself is tested by tests/engine/test_decode_capture_gpu.py (`pytest -m gpu`)."""

from __future__ import annotations

import logging

import pytest
import torch

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine import decode_capture
from serverless_llm.engine.decode_capture import (
    StaticDecodeBatch,
    bucket_for,
    capture_sizes,
)

from .test_engine_core import GREEDY, random_prompts


def test_capture_sizes_cover_every_batch_up_to_the_top():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    sizes = capture_sizes(10_000)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == decode_capture.CAPTURE_LIMIT
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))
    for top in (1, 5, 12, 40, 300):
        sizes = capture_sizes(top)
        for rows in range(1, min(top, decode_capture.CAPTURE_LIMIT) + 1):
            b = bucket_for(rows, sizes)
            assert b is not None and b >= rows
            # the smallest bucket that holds it
            assert all(s < rows for s in sizes if s < b)
    assert bucket_for(9, [1, 2, 4, 8]) is None
    assert bucket_for(8, [1, 2, 4, 8]) == 8


def test_static_batch_pads_rows_past_the_step():
    """Two cache groups: each has its own slots and tables, padded alike."""
    s = StaticDecodeBatch(max_rows=8, max_blocks=4, device=torch.device("cpu"), num_groups=2)
    s.block_tables.fill_(7)  # stale values from an earlier, wider step
    tables = torch.tensor([[3, 4], [5, 6], [9, 1]], dtype=torch.int32)
    window = torch.tensor([[0, 8], [2, 10], [11, 0]], dtype=torch.int32)
    slots = [[100, 90, 30], [130, 40, 180]]
    s.fill(4, [11, 12, 13], [20, 5, 17], slots, [21, 6, 18], [tables, window])
    assert s.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert s.positions[:4].tolist() == [20, 5, 17, 0]
    assert s.slot_mapping[0, :4].tolist() == [100, 90, 30, -1]
    assert s.slot_mapping[1, :4].tolist() == [130, 40, 180, -1]
    assert s.seq_lens[:4].tolist() == [21, 6, 18, 1]
    assert s.context_lens[:4].tolist() == [20, 5, 17, 0]
    assert s.block_tables[0, :3, :2].tolist() == tables.tolist()
    assert s.block_tables[1, :3, :2].tolist() == window.tolist()
    assert s.block_tables[:, :4, 2:].eq(0).all() and s.block_tables[:, 3].eq(0).all()
    metas = s.metadata(4, [21, 6, 18, 1], block_size=16)
    assert len(metas) == 2
    for g, meta in enumerate(metas):
        assert meta.num_decodes == 4 and meta.max_seq_len == 21 and meta.num_requests == 4
        assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
        assert meta.slot_mapping.tolist() == s.slot_mapping[g, :4].tolist()
        assert meta.block_tables.tolist() == s.block_tables[g, :4].tolist()
    assert metas[0].backend_state is not metas[1].backend_state
    with pytest.raises(ValueError):
        s.fill(2, [1, 2, 3], [0, 0, 0], [[0, 1, 2]] * 2, [1, 1, 1], [tables] * 2)
    # A request may hold more blocks than a captured context reads: the extra columns drop.
    wide = torch.tensor([[1, 2, 3, 4, 5]], dtype=torch.int32)
    s.fill(8, [1], [0], [[0], [0]], [1], [wide, wide])
    assert s.block_tables[:, 0].tolist() == [[1, 2, 3, 4]] * 2
    with pytest.raises(ValueError):
        s.fill(9, [1], [0], [[0]] * 2, [1], [torch.zeros(1, 1, dtype=torch.int32)] * 2)


def _llm(tiny_llama, **kw):
    args = dict(num_kv_blocks=96, block_size=8, max_model_len=256)
    args.update(kw)
    return LLM(tiny_llama, **args)


def test_padded_rows_write_no_cache_and_reach_no_sampler(tiny_llama):
    llm = _llm(tiny_llama, decode_capture="replay", max_num_seqs=8)
    captured = llm.engine.runner.captured
    assert captured is not None and captured.enabled and captured.sizes == [1, 2, 4, 8]
    caches = llm.engine.kv_caches
    for c in caches:
        c.fill_(0.25)
    before = [c.clone() for c in caches]
    bs = 8
    # Three decode rows in a bucket of 4, in blocks 5 and 6.
    tables = torch.tensor([[5, 6], [5, 6], [5, 6]], dtype=torch.int32)
    lens = [3, 9, 12]
    positions = [n - 1 for n in lens]
    slots = [int(tables[0, p // bs]) * bs + p % bs for p in positions]
    hidden = captured.run(4, [7, 8, 9], positions, [slots], lens, [tables])
    assert hidden.shape[0] == 3  # the padded row is not returned
    for c, b in zip(caches, before):
        changed = (c != b).flatten(3).any(-1)  # [2, blocks, block_size]: slots written
        written = sorted(int(blk) * bs + int(off) for blk, off in changed.any(0).nonzero())
        assert written == sorted(slots)


def test_captured_tokens_equal_eager_at_every_bucket_boundary(tiny_llama, monkeypatch):
    # Largest bucket 8 while 12 requests may run: batches of 9..12 run eagerly. Contexts longer
    # than 48 tokens run eagerly too.
    monkeypatch.setattr(decode_capture, "CAPTURE_LIMIT", 8)
    eager = _llm(tiny_llama, max_num_seqs=12)
    assert eager.engine.runner.captured is None  # "auto" on CPU: no capture
    replay = _llm(tiny_llama, max_num_seqs=12, decode_capture="replay", max_seq_len_to_capture=48)
    captured = replay.engine.runner.captured
    assert captured.sizes == [1, 2, 4, 8] and captured.max_seq_len == 48
    steps = {"captured": 0}
    real_run = captured.run

    def counting_run(*a, **kw):
        steps["captured"] += 1
        return real_run(*a, **kw)

    monkeypatch.setattr(captured, "run", counting_run)
    vocab = eager.engine.vocab_size
    for n in (1, 2, 3, 4, 5, 8, 9, 12, 16):
        prompts = random_prompts(n, vocab, seed=n, lo=2, hi=30)
        params = [SamplingParams(max_tokens=8 + (i * 5) % 23, **GREEDY) for i in range(n)]
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
        got = [o.outputs[0].token_ids for o in replay.generate(prompts, params)]
        assert got == want, f"{n} requests"
    assert steps["captured"] > 0
    assert replay.engine.block_pool.num_free == 96


def test_steps_past_the_largest_bucket_and_longest_context_run_eagerly(tiny_llama, monkeypatch):
    monkeypatch.setattr(decode_capture, "CAPTURE_LIMIT", 4)
    llm = _llm(tiny_llama, max_num_seqs=6, decode_capture="replay", max_seq_len_to_capture=20)
    runner = llm.engine.runner
    seen = []
    real = runner._captured_bucket

    def recording(h):
        size = real(h)
        seen.append((len(h.query_lens), h.num_decodes, max(h.seq_lens), size))
        return size

    monkeypatch.setattr(runner, "_captured_bucket", recording)
    prompts = random_prompts(6, llm.engine.vocab_size, seed=3, lo=4, hi=10)
    llm.generate(prompts, [SamplingParams(max_tokens=4 + 5 * i, **GREEDY) for i in range(6)])
    decode_only = [s for s in seen if s[0] == s[1]]
    assert any(size is not None for *_, size in decode_only)
    for rows, _, longest, size in decode_only:
        if rows > 4 or longest > 20:
            assert size is None
        else:
            assert size is not None and size >= rows
    assert any(rows > 4 for rows, *_ in decode_only) and any(s[2] > 20 for s in decode_only)
    for rows, nd, _, size in seen:
        if nd != rows:  # a step with a prefill in it
            assert size is None


def test_a_mismatching_capture_turns_itself_off(tiny_llama, monkeypatch, caplog):
    monkeypatch.setattr(decode_capture, "SELF_CHECK_HOOK", lambda hidden: hidden + 0.5)
    with caplog.at_level(logging.WARNING, logger="serverless_llm.engine.decode_capture"):
        llm = _llm(tiny_llama, decode_capture="replay", max_num_seqs=4)
    assert llm.engine.runner.captured is None
    text = caplog.text
    assert "decode capture turned off" in text and "self-check: bucket 1 differs" in text
    # and the engine serves, eagerly
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY))
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_capture_error_turns_it_off(tiny_llama, monkeypatch, caplog):
    def boom(hidden):
        raise RuntimeError("capture exploded")

    monkeypatch.setattr(decode_capture, "SELF_CHECK_HOOK", boom)
    with caplog.at_level(logging.WARNING, logger="serverless_llm.engine.decode_capture"):
        llm = _llm(tiny_llama, decode_capture="replay", max_num_seqs=2)
    assert llm.engine.runner.captured is None
    assert "RuntimeError: capture exploded" in caplog.text


def test_enforce_eager_wins_over_replay(tiny_llama):
    llm = _llm(tiny_llama, decode_capture="replay", enforce_eager=True)
    assert llm.engine.runner.captured is None

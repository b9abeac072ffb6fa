"""Captured verification steps on models with recurrent layers (engine/decode_capture.py, the
verification graphs), on CPU through their eager-replay twin: a step whose requests bring a few
rows each (verifications, and the kept tokens computed again after a rollback) runs in a bucket
of rows, attention seeing every row as a decode of its own and the recurrent layers each
request's rows in order from its state slot, padding entries in the scratch slot. Greedy tokens
equal decoding without speculation and the eager verification path's, k = 1 and 3, with requests
joining and leaving, for ngram on Qwen3-Next (Gated DeltaNet), Jamba (Mamba-1) and LFM2 (short
convolutions), and for Qwen3-Next's own MTP layer; a mismatching check turns the verification
graphs off alone; Falcon-H1 (attention and a state in one layer) verifies eagerly."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine import decode_capture, speculative
from tests.engine.family_check import family_prompts, save_family_model
from tests.engine.test_hybrid_engine import HYBRIDS, assert_books_whole
from tests.engine.test_speculative import NGRAM, repeating_prompts
from tests.engine.test_speculative_mtp_qwen import _with_mtp
from tests.tiny_models import build_tokenizer

# The other kinds of recurrent layers (Mamba-2 beside attention and alone, Nemotron-H's one-kind
# blocks with the prompt-only time-step limit, Kimi Delta Attention)
OTHER_KINDS = ("granitemoehybrid", "mamba2", "nemotron_h", "kimi_linear")
KW = dict(block_size=8, num_kv_blocks=96, max_model_len=96, dtype="float32", max_num_seqs=16)


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(speculative, "BACKOFF_RATE", 0.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    tok = build_tokenizer()
    out = {}
    for kind in ("qwen3_next", "jamba", "lfm2", *OTHER_KINDS):
        out[kind] = save_family_model(str(tmp_path_factory.mktemp(kind)), HYBRIDS[kind](tok))
    return out


def _prompts(path: str) -> list[list[int]]:
    return family_prompts(transformers.AutoConfig.from_pretrained(path).vocab_size)[:5]


def _params(n: int) -> list[SamplingParams]:
    """Different lengths: requests leave at different steps."""
    return [
        SamplingParams(temperature=0.0, max_tokens=10 + 5 * i, ignore_eos=True) for i in range(n)
    ]


def staggered(llm: LLM, prompts, params) -> list[list[int]]:
    """Greedy tokens with the requests joining one or two steps apart (others leaving meanwhile)."""
    e = llm.engine
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    pending = list(enumerate(zip(prompts, params)))
    step = 0
    while pending or e.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, (prompt, p) = pending.pop(0)
            e.add_request(prompt, p, request_id=str(i))
        for o in e.step():
            out[o.request_id].extend(o.new_token_ids)
        step += 1
    return list(out.values())


def oracle(llm: LLM, prompts, full) -> None:
    """Drafts of plain decoding's own tokens, one of them spoiled in every third verification
    of a request (kept runs, cut runs and whole rejections, whatever k)."""
    known = {tuple(p): out for p, out in zip(prompts, full)}
    e = llm.engine
    seen: dict[int, int] = {}

    def propose(req, room):
        k = e.draft_room(req, room)
        out = known[tuple(req.prompt_token_ids)]
        n = len(req.output_token_ids)
        drafts = list(out[n : n + k])
        turn = seen[id(req)] = seen.get(id(req), 0) + 1
        if drafts and turn % 3 == 0:
            bad = (turn // 3) % len(drafts)
            drafts[bad] = (drafts[bad] + 1) % e.vocab_size
        return drafts

    e.scheduler.propose = propose


def count_steps(captured) -> list[tuple[int, int, bool]]:
    """(bucket, rows, through the verification graphs) of each captured step, from now on."""
    steps = []
    run = captured.run

    def counting(size, input_ids, *args, **kw):
        query_lens = kw.get("query_lens", args[6] if len(args) > 6 else None)
        steps.append((size, len(input_ids), len(query_lens) != len(input_ids)))
        return run(size, input_ids, *args, **kw)

    captured.run = counting
    return steps


def count_eager(llm: LLM) -> list[list[int]]:
    """The query lengths of each step run eagerly, from now on."""
    runner = llm.engine.runner
    eager = []
    inputs = runner.device_inputs

    def recording(h):
        eager.append(list(h.query_lens))
        return inputs(h)

    runner.device_inputs = recording
    return eager


def only_long_steps_eager(eager: list[list[int]], verify_rows: int, largest: int) -> bool:
    """Every eager step had a request past what a verification graph holds (a prompt's chunk),
    or more rows than the largest bucket."""
    return all(max(q) > verify_rows or sum(q) > largest for q in eager)


@pytest.mark.parametrize("kind", ["qwen3_next", "jamba", "lfm2"])
@pytest.mark.parametrize("k", [1, 3])
def test_ngram_verification_runs_captured(models, kind, k):
    path = models[kind]
    prompts = _prompts(path)
    params = _params(len(prompts))
    plain = staggered(LLM(path, **KW), prompts, params)
    spec = dict(NGRAM, num_speculative_tokens=k)
    eager = LLM(path, speculative_config=spec, **KW)
    oracle(eager, prompts, plain)
    assert staggered(eager, prompts, params) == plain
    llm = LLM(path, speculative_config=spec, decode_capture="replay", **KW)
    captured = llm.engine.runner.captured
    assert captured.verify_enabled and captured.verify_rows == k + 2
    assert captured.verify_sizes == [2, 4, 8, 16]
    oracle(llm, prompts, plain)
    steps, eager = count_steps(captured), count_eager(llm)
    assert staggered(llm, prompts, params) == plain
    # every verification, and every rollback's kept tokens computed again, ran captured
    assert only_long_steps_eager(eager, k + 2, 16), eager
    stats = llm.engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # kept and cut runs
    assert captured.verify_replays > 0 and captured.replays > 0
    assert any(verify and rows > size // 2 for size, rows, verify in steps), steps
    assert all(size >= rows for size, rows, _ in steps)
    assert_books_whole(llm)


@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_other_recurrent_kinds(models, kind):
    """k = 3, drafts from plain decoding's tokens: as above."""
    path = models[kind]
    prompts = _prompts(path)
    params = _params(len(prompts))
    plain = staggered(LLM(path, **KW), prompts, params)
    spec = dict(NGRAM, num_speculative_tokens=3)
    llm = LLM(path, speculative_config=spec, decode_capture="replay", **KW)
    captured = llm.engine.runner.captured
    assert captured.verify_enabled
    oracle(llm, prompts, plain)
    eager = count_eager(llm)
    assert staggered(llm, prompts, params) == plain
    assert captured.verify_replays > 0
    assert only_long_steps_eager(eager, 5, 16), eager
    assert_books_whole(llm)


def test_prompt_lookup_drafts(models):
    """ngram's own drafts (prompt lookup on prompts that repeat a motif), k = 3."""
    path = models["qwen3_next"]
    prompts = repeating_prompts(transformers.AutoConfig.from_pretrained(path).vocab_size, 4)
    params = _params(len(prompts))
    plain = staggered(LLM(path, **KW), prompts, params)
    spec = dict(NGRAM, num_speculative_tokens=3, prompt_lookup_min=1)
    assert staggered(LLM(path, speculative_config=spec, **KW), prompts, params) == plain
    llm = LLM(path, speculative_config=spec, decode_capture="replay", **KW)
    eager = count_eager(llm)
    assert staggered(llm, prompts, params) == plain
    assert llm.engine.stats().spec_drafts > 0
    assert llm.engine.runner.captured.verify_replays > 0
    assert only_long_steps_eager(eager, 5, 16), eager
    assert_books_whole(llm)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_verification_runs_captured(tmp_path_factory, k):
    """Qwen3-Next's own MTP layer proposing (its head reads the target's hidden states of the
    captured steps' rows)."""
    target = _with_mtp("qwen3_next", tmp_path_factory.mktemp(f"mtp{k}"))["target"]
    prompts = _prompts(target)
    params = _params(len(prompts))
    plain = staggered(LLM(target, **KW), prompts, params)
    spec = {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": None}
    assert staggered(LLM(target, speculative_config=spec, **KW), prompts, params) == plain
    llm = LLM(target, speculative_config=spec, decode_capture="replay", **KW)
    captured = llm.engine.runner.captured
    assert captured.verify_enabled
    eager = count_eager(llm)
    assert staggered(llm, prompts, params) == plain
    assert llm.engine.stats().spec_drafts > 0 and captured.verify_replays > 0
    assert only_long_steps_eager(eager, k + 2, 16), eager
    assert_books_whole(llm)
    llm.engine.drafter.check()


def test_a_mismatching_check_turns_the_verification_graphs_off(models, monkeypatch, caplog):
    """The decode graphs stay; verification steps run eagerly; tokens unchanged."""
    path = models["lfm2"]
    monkeypatch.setattr(decode_capture, "VERIFY_CHECK_HOOK", lambda hidden: hidden * 2 + 1)
    spec = dict(NGRAM, num_speculative_tokens=3)
    with caplog.at_level(logging.WARNING, logger="serverless_llm.engine.decode_capture"):
        llm = LLM(path, speculative_config=spec, decode_capture="replay", **KW)
    captured = llm.engine.runner.captured
    assert captured.enabled and not captured.verify_enabled
    assert "verification capture turned off" in caplog.text
    prompts = _prompts(path)
    params = _params(len(prompts))
    plain = staggered(LLM(path, **KW), prompts, params)
    oracle(llm, prompts, plain)
    assert staggered(llm, prompts, params) == plain
    assert captured.verify_replays == 0 and captured.replays > 0


def test_attention_beside_a_state_verifies_eagerly(tmp_path):
    """Falcon-H1 (attention and Mamba-2 in one layer): no verification graphs, the decode
    graphs and speculation as before."""
    path = save_family_model(str(tmp_path), HYBRIDS["falcon_h1"](build_tokenizer()))
    prompts = _prompts(path)[:3]
    params = _params(len(prompts))
    plain = staggered(LLM(path, **KW), prompts, params)
    llm = LLM(path, speculative_config=NGRAM, decode_capture="replay", **KW)
    captured = llm.engine.runner.captured
    assert captured.enabled and captured.verify_sizes == [] and captured.verify_off
    oracle(llm, prompts, plain)
    assert staggered(llm, prompts, params) == plain
    assert llm.engine.stats().spec_drafts > 0 and captured.replays > 0


def test_entries_of_a_verification_step():
    """The recurrent layers' entries in bucket 8 for requests of 1, 3 and 2 rows: theirs first
    (a state continued where the first row is not at position 0), then one-row padding entries
    while rows are left, then empty ones, all in slot 0 from zeros."""
    s = decode_capture.StaticDecodeBatch(8, 4, torch.device("cpu"), has_state=True)
    positions = [9, 0, 1, 2, 5, 6]
    s.fill(8, [7] * 6, positions, [[-1] * 6], [p + 1 for p in positions],
           [torch.zeros(6, 1, dtype=torch.int32)], None, [False, True, True, True, False, False])  # fmt: skip
    s.fill_entries(8, [1, 3, 2], [4, 2, 5], [p + 1 for p in positions])
    assert s.entry_start_loc.tolist() == [0, 1, 4, 6, 7, 8, 8, 8, 8]
    assert s.state_slots.tolist() == [4, 2, 5, 0, 0, 0, 0, 0]
    assert s.has_initial_state.tolist() == [True, False, True] + [False] * 5
    assert s.prompt_rows.tolist() == [False, True, True, True, False, False, False, False]
    meta = s.recurrent_metadata(8, 5, 10, 8)
    assert meta.num_decodes == 0 and meta.max_query_len == 5
    assert meta.query_start_loc.data_ptr() == s.entry_start_loc.data_ptr()

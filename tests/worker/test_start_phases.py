"""The worker's cold-start line (worker/start_phases.py): each phase's seconds from process
start to ready, then the first output's time."""

from __future__ import annotations

import asyncio
import logging

from serverless_llm.worker.start_phases import StartPhases, seconds_since_process_start


def test_process_age_is_positive_and_grows():
    first = seconds_since_process_start()
    assert first is not None and first > 0
    assert seconds_since_process_start() >= first


def test_start_up_line_names_each_phase(make_worker, caplog):
    worker = make_worker()
    with caplog.at_level(logging.INFO, logger="serverless_llm.worker.handler"):
        worker.load()

        async def first() -> dict:
            job = {"id": "j", "input": {"prompt": "hi", "sampling_params": {"max_tokens": 2}}}
            async for item in worker.handle(job):
                return item
            raise AssertionError("no output")

        asyncio.run(first())
    line = next(r.getMessage() for r in caplog.records if "start-up: ready" in r.getMessage())
    for phase in ("imports and settings", "weights", "tokenizer", "KV allocation",
                  "kernel warm-up", "graph capture", "other set-up"):  # fmt: skip
        assert phase in line, line
    phases = worker.start_phases
    assert 0 < phases.load_start < phases.ready <= phases.first_token
    assert any("first output" in r.getMessage() for r in caplog.records)


def test_line_adds_up():
    p = StartPhases()
    p.load_start, p.ready = 2.0, 10.0
    p.engine = {"weights": 5.0, "KV allocation": 1.0}
    assert p.line() == ("start-up: ready 10.0s after process start (imports and settings 2.0s, "
                        "weights 5.0s, KV allocation 1.0s, other set-up 2.0s)")  # fmt: skip


def test_grammar_warm_up_waits_for_the_first_output(make_worker, monkeypatch):
    """Guided decoding's warm-up starts at the first output, not at ready (where it slowed the
    first request's forward), and once."""
    from serverless_llm.engine import AsyncEngine

    calls = []
    monkeypatch.setattr(AsyncEngine, "warm_up_grammars", lambda self: calls.append(self))
    worker = make_worker()
    worker.load()
    assert calls == []  # not at ready

    async def jobs() -> None:
        for n in range(2):
            job = {"id": f"j{n}", "input": {"prompt": "hi", "sampling_params": {"max_tokens": 2}}}
            async for _ in worker.handle(job):
                assert len(calls) == 1  # from the first output on
        await worker.shutdown()

    asyncio.run(jobs())
    assert calls == [worker.engine]


def test_grammar_warm_up_starts_on_its_own_without_a_job(make_worker, monkeypatch):
    import threading

    from serverless_llm.engine import AsyncEngine
    from serverless_llm.worker import handler

    started = threading.Event()
    monkeypatch.setattr(AsyncEngine, "warm_up_grammars", lambda self: started.set())
    monkeypatch.setattr(handler, "GRAMMAR_WARM_UP_DELAY_S", 0.01)
    worker = make_worker()
    worker.load()
    assert started.wait(timeout=60)
    asyncio.run(worker.shutdown())

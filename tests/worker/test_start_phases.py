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
    for phase in ("imports and settings", "weights", "KV allocation", "kernel warm-up",
                  "graph capture", "other set-up"):  # fmt: skip
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

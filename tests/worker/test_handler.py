"""The handler: concurrent jobs on one engine, the constant concurrency, delegation of OpenAI
jobs, errors in each route's shape, and the model loading once."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

import serverless_llm
from serverless_llm.api.batching import BatchSizes
from serverless_llm.api.limits import RequestLimits
from serverless_llm.api.media import MediaConfig
from serverless_llm.api.openai.response_store import MemoryResponseStore
from serverless_llm.engine.async_engine import AsyncEngine
from serverless_llm.worker import handler as handler_module
from serverless_llm.worker.handler import Worker, _iterates_generators
from serverless_llm.worker.settings import Settings
from tests.worker.conftest import joined, run, run_job, token_counts, wait_blocks_free


def test_many_concurrent_jobs_complete(make_worker):
    worker = make_worker(NUM_GPU_BLOCKS_OVERRIDE="64")  # tight: some requests get preempted
    prompts = [f"Job {i}: the quick brown fox" for i in range(40)]

    async def scenario(w):
        jobs = [
            run_job(
                w,
                {
                    "prompt": p,
                    "sampling_params": {
                        "max_tokens": 24 + i % 9,
                        "ignore_eos": True,
                        "temperature": 0,
                    },
                    "stream": i % 2 == 0,
                },
                job_id=f"job-{i}",
            )
            for i, p in enumerate(prompts)
        ]
        results = await asyncio.gather(*jobs)
        alone = await run_job(
            w,
            {
                "prompt": prompts[3],
                "sampling_params": {"max_tokens": 27, "ignore_eos": True, "temperature": 0},
            },
        )
        return results, alone, await wait_blocks_free(w), w.active_jobs

    results, alone, free, active = run(worker, scenario)
    for i, items in enumerate(results):
        assert "error" not in items[0], items
        assert items[-1]["usage"]["output"] == 24 + i % 9
        assert sum(token_counts(items)) == (24 + i % 9 if i % 2 == 0 else 1)
    # Greedy output does not depend on what else ran in the batch.
    assert joined(results[3]) == joined(alone)
    assert free and active == 0


def test_concurrency_modifier_is_constant(make_worker):
    worker = make_worker(MAX_CONCURRENCY="7")
    assert [worker.concurrency_modifier(c) for c in (0, 1, 7, 300)] == [7, 7, 7, 7]
    assert Worker(Settings.from_env({})).concurrency_modifier(1) == 300


class FakeServing:
    instances: list[FakeServing] = []

    def __init__(self, engine: AsyncEngine, **kwargs: Any) -> None:
        self.engine = engine
        self.kwargs = kwargs
        self.calls: list[tuple[str, Any, BatchSizes]] = []
        FakeServing.instances.append(self)

    async def handle(self, route: str, body: Any, batch: BatchSizes, method: str | None = None):
        self.calls.append((route, body, batch))
        if route == "/boom":
            yield "data: partial\n\n"
            raise RuntimeError("serving layer bug")
        yield 'data: {"n": 1}\n\n'
        yield "data: [DONE]\n\n"


@pytest.fixture()
def fake_openai(monkeypatch):
    FakeServing.instances = []
    monkeypatch.setattr(handler_module, "OpenAIServing", FakeServing)
    return FakeServing


def test_openai_jobs_are_delegated(make_worker, fake_openai):
    worker = make_worker(
        OPENAI_SERVED_MODEL_NAME_OVERRIDE="served",
        OPENAI_RESPONSE_ROLE="bot",
        RAW_OPENAI_OUTPUT="0",
        CUSTOM_CHAT_TEMPLATE="{{ messages }}",
        DEFAULT_BATCH_SIZE="40",
    )
    body = {"model": "served", "messages": [{"role": "user", "content": "hi"}], "stream": True}

    async def scenario(w):
        a = await run_job(w, {"openai_route": "/v1/chat/completions", "openai_input": body})
        b = await run_job(
            w,
            {
                "openai_route": "/v1/models",
                "max_batch_size": 8,
                "min_batch_size": 2,
                "batch_size_growth_factor": 2,
            },
        )
        return a, b

    a, b = run(worker, scenario)
    assert a == ['data: {"n": 1}\n\n', "data: [DONE]\n\n"] and b == a
    assert len(fake_openai.instances) == 1  # built once, on first use
    serving = fake_openai.instances[0]
    assert serving.engine is worker.engine
    # The Responses store: in memory, with the settings' limits (RESPONSES_STORE_URL unset).
    store = serving.kwargs.pop("response_store")
    assert isinstance(store, MemoryResponseStore)
    assert (store.max_count, store.max_bytes) == (10_000, 256 * 1024 * 1024)
    assert len(worker.adapters) == 0 and not worker.adapters.runtime_updates
    assert serving.kwargs == {
        "served_model_name": "served",
        # MODEL_NAME stays accepted beside the override, as written and by its last component.
        "model_aliases": (),
        "unlisted_aliases": (
            worker.settings.model_name,
            os.path.basename(worker.settings.model_name),
        ),
        "response_role": "bot",
        "chat_template": "{{ messages }}",
        "raw_output": False,
        "enable_auto_tool_choice": True,  # the default, as OpenAI's
        "tool_call_parser": None,
        "limits": RequestLimits(),
        "reasoning_parser": "auto",  # REASONING_PARSER unset: read from the chat template
        "structured_in_reasoning": False,
        # The adapters, shared with the native route (none; runtime loading off).
        "lora_modules": worker.adapters,
        "media": MediaConfig(),  # the Multimodal settings' defaults
        "metrics": worker.metrics.render,  # ENABLE_METRICS on by default
        "version": serverless_llm.__version__,
    }
    assert serving.calls[0] == (
        "/v1/chat/completions",
        body,
        BatchSizes(max_batch_size=40, min_batch_size=1, growth_factor=3.0),
    )
    assert serving.calls[1] == ("/v1/models", None, BatchSizes(8, 2, 2.0))


def test_openai_envelope_errors_have_openai_shape(make_worker, fake_openai):
    async def scenario(w):
        return [
            await run_job(w, {"openai_route": 5, "openai_input": {}}),
            await run_job(w, {"openai_route": "/v1/completions", "prompt": "x"}),
            await run_job(w, {"openai_route": "/v1/completions", "max_batch_size": "big"}),
            await run_job(w, {"openai_route": "/boom", "openai_input": {}}),
        ]

    results = run(make_worker(), scenario)
    for items in results[:3]:
        assert len(items) == 1
        error = items[0]["error"]
        assert isinstance(error, dict) and error["type"] == "invalid_request_error"
        assert error["message"]
    assert results[0][0]["error"]["param"] == "openai_route"
    assert results[1][0]["error"]["param"] == "prompt"
    assert results[2][0]["error"]["param"] == "max_batch_size"
    # A bug inside the serving layer: what was produced, then an error; the worker survives.
    boom = results[3]
    assert boom[0] == "data: partial\n\n"
    assert boom[1]["error"]["type"] == "server_error"
    assert "serving layer bug" in boom[1]["error"]["message"]


def test_handle_aggregate_returns_the_items(make_worker):
    async def scenario(w):
        job = {
            "id": "a",
            "input": {
                "prompt": "Hi",
                "sampling_params": {"max_tokens": 10, "ignore_eos": True},
                "stream": True,
            },
        }
        return await w.handle_aggregate(job)

    items = run(make_worker(), scenario)
    assert isinstance(items, list) and sum(token_counts(items)) == 10


def test_model_loads_once(make_worker, monkeypatch):
    calls = []
    real = AsyncEngine.from_config

    def counting(cfg):
        calls.append(cfg)
        return real(cfg)

    monkeypatch.setattr(handler_module.AsyncEngine, "from_config", staticmethod(counting))
    worker = make_worker()

    async def scenario(w):
        await asyncio.gather(*(w.start() for _ in range(5)))
        return await asyncio.gather(
            *(run_job(w, {"prompt": "Hi", "sampling_params": {"max_tokens": 3}}) for _ in range(4))
        )

    results = run(worker, scenario)
    assert len(calls) == 1
    assert all("choices" in items[0] for items in results)


def test_jobs_start_the_worker_lazily(make_worker):
    worker = make_worker()

    async def scenario():
        items = await run_job(worker, {"prompt": "Hi", "sampling_params": {"max_tokens": 3}})
        await worker.shutdown()
        return items

    assert asyncio.run(scenario())[0]["usage"]["output"] >= 1


def test_an_injected_engine_is_used(make_worker):
    donor = make_worker()
    engine = donor.load()
    worker = Worker(donor.settings, engine=engine)

    async def scenario(w):
        return await run_job(w, {"prompt": "Hi", "sampling_params": {"max_tokens": 3}})

    assert "choices" in run(worker, scenario)[0]
    assert worker.engine is engine


def test_a_model_that_cannot_load_fails_jobs_not_the_process(make_worker, tmp_path):
    worker = make_worker(MODEL_NAME=str(tmp_path / "no-such-model"))

    async def scenario():
        return await run_job(worker, {"prompt": "Hi"})

    items = asyncio.run(scenario())
    assert len(items) == 1 and "could not be loaded" in items[0]["error"]


def test_stats_logging(make_worker, monkeypatch, caplog):
    monkeypatch.setattr(handler_module, "STATS_INTERVAL_S", 0.01)
    worker = make_worker(DISABLE_LOG_STATS="0", DISABLE_LOG_REQUESTS="0")

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records]

    async def scenario(w):
        with caplog.at_level("INFO", logger="serverless_llm"):
            await run_job(
                w, {"prompt": "Hi", "sampling_params": {"max_tokens": 40, "ignore_eos": True}}
            )
            # The stats line comes at the logger's next tick after the job: wait for it, not
            # for a guessed time (the deadline only guards against a hang).
            deadline = asyncio.get_running_loop().time() + 30
            while not any(m.startswith("stats: ") for m in logged()):
                if asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.01)
        return logged()

    messages = run(worker, scenario)
    assert any(m.startswith("stats: ") and "KV cache" in m for m in messages)
    assert any(m.startswith("job test-job: native") for m in messages)


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        (["--rp_serve_api", "--rp_api_port", "8001"], {}, True),
        ([], {"RUNPOD_WEBHOOK_GET_JOB": "https://api/job-take/$ID"}, True),
        (["--test_input", "{}"], {"RUNPOD_WEBHOOK_GET_JOB": "x"}, False),
        ([], {}, False),  # test_input.json mode
        ([], {"RUNPOD_WEBHOOK_GET_JOB": "x", "RUNPOD_REALTIME_PORT": "9000"}, False),
    ],
)
def test_generator_handler_only_where_the_sdk_iterates_it(argv, environ, expected):
    assert _iterates_generators(argv, environ) is expected


def test_the_stats_line_says_how_speculation_goes():
    """DISABLE_LOG_STATS=0's line gains the share of drafts accepted and the tokens a
    verification gives once speculation has verified drafts ('' before, or when it is off)."""
    from serverless_llm.engine.outputs import EngineStats
    from serverless_llm.worker.handler import speculation_line

    base = dict(
        num_running=1,
        num_waiting=0,
        num_requests=1,
        num_kv_blocks=8,
        num_free_kv_blocks=4,
        num_preemptions=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
    )
    assert speculation_line(EngineStats(**base)) == ""
    assert speculation_line(EngineStats(**base, speculative=True)) == ""
    stats = EngineStats(
        **base, speculative=True, spec_drafts=4, spec_draft_tokens=16, spec_accepted_tokens=12
    )
    line = speculation_line(stats)
    assert "75% of 16 drafts accepted" in line and "4.00 tokens a verification" in line

"""EngineMetrics on outputs with chosen times: each histogram gets exactly the intervals the
engine's `RequestTimes` say, the counters what the final outputs say, and the gauges what
`stats()` says when scraped."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from serverless_llm.api.metrics import EngineMetrics
from serverless_llm.engine import EngineOutput, EngineStats, RequestTimes


class StatsEngine:
    """Just what EngineMetrics reads: an observer hook, stats() and the block size."""

    def __init__(self) -> None:
        self.observers: list[Any] = []
        self.model_info = type("Info", (), {"block_size": 16})()
        self.now = EngineStats(
            num_running=3,
            num_waiting=2,
            num_requests=5,
            num_kv_blocks=100,
            num_free_kv_blocks=75,
            num_preemptions=4,
            prefix_cache_queries=10,
            prefix_cache_hits=6,
        )

    def add_output_observer(self, observer: Any) -> None:
        self.observers.append(observer)

    def stats(self) -> EngineStats:
        return self.now


def out(
    rid: str, new: int, total: int, times: RequestTimes | None, reason: str | None = None
) -> EngineOutput:
    return EngineOutput(
        request_id=rid,
        new_token_ids=list(range(new)),
        new_text="x" * new,
        finished=reason is not None,
        finish_reason=reason,
        stop_reason=None,
        num_prompt_tokens=11,
        num_output_tokens=total,
        times=times,
    )


def samples(metrics: EngineMetrics) -> dict[str, float]:
    got = {}
    for family in text_string_to_metric_families(metrics.render()):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            assert s.labels["model_name"] == "m"
            suffix = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            got[s.name.removeprefix("serverless_llm:") + (f"{{{suffix}}}" if suffix else "")] = (
                s.value
            )
    return got


def test_observed_times_and_counts():
    engine = StatsEngine()
    metrics = EngineMetrics(engine, "m").attach()
    assert engine.observers == [metrics.observe]
    arrival = time.monotonic() - 5.0  # e2e is measured against the clock: at least 5 s
    a = RequestTimes(arrival, scheduled=arrival + 0.25)
    b = RequestTimes(arrival, scheduled=arrival + 0.5)
    # Step 1: both get their first token.
    a.first_token = a.last_token = arrival + 1.0
    b.first_token = b.last_token = arrival + 2.0
    metrics.observe([out("a", 1, 1, a), out("b", 1, 1, b)])
    # Step 2: a gets another token 0.125 s later and ends by length; b is aborted (no tokens).
    a.token_interval, a.last_token = 0.125, arrival + 1.125
    metrics.observe([out("a", 1, 2, a, "length"), out("b", 0, 1, b, "abort")])
    # A beam search's whole output (no interval), ending by stop; and one without times.
    c = RequestTimes(arrival, scheduled=arrival)
    c.first_token = c.last_token = arrival + 3.0
    metrics.observe([out("c", 4, 4, c, "stop"), out("d", 2, 2, None, "stop")])

    got = samples(metrics)
    assert got["request_success_total{finished_reason=length}"] == 1
    assert got["request_success_total{finished_reason=abort}"] == 1
    assert got["request_success_total{finished_reason=stop}"] == 2
    assert got["prompt_tokens_total"] == 4 * 11
    assert got["generation_tokens_total"] == 2 + 1 + 4 + 2
    assert got["time_to_first_token_seconds_count"] == 3
    assert got["time_to_first_token_seconds_sum"] == 1.0 + 2.0 + 3.0
    assert got["inter_token_latency_seconds_count"] == 1
    assert got["inter_token_latency_seconds_sum"] == 0.125
    assert got["request_queue_time_seconds_count"] == 3
    assert got["request_queue_time_seconds_sum"] == 0.25 + 0.5 + 0.0
    assert got["e2e_request_latency_seconds_count"] == 3
    assert got["e2e_request_latency_seconds_sum"] >= 3 * 5.0
    assert got["time_to_first_token_seconds_bucket{le=1.0}"] == 1
    assert got["time_to_first_token_seconds_bucket{le=2.0}"] == 2
    # The gauges and the engine's own counters, read at scrape time (prefix cache in tokens).
    assert got["num_requests_running"] == 3
    assert got["num_requests_waiting"] == 2
    assert got["kv_cache_usage_perc"] == 0.25
    assert got["num_preemptions_total"] == 4
    assert got["prefix_cache_queries_total"] == 10 * 16
    assert got["prefix_cache_hits_total"] == 6 * 16
    engine.now = EngineStats(0, 0, 0, 100, 100, 5, 10, 6)
    assert samples(metrics)["num_requests_running"] == 0
    assert samples(metrics)["num_preemptions_total"] == 5


def test_two_workers_keep_apart():
    first, second = EngineMetrics(StatsEngine(), "m"), EngineMetrics(StatsEngine(), "m")
    first.observe([out("a", 1, 1, None, "length")])
    assert samples(first)["request_success_total{finished_reason=length}"] == 1
    assert samples(second)["request_success_total{finished_reason=length}"] == 0


def test_times_marked_by_steps():
    t = RequestTimes(10.0)
    t.mark_tokens(11.0)
    assert (t.first_token, t.last_token, t.token_interval) == (11.0, 11.0, None)
    t.mark_tokens(11.5)
    assert (t.first_token, t.last_token, t.token_interval) == (11.0, 11.5, 0.5)


def test_speculative_decoding_counters_only_when_it_is_on():
    import dataclasses

    engine = StatsEngine()
    metrics = EngineMetrics(engine, "m")
    assert not any(k.startswith("spec_decode") for k in samples(metrics))
    engine.now = dataclasses.replace(
        engine.now, speculative=True, spec_drafts=7, spec_draft_tokens=25, spec_accepted_tokens=11
    )
    got = samples(metrics)
    assert got["spec_decode_num_drafts_total"] == 7
    assert got["spec_decode_num_draft_tokens_total"] == 25
    assert got["spec_decode_num_accepted_tokens_total"] == 11

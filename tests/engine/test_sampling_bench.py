"""bench/sampling.py runs end to end at its CI size on the tiny random model (the real run, on
SmolLM2 with a batch of 64, is by hand; results in docs/benchmarks.md)."""

from __future__ import annotations

from tests.bench_harness import run_bench


def test_sampling_bench_tiny(tiny_llama, tmp_path):
    run = run_bench("sampling.py", tiny_llama, tmp_path, timeout=300)
    assert "all_params_sampling=" in run.summary, run.stdout[-4000:]
    report = run.report
    assert report["batch"] == 4
    for config in report["configs"].values():
        assert config["forward_ms"] > 0 and config["sampling_ms"] > 0

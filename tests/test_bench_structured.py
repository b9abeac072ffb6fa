"""bench/structured.py runs end to end at its CI size on the tiny random model's tokenizer (the
real run is by hand; results in docs/benchmarks.md)."""

from __future__ import annotations

from tests.bench_harness import run_bench


def test_structured_bench_tiny(tiny_llama, tmp_path):
    run = run_bench("structured.py", tiny_llama, tmp_path)
    assert "compile_20_properties=" in run.summary and "mask_step=" in run.summary
    report = run.report
    assert report["batch"] == 4
    assert all(row["compile_ms"] > 0 for row in report["compile"])
    assert report["mask"]["mask_step_ms"] > 0
    engine = report["engine"]
    assert engine["guided_tok_s"] > 0 and engine["unconstrained_tok_s"] > 0
    assert (
        report["guided_vs_unconstrained"] == engine["guided_tok_s"] / engine["unconstrained_tok_s"]
    )

"""bench/structured.py runs end to end at its CI size on the tiny random model's tokenizer (the
real run is by hand; results in docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_structured_bench_tiny(tiny_llama, tmp_path):
    out = tmp_path / "structured.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "structured.py"),
            "--tiny",
            "--model",
            tiny_llama,
            "--json",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert len(summary) == 1, proc.stdout[-4000:]
    assert "compile_20_properties=" in summary[0] and "mask_step=" in summary[0]
    report = json.loads(out.read_text())
    assert report["batch"] == 4
    assert all(row["compile_ms"] > 0 for row in report["compile"])
    assert report["mask"]["mask_step_ms"] > 0
    engine = report["engine"]
    assert engine["guided_tok_s"] > 0 and engine["unconstrained_tok_s"] > 0
    assert (
        report["guided_vs_unconstrained"] == engine["guided_tok_s"] / engine["unconstrained_tok_s"]
    )

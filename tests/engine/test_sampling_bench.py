"""bench/sampling.py runs end to end at its CI size on the tiny random model (the real run, on
SmolLM2 with a batch of 64, is by hand; results in docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent


def test_sampling_bench_tiny(tiny_llama, tmp_path):
    out = tmp_path / "sampling.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "sampling.py"),
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
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert len(summary) == 1 and "all_params_sampling=" in summary[0], proc.stdout[-4000:]
    report = json.loads(out.read_text())
    assert report["batch"] == 4
    for config in report["configs"].values():
        assert config["forward_ms"] > 0 and config["sampling_ms"] > 0

"""bench/coldstart.py runs end to end at its smoke size on the tiny random model (the real run,
SmolLM2, is by hand; results in docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("extra", [[], ["--cpu-time"]], ids=["wall", "cpu-time"])
def test_coldstart_tiny(tiny_llama: str, tmp_path: Path, extra: list[str]) -> None:
    out = tmp_path / "coldstart.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "coldstart.py"),
            "--model",
            tiny_llama,
            "--reps",
            "1",
            "--no-warmup",
            "--kv-gib",
            "0.05",
            "--small-kv-gib",
            "0.02",
            "--json",
            str(out),
            *extra,
        ],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert len(summary) == 1 and "ratio=" in summary[0], proc.stdout[-4000:]
    report = json.loads(out.read_text())
    assert len(report["median_s"]) == 4 and all(v > 0 for v in report["median_s"].values())
    assert report["ratio"] > 0
    # Every system answered the same prompt, greedy: the engine rows agree with each other.
    engine_tokens = {v for k, v in report["tokens"].items() if k.startswith("engine")}
    assert len(engine_tokens) == 1
    phases = report["phases"]
    engine_rows = [k for k in phases if k.startswith("engine")]
    assert all("KV cache allocation" in runs[0] for runs in (phases[k] for k in engine_rows))
    cpu_line = [line for line in proc.stdout.splitlines() if line.startswith("CPU (one thread)")]
    assert len(cpu_line) == (1 if extra else 0), proc.stdout[-4000:]
    if extra:  # CPU seconds since the interpreter started, more than the phases it covers
        runs = [runs[0] for runs in phases.values()]
        assert all(r["CPU to first token"] > r["import torch"] > 0 for r in runs), runs

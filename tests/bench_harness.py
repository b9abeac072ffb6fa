"""Runs a benchmark script end to end at its CI size, as the bench smoke tests do: offline, on a
tiny model, in a subprocess, reading back its SUMMARY line and its JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@dataclass
class BenchRun:
    stdout: str
    summary: str  # the one line starting with "SUMMARY "
    report: dict[str, Any]  # what the script wrote to --json


def run_bench(script: str, model: str, tmp_path: Path, *, timeout: float = 180) -> BenchRun:
    """Runs `bench/<script>` with `--tiny --model <model> --json <file in tmp_path>` and checks
    it exits 0 and prints exactly one SUMMARY line."""
    out = tmp_path / f"{Path(script).stem}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / script),
            "--tiny",
            "--model",
            model,
            "--json",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert len(summary) == 1, proc.stdout[-4000:]
    return BenchRun(proc.stdout, summary[0], json.loads(out.read_text()))

"""The throughput benchmark runs end to end at its CI size, transformers baselines included, on a
tiny random model (the real run is by hand; results in docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_throughput_tiny(tiny_llama, tmp_path):
    out = tmp_path / "throughput.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "throughput.py"),
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
    assert "engine=" in summary[0] and "generate_batch=" in summary[0]

    report = json.loads(out.read_text())
    assert report["num_prompts"] == 4 and report["max_tokens"] == 8
    assert report["engine"]["output_tokens_per_s"] > 0
    assert report["generate"]["output_tokens_per_s"] > 0
    assert report["generate_batch"]["output_tokens_per_s"] > 0
    assert report["compute_ceiling_tokens_per_s"] > 0
    for key in ("engine_vs_generate_batch", "engine_vs_generate"):
        assert report["ratios"][key] > 0


def test_endpoint_tiny(tiny_llama, tmp_path):
    """The worker-overhead benchmark: offline engine, then the local endpoint in a subprocess
    driven by the official OpenAI client, same prompts."""
    out = tmp_path / "endpoint.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "endpoint.py"),
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
    assert any(line.startswith("SUMMARY offline=") for line in proc.stdout.splitlines())
    report = json.loads(out.read_text())
    assert report["offline_tok_s"] > 0 and report["endpoint_tok_s"] > 0
    assert len(report["rounds"]) == 1 and report["rounds"][0]["endpoint_s"] > 0

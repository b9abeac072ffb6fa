"""bench/kernels.py: without CUDA it says it needs a GPU and exits 0; its code paths run end to
end at tiny shapes under the interpreter (`--cpu-smoke`; the figures mean nothing there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kernels.py"


def _run(*args: str, interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="there is a GPU: the benchmark would run")
def test_without_gpu_says_so_and_exits_0():
    proc = _run(interpret=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "needs a CUDA GPU" in proc.stdout


def test_cpu_smoke_runs_every_row(tmp_path):
    out = tmp_path / "kernels.json"
    proc = _run("--cpu-smoke", "--json", str(out), interpret=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert len(summary) == 1, proc.stdout[-2000:]
    for key in ("decode_vs_copy=", "prefill_vs_flash=", "rmsnorm_vs_copy=", "silu_vs_copy="):
        assert key in summary[0]
    report = json.loads(out.read_text())
    assert [r["kernel"] for r in report["rows"]] == [
        "decode attention",
        "prefill attention",
        "rms_norm + residual",
        "silu_and_mul",
        "kv write",
        "rotary (in place)",
    ]

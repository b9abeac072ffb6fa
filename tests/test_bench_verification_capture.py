"""bench/verification_capture.py at its smoke size on CPU: the eager-replay twin of the
verification graphs against eager steps on a dummy LFM2 shape, same tokens, one SUMMARY line
(the figures that matter come from a GPU: bench/gpu_checks.sh)."""

from __future__ import annotations


def test_verification_capture_tiny(capsys):
    from bench.verification_capture import main

    assert main(["--tiny", "--shapes", "lfm2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| lfm2 ")]
    assert len(rows) == 2 and all(line.rstrip().endswith("| yes         |") for line in rows), out
    assert sum(line.startswith("SUMMARY captured / eager") for line in out.splitlines()) == 1

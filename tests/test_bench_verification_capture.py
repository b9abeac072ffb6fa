"""bench/verification_capture.py at its smoke size on CPU: the eager-replay twin of the
verification graphs against eager steps on a dummy LFM2 shape (drafts from a plain run's tokens,
some spoiled): verification steps replayed, same tokens, one SUMMARY line
(the figures that matter come from a GPU: bench/gpu_checks.sh)."""

from __future__ import annotations


def test_verification_capture_tiny(capsys):
    from bench.verification_capture import main

    assert main(["--tiny", "--shapes", "lfm2"]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith("| lfm2 ")]  # fmt: skip
    # both batches: verification steps replayed (the twin), the same tokens as eager steps
    assert len(rows) == 2 and all(int(r[5]) > 0 and r[6] == "yes" for r in rows), out
    assert sum(line.startswith("SUMMARY captured / eager") for line in out.splitlines()) == 1

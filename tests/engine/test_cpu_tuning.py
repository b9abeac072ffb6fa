"""Process-level CPU tuning: oneDNN's kernel caches stay bounded under many batch sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from serverless_llm.engine import cpu_tuning

# A fresh interpreter, since oneDNN reads its cache sizes once per process. It packs one weight,
# calls it at 240 distinct batch sizes (each builds a new kernel) and reports the resident memory
# growth after handing free heap memory back.
_PROBE = textwrap.dedent(
    """
    import json, sys
    from serverless_llm.engine import cpu_tuning
    caps = cpu_tuning.cap_kernel_caches(int(sys.argv[1])) if sys.argv[1] != "0" else {}
    import torch
    from serverless_llm.engine.layers.linear import PackedLinear
    torch.set_num_threads(1)
    layer = PackedLinear(torch.nn.Linear(32, 64))
    layer(torch.randn(1, 32))
    cpu_tuning.release_free_memory()
    before = cpu_tuning.resident_bytes()
    for m in range(2, 242):
        layer(torch.randn(m, 32))
    cpu_tuning.release_free_memory()
    print(json.dumps({"caps": caps, "growth": cpu_tuning.resident_bytes() - before}))
    """
)


def _probe(entries: int, env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(entries)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and glibc")
def test_kernel_caches_stay_bounded_across_batch_sizes():
    env = {k: v for k, v in os.environ.items() if k not in cpu_tuning._KERNEL_CACHE_VARS}
    capped = _probe(8, env)
    assert capped["caps"] == {name: "8" for name in cpu_tuning._KERNEL_CACHE_VARS}
    # Uncapped, 240 kernels cost ~130 MB here (~570 KB each); capped at 8, at most ~5 MB stay.
    assert capped["growth"] < 40 * 2**20, capped


def test_cap_kernel_caches_keeps_a_setting_from_the_environment(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "3")
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    caps = cpu_tuning.cap_kernel_caches(99)
    assert caps == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "3", "LRU_CACHE_CAPACITY": "99"}

"""Process-level CPU tuning: oneDNN's kernel caches stay bounded under many batch sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from serverless_llm.engine import cpu_tuning
from serverless_llm.engine.cpu_tuning import ThreadGovernor, cpu_times

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


class _FakeMachine:
    """CPU seconds as /proc would report them: `others` cores busy besides this process's
    `own` cores, advanced by `tick(seconds)`."""

    def __init__(self) -> None:
        self.now, self.busy, self.own = 0.0, 0.0, 0.0
        self.others, self.own_rate = 0.0, 1.0

    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.own += self.own_rate * seconds
        self.busy += (self.others + self.own_rate) * seconds

    def times(self) -> tuple[float, float]:
        return self.busy, self.own


def test_thread_governor_follows_the_free_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    m, calls = _FakeMachine(), []
    gov = ThreadGovernor(
        4, cores=4, clock=lambda: m.now, read_times=m.times, set_threads=calls.append
    )
    assert gov.update() == 4  # the first sample only starts the interval
    for others, want in [(0.0, 4), (2.2, 2), (3.9, 1), (8.0, 1), (1.4, 3), (0.3, 4)]:
        m.others = others
        m.tick(0.6)
        assert gov.update() == want, others
    assert calls == [2, 1, 3, 4]  # only changes reach torch
    m.others = 3.0
    m.tick(0.1)  # within the interval: no new sample
    assert gov.update() == 4 and calls == [2, 1, 3, 4]


def test_thread_governor_stays_off_when_the_operator_chose(monkeypatch):
    m, calls = _FakeMachine(), []

    def governor(threads: int) -> ThreadGovernor:
        return ThreadGovernor(
            threads, cores=2, clock=lambda: m.now, read_times=m.times, set_threads=calls.append
        )

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    pinned = governor(2)
    monkeypatch.delenv("OMP_NUM_THREADS")
    single = governor(1)
    for _ in range(3):
        m.others = 2.0
        m.tick(1.0)
        assert pinned.update() == 2 and single.update() == 1
    assert calls == [] and not pinned.enabled and not single.enabled
    # No /proc: off after the first look.
    blind = ThreadGovernor(2, cores=2, read_times=lambda: None, set_threads=calls.append)
    assert blind.update() == 2 and not blind.enabled


def test_cpu_times_reads_proc():
    times = cpu_times()
    if not os.path.exists("/proc/stat"):
        assert times is None
        return
    busy, own = times
    assert busy >= own >= 0.0

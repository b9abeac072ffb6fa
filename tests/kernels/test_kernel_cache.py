"""Triton's on-disk cache across worker processes, on CPU with Triton's compiler for real NVIDIA
targets (kernel_cache_child.py: a stand-in driver names the target, nothing launches):

- the cache keys of the warm-up's list, computed ahead of time in one process (what the image
  build bakes), are the keys Triton's own launch path asks for in another process serving
  requests, for sm80 and sm90: a baked or kept cache is found, nothing recompiles;
- two workers warming up together on one cache directory both succeed, and a worker starting
  after them compiles nothing (counted by Triton's compilation listener)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from tests.tiny_models import build_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("kernel_cache_child.py")
# Cheap to compile, and each has more than one specialisation in the list.
SHARED_KERNELS = ("_rms_norm_kernel", "_act_and_mul_kernel", "_rotary_kernel")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("cache") / "llama"), "llama")


def _start(model: str, arch: int, mode: str, cache: Path, *kernels: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    cmd = [sys.executable, str(CHILD), model, str(arch), mode, *kernels]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


@pytest.mark.parametrize("arch", [80, 90])
def test_ahead_of_time_keys_are_the_runtime_keys(model_dir, tmp_path, arch):
    aot = _start(model_dir, arch, "aot", tmp_path / "a")
    runtime = _start(model_dir, arch, "runtime", tmp_path / "b")
    ahead, asked = set(_result(aot)["keys"]), set(_result(runtime)["keys"])
    assert asked, "the requests launched no Triton kernel"
    assert asked <= ahead, f"{len(asked - ahead)} keys asked at run time were not baked"


def test_workers_share_one_cache(model_dir, tmp_path):
    cache = tmp_path / "triton-cache"
    first = _start(model_dir, 90, "warmup", cache, *SHARED_KERNELS)
    second = _start(model_dir, 90, "warmup", cache, *SHARED_KERNELS)
    a, b = _result(first), _result(second)
    assert a["specs"] == b["specs"] > len(SHARED_KERNELS)
    assert a["compiled"] + a["hits"] == b["compiled"] + b["hits"] == a["specs"]
    third = _result(_start(model_dir, 90, "warmup", cache, *SHARED_KERNELS))
    assert third == {"specs": a["specs"], "compiled": 0, "hits": a["specs"]}
    assert not [p for p in cache.rglob("tmp.pid_*")]  # no half-written entry left behind

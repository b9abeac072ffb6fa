"""Where the worker points Triton's kernel cache (worker/triton_cache.py)."""

from __future__ import annotations

import importlib.metadata

import pytest

from serverless_llm.worker.triton_cache import BAKED_ENV, triton_cache_dir


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv(BAKED_ENV, raising=False)


def test_network_volume_holds_the_cache_per_version_and_arch(tmp_path):
    pytest.importorskip("triton")
    path, why = triton_cache_dir(str(tmp_path), "sm90")
    version = importlib.metadata.version("triton")
    assert path == str(tmp_path / "triton-cache" / version / "sm90")
    assert why == "the network volume"


def test_no_volume_leaves_tritons_default(tmp_path):
    # The default BASE_PATH counts only where it exists (a volume is mounted there).
    path, why = triton_cache_dir("/runpod-volume", "sm90")
    assert path is None and "default" in why


def test_deployment_and_baked_cache_come_first(tmp_path, monkeypatch):
    baked = tmp_path / "baked"
    baked.mkdir()
    monkeypatch.setenv(BAKED_ENV, str(baked))
    assert triton_cache_dir(str(tmp_path), "sm90")[0] != str(baked)  # empty: not a baked cache
    (baked / "entry").mkdir()
    assert triton_cache_dir(str(tmp_path), "sm90") == (str(baked), "baked into the image")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere")
    assert triton_cache_dir(str(tmp_path), "sm90") == ("/somewhere", "TRITON_CACHE_DIR")

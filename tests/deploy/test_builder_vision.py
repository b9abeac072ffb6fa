"""The build-time download of a vision-language model (builder/download_model.py): the baked
snapshot holds the processor's files, and the builder builds the image processor from them as
the worker does at start; a snapshot without them bakes with a warning that the worker will
serve the model for text only (as the worker does with it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from serverless_llm.worker.baked import read_baked_model
from tests.deploy.test_builder import clean_env, run_builder
from tests.engine.test_loader import populate_hub_cache
from tests.engine.vision_llava_models import save_tiny_llava

COMMIT = "e" * 40
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(save_tiny_llava(str(tmp_path_factory.mktemp("llava") / "repo")))


def _bake(base: Path, tmp_path: Path):
    out = tmp_path / "baked-model.json"
    env = clean_env(
        MODEL_NAME="org/llava", BASE_PATH=str(base), HF_HUB_OFFLINE="1", HOME=str(tmp_path)
    )
    return out, run_builder(env, "--output", str(out))


def test_builder_bakes_and_checks_the_processor(llava_dir: Path, tmp_path: Path) -> None:
    base = tmp_path / "base"
    snapshot = populate_hub_cache(
        base / "huggingface-cache" / "hub", "org/llava", llava_dir, COMMIT
    )
    out, proc = _bake(base, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "(safetensors, images: LlavaProcessor)" in proc.stdout
    assert read_baked_model(str(out)).model_dir == str(snapshot)
    assert "processor_config.json" in os.listdir(snapshot)


def test_a_snapshot_without_the_processor_warns(llava_dir: Path, tmp_path: Path) -> None:
    base = tmp_path / "base"
    files = [n for n in os.listdir(llava_dir) if n not in PROCESSOR_FILES]
    populate_hub_cache(
        base / "huggingface-cache" / "hub", "org/llava", llava_dir, COMMIT, files=files
    )
    out, proc = _bake(base, tmp_path)
    assert proc.returncode == 0, proc.stderr
    warning = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "cannot build the image processor" in warning[0]
    assert "text only" in warning[0]
    assert "(safetensors, text only)" in proc.stdout and out.exists()

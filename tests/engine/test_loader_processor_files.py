"""A vision-language model's processor files come with it from the hub: the engine builds the
processor from the model's directory at start, so the download fetches
`preprocessor_config.json` (the image processor's settings before transformers 5),
`processor_config.json` (all of them since), `video_preprocessor_config.json` and the chat
templates; and a snapshot cached without them (by a worker that did not read them) is completed
from the hub (offline: not found in the cache)."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers
from huggingface_hub import constants as hf_constants

from serverless_llm.engine.config import EngineConfig
from serverless_llm.engine.loader import ModelLoadError, resolve_model
from serverless_llm.engine.loader import hub as hub_mod
from tests.engine.test_loader import COMMIT_A, populate_hub_cache
from tests.engine.vision_check import family_processor
from tests.engine.vision_llava_models import sample_images, save_tiny_llava

PROCESSOR_FILES = [
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.jinja",
    "chat_template.json",
]


@pytest.fixture(scope="module")
def llava_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaVA as a hub repo holds it: transformers 5's processor_config.json, the older
    layout's preprocessor_config.json and chat_template.json beside it, a video processor's
    settings, and a README the engine never reads."""
    src = Path(save_tiny_llava(str(tmp_path_factory.mktemp("llava") / "repo")))
    processor = transformers.AutoProcessor.from_pretrained(src)
    processor.image_processor.save_pretrained(src)  # preprocessor_config.json
    template = (src / "chat_template.jinja").read_text()
    (src / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    (src / "video_preprocessor_config.json").write_text("{}")
    (src / "README.md").write_text("readme")
    assert all((src / name).is_file() for name in PROCESSOR_FILES)
    return src


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch):
    """The hub faked and online: `serve(src, cache)` makes `src` the repo every download
    reads, laid out in `cache` as huggingface_hub lays it out; returns the allow-lists the
    downloads asked for."""
    real_snapshot_download = hub_mod.snapshot_download
    calls: list[list[str]] = []

    def serve(src: Path, cache: Path) -> list[list[str]]:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing real is reached

        def model_info(self: object, repo_id: str, **kwargs: object) -> SimpleNamespace:
            siblings = [SimpleNamespace(rfilename=n) for n in sorted(os.listdir(src))]
            return SimpleNamespace(sha=COMMIT_A, siblings=siblings)

        def snapshot_download(repo_id: str, **kwargs: object) -> str:
            if kwargs.get("local_files_only"):
                return real_snapshot_download(repo_id, **kwargs)
            allow = list(kwargs["allow_patterns"])  # type: ignore[arg-type]
            calls.append(allow)
            wanted = [n for n in os.listdir(src) if any(fnmatch.fnmatch(n, p) for p in allow)]
            return str(populate_hub_cache(cache, repo_id, src, COMMIT_A, None, wanted))

        monkeypatch.setattr(hub_mod.HfApi, "model_info", model_info)
        monkeypatch.setattr(hub_mod, "snapshot_download", snapshot_download)
        return calls

    return serve


def _processed_ids(model_dir: str) -> list[int]:
    family, processor = family_processor(model_dir)
    text = f"Hello {family.image_placeholder(processor)} world"
    ids = processor(text=[text], images=[sample_images()[0]], return_tensors="pt")
    return ids["input_ids"][0].tolist()


def test_download_fetches_the_processor_files(llava_repo: Path, tmp_path: Path, fake_hub):
    cache = tmp_path / "hub"
    calls = fake_hub(llava_repo, cache)
    resolved = resolve_model(EngineConfig(model="org/llava", download_dir=str(cache)))
    got = sorted(os.listdir(resolved.model_dir))
    assert set(PROCESSOR_FILES) <= set(got), got
    assert "README.md" not in got
    assert len(calls) == 1
    # the processor the engine builds from the snapshot is the repo's
    assert _processed_ids(resolved.model_dir) == _processed_ids(str(llava_repo))


def test_a_snapshot_cached_without_them_is_completed(
    llava_repo: Path, tmp_path: Path, fake_hub, monkeypatch: pytest.MonkeyPatch
):
    """A snapshot from before: weights, config and tokenizer, but of the processor's files only
    the chat template; the hub's cached listing of the repo names the rest."""
    cache = tmp_path / "hub"
    old = [n for n in os.listdir(llava_repo) if n not in PROCESSOR_FILES[:3] + ["README.md"]]
    snapshot = populate_hub_cache(cache, "org/llava", llava_repo, COMMIT_A, files=old)
    listed = sorted(os.listdir(llava_repo))
    tree = {"format_version": 1, "files": {n: {"size": 1, "blob_id": "c" * 40} for n in listed}}
    trees = cache / "models--org--llava" / "trees"
    trees.mkdir()
    (trees / f"{COMMIT_A}.json").write_text(json.dumps(tree))
    cfg = EngineConfig(model="org/llava", download_dir=str(cache))

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    # huggingface_hub's own check: the listing names wanted files the snapshot lacks
    with pytest.raises(ModelLoadError, match="org/llava is not in the cache"):
        resolve_model(cfg)

    calls = fake_hub(llava_repo, cache)  # online again
    resolved = resolve_model(cfg)
    assert resolved.model_dir == str(snapshot) and len(calls) == 1
    assert set(PROCESSOR_FILES) <= set(os.listdir(snapshot))
    # complete now: the next start reads the cache alone
    assert resolve_model(cfg).model_dir == str(snapshot) and len(calls) == 1


def test_text_models_are_unaffected(
    tiny_llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repo listing without processor files: its cached snapshot is complete as before."""
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "hub"
    snapshot = populate_hub_cache(cache, "org/tiny", Path(tiny_llama), COMMIT_A)
    listed = [*os.listdir(tiny_llama), "README.md"]
    tree = {"format_version": 1, "files": {n: {"size": 1, "blob_id": "c" * 40} for n in listed}}
    (cache / "models--org--tiny" / "trees").mkdir()
    (cache / "models--org--tiny" / "trees" / f"{COMMIT_A}.json").write_text(json.dumps(tree))
    cfg = EngineConfig(model="org/tiny", download_dir=str(cache))
    assert resolve_model(cfg).model_dir == str(snapshot)


def test_startup_line_without_a_processor(llava_repo: Path, tmp_path: Path, caplog) -> None:
    """A vision checkpoint whose processor cannot be built is served for text: the start-up
    line says images are off; with its processor files it names the family."""
    import logging

    from tests.engine.vision_check import make_llm

    stripped = tmp_path / "stripped"
    shutil.copytree(llava_repo, stripped)
    for name in PROCESSOR_FILES[:3]:
        (stripped / name).unlink()

    def ready(path: Path) -> str:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="serverless_llm.engine.llm_engine"):
            make_llm(str(path), num_kv_blocks=16, max_model_len=64)
        return next(r.getMessage() for r in caplog.records if "engine ready" in r.getMessage())

    assert ready(stripped).endswith(" images=off (no image processor)")
    assert " images=Llava (tower " in ready(llava_repo)

"""The weight files read ahead of the loader (engine/loader/prefetch.py): which files, that the
whole of each is read, when it is skipped, and that a load with it gives the same model."""

from __future__ import annotations

import os

import torch

from serverless_llm.engine import model_builder
from serverless_llm.engine.config import EngineConfig
from serverless_llm.engine.loader import ResolvedModel
from serverless_llm.engine.loader import prefetch as prefetch_mod
from serverless_llm.engine.loader.prefetch import prefetch_weights, weight_paths


def _resolved(path: str, fmt: str = "safetensors", gguf: str | None = None) -> ResolvedModel:
    return ResolvedModel(path, path, fmt, path, gguf)


def test_reads_every_weight_file_whole(tiny_llama):
    paths = weight_paths(_resolved(tiny_llama))
    assert paths and all(p.endswith(".safetensors") for p in paths)
    job = prefetch_weights(_resolved(tiny_llama))
    assert job is not None
    job.join(timeout=60)
    assert job.bytes_read == sum(os.path.getsize(p) for p in paths)


def test_sharded_checkpoint_reads_the_shards_not_the_index(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors",'
        ' "b": "model-00002-of-00002.safetensors"}}'
    )
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (tmp_path / name).write_bytes(b"x" * 1000)
    (tmp_path / "consolidated.safetensors").write_bytes(b"y" * 1000)  # not in the index
    names = [os.path.basename(p) for p in weight_paths(_resolved(str(tmp_path)))]
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_skipped_without_files_or_memory(tmp_path, tiny_llama, monkeypatch):
    assert prefetch_weights(_resolved(tiny_llama, "dummy")) is None
    assert prefetch_weights(_resolved(str(tmp_path))) is None  # no weights there
    assert weight_paths(_resolved(str(tmp_path), "gguf", "/x/m.gguf")) == ["/x/m.gguf"]
    size = sum(os.path.getsize(p) for p in weight_paths(_resolved(tiny_llama)))
    monkeypatch.setattr(prefetch_mod, "available_memory", lambda: 2 * size - 1)
    assert prefetch_weights(_resolved(tiny_llama)) is None  # over half of what is available
    monkeypatch.setattr(prefetch_mod, "available_memory", lambda: 2 * size)
    job = prefetch_weights(_resolved(tiny_llama))
    assert job is not None
    job.join(timeout=60)
    monkeypatch.setattr(prefetch_mod, "available_memory", lambda: None)  # unknown: no read
    assert prefetch_weights(_resolved(tiny_llama)) is None


def test_load_with_the_prefetch_equals_the_load_without(tiny_llama, monkeypatch):
    config = EngineConfig(model=tiny_llama, device="cpu", show_progress=False)
    started = []

    def recording(resolved):
        job = prefetch_weights(resolved)
        started.append(job)
        return job

    monkeypatch.setattr(model_builder, "prefetch_weights", recording)
    with_it = model_builder.load_model(config).model.state_dict()
    assert started and started[0] is not None
    monkeypatch.setattr(model_builder, "prefetch_weights", lambda resolved: None)
    without = model_builder.load_model(config).model.state_dict()
    assert with_it.keys() == without.keys()
    for name, tensor in with_it.items():
        assert torch.equal(tensor, without[name]), name

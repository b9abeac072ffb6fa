"""Model resolution and weight loading, all offline: local directories, a hand-built HF hub cache
(no network call when the files are there), GGUF conversion with its cache, and dummy weights."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from huggingface_hub import constants as hf_constants
from safetensors.torch import load_file, save_file

from serverless_llm.engine.config import EngineConfig
from serverless_llm.engine.loader import (
    ModelLoadError,
    ResolvedModel,
    embedded_model_path,
    iter_weights,
    load_hf_config,
    resolve_model,
)
from serverless_llm.engine.loader import gguf as gguf_mod
from serverless_llm.engine.loader import hub as hub_mod
from serverless_llm.engine.loader.weights import select_weight_files
from tests.tiny_models import build_tiny_model

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"]


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny llama saved as safetensors; tests copy it rather than rebuild it (3 s each)."""
    return Path(build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"), "llama"))


@pytest.fixture(scope="module")
def tiny_src_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture, other weights: tells two revisions apart."""
    return Path(build_tiny_model(str(tmp_path_factory.mktemp("tinyb") / "model"), "llama", seed=1))


@pytest.fixture
def tiny_dir(tiny_src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_src, tmp_path / "model"))


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def online_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Online mode, but any request goes to a port where nothing listens."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(hf_constants, "ENDPOINT", "http://127.0.0.1:9")


def populate_hub_cache(
    cache: Path,
    repo_id: str,
    src: Path,
    commit: str,
    revision: str | None = "main",
    files: list[str] | None = None,
) -> Path:
    """Lays `src`'s files out as huggingface_hub does: content-addressed blobs, a snapshot
    folder of relative symlinks per commit, and refs/<revision> holding the commit hash."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in files if files is not None else sorted(os.listdir(src)):
        data = (src / name).read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        if link.exists() or link.is_symlink():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, snapshot))
    if revision is not None:
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / revision).write_text(commit)
    return snapshot


def all_weights(resolved: ResolvedModel) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in iter_weights(resolved, show_progress=False):
        assert name not in out, f"{name} yielded twice"
        out[name] = tensor
    return out


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


# Local directories.


def test_local_safetensors_dir(tiny_dir: Path) -> None:
    resolved = resolve_model(EngineConfig(model=str(tiny_dir)))
    assert resolved.model_dir == str(tiny_dir)
    assert resolved.tokenizer_dir == str(tiny_dir)
    assert resolved.load_format == "safetensors"
    assert_same_tensors(all_weights(resolved), load_file(tiny_dir / "model.safetensors"))
    config = load_hf_config(resolved)
    assert config.model_type == "llama" and config.num_hidden_layers == 2
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolved.tokenizer_dir)
    assert tokenizer.chat_template


def test_local_bin_dir(tiny_dir: Path) -> None:
    # transformers 5 always saves safetensors, so write the .bin checkpoint by hand.
    state = load_file(tiny_dir / "model.safetensors")
    (tiny_dir / "model.safetensors").unlink()
    torch.save(state, tiny_dir / "pytorch_model.bin")
    torch.save({"not": "weights"}, tiny_dir / "training_args.bin")
    resolved = resolve_model(EngineConfig(model=str(tiny_dir)))
    assert resolved.load_format == "pt"
    assert_same_tensors(all_weights(resolved), state)
    with pytest.raises(ModelLoadError, match="no safetensors weights"):
        resolve_model(EngineConfig(model=str(tiny_dir), load_format="safetensors"))


def test_load_format_pt_prefers_bin_when_asked(tiny_dir: Path) -> None:
    state = load_file(tiny_dir / "model.safetensors")
    torch.save(state, tiny_dir / "pytorch_model.bin")
    assert resolve_model(EngineConfig(model=str(tiny_dir))).load_format == "safetensors"
    resolved = resolve_model(EngineConfig(model=str(tiny_dir), load_format="pt"))
    assert resolved.load_format == "pt"
    assert_same_tensors(all_weights(resolved), state)


def test_sharded_safetensors_with_index(tiny_src: Path, tmp_path: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_src))
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="50KB")
    transformers.AutoTokenizer.from_pretrained(str(tiny_src)).save_pretrained(sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    # A file the index does not list (like Mistral's consolidated.safetensors) is not read.
    save_file({"stray": torch.zeros(2)}, sharded / "consolidated.safetensors")
    resolved = resolve_model(EngineConfig(model=str(sharded)))
    assert resolved.load_format == "safetensors"
    want: dict[str, torch.Tensor] = {}
    for shard in shards:
        want.update(load_file(sharded / shard))
    got = all_weights(resolved)
    assert set(got) == set(index["weight_map"])
    assert_same_tensors(got, want)
    # A shard the index names but the disk lacks is a clear error, not a silent partial load.
    (sharded / shards[-1]).unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        list(iter_weights(resolved, show_progress=False))


def test_select_weight_files_prefers_safetensors() -> None:
    index = json.dumps({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}})
    names = [
        "config.json",
        "model.safetensors.index.json",
        "model-1.safetensors",
        "model-2.safetensors",
        "consolidated.safetensors",
        "pytorch_model.bin",
        "original/consolidated.00.pth",
    ]
    assert select_weight_files(names, "auto", lambda _: index) == (
        "safetensors",
        ["model.safetensors.index.json", "model-1.safetensors", "model-2.safetensors"],
    )
    assert select_weight_files(names, "pt", lambda _: index) == ("pt", ["pytorch_model.bin"])
    assert select_weight_files(["config.json", "pytorch_model.bin"], "auto", str) == (
        "pt",
        ["pytorch_model.bin"],
    )
    assert select_weight_files(["config.json", "sub/model.safetensors"], "auto", str) is None


def test_missing_path_and_bad_names(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match=f"model path {missing} does not exist"):
        resolve_model(EngineConfig(model=str(missing)))
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        resolve_model(EngineConfig(model=str(tmp_path / "x.gguf")))
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(EngineConfig(model=str(tmp_path)))
    with pytest.raises(ModelLoadError, match="neither an existing path nor a hub id"):
        resolve_model(EngineConfig(model="not a/valid id!"))


# Dummy weights.


def test_dummy_local(tiny_dir: Path) -> None:
    resolved = resolve_model(EngineConfig(model=str(tiny_dir), load_format="dummy"))
    assert resolved.load_format == "dummy"
    assert load_hf_config(resolved).hidden_size == 64
    with pytest.raises(ModelLoadError, match="dummy"):
        next(iter(iter_weights(resolved)))


def test_dummy_hub_needs_only_config_and_tokenizer(
    tiny_src: Path, tmp_path: Path, offline: None
) -> None:
    cache = tmp_path / "hub"
    snapshot = populate_hub_cache(cache, "org/tiny", tiny_src, COMMIT_A, files=TOKENIZER_FILES)
    cfg = EngineConfig(model="org/tiny", download_dir=str(cache), load_format="dummy")
    resolved = resolve_model(cfg)
    assert resolved.model_dir == str(snapshot) and resolved.load_format == "dummy"
    assert load_hf_config(resolved).model_type == "llama"
    # The same cache is not enough for real weights.
    with pytest.raises(ModelLoadError, match="incomplete"):
        resolve_model(EngineConfig(model="org/tiny", download_dir=str(cache)))


# Hub ids served from a locally populated cache.


def test_hub_cache_offline(tiny_src: Path, tmp_path: Path, offline: None) -> None:
    cache = tmp_path / "hub"
    snapshot = populate_hub_cache(cache, "org/tiny", tiny_src, COMMIT_A)
    resolved = resolve_model(EngineConfig(model="org/tiny", download_dir=str(cache)))
    assert resolved.model_dir == str(snapshot)
    assert resolved.tokenizer_dir == str(snapshot)
    assert resolved.load_format == "safetensors"
    assert resolved.source == "org/tiny"
    assert_same_tensors(all_weights(resolved), load_file(tiny_src / "model.safetensors"))
    assert transformers.AutoTokenizer.from_pretrained(resolved.tokenizer_dir).chat_template


def test_hub_cache_makes_no_network_call(
    tiny_src: Path, tmp_path: Path, online_unreachable: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hub"
    snapshot = populate_hub_cache(cache, "org/tiny", tiny_src, COMMIT_A)

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the network was used although the model is cached")

    monkeypatch.setattr(hub_mod, "_download", no_network)
    start = time.monotonic()
    resolved = resolve_model(EngineConfig(model="org/tiny", download_dir=str(cache)))
    assert resolved.model_dir == str(snapshot)
    assert time.monotonic() - start < 2.0


def test_hub_online_miss_with_unreachable_hub_fails_fast(
    tmp_path: Path, online_unreachable: None
) -> None:
    token = "hf_SecretTokenValue123"
    cfg = EngineConfig(model="org/absent", download_dir=str(tmp_path / "hub"), hf_token=token)
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="cannot download model org/absent") as info:
        resolve_model(cfg)
    assert time.monotonic() - start < 10.0
    assert token not in str(info.value)


def test_hub_empty_cache_offline(tmp_path: Path, offline: None) -> None:
    token = "hf_SecretTokenValue123"
    cache = tmp_path / "hub"
    cfg = EngineConfig(model="org/absent", download_dir=str(cache), hf_token=token)
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="not in the cache at .* hub is offline") as info:
        resolve_model(cfg)
    assert time.monotonic() - start < 2.0
    assert str(cache / "models--org--absent") in str(info.value)
    assert token not in str(info.value)


def test_hub_revision(tiny_src: Path, tiny_src_b: Path, tmp_path: Path, offline: None) -> None:
    cache = tmp_path / "hub"
    populate_hub_cache(cache, "org/tiny", tiny_src, COMMIT_A)
    snap_b = populate_hub_cache(cache, "org/tiny", tiny_src_b, COMMIT_B, revision="v1")
    resolved = resolve_model(EngineConfig(model="org/tiny", revision="v1", download_dir=str(cache)))
    assert resolved.model_dir == str(snap_b)
    assert resolved.source == "org/tiny@v1"
    assert_same_tensors(all_weights(resolved), load_file(tiny_src_b / "model.safetensors"))
    # A commit hash needs no ref.
    by_commit = resolve_model(
        EngineConfig(model="org/tiny", revision=COMMIT_B, download_dir=str(cache))
    )
    assert by_commit.model_dir == str(snap_b)
    with pytest.raises(ModelLoadError, match="not in the cache"):
        resolve_model(EngineConfig(model="org/tiny", revision="v2", download_dir=str(cache)))


def test_hub_bin_only_repo(tiny_src: Path, tmp_path: Path, offline: None) -> None:
    src = Path(shutil.copytree(tiny_src, tmp_path / "src"))
    torch.save(load_file(src / "model.safetensors"), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    cache = tmp_path / "hub"
    populate_hub_cache(cache, "org/tiny-bin", src, COMMIT_A)
    resolved = resolve_model(EngineConfig(model="org/tiny-bin", download_dir=str(cache)))
    assert resolved.load_format == "pt"
    assert "model.embed_tokens.weight" in all_weights(resolved)


def test_hub_cache_with_tree_listing(tiny_src: Path, tmp_path: Path, offline: None) -> None:
    """After a real download the hub caches the repo's file list; completeness is judged on it:
    a .bin the repo also has is not needed, a safetensors file it lists is."""
    cache = tmp_path / "hub"
    snapshot = populate_hub_cache(cache, "org/tiny", tiny_src, COMMIT_A)
    listed = [*os.listdir(tiny_src), "pytorch_model.bin", "README.md"]
    tree = {"format_version": 1, "files": {n: {"size": 1, "blob_id": "c" * 40} for n in listed}}
    trees = cache / "models--org--tiny" / "trees"
    trees.mkdir()
    (trees / f"{COMMIT_A}.json").write_text(json.dumps(tree))
    cfg = EngineConfig(model="org/tiny", download_dir=str(cache))
    assert resolve_model(cfg).model_dir == str(snapshot)
    (snapshot / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="incomplete in the cache .*model.safetensors"):
        resolve_model(cfg)


def test_tokenizer_override(tiny_src: Path, tiny_dir: Path, tmp_path: Path, offline: None) -> None:
    cache = tmp_path / "hub"
    tok_snapshot = populate_hub_cache(cache, "org/tok", tiny_src, COMMIT_A, files=TOKENIZER_FILES)
    tok_v2 = populate_hub_cache(
        cache, "org/tok", tiny_src, COMMIT_B, revision="v2", files=TOKENIZER_FILES
    )
    cfg = EngineConfig(model=str(tiny_dir), tokenizer="org/tok", download_dir=str(cache))
    resolved = resolve_model(cfg)
    assert resolved.model_dir == str(tiny_dir)
    assert resolved.tokenizer_dir == str(tok_snapshot)
    assert transformers.AutoTokenizer.from_pretrained(resolved.tokenizer_dir).chat_template
    cfg.tokenizer_revision = "v2"
    assert resolve_model(cfg).tokenizer_dir == str(tok_v2)
    # A directory works as well; a name that is neither is an error naming it.
    cfg = EngineConfig(model=str(tiny_dir), tokenizer=str(tok_snapshot))
    assert resolve_model(cfg).tokenizer_dir == str(tok_snapshot)
    with pytest.raises(ModelLoadError, match="org/absent"):
        resolve_model(EngineConfig(model=str(tiny_dir), tokenizer="org/absent"))


def test_hub_download_fetches_only_needed_files_then_caches(
    tiny_src: Path, tmp_path: Path, online_unreachable: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The network path with the hub faked: what it asks for, and that a later start is offline."""
    src = Path(shutil.copytree(tiny_src, tmp_path / "src"))
    torch.save(load_file(src / "model.safetensors"), src / "pytorch_model.bin")
    (src / "README.md").write_text("readme")
    cache = tmp_path / "hub"
    real_snapshot_download = hub_mod.snapshot_download
    calls: list[list[str]] = []

    def fake_model_info(self: object, repo_id: str, **kwargs: object) -> SimpleNamespace:
        assert kwargs["timeout"] is not None
        siblings = [SimpleNamespace(rfilename=n) for n in sorted(os.listdir(src))]
        return SimpleNamespace(sha=COMMIT_A, siblings=siblings)

    def fake_snapshot_download(repo_id: str, **kwargs: object) -> str:
        if kwargs.get("local_files_only"):
            return real_snapshot_download(repo_id, **kwargs)
        assert kwargs["revision"] == COMMIT_A
        allow = list(kwargs["allow_patterns"])  # type: ignore[arg-type]
        calls.append(allow)
        import fnmatch

        wanted = [n for n in os.listdir(src) if any(fnmatch.fnmatch(n, p) for p in allow)]
        snap = populate_hub_cache(cache, repo_id, src, COMMIT_A, revision=None, files=wanted)
        return str(snap)

    monkeypatch.setattr(hub_mod.HfApi, "model_info", fake_model_info)
    monkeypatch.setattr(hub_mod, "snapshot_download", fake_snapshot_download)
    resolved = resolve_model(EngineConfig(model="org/tiny", download_dir=str(cache)))
    assert resolved.load_format == "safetensors"
    snapshot = Path(resolved.model_dir)
    assert sorted(os.listdir(snapshot)) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES[:3]]
    )
    assert (cache / "models--org--tiny" / "refs" / "main").read_text() == COMMIT_A
    # Next start: served from the cache, no hub at all.
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    assert resolve_model(EngineConfig(model="org/tiny", download_dir=str(cache))).model_dir == (
        str(snapshot)
    )
    assert len(calls) == 1


# GGUF, with the converter faked (fast), then the real embedded model (slow).


@pytest.fixture
def fake_converter(tiny_src: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    converted: list[str] = []

    def convert(gguf_path: str, out_dir: str, show_progress: bool = True) -> None:
        converted.append(gguf_path)
        for name in os.listdir(tiny_src):
            shutil.copy(tiny_src / name, out_dir)

    monkeypatch.setattr(gguf_mod, "convert_gguf", convert)
    return converted


def test_gguf_converted_once_and_cached(
    tmp_path: Path, fake_converter: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tmp_path / "ggufdir"
    model_dir.mkdir()
    gguf = model_dir / "tiny.Q4_0.gguf"
    gguf.write_bytes(b"GGUF fake")
    cache = tmp_path / "dl"
    # A directory holding one .gguf and no config.json is that GGUF.
    first = resolve_model(
        EngineConfig(quantized_weights="dequantize", model=str(model_dir), download_dir=str(cache))
    )
    assert first.load_format == "safetensors"
    assert Path(first.model_dir).parent == cache / "gguf-converted"
    assert first.tokenizer_dir == first.model_dir
    second = resolve_model(
        EngineConfig(quantized_weights="dequantize", model=str(gguf), download_dir=str(cache))
    )
    assert second.model_dir == first.model_dir
    assert fake_converter == [str(gguf)]
    # A changed file (size/mtime) is converted again, into a new entry.
    gguf.write_bytes(b"GGUF fake, but longer")
    third = resolve_model(
        EngineConfig(quantized_weights="dequantize", model=str(gguf), download_dir=str(cache))
    )
    assert third.model_dir != first.model_dir and len(fake_converter) == 2
    # No download dir: $SERVERLESS_LLM_CACHE.
    monkeypatch.setenv("SERVERLESS_LLM_CACHE", str(tmp_path / "env-cache"))
    fourth = resolve_model(EngineConfig(quantized_weights="dequantize", model=str(gguf)))
    assert Path(fourth.model_dir).parent == tmp_path / "env-cache" / "gguf-converted"
    with pytest.raises(ModelLoadError, match="load_format=pt"):
        resolve_model(
            EngineConfig(quantized_weights="dequantize", model=str(gguf), load_format="pt")
        )


def test_gguf_crash_mid_conversion_leaves_no_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF fake")

    def crash(gguf_path: str, out_dir: str, show_progress: bool = True) -> None:
        Path(out_dir, "config.json").write_text("{}")  # half written
        raise ValueError("unsupported GGUF architecture")

    monkeypatch.setattr(gguf_mod, "convert_gguf", crash)
    cache = tmp_path / "dl"
    with pytest.raises(ModelLoadError, match="cannot convert GGUF file .*unsupported"):
        resolve_model(
            EngineConfig(quantized_weights="dequantize", model=str(gguf), download_dir=str(cache))
        )
    assert os.listdir(cache / "gguf-converted") == []


def test_gguf_dir_with_several_files_is_ambiguous(tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="exactly one .gguf"):
        resolve_model(EngineConfig(quantized_weights="dequantize", model=str(tmp_path)))


def test_embedded_model_path_exists() -> None:
    path = embedded_model_path()
    assert os.path.isabs(path) and os.path.isfile(path)
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def embedded(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[EngineConfig, ResolvedModel]:
    """The real conversion (about 20 s): shares the session's cache when tests/conftest.py
    offers one (so the suite converts once), else converts into a directory of its own."""
    try:
        download_dir = str(request.getfixturevalue("model_cache_dir"))
    except pytest.FixtureLookupError:
        download_dir = str(tmp_path_factory.mktemp("dl"))
    cfg = EngineConfig(
        download_dir=download_dir, show_progress=False, quantized_weights="dequantize"
    )
    return cfg, resolve_model(cfg)


@pytest.mark.slow
def test_embedded_gguf_converts_and_caches(
    embedded: tuple[EngineConfig, ResolvedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, resolved = embedded
    assert resolved.load_format == "safetensors"
    assert resolved.source == "embedded SmolLM2-135M-Instruct.Q4_1.gguf"
    raw = json.loads(Path(resolved.model_dir, "config.json").read_text())
    assert "quantization_config" not in raw
    config = load_hf_config(resolved)
    assert config.model_type == "llama" and config.num_hidden_layers == 30
    assert config.tie_word_embeddings
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolved.tokenizer_dir)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    names = {name: tuple(t.shape) for name, t in iter_weights(resolved, show_progress=False)}
    assert names["model.embed_tokens.weight"] == (49152, 576)
    assert "lm_head.weight" not in names  # tied, so not stored
    assert len(names) == 272

    def must_not_convert(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again although cached")

    monkeypatch.setattr(gguf_mod, "convert_gguf", must_not_convert)
    start = time.monotonic()
    again = resolve_model(cfg)
    assert again.model_dir == resolved.model_dir
    assert time.monotonic() - start < 2.0

"""The build-time download (builder/download_model.py) against a locally populated hub cache, the
baked-model file the worker reads at start, starting with the hub unreachable, and the token
kept out of every file and log line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import constants as hf_constants

from serverless_llm.engine.loader import hub as hub_mod
from serverless_llm.worker.baked import (
    BAKED_MODEL_ENV,
    BakedModel,
    BakedModelError,
    apply_baked_model,
    read_baked_model,
    write_baked_model,
)
from serverless_llm.worker.handler import Worker
from serverless_llm.worker.settings import ENV_TO_FIELD, Settings
from tests.engine.test_loader import populate_hub_cache

REPO = Path(__file__).resolve().parents[2]
BUILDER = REPO / "builder" / "download_model.py"
FAKE_TOKEN = "hf_FakeTokenForTestsOnly0123456789abcd"
COMMIT = "c" * 40
UNREACHABLE = "http://127.0.0.1:9"  # nothing listens there: a connection is refused at once
GREEDY = {"max_tokens": 8, "ignore_eos": True, "temperature": 0}


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment less every worker setting, offline flag and RunPod variable,
    plus `extra`."""
    drop = {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", BAKED_MODEL_ENV}
    env = {
        k: v
        for k, v in os.environ.items()
        if k.upper() not in ENV_TO_FIELD and k not in drop and not k.startswith("RUNPOD_")
    }
    env.update(extra)
    return env


def run_builder(
    env: dict[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BUILDER), "--no-progress", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def files_holding(root: Path, needle: str) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and needle.encode() in path.read_bytes():
            found.append(str(path))
    return found


@pytest.fixture(scope="module")
def hub_cache(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """BASE_PATH whose hub cache holds org/tiny, laid out as huggingface_hub lays it out."""
    base = tmp_path_factory.mktemp("base")
    populate_hub_cache(base / "huggingface-cache" / "hub", "org/tiny", Path(tiny_llama), COMMIT)
    return base


@pytest.fixture(scope="module")
def baked(
    hub_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, subprocess.CompletedProcess]:
    """The builder run offline on the populated cache, with a token given as the secret file
    (once for the module: the tests only read what it wrote)."""
    tmp_path = tmp_path_factory.mktemp("build")
    secret = tmp_path / "secrets" / "HF_TOKEN"
    secret.parent.mkdir()
    secret.write_text(FAKE_TOKEN + "\n")
    out = tmp_path / "etc" / "baked-model.json"
    env = clean_env(
        MODEL_NAME="org/tiny", BASE_PATH=str(hub_cache), HF_HUB_OFFLINE="1", HOME=str(tmp_path)
    )
    proc = run_builder(env, "--output", str(out), "--token-file", str(secret))
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_builder_resolves_from_the_cache_and_records_it(
    baked: tuple[Path, subprocess.CompletedProcess], hub_cache: Path
) -> None:
    out, proc = baked
    snapshot = hub_cache / "huggingface-cache" / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    record = read_baked_model(str(out))
    assert record == BakedModel(
        model_name="org/tiny",
        model_revision=None,
        tokenizer_name=None,
        tokenizer_revision=None,
        base_path=str(hub_cache),
        model_dir=str(snapshot),
        tokenizer_dir=str(snapshot),
        load_format="safetensors",
    )
    assert f"baked org/tiny (safetensors) into {snapshot}" in proc.stdout


def test_builder_never_shows_the_token(
    baked: tuple[Path, subprocess.CompletedProcess], hub_cache: Path
) -> None:
    out, proc = baked
    assert FAKE_TOKEN not in proc.stdout + proc.stderr
    assert not files_holding(hub_cache, FAKE_TOKEN)
    # Everything the build step wrote besides the secret itself: the record, HOME's caches.
    build_dir = out.parent.parent
    written = [p for p in files_holding(build_dir, FAKE_TOKEN) if "/secrets/" not in p]
    assert not written, written


def test_builder_fails_fast_on_an_empty_cache_offline(tmp_path: Path) -> None:
    env = clean_env(
        MODEL_NAME="org/absent",
        BASE_PATH=str(tmp_path / "base"),
        HF_HUB_OFFLINE="1",
        HF_TOKEN=FAKE_TOKEN,
        HOME=str(tmp_path),
    )
    start = time.monotonic()
    proc = run_builder(env, "--output", str(tmp_path / "baked.json"), timeout=60)
    assert proc.returncode == 1
    assert time.monotonic() - start < 30
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: model org/absent is not in the cache at ")
    assert "hub is offline" in lines[-1]
    assert FAKE_TOKEN not in proc.stdout + proc.stderr
    assert not (tmp_path / "baked.json").exists()


def test_builder_fails_fast_when_the_hub_is_unreachable(tmp_path: Path) -> None:
    env = clean_env(
        MODEL_NAME="org/absent",
        BASE_PATH=str(tmp_path / "base"),
        HF_ENDPOINT=UNREACHABLE,
        HF_HUB_ETAG_TIMEOUT="5",
        HF_TOKEN=FAKE_TOKEN,
        HOME=str(tmp_path),
    )
    start = time.monotonic()
    proc = run_builder(env, "--output", str(tmp_path / "baked.json"), timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert time.monotonic() - start < 30
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot download model org/absent from {UNREACHABLE}"), last
    assert FAKE_TOKEN not in proc.stdout + proc.stderr
    assert not (tmp_path / "baked.json").exists()


def test_builder_needs_a_model_and_refuses_bad_settings(tmp_path: Path) -> None:
    env = clean_env(BASE_PATH=str(tmp_path / "base"), HF_HUB_OFFLINE="1", HOME=str(tmp_path))
    proc = run_builder(env, "--output", str(tmp_path / "baked.json"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: MODEL_NAME is not set: pass --build-arg MODEL_NAME=<hub repo id>"
    ]
    proc = run_builder({**env, "MODEL_NAME": "org/tiny", "QUANTIZATION": "bitsandbytes"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: QUANTIZATION='bitsandbytes'")


def worker_env(**extra: str) -> dict[str, str]:
    return clean_env(
        NUM_GPU_BLOCKS_OVERRIDE="64",
        MAX_MODEL_LEN="256",
        DEVICE="cpu",
        RUNPOD_SKIP_AUTO_SYSTEM_CHECKS="true",
        RUNPOD_SKIP_GPU_CHECK="true",
        **extra,
    )


def run_worker_once(env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """`python -m serverless_llm.worker` as the image runs it, on one job (runpod's
    --test_input), then exit."""
    job = json.dumps({"input": {"prompt": "Hello", "sampling_params": GREEDY}})
    return subprocess.run(
        [sys.executable, "-m", "serverless_llm.worker", "--test_input", job],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
    )


def test_baked_worker_starts_with_the_hub_unreachable(
    baked: tuple[Path, subprocess.CompletedProcess], tmp_path: Path
) -> None:
    """No offline flag in the environment and a hub that refuses connections: the baked-model
    file switches the hub off, and the worker serves from the image's files."""
    out, _ = baked
    env = worker_env(
        **{BAKED_MODEL_ENV: str(out)},
        HF_ENDPOINT=UNREACHABLE,
        HF_TOKEN=FAKE_TOKEN,
        HOME=str(tmp_path),
    )
    proc = run_worker_once(env, tmp_path)
    logs = proc.stdout + proc.stderr
    assert proc.returncode == 0, logs[-4000:]
    assert "the hub is off (HF_HUB_OFFLINE=1)" in logs
    ready = [line for line in logs.splitlines() if "worker ready:" in line]
    assert len(ready) == 1, logs[-4000:]
    for part in ("model=org/tiny", "dtype=float32", "kv_blocks=64", "max_concurrency=300"):
        assert part in ready[0]
    assert "Job local_test completed successfully" in logs
    assert "'output': 8" in logs  # usage.output of the job's single item
    assert FAKE_TOKEN not in logs


def test_worker_without_model_name_exits_at_once(tmp_path: Path) -> None:
    env = worker_env(**{BAKED_MODEL_ENV: str(tmp_path / "none.json")}, HF_TOKEN=FAKE_TOKEN)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "serverless_llm.worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: MODEL_NAME is not set"), lines
    assert time.monotonic() - start < 60
    assert FAKE_TOKEN not in proc.stdout + proc.stderr


@pytest.fixture()
def online_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Online mode (no offline flag anywhere), every request to a refusing port, and any
    download attempt an error."""
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE)
    monkeypatch.setattr(hf_constants, "ENDPOINT", UNREACHABLE)

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the hub was contacted although the model is cached")

    monkeypatch.setattr(hub_mod, "_download", no_network)


def test_cached_model_starts_with_the_network_unreachable(
    hub_cache: Path, online_unreachable: None
) -> None:
    """A worker restarting on a network volume that already holds its model needs no hub."""
    import asyncio

    settings = Settings.from_env(
        {
            "MODEL_NAME": "org/tiny",
            "BASE_PATH": str(hub_cache),
            "NUM_GPU_BLOCKS_OVERRIDE": "64",
            "MAX_MODEL_LEN": "256",
            "DEVICE": "cpu",
        }
    )
    worker = Worker(settings)

    async def scenario() -> list:
        await worker.start()
        try:
            job = {"id": "j", "input": {"prompt": "Hello", "sampling_params": GREEDY}}
            return [item async for item in worker.handle(job)]
        finally:
            await worker.shutdown()

    start = time.monotonic()
    items = asyncio.run(scenario())
    assert items[-1]["usage"]["output"] == 8, items
    assert time.monotonic() - start < 60


# The baked-model file, read in process.


def _record(tmp_path: Path, model_dir: Path, tokenizer_dir: Path | None = None) -> Path:
    path = tmp_path / "baked.json"
    write_baked_model(
        BakedModel(
            model_name="org/tiny",
            model_revision=None,
            tokenizer_name=None,
            tokenizer_revision=None,
            base_path="/models",
            model_dir=str(model_dir),
            tokenizer_dir=str(tokenizer_dir or model_dir),
            load_format="safetensors",
        ),
        str(path),
    )
    return path


def test_apply_baked_model_points_at_local_files(tmp_path: Path) -> None:
    path = _record(tmp_path, tmp_path)
    env: dict[str, str] = {"MODEL_REVISION": "main"}
    assert apply_baked_model(env, str(path)) is not None
    assert env["MODEL_NAME"] == str(tmp_path)
    assert "MODEL_REVISION" not in env and "TOKENIZER_NAME" not in env
    assert env["OPENAI_SERVED_MODEL_NAME_OVERRIDE"] == "org/tiny"
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert Settings.from_env(env).served_model_name == "org/tiny"
    # The same model named explicitly is the baked one too; a served name set stays.
    env = {"MODEL_NAME": "org/tiny", "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "tiny"}
    assert apply_baked_model(env, str(path)) is not None
    assert env["MODEL_NAME"] == str(tmp_path) and env["OPENAI_SERVED_MODEL_NAME_OVERRIDE"] == "tiny"


def test_apply_baked_model_yields_to_another_model(tmp_path: Path) -> None:
    path = _record(tmp_path, tmp_path)
    env = {"MODEL_NAME": "org/other"}
    assert apply_baked_model(env, str(path)) is None
    assert env == {"MODEL_NAME": "org/other"}  # the hub stays on for the other model
    env = {"MODEL_REVISION": "v2"}
    assert apply_baked_model(env, str(path)) is None
    assert env == {"MODEL_NAME": "org/tiny", "MODEL_REVISION": "v2"}


def test_apply_baked_model_hidden_by_a_volume(tmp_path: Path) -> None:
    path = _record(tmp_path, tmp_path / "gone")
    env: dict[str, str] = {}
    assert apply_baked_model(env, str(path)) is None
    assert env == {"MODEL_NAME": "org/tiny"}  # fetched again from the hub, not offline


def test_apply_baked_model_without_a_file_or_with_a_bad_one(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    assert apply_baked_model(env, str(tmp_path / "absent.json")) is None and env == {}
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(BakedModelError, match="cannot read the baked-model file"):
        apply_baked_model({}, str(bad))
    bad.write_text(json.dumps({"format_version": 99}))
    with pytest.raises(BakedModelError, match="rebuild the image"):
        apply_baked_model({}, str(bad))


def test_builder_bakes_lora_adapters(hub_cache: Path, tiny_llama: str, tmp_path: Path) -> None:
    """LORA_MODULES at build time: each hub adapter is read from (or put into) the same cache,
    the list is recorded, and the worker's environment gets it when the endpoint sets none; an
    adapter repo the builder cannot get fails the build naming it."""
    pytest.importorskip("peft")
    from serverless_llm.worker.baked import apply_baked_model
    from tests.lora_adapters import make_adapter

    adapter = make_adapter(tiny_llama, str(tmp_path / "adapter"), 4, 8, ["q_proj"])
    populate_hub_cache(
        hub_cache / "huggingface-cache" / "hub", "org/tiny-lora", Path(adapter), "d" * 40
    )
    out = tmp_path / "baked-model.json"
    env = clean_env(
        MODEL_NAME="org/tiny",
        BASE_PATH=str(hub_cache),
        HF_HUB_OFFLINE="1",
        HOME=str(tmp_path),
        ENABLE_LORA="true",
        LORA_MODULES="sql=org/tiny-lora",
    )
    proc = run_builder(env, "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    assert read_baked_model(str(out)).lora_modules == "sql=org/tiny-lora"
    worker_env: dict[str, str] = {}
    apply_baked_model(worker_env, str(out))
    assert worker_env["LORA_MODULES"] == "sql=org/tiny-lora"
    assert worker_env["ENABLE_LORA"] == "true"
    worker_env = {"LORA_MODULES": "other=/x"}
    apply_baked_model(worker_env, str(out))
    assert worker_env["LORA_MODULES"] == "other=/x"  # the endpoint's own list wins

    env["LORA_MODULES"] = "sql=org/missing-lora"
    proc = run_builder(env, "--output", str(tmp_path / "other.json"))
    assert proc.returncode == 1
    assert "org/missing-lora" in proc.stderr and "not in the cache" in proc.stderr

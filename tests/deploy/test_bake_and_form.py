"""docker-bake.hcl (parsed with python-hcl2, variables and `inherits` resolved as bake does) and
worker-config.json, the console form: current with its generator, in step with the settings and
with the image tags bake builds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from serverless_llm import __version__
from serverless_llm.engine.loader.quantization import SERVED_METHODS
from serverless_llm.worker import console_form
from serverless_llm.worker.settings import CATEGORIES, Settings, settings_metadata

REPO = Path(__file__).resolve().parents[2]
hcl2 = pytest.importorskip("hcl2", reason="pip install -r requirements-dev.txt (python-hcl2)")


def _unquote(value: Any) -> Any:
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    if isinstance(value, list):
        return [_unquote(v) for v in value]
    if isinstance(value, dict):
        return {_unquote(k): _unquote(v) for k, v in value.items() if k != "__is_block__"}
    return value


def _blocks(doc: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for entry in doc.get(kind, []):
        for name, body in entry.items():
            out[_unquote(name)] = _unquote(body)
    return out


def load_bake() -> tuple[dict[str, list[str]], dict[str, dict[str, Any]]]:
    """(groups, targets) with inherits merged (args merged key by key) and ${VAR}s resolved from
    the variables' defaults."""
    with open(REPO / "docker-bake.hcl", encoding="utf-8") as f:
        doc = hcl2.load(f)
    variables = {name: body.get("default", "") for name, body in _blocks(doc, "variable").items()}

    def interpolate(value: Any) -> Any:
        if isinstance(value, str):
            return re.sub(r"\$\{(\w+)\}", lambda m: str(variables[m.group(1)]), value)
        if isinstance(value, list):
            return [interpolate(v) for v in value]
        if isinstance(value, dict):
            return {k: interpolate(v) for k, v in value.items()}
        return value

    raw = _blocks(doc, "target")

    def resolved(name: str) -> dict[str, Any]:
        body = dict(raw[name])
        merged: dict[str, Any] = {}
        for parent in body.pop("inherits", []):
            base = resolved(parent)
            args = {**merged.get("args", {}), **base.get("args", {})}
            merged.update(base)
            merged["args"] = args
        args = {**merged.get("args", {}), **body.get("args", {})}
        merged.update(body)
        merged["args"] = args
        return interpolate(merged)

    groups = {name: body["targets"] for name, body in _blocks(doc, "group").items()}
    return groups, {name: resolved(name) for name in raw}


def dockerfile_args() -> set[str]:
    text = (REPO / "Dockerfile").read_text()
    return set(re.findall(r"^ARG (\w+)", text, flags=re.M))


def test_bake_parses_and_names_the_targets() -> None:
    groups, targets = load_bake()
    default = groups["default"]
    cudas = {targets[t]["args"]["CUDA_VERSION"] for t in default}
    assert len(default) >= 2 and len(cudas) == len(default), (default, cudas)
    for name in default:
        target = targets[name]
        assert target["dockerfile"] == "Dockerfile" and target["context"] == "."
        major_minor = ".".join(target["args"]["CUDA_VERSION"].split(".")[:2])
        assert all(tag.endswith(f"-cuda{major_minor}") for tag in target["tags"]), target["tags"]
        assert "MODEL_NAME" not in target["args"]
    baked = [t for name, t in targets.items() if t.get("args", {}).get("MODEL_NAME")]
    assert baked, "no baked-model target"
    for target in baked:
        assert target["args"]["BASE_PATH"] != "/runpod-volume"  # a volume would hide it
        assert "id=HF_TOKEN,env=HF_TOKEN" in target["secret"]
        assert "CUDA_VERSION" in target["args"]
    assert any(name in groups.get("baked", []) for name in targets)
    for name, target in targets.items():
        unknown = set(target.get("args", {})) - dockerfile_args()
        assert not unknown, f"{name} passes build args the Dockerfile lacks: {unknown}"
        assert "HF_TOKEN" not in target.get("args", {})


def test_form_is_current_with_its_generator() -> None:
    text = (REPO / "worker-config.json").read_text(encoding="utf-8")
    assert text == console_form.render(console_form.console_form()), (
        "worker-config.json is stale: python -m serverless_llm.worker.console_form "
        "> worker-config.json"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "serverless_llm.worker.console_form",
            "--check",
            "worker-config.json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_form_image_is_built_by_bake() -> None:
    form = json.loads((REPO / "worker-config.json").read_text())
    _, targets = load_bake()
    (version, entry), *others = form["versions"].items()
    assert not others and version == __version__
    by_tag = {
        tag: t
        for t in targets.values()
        for tag in t.get("tags", [])
        if "MODEL_NAME" not in t["args"]
    }
    assert entry["imageName"] in by_tag, (entry["imageName"], sorted(by_tag))
    cuda = by_tag[entry["imageName"]]["args"]["CUDA_VERSION"]
    assert entry["minimumCudaVersion"] == ".".join(cuda.split(".")[:2])


def _form_type(kind: str, choices: list[Any]) -> str:
    if choices:
        return "select"
    return {"bool": "toggle", "int": "number", "float": "number"}.get(kind, "text")


def test_form_and_settings_agree() -> None:
    form = json.loads((REPO / "worker-config.json").read_text())
    schema = form["schema"]
    rows = {row["env"]: row for row in settings_metadata()}
    assert list(schema) == list(rows)  # same names, same order
    (entry,) = form["versions"].values()
    listed = [name for category in entry["categories"] for name in category["settings"]]
    assert sorted(listed) == sorted(rows) and len(listed) == len(set(listed))
    assert [c["title"] for c in entry["categories"]] == [
        c for c in CATEGORIES if any(r["category"] == c for r in rows.values())
    ]
    for category in entry["categories"]:
        assert all(rows[name]["category"] == category["title"] for name in category["settings"])
    for env, field in schema.items():
        row = rows[env]
        assert field["env_var_name"] == env
        assert field["title"] == row["title"] and field["description"] == row["description"]
        assert field["type"] == _form_type(row["type"], row["choices"])
        assert field["required"] is (env == "MODEL_NAME")
        value = field["value"]
        if field["type"] == "toggle":
            assert value is row["default"]
        elif field["type"] == "number":
            assert value == ("" if row["default"] is None else row["default"])
            assert value == "" or isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            assert isinstance(value, str)
        if field["type"] == "select":
            values = [o["value"] for o in field["options"]]
            assert values == [""] * (row["default"] is None) + [str(c) for c in row["choices"]]
            assert value in values
    # Each default, written into the environment as the console does, reads back as itself.
    for env, field in schema.items():
        if field["value"] in ("", None):
            continue
        text = str(field["value"]).lower() if field["type"] == "toggle" else str(field["value"])
        settings = Settings.from_env({env: text})
        assert getattr(settings, rows[env]["field"]) == rows[env]["default"], env


def test_form_options_are_accepted() -> None:
    form = json.loads((REPO / "worker-config.json").read_text())
    for env, field in form["schema"].items():
        if field["type"] != "select":
            continue
        for option in field["options"]:
            if env == "QUANTIZATION" and option["value"] not in SERVED_METHODS:
                continue  # valid, but stops start-up until the format is served
            Settings.from_env({env: option["value"]})

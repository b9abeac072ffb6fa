"""Where the worker keeps the native CPU kernels' cache (worker/native_cache.py), the row choice's
key (engine/layers/linear.py), and the build step that bakes both (builder/bake_cpu_kernels.py)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from serverless_llm.engine.kernels import cpu_native
from serverless_llm.engine.layers import linear
from serverless_llm.worker import native_cache
from serverless_llm.worker.native_cache import BAKED_ENV, ENV, native_cache_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def clean(monkeypatch):
    # Set, then removed: monkeypatch then restores what was there, `configure`'s own setting
    # of NATIVE_KERNEL_CACHE included.
    for name in (ENV, BAKED_ENV, "NATIVE_LINEAR_ROWS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def test_the_deployment_then_the_volume_then_the_image_then_the_default(clean, tmp_path):
    baked = tmp_path / "baked"
    baked.mkdir()
    clean.setenv(BAKED_ENV, str(baked))
    # No volume (the default BASE_PATH, absent here), the baked directory empty: the default.
    assert native_cache_dir("/runpod-volume") == (None, "the container's (the default)")
    (baked / "linear-rows-0123.json").write_text("{}")
    assert native_cache_dir("/runpod-volume") == (str(baked), "baked into the image")
    volume = tmp_path / "volume"
    assert native_cache_dir(str(volume)) == (
        str(volume / "cpu-native-cache"),
        "the network volume",
    )
    clean.setenv(ENV, "/somewhere")
    assert native_cache_dir(str(volume)) == ("/somewhere", ENV)


def test_a_volume_is_seeded_with_the_images_entries_and_kept(clean, tmp_path):
    baked = tmp_path / "baked"
    baked.mkdir()
    (baked / "cpu_native-abc.so").write_bytes(b"library")
    (baked / "linear-rows-abc.json").write_text('{"8x16": [1, 4]}')
    clean.setenv(BAKED_ENV, str(baked))
    volume = tmp_path / "volume"
    mine = volume / "cpu-native-cache"
    mine.mkdir(parents=True)
    (mine / "linear-rows-abc.json").write_text('{"8x16": [1, 8]}')  # measured here before
    assert native_cache.configure(str(volume)) == str(mine)
    assert os.environ[ENV] == str(mine)
    assert (mine / "cpu_native-abc.so").read_bytes() == b"library"
    assert (mine / "linear-rows-abc.json").read_text() == '{"8x16": [1, 8]}'  # not overwritten
    assert sorted(p.name for p in mine.iterdir()) == ["cpu_native-abc.so", "linear-rows-abc.json"]


def test_the_row_choice_key_holds_the_cpu_and_its_cores(clean, tmp_path):
    """A cache shared by machines (a volume, an image baked elsewhere) never hands one CPU the
    choice measured on another: each of the CPU's model name, flags, core counts and threads is
    in the file's key."""

    class Native:
        path = Path("/x/cpu_native-0123.so")

    clean.setenv(ENV, str(tmp_path))
    shapes = {(24, 16): [object(), object()], (8, 16): [object()]}
    here = linear.choice_file(Native, shapes)
    assert here.parent == tmp_path and here.name.startswith("linear-rows-")
    assert linear.choice_file(Native, shapes) == here
    identity = linear.cpu_identity()
    for i in range(len(identity)):
        other = list(identity)
        other[i] = "another" if isinstance(other[i], str) else (other[i] or 0) + 1
        clean.setattr(linear, "cpu_identity", lambda other=tuple(other): other)
        assert linear.choice_file(Native, shapes) != here, f"identity field {i} not in the key"
    clean.setattr(linear, "cpu_identity", lambda: identity)
    assert linear.choice_file(Native, {(24, 16): [object()]}) != here  # shapes and counts


def test_the_gguf_rows_key_holds_the_cpu_and_its_cores(clean, tmp_path):
    """The GGUF block linears' measured rows (layers/gguf_linear.py) live in the same shared
    cache: their key holds every field of the CPU's identity too."""
    from serverless_llm.engine.layers import gguf_linear

    class Kernels:
        path = "/x/gguf_blocks-0123.so"

    clean.setenv(ENV, str(tmp_path))
    keys = ["576x576:4/32:float", "1536x576:4/32:float"]
    here = gguf_linear.block_rows_file(Kernels, keys)
    assert here.parent == tmp_path and here.name.startswith("gguf-rows-")
    identity = linear.cpu_identity()
    for i in range(len(identity)):
        other = list(identity)
        other[i] = "another" if isinstance(other[i], str) else (other[i] or 0) + 1
        clean.setattr(gguf_linear, "cpu_identity", lambda other=tuple(other): other)
        assert gguf_linear.block_rows_file(Kernels, keys) != here, f"field {i} not in the key"
    clean.setattr(gguf_linear, "cpu_identity", lambda: identity)
    assert gguf_linear.block_rows_file(Kernels, keys) == here
    assert gguf_linear.block_rows_file(Kernels, keys[:1]) != here


def _builder():
    spec = importlib.util.spec_from_file_location(
        "bake_cpu_kernels", REPO / "builder" / "bake_cpu_kernels.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_baked_choice_is_the_one_a_worker_on_the_same_cpu_reads(clean, tmp_path, tiny_llama):
    """The build step measures into the image's cache; a worker started with that image and a
    network volume copies it to the volume and loads without measuring (the keys computed at
    build time are the ones the worker asks for)."""
    from serverless_llm.engine.model_builder import load_model
    from serverless_llm.worker.settings import Settings

    assert cpu_native.load() is not None, "the native kernels must build on this machine"
    baked = tmp_path / "baked"
    clean.setenv("MODEL_NAME", tiny_llama)
    clean.setenv("DEVICE", "cpu")
    clean.setenv(ENV, str(baked))
    clean.setattr(linear, "others_busy_cores", lambda before, after: 0.0)  # a quiet build
    measured = []
    choose = linear.choose_native_rows

    def counting(group, native, timer=linear.time_pass):
        measured.append(len(group))
        return choose(group, native, timer)

    clean.setattr(linear, "choose_native_rows", counting)
    assert _builder().main() == 0
    assert measured, "the build step measured nothing"
    rows = list(baked.glob("linear-rows-*.json"))
    assert len(rows) == 1

    # The worker: the image's cache named, a volume at BASE_PATH.
    clean.delenv(ENV)
    clean.setenv(BAKED_ENV, str(baked))
    volume = tmp_path / "volume"
    settings = Settings.from_env({"MODEL_NAME": tiny_llama, "DEVICE": "cpu",
                                  "BASE_PATH": str(volume)})  # fmt: skip
    assert native_cache.configure(settings.base_path) == str(volume / "cpu-native-cache")
    assert (volume / "cpu-native-cache" / rows[0].name).read_text() == rows[0].read_text()
    measured.clear()
    config = settings.engine_config()
    model = load_model(config).model
    assert not measured, "the worker measured again: the baked key is not the runtime's"
    assert linear.choice_file(cpu_native.load(), linear.linear_shapes(model)).name == rows[0].name


def test_the_dockerfile_bakes_into_the_directory_the_worker_reads():
    text = (REPO / "Dockerfile").read_text()
    assert 'ARG CPU_KERNELS=""' in text  # a compiler only when asked for: GPU images need none
    assert f"ENV {BAKED_ENV}=/opt/cpu-native-cache" in text
    assert f"{ENV}=${BAKED_ENV} python builder/bake_cpu_kernels.py" in text

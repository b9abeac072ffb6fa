"""Which files of a checkpoint hold its weights, and reading them tensor by tensor.

The same selection runs on a hub repo's file list (to choose what to download) and on a local
directory (to choose what to read), so both agree on what a complete checkpoint is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator

import torch
import transformers
from safetensors import safe_open
from tqdm.auto import tqdm

from .base import ModelLoadError, ResolvedModel
from .config_import import defer_activations, defer_models_index
from .multimodal import text_part

SAFETENSORS_INDEX = "model.safetensors.index.json"
PT_INDEX = "pytorch_model.bin.index.json"
# .bin files that are pickles of training state, not weights.
_NOT_WEIGHTS = {"training_args.bin", "optimizer.bin", "scheduler.bin", "rng_state.bin"}


def _indexed(index_name: str, read_index: Callable[[str], str]) -> list[str]:
    """The index file followed by the shards it names."""
    try:
        weight_map = json.loads(read_index(index_name))["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{index_name} is not a valid weight index: {e}") from e
    return [index_name, *sorted(set(weight_map.values()))]


def select_weight_files(
    names: Iterable[str], load_format: str, read_index: Callable[[str], str]
) -> tuple[str, list[str]] | None:
    """Picks (format, files) from top-level file `names`: safetensors before .bin under "auto".

    An index, when present, decides the shards (a Mistral repo also ships consolidated.safetensors,
    which must not be read twice). `read_index(name)` returns an index file's text. The list
    includes the index itself, so a download of the list fetches it. None: no weights of the format.
    """
    top = {n for n in names if "/" not in n}
    formats = ("safetensors", "pt") if load_format == "auto" else (load_format,)
    for fmt in formats:
        if fmt == "safetensors":
            if SAFETENSORS_INDEX in top:
                return fmt, _indexed(SAFETENSORS_INDEX, read_index)
            if "model.safetensors" in top:
                return fmt, ["model.safetensors"]
            files = sorted(n for n in top if n.endswith(".safetensors"))
        else:
            if PT_INDEX in top:
                return fmt, _indexed(PT_INDEX, read_index)
            files = sorted(n for n in top if n.startswith("pytorch_model") and n.endswith(".bin"))
            if not files:
                files = sorted(n for n in top if n.endswith(".bin") and n not in _NOT_WEIGHTS)
        if files:
            return fmt, files
    return None


def local_weight_files(model_dir: str, load_format: str) -> tuple[str, list[str]] | None:
    """select_weight_files on a directory's listing; indexes are read from the directory."""

    def read_index(name: str) -> str:
        path = os.path.join(model_dir, name)
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise ModelLoadError(f"cannot read weight index {path}: {e}") from e

    return select_weight_files(os.listdir(model_dir), load_format, read_index)


# model_type -> the transformers model_type whose config class reads it: families whose config
# code lives only in their hub repositories (trust_remote_code) but holds exactly that class's
# fields plus keys kept as plain attributes (MiMo: Qwen2's, and num_nextn_predict_layers).
CONFIG_STANDINS = {"mimo": "qwen2"}


def _standin_config(model_dir: str) -> transformers.PretrainedConfig | None:
    """The config.json of a `CONFIG_STANDINS` model type read by its stand-in's config class
    (its own model_type and architectures kept), or None for any other model type."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    standin = CONFIG_STANDINS.get(data.get("model_type")) if isinstance(data, dict) else None
    if standin is None:
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    data = {k: v for k, v in data.items() if k != "auto_map"}
    config = CONFIG_MAPPING[standin].from_dict(data)
    config.model_type = data["model_type"]
    return config


def load_hf_config(
    resolved: ResolvedModel, trust_remote_code: bool = False
) -> transformers.PretrainedConfig:
    """The model's transformers config, read from disk only (resolution already fetched it);
    for a multimodal checkpoint, the config of its text decoder (`multimodal.text_part`). A
    model type transformers does not know and `CONFIG_STANDINS` names (its code only in its
    repository) is read by its stand-in's config class, without the repository's code."""
    defer_activations()  # transformers' modeling imports only when something needs them
    defer_models_index()  # and its model index (~0.2 s) only when something reads it
    try:
        config = transformers.AutoConfig.from_pretrained(
            resolved.model_dir, trust_remote_code=trust_remote_code, local_files_only=True
        )
    except Exception as e:  # transformers raises ValueError, OSError, KeyError for bad configs
        standin = _standin_config(resolved.model_dir)
        if standin is not None:
            return text_part(standin)
        hint = "" if trust_remote_code else " (a custom architecture needs trust_remote_code)"
        raise ModelLoadError(
            f"cannot read the model config of {resolved.source} in {resolved.model_dir}: "
            f"{type(e).__name__}: {e}{hint}"
        ) from e
    return text_part(config)


def _torch_load(path: str) -> dict:
    # mmap keeps a shard's peak memory near one tensor; old (non-zip) files cannot be mapped.
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        return torch.load(path, map_location="cpu", weights_only=True)


class LazyTensor:
    """A checkpoint tensor not read yet: its shape and dtype, and reads of parts of it. A
    tensor-parallel rank reads only its slice (from the memory-mapped file), so its peak host
    memory follows its share of the model, not the model."""

    def __init__(self, source) -> None:
        self._source = source  # a safetensors slice, or a (memory-mapped) torch tensor
        if isinstance(source, torch.Tensor):
            self.shape = tuple(source.shape)
            self.dtype = source.dtype
        else:
            self.shape = tuple(source.get_shape())
            self.dtype = source[0:0].dtype if self.shape else source[...].dtype

    def full(self) -> torch.Tensor:
        src = self._source
        if isinstance(src, torch.Tensor):
            return src
        return src[...] if not self.shape else src[:]

    def read(self, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """The rows `ranges` ((start, length) pairs) along `dim`, concatenated, as a copy."""
        src = self._source
        parts = []
        for lo, ln in ranges:
            if isinstance(src, torch.Tensor):
                parts.append(src.narrow(dim, lo, ln))
            else:
                index = (slice(None),) * dim + (slice(lo, lo + ln),)
                parts.append(src[index])
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
        return out.clone() if isinstance(src, torch.Tensor) else out


def iter_weights(
    resolved: ResolvedModel, show_progress: bool = True, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """Yields (checkpoint parameter name, CPU tensor) for every tensor of every shard; with
    `lazy`, a LazyTensor instead, valid until the next item.

    One shard at a time, so peak memory is a shard, not the model. The names are the
    checkpoint's, before any renaming the model code does.
    """
    if resolved.load_format == "dummy":
        raise ModelLoadError(
            f"{resolved.source}: load_format=dummy has no weights; initialise the model randomly"
        )
    found = local_weight_files(resolved.model_dir, resolved.load_format)
    if found is None:
        raise ModelLoadError(
            f"no {resolved.load_format} weights in {resolved.model_dir} (from {resolved.source})"
        )
    fmt, files = found
    shards = [f for f in files if not f.endswith(".json")]
    missing = [f for f in shards if not os.path.isfile(os.path.join(resolved.model_dir, f))]
    if missing:
        raise ModelLoadError(
            f"weight shards listed in the index are missing from {resolved.model_dir}: "
            + ", ".join(missing[:3])
            + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        )
    bar = tqdm(shards, desc=f"Loading {fmt} shards", unit="shard", disable=not show_progress)
    for name in bar:
        path = os.path.join(resolved.model_dir, name)
        try:
            if fmt == "safetensors":
                with safe_open(path, framework="pt", device="cpu") as f:
                    for key in f.keys():
                        yield key, LazyTensor(f.get_slice(key)) if lazy else f.get_tensor(key)
            else:
                state = _torch_load(path)
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        yield key, LazyTensor(value) if lazy else value
                del state
        except ModelLoadError:
            raise
        except Exception as e:  # corrupt or truncated file: name it
            raise ModelLoadError(f"cannot read weights from {path}: {type(e).__name__}: {e}") from e

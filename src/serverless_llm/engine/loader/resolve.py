"""From what the user named (nothing, a directory, a .gguf file, a hub id) to files on disk."""

from __future__ import annotations

import logging
import os

from ..config import EngineConfig
from .base import ModelLoadError, ResolvedModel, scrub
from .gguf import (
    EMBEDDED_GGUF,
    converted_gguf_dir,
    embedded_model_path,
    gguf_architecture,
    gguf_files_in,
    gguf_metadata_dir,
)
from .hub import hub_snapshot, looks_like_hub_id
from .weights import local_weight_files

logger = logging.getLogger(__name__)


def _weights_format(load_format: str) -> str | None:
    """What to look for on disk: None for dummy; gguf input is converted to safetensors."""
    if load_format == "dummy":
        return None
    return "auto" if load_format in ("auto", "gguf") else load_format


def gguf_kept_quantized(cfg: EngineConfig) -> bool:
    """Whether a GGUF model is served from the file's own blocks (layers/gguf_linear.py: no
    float copy, on disk or in memory): QUANTIZED_WEIGHTS=packed or auto on a CPU, one process
    (auto: not with LoRA adapters, which wrap float linears). The default since the blocks'
    many-row GEMM batches as fast as the float32 copy and one request decodes 3x faster, in
    ~0.4x the memory (docs/benchmarks.md, issue 39). Anywhere else, or with
    QUANTIZED_WEIGHTS=dequantize, the file is converted once to a float safetensors copy."""
    wanted = cfg.quantized_weights == "packed" or (
        cfg.quantized_weights == "auto" and not cfg.enable_lora
    )
    return (
        wanted
        and cfg.load_format != "dummy"
        and cfg.tensor_parallel_size == 1
        and cfg.resolve_device().type == "cpu"
    )


# The GGUF architectures (the file's `general.architecture`) served from their blocks by default
# (QUANTIZED_WEIGHTS=auto): those whose direct read of the file (loader/gguf_direct.py) is tested
# against the same weights dequantized (tests/engine/test_gguf_direct.py, test_gguf_families.py,
# test_gguf_blocks_model.py). llama.cpp writes Mistral's files as "llama". Any other
# architecture converts under auto, as before, and takes the blocks with QUANTIZED_WEIGHTS=packed.
GGUF_BLOCKS_BY_DEFAULT = frozenset(
    {"llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "starcoder2", "stablelm", "gpt2",
     "lfm2", "mamba", "qwen2moe", "qwen3moe", "bloom", "falcon"}
)  # fmt: skip


def _from_gguf(gguf_path: str, cfg: EngineConfig) -> tuple[str, str]:
    if cfg.load_format == "pt":
        raise ModelLoadError(f"load_format=pt cannot read GGUF file {gguf_path}")
    if gguf_kept_quantized(cfg):  # config and tokenizer only; weights read from the file
        # the header's architecture first: a file that converts writes no unused config dir
        arch = None if cfg.quantized_weights == "packed" else gguf_architecture(gguf_path)
        if cfg.quantized_weights == "packed" or arch in GGUF_BLOCKS_BY_DEFAULT:
            meta_dir = gguf_metadata_dir(gguf_path, cfg.download_dir, cfg.show_progress)
            return meta_dir, "gguf"
        logger.info("GGUF %s (%s): converted to float32 (QUANTIZED_WEIGHTS=packed serves it from "
                    "the file's blocks; by default only %s files are)", gguf_path, arch,
                    ", ".join(sorted(GGUF_BLOCKS_BY_DEFAULT)))  # fmt: skip
    model_dir = converted_gguf_dir(gguf_path, cfg.download_dir, cfg.show_progress)
    return model_dir, "dummy" if cfg.load_format == "dummy" else "safetensors"


def _from_directory(path: str, cfg: EngineConfig) -> tuple[str, str]:
    ggufs = gguf_files_in(path)
    has_config = os.path.isfile(os.path.join(path, "config.json"))
    weights_format = _weights_format(cfg.load_format)
    # A lone .gguf is the model unless the directory also holds a transformers checkpoint.
    gguf_only = bool(ggufs) and (
        not has_config
        or (weights_format is not None and local_weight_files(path, weights_format) is None)
    )
    if cfg.load_format == "gguf" or gguf_only:
        if len(ggufs) != 1:
            found = ", ".join(ggufs) if ggufs else "none"
            raise ModelLoadError(
                f"{path} needs exactly one .gguf file to load as GGUF (found: {found}); "
                "pass the file's path instead"
            )
        return _from_gguf(os.path.join(path, ggufs[0]), cfg)
    if not has_config:
        raise ModelLoadError(f"{path} holds no config.json: not a transformers model directory")
    if weights_format is None:
        return path, "dummy"
    found = local_weight_files(path, weights_format)
    if found is None:
        kind = "*.safetensors or *.bin" if weights_format == "auto" else weights_format
        raise ModelLoadError(f"{path} holds no {kind} weights")
    return path, found[0]


def _resolve_tokenizer(cfg: EngineConfig, model_dir: str) -> str:
    """The tokenizer's directory: the model's own unless TOKENIZER (or its revision) says so."""
    if cfg.tokenizer:
        path = os.path.abspath(os.path.expanduser(cfg.tokenizer))
        if os.path.isdir(path):
            return path
        if os.path.isfile(path) and path.lower().endswith(".gguf"):
            return gguf_metadata_dir(path, cfg.download_dir, cfg.show_progress)
        if looks_like_hub_id(cfg.tokenizer):
            folder, _ = hub_snapshot(
                cfg.tokenizer,
                revision=cfg.tokenizer_revision,
                cache_dir=cfg.download_dir,
                token=cfg.hf_token,
                weights_format=None,
                tokenizer_only=True,
                trust_remote_code=cfg.trust_remote_code,
            )
            return folder
        raise ModelLoadError(
            f"tokenizer {scrub(cfg.tokenizer, cfg.hf_token)!r} is neither an existing directory "
            "nor a hub id"
        )
    model = cfg.model
    if (
        cfg.tokenizer_revision
        and model
        and not os.path.exists(os.path.expanduser(model))
        and cfg.tokenizer_revision != (cfg.revision or "main")
    ):
        folder, _ = hub_snapshot(
            model,
            revision=cfg.tokenizer_revision,
            cache_dir=cfg.download_dir,
            token=cfg.hf_token,
            weights_format=None,
            tokenizer_only=True,
            trust_remote_code=cfg.trust_remote_code,
        )
        return folder
    return model_dir


def resolve_model(cfg: EngineConfig) -> ResolvedModel:
    """Finds or fetches the model `cfg` names; every later step reads only local files.

    None: the embedded SmolLM2 GGUF. A directory: used as is (or its single .gguf when it has no
    config.json). A .gguf file: converted once to a cached safetensors directory. Anything else
    must be a hub id, served from the HF cache without a network call when already there.
    """
    model = cfg.model
    gguf_path = None
    if model is None:
        gguf_path = embedded_model_path()
        model_dir, fmt = _from_gguf(gguf_path, cfg)
        source = f"embedded {EMBEDDED_GGUF}"
    else:
        source = scrub(model if not cfg.revision else f"{model}@{cfg.revision}", cfg.hf_token)
        path = os.path.abspath(os.path.expanduser(model))
        if os.path.isdir(path):
            model_dir, fmt = _from_directory(path, cfg)
            if fmt == "gguf":  # its one .gguf, served from its blocks
                gguf_path = os.path.join(path, gguf_files_in(path)[0])
        elif os.path.isfile(path):
            if not (path.lower().endswith(".gguf") or cfg.load_format == "gguf"):
                raise ModelLoadError(
                    f"{source} is a file; give a model directory, a .gguf file or a hub id"
                )
            model_dir, fmt = _from_gguf(path, cfg)
            gguf_path = path
        elif model.lower().endswith(".gguf"):
            raise ModelLoadError(f"GGUF file not found: {source}")
        elif looks_like_hub_id(model):
            if cfg.load_format == "gguf":
                raise ModelLoadError(
                    f"load_format=gguf needs a local .gguf file, not hub id {source}: "
                    "download the .gguf file and pass its path"
                )
            model_dir, fmt = hub_snapshot(
                model,
                revision=cfg.revision,
                cache_dir=cfg.download_dir,
                token=cfg.hf_token,
                weights_format=_weights_format(cfg.load_format),
                trust_remote_code=cfg.trust_remote_code,
            )
        elif model.startswith(("/", ".", "~")) or model.count("/") > 1:
            raise ModelLoadError(f"model path {source} does not exist")
        else:
            raise ModelLoadError(f"model {source!r} is neither an existing path nor a hub id")
    tokenizer_dir = _resolve_tokenizer(cfg, model_dir)
    logger.info("model %s: %s weights in %s", source, fmt, model_dir)
    return ResolvedModel(
        model_dir=model_dir,
        tokenizer_dir=tokenizer_dir,
        load_format=fmt,
        source=source,
        gguf_path=gguf_path,
    )

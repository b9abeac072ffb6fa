"""The engine's configuration (`EngineConfig`) from the settings, and where models download."""

from __future__ import annotations

import logging
import os

from ...engine import LoRARequest
from ...engine.config import EngineConfig
from ...engine.speculative import METHODS, speculative_method
from .fields import DEFAULT_BASE_PATH, SettingsFields, parse_json_object, parse_lora_modules

logger = logging.getLogger(__name__)


def download_dir(base_path: str) -> str | None:
    """Where models are downloaded: `<BASE_PATH>/huggingface-cache/hub`, as worker-vllm laid it
    out (a network volume it populated is reused). The default BASE_PATH is used only where it
    is already there, which on RunPod means a network volume is mounted; elsewhere (a local run,
    a worker without a volume) models go to the Hugging Face cache (None) rather than a new
    `/runpod-volume` at the filesystem's root."""
    if base_path == DEFAULT_BASE_PATH and not _volume_present(base_path):
        return None
    return os.path.join(os.path.expanduser(base_path), "huggingface-cache", "hub")


def _volume_present(path: str) -> bool:
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def engine_config(settings: SettingsFields) -> EngineConfig:
    """The engine's configuration from these settings. Raises ConfigError when the engine
    refuses a combination."""
    s = settings
    return EngineConfig(
        model=s.model_name,
        revision=s.model_revision,
        tokenizer=s.tokenizer_name,
        tokenizer_revision=s.tokenizer_revision,
        load_format=s.load_format,
        quantization=s.quantization,
        quantized_weights=s.quantized_weights,
        kv_cache_dtype=s.kv_cache_dtype,
        dtype=s.dtype,
        seed=s.seed,
        trust_remote_code=s.trust_remote_code,
        hf_overrides=hf_overrides(s),
        generation_config=s.generation_config,
        override_generation_config=(
            parse_json_object(s.override_generation_config)
            if s.override_generation_config
            else None
        ),
        max_num_partial_prefills=s.max_num_partial_prefills,
        disable_hybrid_kv_cache_manager=s.disable_hybrid_kv_cache_manager,
        download_dir=download_dir(s.base_path),
        hf_token=s.hf_token.get_secret_value() if s.hf_token else None,
        max_model_len=s.max_model_len,
        max_num_seqs=s.max_num_seqs,
        scheduling_policy=s.scheduling_policy,
        task=s.task,
        pooling_type=s.pooling_type,
        normalize=s.normalize,
        max_num_batched_tokens=s.max_num_batched_tokens,
        block_size=s.block_size,
        gpu_memory_utilization=s.gpu_memory_utilization,
        kv_cache_space_gib=s.cpu_kv_cache_space,
        num_kv_blocks=s.num_gpu_blocks_override,
        device=s.device,
        attention_backend=s.attention_backend,
        enforce_eager=s.enforce_eager,
        kernel_warmup=s.kernel_warmup,
        max_seq_len_to_capture=s.max_seq_len_to_capture,
        enable_prefix_caching=s.enable_prefix_caching,
        grammar_compile_timeout=s.grammar_compile_timeout,
        grammar_max_chars=s.grammar_max_chars,
        enable_lora=s.enable_lora,
        max_loras=s.max_loras,
        max_lora_rank=s.max_lora_rank,
        max_cpu_loras=s.max_cpu_loras,
        lora_dtype=s.lora_dtype,
        tensor_parallel_size=s.tensor_parallel_size,
        max_parallel_loading_workers=s.max_parallel_loading_workers,
        speculative_config=speculative_config(s),
    )


def speculative_config(settings: SettingsFields) -> dict | None:
    """SPECULATIVE_CONFIG for the engine: None when unset, or (with a warning) when it names a
    method this engine does not run, so the worker serves without speculation rather than not
    at all; a config of a method it runs that the engine refuses (bad numbers, a draft of
    another tokenizer) fails the start."""
    if not settings.speculative_config:
        return None
    value = parse_json_object(settings.speculative_config)
    method = speculative_method(value)
    if method not in METHODS:
        logger.warning(
            "SPECULATIVE_CONFIG method=%r is not implemented (only ngram, prompt lookup, "
            "draft_model, eagle, eagle3 and mtp): serving without speculative decoding",
            method,
        )
        return None
    return value


def hf_overrides(settings: SettingsFields) -> dict | None:
    """HF_OVERRIDES, with ROPE_SCALING and ROPE_THETA after it (vLLM folds them in alike)."""
    s = settings
    out = parse_json_object(s.hf_overrides) if s.hf_overrides else {}
    if s.rope_scaling:
        out["rope_scaling"] = parse_json_object(s.rope_scaling)
    if s.rope_theta is not None:
        out["rope_theta"] = s.rope_theta
    return out or None


def lora_requests(settings: SettingsFields) -> list[LoRARequest]:
    """The adapters LORA_MODULES names, with ids 1, 2, ... in order."""
    if not settings.lora_modules:
        return []
    return [
        LoRARequest(m["name"], i, m["path"], m["base_model_name"])
        for i, m in enumerate(parse_lora_modules(settings.lora_modules), start=1)
    ]

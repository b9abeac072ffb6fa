"""Engine configuration: every option the engine itself understands, with its default.

The worker's env settings (a later layer) map onto these fields; the offline `LLM` takes them as
keyword arguments, with vLLM's names where vLLM has one.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_DTYPES = {
    "half": torch.float16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
    "fp32": torch.float32,
}
DTYPE_CHOICES = ("auto", *_DTYPES)
LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
# The KV cache's element type: "auto" is the model dtype; "fp8" is e4m3 (vLLM's meaning).
KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# What kv_cache_dtype (KV_CACHE_DTYPE) takes.
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_CACHE_DTYPES)
# How quantized weights are held (quantized_weights, QUANTIZED_WEIGHTS); see the field below.
QUANTIZED_WEIGHTS_MODES = ("auto", "packed", "dequantize")
# The share of GPU memory the engine may use: worker-vllm's documented GPU_MEMORY_UTILIZATION
# default, which the worker reads from here, so the deployed worker and the offline LLM size
# their KV cache alike (vLLM's own default is 0.9; see docs/engine.md).
GPU_MEMORY_UTILIZATION = 0.95
BLOCK_SIZES = (8, 16, 32)
ATTENTION_BACKENDS = ("auto", "native", "torch", "triton")
DECODE_CAPTURE_MODES = ("auto", "off", "replay")
SCHEDULING_POLICIES = ("fcfs", "priority")


class ConfigError(ValueError):
    """A setting has a value the engine cannot use; the message names it."""


TASKS = ("auto", "generate", "embed", "classify", "score")


@dataclass
class EngineConfig:
    # What to load.
    model: str | None = None  # hub id, local directory or .gguf file; None: embedded SmolLM2
    revision: str | None = None
    tokenizer: str | None = None
    tokenizer_revision: str | None = None
    load_format: str = "auto"
    quantization: str | None = None  # None: as the checkpoint says (loader/quantization.py)
    # How GPTQ/AWQ weights are held (layers/quant_linear.py): "packed" (at their bit width,
    # dequantized inside the matmul), "dequantize" (float once at load), or "auto": packed on
    # CUDA, dequantized elsewhere (faster on CPU: docs/quantization.md). A GGUF file on CPU:
    # "auto" and "packed" serve its own blocks (loader/resolve.gguf_kept_quantized).
    quantized_weights: str = "auto"
    # "auto" (the model dtype) or an 8-bit float: fp8 / fp8_e4m3, fp8_e5m2 (kv_cache.py).
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    trust_remote_code: bool = False
    # Changes to the model's config (vLLM's --hf-overrides; rope too: hf_overrides.py), and
    # where requests' unset sampling parameters come from (vLLM's --generation-config "auto" |
    # "vllm" | a directory, --override-generation-config; generation_defaults.py).
    hf_overrides: dict | None = None
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    download_dir: str | None = None  # hub cache root (BASE_PATH on the worker)
    hf_token: str | None = dataclasses.field(default=None, repr=False)
    # Shape limits.
    max_model_len: int | None = None  # None: from the model config
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 8192 on CUDA, else 2048 (LLMEngine)
    # Prompts prefilled side by side in one step (vLLM's --max-num-partial-prefills): 1, one
    # at a time in order; N > 1, up to N, each chunk at most max_num_batched_tokens / N.
    max_num_partial_prefills: int = 1
    # "fcfs": waiting requests in arrival order, the newest running one preempted; "priority":
    # by (request priority, arrival), lower first, the worst running one preempted (scheduler.py).
    scheduling_policy: str = "fcfs"
    # KV cache.
    block_size: int = 16
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    kv_cache_space_gib: float = 4.0  # the cache's size on CPU
    num_kv_blocks: int | None = None  # overrides both of the above (tests, debugging)
    enable_prefix_caching: bool = True
    # Every layer keeps every token in one cache group, sliding windows included (vLLM's
    # --disable-hybrid-kv-cache-manager): the before of bench/kv_capacity.py, and a way out.
    disable_hybrid_kv_cache_manager: bool = False
    # Execution.
    device: str = "auto"  # auto: cuda when available
    attention_backend: str = "auto"  # auto: triton on CUDA, torch on CPU
    # Decode steps captured as CUDA graphs (decode_capture.py) unless enforce_eager; contexts
    # longer than max_seq_len_to_capture run eagerly. `decode_capture`: "auto" (CUDA graphs on
    # CUDA, nothing on CPU), "off", or "replay" (the capture buffers with an eager replay: the
    # CPU twin tests run; it saves nothing).
    enforce_eager: bool = False
    max_seq_len_to_capture: int = 8192
    decode_capture: str = "auto"
    # Kernel warm-up (kernel_warmup.py): on CUDA with the Triton backend, every kernel
    # specialisation the model can launch is listed and compiled (or loaded from Triton's cache)
    # before the engine is ready, so none compiles on a request's path.
    kernel_warmup: bool = True
    show_progress: bool = True
    # Structured output: each grammar compiles in a compile process, killed after this many
    # seconds (0: no limit); a schema, regex, grammar or choice list longer than this many
    # characters is refused before compiling (0: no limit).
    grammar_compile_timeout: float = 15.0
    grammar_max_chars: int = 256 << 10
    # LoRA (lora.py): adapters named per request, `max_loras` of them in one step (the model's
    # slots), ranks up to `max_lora_rank`, `max_cpu_loras` kept read on the host (None: as
    # many as max_loras); `lora_dtype` "auto" is the model dtype.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    # Tensor parallelism (parallel/): the model split across this many devices, one process
    # each (CUDA: cuda:0..N-1; CPU: the cores divided among them); at most
    # `max_parallel_loading_workers` ranks read their weights at once (None: all).
    tensor_parallel_size: int = 1
    max_parallel_loading_workers: int | None = None
    # Speculative decoding (vLLM's speculative_config, a dict or its JSON):
    # {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
    # "prompt_lookup_min": m} (speculative.py) or {"method": "draft_model", "model": path,
    # "num_speculative_tokens": k} (draft_model.py); None: off.
    speculative_config: dict | str | None = None
    # What the model serves (vLLM's --task / --runner): "generate"; "embed", "classify" or
    # "score" (pooling requests only: engine/pooling.py); "auto": "classify" for a
    # ...ForSequenceClassification checkpoint, else "generate". `pooling_type` ("last" |
    # "mean") and `normalize`: None reads them from a sentence-transformers layout
    # (modules.json, 1_Pooling/), else last-token pooling, normalised.
    task: str = "auto"
    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"task={self.task!r}: allowed {', '.join(TASKS)}")
        if self.pooling_type is not None and self.pooling_type not in ("last", "mean", "cls"):
            raise ConfigError(f"pooling_type={self.pooling_type!r}: allowed last, mean, cls")
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"dtype={self.dtype!r}: allowed {', '.join(DTYPE_CHOICES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"load_format={self.load_format!r}: allowed {', '.join(LOAD_FORMATS)}"
            )
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError(f"block_size={self.block_size}: allowed 8, 16, 32")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend={self.attention_backend!r}: allowed {', '.join(ATTENTION_BACKENDS)}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization={self.gpu_memory_utilization}: allowed (0, 1]"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ConfigError(
                f"kv_cache_dtype={self.kv_cache_dtype!r}: allowed "
                + ", ".join(KV_CACHE_DTYPE_CHOICES)
            )
        if self.quantized_weights not in QUANTIZED_WEIGHTS_MODES:
            raise ConfigError(
                f"quantized_weights={self.quantized_weights!r}: allowed "
                + ", ".join(QUANTIZED_WEIGHTS_MODES)
            )
        if self.decode_capture not in DECODE_CAPTURE_MODES:
            raise ConfigError(
                f"decode_capture={self.decode_capture!r}: allowed {', '.join(DECODE_CAPTURE_MODES)}"
            )
        if self.max_seq_len_to_capture < 1:
            raise ConfigError(f"max_seq_len_to_capture={self.max_seq_len_to_capture}: must be >= 1")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs={self.max_num_seqs}: must be >= 1")
        if self.max_num_partial_prefills < 1:
            raise ConfigError(
                f"max_num_partial_prefills={self.max_num_partial_prefills}: must be >= 1"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                f"scheduling_policy={self.scheduling_policy!r}: allowed "
                + ", ".join(SCHEDULING_POLICIES)
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len={self.max_model_len}: must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks={self.num_kv_blocks}: must be >= 1")
        if self.grammar_compile_timeout < 0:
            raise ConfigError(
                f"grammar_compile_timeout={self.grammar_compile_timeout}: must be >= 0"
            )
        if self.grammar_max_chars < 0:
            raise ConfigError(f"grammar_max_chars={self.grammar_max_chars}: must be >= 0")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ConfigError(
                f"max_loras={self.max_loras}, max_lora_rank={self.max_lora_rank}: must be >= 1"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"max_cpu_loras={self.max_cpu_loras}: must be >= max_loras ({self.max_loras})"
            )
        if self.lora_dtype not in DTYPE_CHOICES:
            raise ConfigError(f"lora_dtype={self.lora_dtype!r}: allowed {', '.join(DTYPE_CHOICES)}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size}: must be >= 1")
        if self.max_parallel_loading_workers is not None and self.max_parallel_loading_workers < 1:
            raise ConfigError(
                f"max_parallel_loading_workers={self.max_parallel_loading_workers}: must be >= 1"
            )
        from .speculative import parse_speculative_config  # it imports ConfigError from here

        parse_speculative_config(self.speculative_config)  # ConfigError naming what is wrong
        if self.kv_cache_space_gib <= 0:
            raise ConfigError(f"kv_cache_space_gib={self.kv_cache_space_gib}: must be > 0")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def resolve_dtype(
    name: str, config_dtype: torch.dtype | str | None, device: torch.device
) -> torch.dtype:
    """DTYPE=auto takes the checkpoint's dtype, except float32 on CPU for half checkpoints
    (CPU half matmuls are slow and imprecise), float16 on GPU for float32 checkpoints, and
    float16 for bfloat16 checkpoints on GPUs without bfloat16 arithmetic (before sm80: V100,
    T4), with a warning, as vLLM does; bfloat16 asked for by name there is a ConfigError."""
    bf16_ok = device.type != "cuda" or _cuda_has_bf16(device)
    if name != "auto":
        if _DTYPES[name] == torch.bfloat16 and not bf16_ok:
            raise ConfigError(
                f"dtype={name}: this GPU ({torch.cuda.get_device_name(device)}) has no bfloat16 "
                "arithmetic (it needs compute capability 8.0 or newer); use float16"
            )
        return _DTYPES[name]
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    if device.type == "cpu":
        return torch.float32
    if config_dtype == torch.bfloat16 and not bf16_ok:
        logger.warning(
            "the checkpoint is bfloat16, which this GPU (%s) cannot compute in; running it in "
            "float16 (set DTYPE=float16 to silence this)",
            torch.cuda.get_device_name(device),
        )
        return torch.float16
    if config_dtype in (torch.float16, torch.bfloat16):
        return config_dtype
    return torch.float16


def lora_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The adapters' dtype: LORA_DTYPE, `auto` being the model's."""
    return model_dtype if config.lora_dtype == "auto" else _DTYPES[config.lora_dtype]


def _cuda_has_bf16(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)

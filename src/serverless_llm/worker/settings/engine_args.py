"""vLLM's engine arguments as environment variables: each one honoured or named as ignored.

worker-vllm turns any vLLM engine argument set as an upper-case env var (`--cpu-offload-gb` ->
`CPU_OFFLOAD_GB`) into a flag, so users carry such variables over. Here every one of them is
either a setting (a field of `SettingsFields` under that name or an alias: same meaning,
documented in docs/settings.md) or listed below with the reason it is ignored; at start-up the
ignored ones that are set are named in one warning line (`ignored_engine_args`). A value that is
JSON in vLLM is parsed as JSON even when ignored, so a typo is caught where it was made
(`check_json_engine_args`: the variable and the position).

The list is vLLM's engine arguments (its `AsyncEngineArgs`), with the older ones worker-vllm's
README and vLLM's CLI pages still name (speculative decoding's flags, tokenizer pools, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from .fields import ENV_TO_FIELD

_SPECULATIVE = (
    "an older speculative decoding flag: speculative decoding is set by SPECULATIVE_CONFIG "
    "(ngram, draft_model)"
)
_DATA_PARALLEL = "one worker is one replica: scale out with more workers, not in-process ranks"
_EXPERTS = "MoE experts are split by tensor parallelism only"
_ONLY_GENERATION = (
    "pooling is TASK=embed, classify or score with POOLING_TYPE and NORMALIZE (the head and "
    "pooling come from the checkpoint); no converted runners"
)
_MULTIMODAL = "images are processed with the model's own processor defaults"
_LEGACY = "an older vLLM option with no counterpart in this engine"
_NO_TRACING = "tracing and hidden metrics are not provided"
_OWN_MODELS = "every model runs this engine's own implementation"

# Engine arguments the worker does not honour, with why. A name that is also a settings field
# (or alias) is honoured, whatever this table says: a setting added later takes over its entry.
IGNORED: dict[str, str] = {
    # What to load.
    "MODEL": "the model is MODEL_NAME",
    "TOKENIZER_MODE": (
        "the tokenizer is always transformers' AutoTokenizer (the fast one where the model "
        "has it); mistral_common tokenizers are not used"
    ),
    "HF_CONFIG_PATH": "config.json is read from the model's own directory (see HF_OVERRIDES)",
    "CODE_REVISION": _OWN_MODELS + "; remote model code is never run",
    "CONFIG_FORMAT": "configs are read in Hugging Face's format",
    "MODEL_IMPL": _OWN_MODELS,
    "RUNNER": "the task is set by TASK (auto, generate, embed, classify or score)",
    "CONVERT": _ONLY_GENERATION,
    "POOLER_CONFIG": _ONLY_GENERATION,
    "OVERRIDE_POOLER_CONFIG": _ONLY_GENERATION,
    "SKIP_TOKENIZER_INIT": (
        "the worker needs the tokenizer (chat templates, stop strings, detokenizing)"
    ),
    "ENABLE_PROMPT_EMBEDS": "prompts are text or token ids; embeddings as prompts are not served",
    "DOWNLOAD_DIR": "models download under BASE_PATH (<BASE_PATH>/huggingface-cache/hub)",
    "SAFETENSORS_LOAD_STRATEGY": "safetensors files are memory-mapped and read once",
    "MODEL_LOADER_EXTRA_CONFIG": "the loader takes no extra options",
    "IGNORE_PATTERNS": "the loader picks the weight files itself (safetensors over .bin)",
    "USE_TQDM_ON_LOAD": "loading progress is always shown",
    "PT_LOAD_MAP_LOCATION": "weights are read on the host and placed on the device by the loader",
    "QUANTIZATION_PARAM_PATH": "FP8 KV cache scales come from the checkpoint (or are 1.0)",
    "CALCULATE_KV_SCALES": "FP8 KV cache scales come from the checkpoint (or are 1.0)",
    "OVERRIDE_ATTENTION_DTYPE": "attention runs in the model's dtype",
    "ENABLE_SLEEP_MODE": "the engine has no sleep mode",
    # Sampling and outputs.
    "MAX_LOGPROBS": "a request may ask for up to 20 logprobs (vLLM's default), fixed",
    "LOGPROBS_MODE": (
        "logprobs are always the model's own distribution, before any sampling parameter "
        "(vLLM's default raw_logprobs)"
    ),
    "LOGITS_PROCESSOR_PATTERN": "requests' logits_processors are not supported",
    "LOGITS_PROCESSORS": "custom logits processors are not loaded",
    "IO_PROCESSOR_PLUGIN": "IO processor plugins are not loaded",
    "GUIDED_DECODING_BACKEND": (
        "structured output always uses the engine's own grammar compiler (a request's "
        "guided_decoding_backend options still apply)"
    ),
    "STRUCTURED_OUTPUTS_CONFIG": (
        "structured output always uses the engine's own grammar compiler; its "
        "enable_in_reasoning is STRUCTURED_OUTPUTS_ENABLE_IN_REASONING"
    ),
    "REASONING_PARSER_PLUGIN": "reasoning parser plugins are not loaded",
    "ENABLE_REASONING": (
        "reasoning is parsed whenever a parser applies (REASONING_PARSER, or the one the chat "
        "template calls for)"
    ),
    "GUIDED_DECODING_DISABLE_FALLBACK": "there is one grammar compiler, so nothing to fall back to",
    "GUIDED_DECODING_DISABLE_ANY_WHITESPACE": (
        "JSON whitespace follows each request's guided_decoding_backend options"
    ),
    "GUIDED_DECODING_DISABLE_ADDITIONAL_PROPERTIES": (
        "JSON schemas are compiled as written (additionalProperties as the schema says)"
    ),
    # Attention and the cache.
    "DISABLE_SLIDING_WINDOW": "sliding-window layers always attend within their window",
    "DISABLE_CASCADE_ATTN": "the engine has no cascade attention",
    "KV_CACHE_MEMORY_BYTES": (
        "the cache is sized by GPU_MEMORY_UTILIZATION, CPU_KV_CACHE_SPACE or "
        "NUM_GPU_BLOCKS_OVERRIDE"
    ),
    "PREFIX_CACHING_HASH_ALGO": "cached blocks are keyed by the engine's own chained hash",
    "CPU_OFFLOAD_GB": "weights are not offloaded to CPU memory",
    "KV_SHARING_FAST_PREFILL": "layers sharing a KV cache are computed in full",
    "MAMBA_CACHE_DTYPE": "recurrent states are kept in the engine's chosen dtype",
    "MAMBA_SSM_CACHE_DTYPE": "recurrent states are kept in the engine's chosen dtype",
    "MAMBA_BLOCK_SIZE": "recurrent states are kept whole per request, not in blocks",
    "KV_OFFLOADING_SIZE": "the KV cache is not offloaded to CPU memory",
    "KV_OFFLOADING_BACKEND": "the KV cache is not offloaded to CPU memory",
    "KV_TRANSFER_CONFIG": "disaggregated prefill (KV transfer between instances) is not supported",
    "KV_EVENTS_CONFIG": "KV cache events are not published",
    # Scheduling.
    "MAX_LONG_PARTIAL_PREFILLS": (
        "partial prefills are not told apart by length (MAX_NUM_PARTIAL_PREFILLS bounds them all)"
    ),
    "LONG_PREFILL_TOKEN_THRESHOLD": (
        "partial prefills are not told apart by length (MAX_NUM_PARTIAL_PREFILLS bounds them all)"
    ),
    "SCHEDULER_CLS": "the engine's own scheduler is the only one",
    "SCHEDULER_DELAY_FACTOR": "waiting requests are admitted as soon as they fit",
    "DISABLE_CHUNKED_MM_INPUT": "a prompt's image is never split across steps where it must not be",
    "ASYNC_SCHEDULING": "steps are scheduled one after another",
    "CUDA_GRAPH_SIZES": "decode steps are captured at batch sizes 1, 2, 4, 8, 16, ... MAX_NUM_SEQS",
    "STREAM_INTERVAL": "tokens stream in DEFAULT_BATCH_SIZE-bounded batches (Streaming Settings)",
    "PREEMPTION_MODE": "preempted requests are always recomputed",
    "COMPILATION_CONFIG": "the model is not compiled with torch.compile (CUDA graphs: ENFORCE_EAGER)",
    "ADDITIONAL_CONFIG": "no platform plugins read it",
    # Parallelism.
    "DISTRIBUTED_EXECUTOR_BACKEND": "tensor-parallel ranks are always local processes",
    "PIPELINE_PARALLEL_SIZE": "pipeline parallelism is not supported; use TENSOR_PARALLEL_SIZE",
    "DECODE_CONTEXT_PARALLEL_SIZE": "context parallelism is not supported",
    "DATA_PARALLEL_SIZE": _DATA_PARALLEL,
    "DATA_PARALLEL_SIZE_LOCAL": _DATA_PARALLEL,
    "DATA_PARALLEL_RANK": _DATA_PARALLEL,
    "DATA_PARALLEL_START_RANK": _DATA_PARALLEL,
    "DATA_PARALLEL_ADDRESS": _DATA_PARALLEL,
    "DATA_PARALLEL_RPC_PORT": _DATA_PARALLEL,
    "DATA_PARALLEL_BACKEND": _DATA_PARALLEL,
    "DATA_PARALLEL_HYBRID_LB": _DATA_PARALLEL,
    "DATA_PARALLEL_EXTERNAL_LB": _DATA_PARALLEL,
    "ENABLE_EXPERT_PARALLEL": _EXPERTS,
    "ENABLE_EPLB": _EXPERTS,
    "EPLB_CONFIG": _EXPERTS,
    "EXPERT_PLACEMENT_STRATEGY": _EXPERTS,
    "NUM_REDUNDANT_EXPERTS": _EXPERTS,
    "EPLB_WINDOW_SIZE": _EXPERTS,
    "EPLB_STEP_INTERVAL": _EXPERTS,
    "EPLB_LOG_BALANCEDNESS": _EXPERTS,
    "ENABLE_DBO": "dual-batch overlap is not implemented",
    "DBO_DECODE_TOKEN_THRESHOLD": "dual-batch overlap is not implemented",
    "DBO_PREFILL_TOKEN_THRESHOLD": "dual-batch overlap is not implemented",
    "RAY_WORKERS_USE_NSIGHT": "Ray is not used",
    "WORKER_USE_RAY": "Ray is not used",
    "WORKER_CLS": "the engine's own worker processes are the only ones",
    "WORKER_EXTENSION_CLS": "the engine's own worker processes are the only ones",
    # LoRA.
    "FULLY_SHARDED_LORAS": "adapters are applied whole on every tensor-parallel rank",
    "LORA_EXTRA_VOCAB_SIZE": "adapters that add tokens to the vocabulary are not served",
    "LONG_LORA_SCALING_FACTORS": "long-context LoRA scaling is not supported",
    "DEFAULT_MM_LORAS": "adapters are chosen per request by name only",
    "ENABLE_LORA_BIAS": "adapter biases are not supported",
    "ENABLE_PROMPT_ADAPTER": "prompt adapters are not supported",
    "MAX_PROMPT_ADAPTERS": "prompt adapters are not supported",
    "MAX_PROMPT_ADAPTER_TOKEN": "prompt adapters are not supported",
    "QLORA_ADAPTER_NAME_OR_PATH": "bitsandbytes QLoRA is not supported; serve adapters with LORA_MODULES",
    # Multimodal.
    "MM_PROCESSOR_KWARGS": _MULTIMODAL,
    "MM_PROCESSOR_CACHE_GB": "processed images are cached by the engine's own encoder cache",
    "MM_PROCESSOR_CACHE_TYPE": "processed images are cached by the engine's own encoder cache",
    "DISABLE_MM_PREPROCESSOR_CACHE": "processed images are cached by the engine's own encoder cache",
    "MM_SHM_CACHE_MAX_OBJECT_SIZE_MB": "processed images are cached by the engine's own encoder cache",
    "MM_ENCODER_TP_MODE": "the vision tower is replicated on every tensor-parallel rank",
    "ENABLE_MULTIMODAL_ENCODER_DATA_PARALLEL": (
        "the vision tower is replicated on every tensor-parallel rank"
    ),
    "MEDIA_IO_KWARGS": _MULTIMODAL,
    "INTERLEAVE_MM_STRINGS": "a message's text and image parts keep their order as sent",
    "SKIP_MM_PROFILING": "the start-up profile covers the decoder only",
    "VIDEO_PRUNING_RATE": "video inputs are not served",
    "ENABLE_MM_EMBEDS": "image embeddings as inputs are not served",
    "ALLOWED_MEDIA_DOMAINS": (
        "image URLs are checked by address (ALLOW_PRIVATE_IMAGE_URLS), not by domain"
    ),
    # Logging and observability.
    "ENABLE_LOG_REQUESTS": "request logging is DISABLE_LOG_REQUESTS=0",
    "MAX_LOG_LEN": "prompt text is never logged",
    "AGGREGATE_ENGINE_LOGGING": "statistics are logged for the one engine (DISABLE_LOG_STATS=0)",
    "SHOW_HIDDEN_METRICS_FOR_VERSION": _NO_TRACING,
    "OTLP_TRACES_ENDPOINT": _NO_TRACING,
    "COLLECT_DETAILED_TRACES": _NO_TRACING,
    # Speculative decoding.
    "SPECULATIVE_MODEL": _SPECULATIVE,
    "SPECULATIVE_MODEL_QUANTIZATION": _SPECULATIVE,
    "NUM_SPECULATIVE_TOKENS": _SPECULATIVE,
    "SPECULATIVE_DRAFT_TENSOR_PARALLEL_SIZE": _SPECULATIVE,
    "SPECULATIVE_MAX_MODEL_LEN": _SPECULATIVE,
    "SPECULATIVE_DISABLE_BY_BATCH_SIZE": _SPECULATIVE,
    "NGRAM_PROMPT_LOOKUP_MAX": _SPECULATIVE,
    "NGRAM_PROMPT_LOOKUP_MIN": _SPECULATIVE,
    "SPEC_DECODING_ACCEPTANCE_METHOD": _SPECULATIVE,
    "TYPICAL_ACCEPTANCE_SAMPLER_POSTERIOR_THRESHOLD": _SPECULATIVE,
    "TYPICAL_ACCEPTANCE_SAMPLER_POSTERIOR_ALPHA": _SPECULATIVE,
    "DISABLE_LOGPROBS_DURING_SPEC_DECODING": _SPECULATIVE,
    "NUM_LOOKAHEAD_SLOTS": _SPECULATIVE,
    "SPECULATIVE_DISABLE_MQA_SCORER": _SPECULATIVE,
    # Older vLLM.
    "TOKENIZER_POOL_SIZE": "prompts are tokenized on the worker's own preparation threads",
    "TOKENIZER_POOL_TYPE": "prompts are tokenized on the worker's own preparation threads",
    "TOKENIZER_POOL_EXTRA_CONFIG": "prompts are tokenized on the worker's own preparation threads",
    "USE_V2_BLOCK_MANAGER": _LEGACY,
    "NUM_SCHEDULER_STEPS": _LEGACY,
    "MULTI_STEP_STREAM_OUTPUTS": _LEGACY,
    "DISABLE_ASYNC_OUTPUT_PROC": _LEGACY,
    "OVERRIDE_NEURON_CONFIG": _LEGACY,
}

# Engine arguments honoured as settings of the same name (or an alias): same meaning,
# documented in docs/settings.md. A test checks each is a setting.
HONOURED: tuple[str, ...] = (
    "TOKENIZER",
    "REVISION",
    "TRUST_REMOTE_CODE",
    "DTYPE",
    "SEED",
    "TOKENIZER_REVISION",
    "MAX_MODEL_LEN",
    "QUANTIZATION",
    "ENFORCE_EAGER",
    "MAX_SEQ_LEN_TO_CAPTURE",
    "MAX_CONTEXT_LEN_TO_CAPTURE",
    "SERVED_MODEL_NAME",
    "HF_TOKEN",
    "HF_OVERRIDES",
    "ROPE_SCALING",
    "ROPE_THETA",
    "GENERATION_CONFIG",
    "OVERRIDE_GENERATION_CONFIG",
    "ALLOWED_LOCAL_MEDIA_PATH",
    "LOAD_FORMAT",
    "REASONING_PARSER",
    "TENSOR_PARALLEL_SIZE",
    "MAX_PARALLEL_LOADING_WORKERS",
    "DISABLE_CUSTOM_ALL_REDUCE",
    "BLOCK_SIZE",
    "GPU_MEMORY_UTILIZATION",
    "SWAP_SPACE",
    "TASK",
    "KV_CACHE_DTYPE",
    "NUM_GPU_BLOCKS_OVERRIDE",
    "ENABLE_PREFIX_CACHING",
    "LIMIT_MM_PER_PROMPT",
    "ENABLE_LORA",
    "MAX_LORAS",
    "MAX_LORA_RANK",
    "MAX_CPU_LORAS",
    "LORA_DTYPE",
    "DEVICE",
    "MAX_NUM_BATCHED_TOKENS",
    "MAX_NUM_SEQS",
    "MAX_NUM_PARTIAL_PREFILLS",
    "SCHEDULING_POLICY",
    "ENABLE_CHUNKED_PREFILL",
    "DISABLE_HYBRID_KV_CACHE_MANAGER",
    "DISABLE_LOG_STATS",
    "DISABLE_LOG_REQUESTS",
    "SPECULATIVE_CONFIG",
)

# The engine arguments whose value vLLM reads as JSON.
JSON_VALUED: frozenset[str] = frozenset(
    {
        "HF_OVERRIDES",
        "ROPE_SCALING",
        "OVERRIDE_GENERATION_CONFIG",
        "LIMIT_MM_PER_PROMPT",
        "SPECULATIVE_CONFIG",
        "KV_TRANSFER_CONFIG",
        "KV_EVENTS_CONFIG",
        "COMPILATION_CONFIG",
        "ADDITIONAL_CONFIG",
        "STRUCTURED_OUTPUTS_CONFIG",
        "EPLB_CONFIG",
        "POOLER_CONFIG",
        "OVERRIDE_POOLER_CONFIG",
        "MM_PROCESSOR_KWARGS",
        "MEDIA_IO_KWARGS",
        "MODEL_LOADER_EXTRA_CONFIG",
        "DEFAULT_MM_LORAS",
        "TOKENIZER_POOL_EXTRA_CONFIG",
        "OVERRIDE_NEURON_CONFIG",
        "LONG_LORA_SCALING_FACTORS",
    }
)

ENGINE_ARGS: frozenset[str] = frozenset(IGNORED) | frozenset(HONOURED)


def ignored_reason(env: str) -> str | None:
    """Why the engine argument `env` is ignored; None when a setting honours it (or it is not
    an engine argument)."""
    if env in ENV_TO_FIELD:
        return None
    return IGNORED.get(env)


def _set(environ: Mapping[str, str]) -> dict[str, str]:
    return {str(k).upper(): v for k, v in environ.items() if v != ""}


def ignored_engine_args(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """(name, reason) of every engine argument set in `environ` that the worker ignores, in
    the table's order."""
    env = _set(environ)
    return [(name, why) for name in IGNORED if name in env and (why := ignored_reason(name))]


def ignored_warning(ignored: list[tuple[str, str]]) -> str | None:
    """The one start-up warning line naming the ignored engine arguments, or None."""
    if not ignored:
        return None
    return "vLLM engine arguments set but ignored: " + "; ".join(
        f"{name} ({why})" for name, why in ignored
    )


def check_json_engine_args(environ: Mapping[str, str]) -> None:
    """Each JSON-valued engine argument set in `environ` (settings and ignored ones alike) must
    parse; ValueError naming the variable and where its JSON breaks. Settings check their own
    values further (a JSON object, known keys)."""
    env = _set(environ)
    for name in sorted(JSON_VALUED & env.keys()):
        if name == "LIMIT_MM_PER_PROMPT" and not env[name].lstrip().startswith("{"):
            continue  # vLLM's older `image=4` form, which the setting also reads
        try:
            json.loads(env[name])
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{name} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} "
                f"(char {e.pos})"
            ) from None

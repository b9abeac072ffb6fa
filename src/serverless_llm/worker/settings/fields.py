"""The declared settings: every environment variable the worker reads, with its metadata.

Each setting carries its env name, aliases, title, description, type, default and console
category as first-class metadata (`json_schema_extra`), which the docs and the console form are
generated from. What one field accepts is checked here, as it is parsed (type, bounds, choices);
the checks across fields are in `validation`.
"""

from __future__ import annotations

import json
import os
import re
from functools import partial
from typing import Any

import annotated_types
from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from ...api.media import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MEDIA_FETCH_TIMEOUT,
    MAX_IMAGE_PIXELS,
    parse_limit_mm_per_prompt,
)
from ...api.openai.response_store import DEFAULT_MAX_BYTES as DEFAULT_STORE_MAX_BYTES
from ...api.openai.response_store import DEFAULT_MAX_COUNT as DEFAULT_STORE_MAX_COUNT
from ...api.openai.response_store import DEFAULT_TTL_SECONDS as DEFAULT_STORE_TTL_SECONDS
from ...api.openai.response_store import check_url as check_store_url
from ...engine.config import (
    ATTENTION_BACKENDS,
    BLOCK_SIZES,
    DTYPE_CHOICES,
    GPU_MEMORY_UTILIZATION,
    KV_CACHE_DTYPE_CHOICES,
    LOAD_FORMATS,
    QUANTIZED_WEIGHTS_MODES,
    SCHEDULING_POLICIES,
    TASKS,
)
from ...engine.generation_defaults import DEFAULTABLE, GENERATION_CONFIG_FILE, check_value
from ...engine.loader.quantization import QUANTIZATION_METHODS
from ...engine.pooling import POOLING_TYPES

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_BASE_PATH = "/runpod-volume"

# Console categories, in the order the form and the docs show them.
LLM = "LLM Settings"
TOKENIZER = "Tokenizer Settings"
SYSTEM = "System Settings"
STREAMING = "Streaming Settings"
OPENAI = "OpenAI Settings"
SERVERLESS = "Serverless Settings"
LIMITS = "Request Limits"
MULTIMODAL = "Multimodal Settings"
CATEGORIES = (LLM, TOKENIZER, SYSTEM, STREAMING, OPENAI, SERVERLESS, LIMITS, MULTIMODAL)

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
CHOICES_MSG = "not one of the choices"


def _setting(
    category: str,
    default: Any,
    env: str,
    *aliases: str,
    title: str,
    description: str,
    choices: tuple[Any, ...] | None = None,
    allowed: str | None = None,
    json_object: bool = False,
    **constraints: Any,
) -> Any:
    """A Field whose metadata the docs and the console form are generated from. `env` is the
    documented name; `aliases` are other names read too (first one set wins, `env` first).
    `json_object`: the value is a JSON object (checked as parsed; `parse_json_object`)."""
    extra: dict[str, Any] = {"category": category, "env": env, "aliases": list(aliases)}
    if json_object:
        extra["json_object"] = True
    if choices is not None:
        extra["choices"] = list(choices)
    if allowed is not None:
        extra["allowed"] = allowed
    return Field(
        default,
        validation_alias=AliasChoices(env, *aliases) if aliases else env,
        title=title,
        description=description,
        json_schema_extra=extra,
        **constraints,
    )


# One field factory per console category: a field's category is the section it is declared in.
_llm = partial(_setting, LLM)
_tokenizer = partial(_setting, TOKENIZER)
_system = partial(_setting, SYSTEM)
_streaming = partial(_setting, STREAMING)
_openai = partial(_setting, OPENAI)
_serverless = partial(_setting, SERVERLESS)
_limits = partial(_setting, LIMITS)
_multimodal = partial(_setting, MULTIMODAL)


class SettingsFields(BaseSettings):
    """Every setting as a field, each checked on its own as it is parsed. `Settings` (in
    `loader`) adds reading the environment, the checks across fields and derived values."""

    model_config = SettingsConfigDict(
        env_ignore_empty=True,  # the console sends "" for a field left blank: that is unset
        extra="ignore",
        populate_by_name=True,
        validate_default=False,
    )

    # -- LLM Settings -----------------------------------------------------------------------
    model_name: str | None = _llm(
        None,
        "MODEL_NAME",
        title="Model",
        description=(
            "Hugging Face repo id (e.g. `Qwen/Qwen2.5-0.5B-Instruct`), local directory or `.gguf` "
            "file of the model to serve. Required by the deployed worker, unless the image has a "
            "model baked in; the local devserver serves the embedded "
            f"{EMBEDDED_MODEL_NAME} (GGUF) when it is unset."
        ),
    )
    model_revision: str | None = _llm(
        None,
        "MODEL_REVISION",
        "REVISION",
        title="Model Revision",
        description="Branch, tag or commit of the model repo. Unset: `main`.",
    )
    max_model_len: int | None = _llm(
        None,
        "MAX_MODEL_LEN",
        title="Max Model Length",
        description=(
            "Most tokens (prompt plus output) one request may hold. Unset: the model's maximum."
        ),
        ge=1,
    )
    base_path: str = _llm(
        DEFAULT_BASE_PATH,
        "BASE_PATH",
        title="Base Path",
        description=(
            "Storage root: models are downloaded to `<BASE_PATH>/huggingface-cache/hub`. "
            "`/runpod-volume` is the network volume when one is attached, so one worker downloads "
            "and all load. Where the default directory is not there (no volume attached, a "
            "local run) the Hugging Face cache is used instead; nothing is created at `/`."
        ),
        min_length=1,
    )
    load_format: str = _llm(
        "auto",
        "LOAD_FORMAT",
        title="Load Format",
        description=(
            "Weight format to load: `auto` (safetensors, else PyTorch .bin, or a .gguf file), "
            "`safetensors`, `pt`, `gguf` (dequantized once at load), or `dummy` (random weights, "
            "for testing)."
        ),
        choices=LOAD_FORMATS,
    )
    hf_token: SecretStr | None = _llm(
        None,
        "HF_TOKEN",
        title="Hugging Face Token",
        description="Token for private or gated models. Never written to any log.",
    )
    quantization: str | None = _llm(
        None,
        "QUANTIZATION",
        title="Quantization",
        description=(
            "Quantization method of an already quantized checkpoint. Unset, the method comes "
            "from the checkpoint's `quantization_config`; set, it must agree with it. GPTQ (4 "
            "and 8 bits, act-order), AWQ (4 bits, GEMM layout), FP8 weights (`fp8`, or "
            "`compressed-tensors` float-quantized), `compressed-tensors` pack-quantized integers "
            "and MXFP4 experts (`mxfp4`, gpt-oss) are served (the `*marlin` names read as their "
            "base format); the other methods stop start-up for now. See docs/quantization.md."
        ),
        choices=QUANTIZATION_METHODS,
    )
    task: str = _llm(
        "auto",
        "TASK",
        title="Task",
        description=(
            "What the model serves (vLLM's `--task` / `--runner pooling`). `auto`: from the "
            "architecture (`embed` for an encoder such as BERT / XLM-RoBERTa, `classify` for a "
            "`...ForSequenceClassification` checkpoint, else `generate`). `generate`: the "
            "generation routes. `embed`: `/v1/embeddings` only, from a model's final "
            "hidden states (after its final norm), pooled per `POOLING_TYPE` and normalised per "
            "`NORMALIZE` (and `/score`, `/rerank` as the embeddings' cosine, `/pooling`); the "
            "generation routes answer a 400 saying so. `classify`: `/classify` and `/pooling` "
            "from a classifier head (a `...ForSequenceClassification` checkpoint; with one "
            "label `/score` and `/rerank` too). `score`: `/score` and `/rerank` from a one-label "
            "cross-encoder, or from a causal LM as Qwen3-Reranker's recipe (P(yes) over its "
            '"yes"/"no" tokens). With `generate`, `/v1/embeddings` is served beside the '
            "generation routes (one decoder for both; pooled per `POOLING_TYPE` and "
            "`NORMALIZE`, else the last token's, normalised); the other pooling routes answer "
            "a 400 naming the `TASK` to set."
        ),
        choices=TASKS,
    )
    pooling_type: str | None = _llm(
        None,
        "POOLING_TYPE",
        title="Pooling Type",
        description=(
            "For embeddings: `last` (the last token's hidden state: causal embedders such as "
            "Qwen3-Embedding, e5-mistral, gte-Qwen2), `mean` (the mean over the input's "
            "tokens) or `cls` (the first token's: BERT-family encoders such as bge). Unset: what "
            "the model's sentence-transformers files say (`modules.json`, "
            "`1_Pooling/config.json`), else `cls` for an encoder and `last` otherwise."
        ),
        choices=POOLING_TYPES,
    )
    normalize: bool | None = _llm(
        None,
        "NORMALIZE",
        title="Normalize Embeddings",
        description=(
            "For embeddings: L2-normalise each embedding (after `dimensions` truncation). "
            "Unset: as the model's sentence-transformers files say (a `Normalize` module in "
            "`modules.json`), else on."
        ),
    )
    trust_remote_code: bool = _llm(
        False,
        "TRUST_REMOTE_CODE",
        title="Trust Remote Code",
        description=(
            "Allow code from the model repo when reading its config and tokenizer. The model "
            "itself always runs this engine's own implementation."
        ),
    )
    seed: int = _llm(
        0,
        "SEED",
        title="Seed",
        description="Seed of the engine's random generators (requests may set their own).",
        ge=0,
    )
    kv_cache_dtype: str = _llm(
        "auto",
        "KV_CACHE_DTYPE",
        title="KV Cache Data Type",
        description=(
            "Data type of the KV cache; `auto` uses the model's. `fp8` (= `fp8_e4m3`) or "
            "`fp8_e5m2` store it in 8 bits (twice the tokens of a 16-bit model's cache), with "
            "per-layer K and V scales from the checkpoint (`k_scale`, `v_scale`) or 1.0."
        ),
        choices=KV_CACHE_DTYPE_CHOICES,
    )
    quantized_weights: str = _llm(
        "auto",
        "QUANTIZED_WEIGHTS",
        title="Quantized Weights",
        description=(
            "How GPTQ/AWQ/pack-quantized weights are held: `packed` (at their bit width, "
            "dequantized inside the matmul; MoE experts too), `dequantize` (float once at "
            "load: faster on CPU, 4x the memory), or `auto`: packed on CUDA, dequantized "
            "elsewhere. For a GGUF model on CPU, `packed` serves it from the file's own blocks "
            "(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) with no float copy converted or "
            "held (~0.4x the resident memory); `auto` does the same for the architectures whose "
            "direct read is tested (llama/mistral, qwen2/3 and their MoE, gemma2/3, phi3, starcoder2, "
            "stablelm, gpt2, bloom, falcon, lfm2, mamba; docs/models.md) (one "
            "request decodes ~3x faster than from a float32 copy and a batch as fast; "
            "measured, docs/quantization.md) except with LoRA adapters; `dequantize` converts it once to a float copy."
        ),
        choices=QUANTIZED_WEIGHTS_MODES,
    )
    enable_lora: bool = _llm(
        False,
        "ENABLE_LORA",
        title="Enable LoRA",
        description=(
            "Serve LoRA adapters on top of the model: the ones LORA_MODULES names, each by its "
            "name as the request's `model`."
        ),
    )
    lora_modules: str | None = _llm(
        None,
        "LORA_MODULES",
        title="LoRA Modules",
        description=(
            'Adapters to serve: JSON, one object or a list of `{"name": ..., "path": ..., '
            '"base_model_name": ...}` (path: a local directory or a hub repo id, downloaded '
            "into BASE_PATH like the model), or vLLM's `name=path` pairs separated by spaces "
            "or commas. Needs ENABLE_LORA."
        ),
    )
    allow_runtime_lora_updating: bool = _llm(
        False,
        "ALLOW_RUNTIME_LORA_UPDATING",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        title="Allow Runtime LoRA Updating",
        description=(
            "Turns on `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's "
            "routes, through `openai_route` on the worker) to add and remove adapters while "
            "serving. Needs ENABLE_LORA. Anyone who can call the endpoint can then make the "
            "worker read any adapter path it can reach."
        ),
    )
    max_loras: int = _llm(
        1,
        "MAX_LORAS",
        title="Max LoRAs",
        description="Most distinct adapters in one step (the model's adapter slots).",
        ge=1,
    )
    max_lora_rank: int = _llm(
        16,
        "MAX_LORA_RANK",
        title="Max LoRA Rank",
        description="Highest adapter rank served; an adapter above it is refused.",
        ge=1,
    )
    max_cpu_loras: int | None = _llm(
        None,
        "MAX_CPU_LORAS",
        title="Max CPU LoRAs",
        description=(
            "Adapters kept read in host memory (least recently used dropped first); unset: "
            "MAX_LORAS."
        ),
        ge=1,
    )
    lora_dtype: str = _llm(
        "auto",
        "LORA_DTYPE",
        title="LoRA Data Type",
        description="Data type of the adapter weights; `auto`: the model's.",
        choices=DTYPE_CHOICES,
    )
    dtype: str = _llm(
        "auto",
        "DTYPE",
        title="Data Type",
        description=(
            "Precision of weights and activations. `auto`: the checkpoint's (float16 on GPU for "
            "float32 checkpoints, and for bfloat16 ones on GPUs older than compute capability "
            "8.0; float32 on CPU). `bfloat16` on a CPU with bfloat16 arithmetic (AVX512_BF16 "
            "or AMX) packs the linears for oneDNN's bfloat16 GEMM: half the weight memory, "
            "1.0-1.4x float32's speed (docs/benchmarks.md)."
        ),
        choices=DTYPE_CHOICES,
    )
    hf_overrides: str | None = _llm(
        None,
        "HF_OVERRIDES",
        title="Hugging Face Config Overrides",
        description=(
            "vLLM's `--hf-overrides`: a JSON object of changes to the model's config.json, "
            'applied before the model is built (`{"max_position_embeddings": 4096}`); an object '
            "given for a nested config or dict is merged into it. On a vision-language model "
            "they apply to its text decoder's config. `rope_scaling`, `rope_parameters` and "
            "`rope_theta` keys act as ROPE_SCALING and ROPE_THETA."
        ),
        allowed="a JSON object",
        json_object=True,
    )
    rope_scaling: str | None = _llm(
        None,
        "ROPE_SCALING",
        title="RoPE Scaling",
        description=(
            'vLLM\'s `--rope-scaling`: JSON such as `{"rope_type": "yarn", "factor": 4.0, '
            '"original_max_position_embeddings": 32768}` (`type` is read as `rope_type`), '
            "merged into the model's rope parameters. A linear, dynamic or YaRN factor also "
            "extends the maximum length to the original length times the factor, as vLLM "
            "derives it. Applied after HF_OVERRIDES."
        ),
        allowed="a JSON object",
        json_object=True,
    )
    rope_theta: float | None = _llm(
        None,
        "ROPE_THETA",
        title="RoPE Theta",
        description="vLLM's `--rope-theta`: the rope base, replacing the model's.",
        gt=0.0,
        allow_inf_nan=False,
    )
    generation_config: str = _llm(
        "auto",
        "GENERATION_CONFIG",
        title="Generation Config",
        description=(
            "Where unset sampling parameters get their defaults (vLLM's `--generation-config`): "
            "`auto` reads the model's generation_config.json, so a request (OpenAI or native) "
            "that leaves temperature, top_p, top_k, min_p or repetition_penalty unset gets the "
            "value the model's authors wrote there; `vllm` keeps the engine's own defaults "
            "(temperature 1, no top-p/top-k/min-p, no repetition penalty); a directory reads "
            "its generation_config.json instead. The worker's start-up line lists the defaults "
            "in force and where each came from."
        ),
        allowed="auto, vllm, or a directory holding a generation_config.json",
        min_length=1,
    )
    override_generation_config: str | None = _llm(
        None,
        "OVERRIDE_GENERATION_CONFIG",
        title="Override Generation Config",
        description=(
            "vLLM's `--override-generation-config`: a JSON object of sampling defaults set on "
            'top of GENERATION_CONFIG\'s (`{"temperature": 0.5}`; alone with `vllm`). Keys: '
            "temperature, top_p, top_k, min_p, repetition_penalty."
        ),
        allowed="a JSON object",
        json_object=True,
    )
    speculative_config: str | None = _llm(
        None,
        "SPECULATIVE_CONFIG",
        title="Speculative Decoding",
        description=(
            "vLLM's `--speculative-config`: a JSON object. Prompt lookup: "
            '`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
            '"prompt_lookup_min": 2}` proposes up to `num_speculative_tokens` tokens a step '
            "from the request's own prompt and output. A draft model: "
            '`{"method": "draft_model", "model": "<path or hub id>", '
            '"num_speculative_tokens": 3}` (or `model` alone) runs a smaller model of the '
            "same tokenizer (refused at start otherwise) for that many greedy steps, with its "
            "own KV cache taken from the same memory (`draft_tensor_parallel_size` 1 only). "
            "The target verifies the drafts in one pass; greedy output is the same as without "
            "it, sampled output has the same distribution (the same tokens for a seeded "
            "request). `disable_by_batch_size` (default 16; null: never) stops speculation in "
            "steps with more running requests, and a request whose drafts are mostly rejected "
            "backs off by itself. An EAGLE head: "
            '`{"method": "eagle", "model": "<path or hub id>", "num_speculative_tokens": 3}` '
            "(EAGLE-1; `eagle3` for an EAGLE-3 head) drafts from the target's hidden states "
            "(same hidden size and vocabulary, refused at start otherwise); "
            '`{"method": "mtp", "num_speculative_tokens": 1}` runs the target\'s own '
            "multi-token-prediction layer (DeepSeek-V3 and GLM-4.5 checkpoints). Other methods "
            "(medusa, mlp_speculator) are not implemented: named in a warning and served "
            "without speculation. Unset: off."
        ),
        allowed="a JSON object",
        json_object=True,
    )

    # -- Tokenizer Settings -----------------------------------------------------------------
    tokenizer_name: str | None = _tokenizer(
        None,
        "TOKENIZER_NAME",
        "TOKENIZER",
        title="Tokenizer",
        description="Repo id or directory of a tokenizer to use instead of the model's own.",
    )
    tokenizer_revision: str | None = _tokenizer(
        None,
        "TOKENIZER_REVISION",
        title="Tokenizer Revision",
        description="Branch, tag or commit of the tokenizer repo.",
    )
    custom_chat_template: str | None = _tokenizer(
        None,
        "CUSTOM_CHAT_TEMPLATE",
        title="Custom Chat Template",
        description=(
            "Jinja chat template that replaces the model's, for chat requests on both routes."
        ),
    )

    # -- System Settings --------------------------------------------------------------------
    gpu_memory_utilization: float = _system(
        GPU_MEMORY_UTILIZATION,
        "GPU_MEMORY_UTILIZATION",
        title="GPU Memory Utilization",
        description=(
            "Fraction of GPU memory the engine may use (weights, activations and KV cache); the "
            "KV cache gets what is left after a profiling pass (a hybrid model's recurrent "
            "states too: MAX_NUM_SEQS requests' states first, from at most half of it). No "
            "effect on CPU."
        ),
        gt=0.0,
        le=1.0,
        allow_inf_nan=False,
    )
    max_parallel_loading_workers: int | None = _system(
        None,
        "MAX_PARALLEL_LOADING_WORKERS",
        title="Max Parallel Loading Workers",
        description=(
            "With tensor parallelism, how many ranks read their share of the weights at once "
            "(unset: all of them). Lower it when host memory or disk bandwidth is short: each "
            "rank reads only its slices, about 1/TENSOR_PARALLEL_SIZE of the checkpoint."
        ),
        ge=1,
    )
    block_size: int = _system(
        16,
        "BLOCK_SIZE",
        title="Block Size",
        description="Tokens per KV cache block.",
        choices=BLOCK_SIZES,
    )
    swap_space: float = _system(
        0.0,
        "SWAP_SPACE",
        title="Swap Space",
        description=(
            "CPU memory (GiB) to swap preempted requests to. Preempted requests are recomputed "
            "instead; swapping is not supported yet and a value above 0 is reported at start-up."
        ),
        ge=0.0,
        allow_inf_nan=False,
    )
    enforce_eager: bool = _system(
        False,
        "ENFORCE_EAGER",
        title="Enforce Eager",
        description=(
            "Always run eagerly, without CUDA graphs. By default a GPU worker captures its "
            "decode steps as CUDA graphs at start (batch sizes 1, 2, 4, 8, 16, ... up to "
            "MAX_NUM_SEQS, at most 256) and checks each against the eager forward; steps with a "
            "prefill in them run eagerly. No effect on CPU."
        ),
    )
    kernel_warmup: bool = _system(
        True,
        "KERNEL_WARMUP",
        title="Kernel Warm-up",
        description=(
            "GPU workers list every Triton kernel specialisation the model can launch (dtype, "
            "head sizes, block size, tiles, alignment) and compile them all at start, in "
            "parallel, before reporting ready, so no request waits for a compile; compiled "
            "kernels are kept in `<BASE_PATH>/triton-cache/<triton version>/<GPU arch>` when a "
            "network volume is attached (the next worker compiles nothing), else in the image's "
            "cache. `0` skips it (kernels then compile at their first launch). No effect on CPU."
        ),
    )
    max_seq_len_to_capture: int = _system(
        8192,
        "MAX_SEQ_LEN_TO_CAPTURE",
        "MAX_CONTEXT_LEN_TO_CAPTURE",
        title="Max Sequence Length to Capture",
        description=(
            "Longest context covered by CUDA graphs: a decode step with a longer context runs "
            "eagerly. Capped at the model's maximum length."
        ),
        ge=1,
    )
    disable_custom_all_reduce: bool = _system(
        False,
        "DISABLE_CUSTOM_ALL_REDUCE",
        title="Disable Custom All-Reduce",
        description=(
            "Disable the custom all-reduce kernel of tensor parallelism. Accepted for "
            "compatibility: the engine has no custom all-reduce, torch.distributed's (NCCL on "
            "GPUs) is the only one, so either value is honoured."
        ),
    )
    tensor_parallel_size: int = _system(
        1,
        "TENSOR_PARALLEL_SIZE",
        title="Tensor Parallel Size",
        description=(
            "Number of GPUs to shard the model over (tensor parallelism: one process per GPU, "
            "cuda:0 to cuda:N-1; docs/parallel.md). The attention heads and MLP widths must "
            "split evenly (start-up names a dimension that does not; the vocabulary is padded); "
            "quantized checkpoints' packed tensors must split on their pack and group "
            "boundaries."
        ),
        ge=1,
    )
    max_num_seqs: int = _system(
        256,
        "MAX_NUM_SEQS",
        title="Max Number of Sequences",
        description=(
            "Most requests the engine runs in one step; the rest wait in its queue. A hybrid "
            "model (recurrent layers) keeps a state per running request: this many states are "
            "reserved at start, fewer when memory is short."
        ),
        ge=1,
    )
    scheduling_policy: str = _system(
        "fcfs",
        "SCHEDULING_POLICY",
        title="Scheduling Policy",
        description=(
            "How waiting requests are ordered (vLLM's `--scheduling-policy`). `fcfs`: first come, "
            "first served; a request's non-zero `priority` is refused. `priority`: by the "
            "request's `priority` (an integer, lower first; 0 when unset), then arrival; when "
            "the KV cache runs out, the running request with the largest priority value (the "
            "latest among equals) is preempted first."
        ),
        choices=SCHEDULING_POLICIES,
    )
    max_num_batched_tokens: int | None = _system(
        None,
        "MAX_NUM_BATCHED_TOKENS",
        title="Max Batched Tokens",
        description=(
            "Token budget of one engine step (long prompts are prefilled in chunks of at most "
            "this). Unset: 8192 on GPU, 2048 on CPU."
        ),
        ge=1,
    )
    disable_hybrid_kv_cache_manager: bool = _system(
        False,
        "DISABLE_HYBRID_KV_CACHE_MANAGER",
        title="Disable Hybrid KV Cache Manager",
        description=(
            "Keep every token of every layer in one cache group, sliding-window layers "
            "included (vLLM's `--disable-hybrid-kv-cache-manager`): the same outputs, with "
            "the cache memory sliding windows would save spent instead (docs/engine.md)."
        ),
    )
    enable_chunked_prefill: bool = _system(
        True,
        "ENABLE_CHUNKED_PREFILL",
        title="Enable Chunked Prefill",
        description=(
            "Always on: a step's token budget (MAX_NUM_BATCHED_TOKENS) is shared by decodes and "
            "prompt chunks, and a prompt longer than it is prefilled over several steps; the "
            "engine has no separate prefill phase to fall back to. `true` is accepted; `false` "
            "stops start-up with this reason."
        ),
    )
    max_num_partial_prefills: int = _system(
        1,
        "MAX_NUM_PARTIAL_PREFILLS",
        title="Max Partial Prefills",
        description=(
            "How many prompts may be prefilled side by side in one step (vLLM's "
            "`--max-num-partial-prefills`). 1: one at a time, in arrival order; the prompt being "
            "prefilled takes the step's remaining budget. N > 1: up to N prompts progress "
            "together, each chunk at most MAX_NUM_BATCHED_TOKENS / N tokens, so short prompts "
            "are not held behind a long one."
        ),
        ge=1,
    )
    enable_prefix_caching: bool = _system(
        True,
        "ENABLE_PREFIX_CACHING",
        title="Enable Prefix Caching",
        description=(
            "Reuse the KV cache of prompt prefixes shared between requests (system prompts, "
            "chat history)."
        ),
    )
    attention_backend: str = _system(
        "auto",
        "ATTENTION_BACKEND",
        title="Attention Backend",
        description=(
            "`auto` picks the best available for the device: `triton` (the GPU kernels) on "
            "CUDA; on CPU `native`, the CPU kernels compiled with the system C compiler at the "
            "first start, or `torch` (the reference implementation) where they cannot be built."
        ),
        choices=ATTENTION_BACKENDS,
    )
    device: str = _system(
        "auto",
        "DEVICE",
        title="Device",
        description="`auto` (CUDA when available, else CPU), `cpu`, `cuda` or `cuda:N`.",
        allowed="auto, cpu, cuda or cuda:N",
    )
    cpu_kv_cache_space: float = _system(
        4.0,
        "CPU_KV_CACHE_SPACE",
        "VLLM_CPU_KV_CACHE_SPACE",
        title="CPU KV Cache Space",
        description=(
            "Size of the KV cache in GiB when running on CPU (with a hybrid model's recurrent "
            "states, as GPU_MEMORY_UTILIZATION's share)."
        ),
        gt=0.0,
        allow_inf_nan=False,
    )
    num_gpu_blocks_override: int | None = _system(
        None,
        "NUM_GPU_BLOCKS_OVERRIDE",
        "NUM_KV_BLOCKS",
        title="KV Cache Blocks Override",
        description=(
            "Exact number of KV cache blocks, overriding GPU_MEMORY_UTILIZATION and "
            "CPU_KV_CACHE_SPACE (testing and debugging). With sliding-window layers a block "
            "spans one cache group's layers, not every layer (docs/engine.md, cache groups)."
        ),
        ge=1,
    )

    # -- Streaming Settings -----------------------------------------------------------------
    default_batch_size: int = _streaming(
        50,
        "DEFAULT_BATCH_SIZE",
        title="Default Batch Size",
        description=(
            "Most tokens sent in one streamed message (the largest batch). Jobs may override it "
            "with `max_batch_size`."
        ),
        ge=1,
    )
    default_min_batch_size: int = _streaming(
        1,
        "DEFAULT_MIN_BATCH_SIZE",
        "MIN_BATCH_SIZE",
        title="Default Min Batch Size",
        description=(
            "Tokens in the first streamed message; each next one is multiplied by the growth "
            "factor up to DEFAULT_BATCH_SIZE (1, 3, 9, 27, 50, 50, ... by default). Jobs may "
            "override it with `min_batch_size`."
        ),
        ge=1,
    )
    default_batch_size_growth_factor: float = _streaming(
        3.0,
        "DEFAULT_BATCH_SIZE_GROWTH_FACTOR",
        "BATCH_SIZE_GROWTH_FACTOR",
        title="Default Batch Size Growth Factor",
        description=(
            "Factor by which each streamed message grows; 1 or less means every message holds "
            "DEFAULT_BATCH_SIZE tokens. Jobs may override it with `batch_size_growth_factor`."
        ),
        gt=0.0,
        allow_inf_nan=False,
    )

    # -- OpenAI Settings --------------------------------------------------------------------
    raw_openai_output: bool = _openai(
        True,
        "RAW_OPENAI_OUTPUT",
        title="Raw OpenAI Output",
        description=(
            "Streamed OpenAI jobs yield SSE text (`data: {...}\\n\\n`), as the `/openai/v1` "
            "route needs; off, they yield lists of chunk objects."
        ),
    )
    openai_served_model_name_override: str | None = _openai(
        None,
        "OPENAI_SERVED_MODEL_NAME_OVERRIDE",
        title="Served Model Name",
        description=(
            "The model name clients send and `/v1/models` lists. Unset: MODEL_NAME (a local "
            "path's last component, never a path; the repo id it was built with for a baked "
            f"image; `{EMBEDDED_MODEL_NAME}` for the embedded model). Requests naming the model "
            "as MODEL_NAME is written (a path as given, or its last component) are served too. "
            "Several names may be given, separated by commas or spaces, as SERVED_MODEL_NAME."
        ),
        min_length=1,
    )
    served_names: str | None = _openai(
        None,
        "SERVED_MODEL_NAME",
        title="Served Model Names",
        description=(
            "vLLM's `--served-model-name`: one or more names the model answers to, separated by "
            "commas or spaces (`my-model,my-model-v2` or `my-model my-model-v2`). `/v1/models` "
            "lists the first, then the others; responses echo the name the request used. With "
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE set too, its names come first."
        ),
        min_length=1,
    )
    openai_response_role: str = _openai(
        "assistant",
        "OPENAI_RESPONSE_ROLE",
        title="Response Role",
        description="Role of the model's messages in chat completions.",
        min_length=1,
    )
    enable_auto_tool_choice: bool = _openai(
        True,
        "ENABLE_AUTO_TOOL_CHOICE",
        title="Enable Auto Tool Choice",
        description=(
            'Let chat requests with `tools` use `tool_choice: "auto"`, the default then, as '
            "OpenAI's: the model's text is parsed into `tool_calls` by TOOL_CALL_PARSER, or by "
            "the parser its chat template calls for when that is unset (a template that ignores "
            "tools gets them described in a system message, in the hermes format). Off, `tools` "
            'alone mean `"none"`. Named and `required` tool choices work either way.'
        ),
    )
    tool_call_parser: str | None = _openai(
        None,
        "TOOL_CALL_PARSER",
        title="Tool Call Parser",
        description=(
            'How the model writes tool calls, for `tool_choice: "auto"`: `hermes`, '
            "`mistral`, `llama3_json`, `internlm`, `jamba`, `qwen3_coder`, `pythonic`, "
            "`granite`, `deepseek_v3`, `deepseek_v31`, `kimi_k2`, `glm45` (vLLM's names), or a "
            "name TOOL_PARSER_PLUGIN registers. Unset: read from the chat template's markers "
            "(docs/api.md lists them; `<tool_call>` alone: hermes)."
        ),
        min_length=1,
    )
    reasoning_parser: str | None = _openai(
        None,
        "REASONING_PARSER",
        title="Reasoning Parser",
        description=(
            "Splits a reasoning model's `<think>...</think>` text from its answer into chat's "
            "`reasoning_content`: `deepseek_r1` (everything before `</think>` is reasoning), "
            "`qwen3` and `glm45` (only a `<think>` block that opens the output), "
            "`deepseek_v3` (V3.1: as deepseek_r1 when the chat template kwarg `thinking` is "
            "true, else all content), `granite` (\"Here is my thought process:\" ... \"Here "
            "is my response:\"), or `none`. Unset: read from the chat template (docs/api.md)."
        ),
        choices=("deepseek_r1", "qwen3", "glm45", "deepseek_v3", "granite", "none"),
    )
    structured_outputs_enable_in_reasoning: bool = _openai(
        False,
        "STRUCTURED_OUTPUTS_ENABLE_IN_REASONING",
        title="Structured Output In Reasoning",
        description=(
            "With a reasoning parser on, structured output (response_format, guided_*, forced "
            "tool calls) constrains only the answer: the model thinks freely until `</think>`, "
            "then the constraint starts (vLLM's behaviour). On: the constraint applies from "
            "the first token, reasoning included (vLLM's "
            "`--structured-outputs-config.enable_in_reasoning`)."
        ),
    )
    tool_parser_plugin: str | None = _openai(
        None,
        "TOOL_PARSER_PLUGIN",
        title="Tool Parser Plugin",
        description=(
            "Path of a Python file that registers more tool call parsers (a `ToolParser` "
            'subclass with `@register_tool_parser("name")`, or a `TOOL_PARSERS` dict); loaded '
            "at startup, before TOOL_CALL_PARSER is checked."
        ),
        min_length=1,
    )
    responses_store_max_count: int = _openai(
        DEFAULT_STORE_MAX_COUNT,
        "RESPONSES_STORE_MAX_COUNT",
        title="Responses Store Max Count",
        description=(
            "Most responses `/v1/responses` keeps in the worker's memory (for "
            "`previous_response_id` and GET/DELETE `/v1/responses/{id}`), the oldest dropped "
            "first; a dropped id is a 404. 0: keep none. Not used with RESPONSES_STORE_URL."
        ),
        ge=0,
    )
    responses_store_max_bytes: int = _openai(
        DEFAULT_STORE_MAX_BYTES,
        "RESPONSES_STORE_MAX_BYTES",
        title="Responses Store Max Bytes",
        description=(
            "Most bytes (of stored JSON: each response with the input it answered) the "
            "in-memory responses store holds, the oldest dropped first; a response larger "
            "than this on its own is not kept. Not used with RESPONSES_STORE_URL."
        ),
        ge=0,
    )
    responses_store_url: SecretStr | None = _openai(
        None,
        "RESPONSES_STORE_URL",
        title="Responses Store URL",
        description=(
            "A Redis URL (`redis://[:password@]host:6379/0`, `rediss://...` for TLS, "
            "`unix:///path.sock`) where `/v1/responses` keeps responses instead of the "
            "worker's memory, so a `previous_response_id` follow-up, GET or DELETE reaches them "
            "on any worker of the endpoint. Never written to any log."
        ),
        allowed="a redis://, rediss:// or unix:// URL",
    )
    responses_store_ttl_seconds: int = _openai(
        DEFAULT_STORE_TTL_SECONDS,
        "RESPONSES_STORE_TTL_SECONDS",
        title="Responses Store TTL Seconds",
        description=(
            "How long Redis keeps a stored response (RESPONSES_STORE_URL); 30 days by default, "
            "as OpenAI. 0: until deleted (or evicted by Redis's own maxmemory policy)."
        ),
        ge=0,
    )

    # -- Serverless Settings ----------------------------------------------------------------
    max_concurrency: int = _serverless(
        300,
        "MAX_CONCURRENCY",
        title="Max Concurrency",
        description=(
            "Most jobs one worker takes at once. The engine queues what does not fit in a step, "
            "so this tunes load balancing across workers, not memory."
        ),
        ge=1,
    )
    shutdown_grace_seconds: float = _serverless(
        30.0,
        "SHUTDOWN_GRACE_SECONDS",
        title="Shutdown Grace Seconds",
        description=(
            "On SIGTERM or SIGINT the worker (and the local endpoint) stops taking new jobs "
            "(they get a shutdown error, 503 on OpenAI routes) and lets running ones finish for "
            "up to this long; then it ends the rest with an error and exits 0. A second signal "
            "exits at once."
        ),
        ge=0,
    )
    disable_log_stats: bool = _serverless(
        True,
        "DISABLE_LOG_STATS",
        title="Disable Log Stats",
        description=(
            "Off: log engine statistics (jobs, queued and running requests, KV cache use) every "
            "10 seconds while busy."
        ),
    )
    enable_metrics: bool = _serverless(
        True,
        "ENABLE_METRICS",
        title="Enable Metrics",
        description=(
            "Prometheus metrics at `/metrics` (and the `/metrics` openai_route): requests by "
            "finish reason, tokens, queue and KV cache load, latency histograms (docs/api.md). "
            "Off: the engine's outputs are not observed and `/metrics` answers 404."
        ),
    )
    disable_log_requests: bool = _serverless(
        True,
        "DISABLE_LOG_REQUESTS",
        title="Disable Log Requests",
        description=(
            "Off: log each job's route, prompt length and sampling parameters (never the prompt "
            "text)."
        ),
    )

    # -- Request Limits ---------------------------------------------------------------------
    max_prompt_chars: int = _limits(
        1_000_000,
        "MAX_PROMPT_CHARS",
        title="Max Prompt Characters",
        description=(
            "Most characters of prompt text one request may send (all its prompts or all its "
            "messages), checked before tokenizing. About 250k tokens of English. 0: no limit."
        ),
        ge=0,
    )
    max_messages: int = _limits(
        2048,
        "MAX_MESSAGES",
        title="Max Messages",
        description="Most chat messages in one request. 0: no limit.",
        ge=0,
    )
    max_stop_strings: int = _limits(
        64,
        "MAX_STOP_STRINGS",
        title="Max Stop Strings",
        description="Most stop strings in one request (each is matched after every token). "
        "0: no limit.",
        ge=0,
    )
    max_logit_bias: int = _limits(
        1024,
        "MAX_LOGIT_BIAS",
        title="Max Logit Bias Entries",
        description="Most logit_bias entries in one request. 0: no limit.",
        ge=0,
    )
    max_tools: int = _limits(
        128,
        "MAX_TOOLS",
        title="Max Tools",
        description="Most tool definitions in one chat request (OpenAI's own limit). 0: no limit.",
        ge=0,
    )
    max_n: int = _limits(
        128,
        "MAX_N",
        title="Max n / best_of",
        description=(
            "Largest n or best_of one request may ask for: each choice is a sequence of its "
            "own. 0: no limit."
        ),
        ge=0,
    )
    max_prompts: int = _limits(
        256,
        "MAX_PROMPTS",
        title="Max Prompts",
        description=(
            "Most prompts in one /v1/completions request (a list of prompts): each runs n "
            "sequences of its own. 0: no limit."
        ),
        ge=0,
    )
    grammar_compile_timeout: float = _limits(
        15.0,
        "GRAMMAR_COMPILE_TIMEOUT",
        title="Grammar Compile Timeout",
        description=(
            "Seconds one structured-output grammar (guided_json, guided_regex, guided_grammar, "
            "guided_choice, response_format, tools) may take to compile. Compiling runs in a "
            "separate low-priority process, which is killed at the limit or when no request "
            "waits for it any more; the request gets a 400. 0: no limit."
        ),
        ge=0,
    )
    grammar_max_chars: int = _limits(
        262144,
        "GRAMMAR_MAX_CHARS",
        title="Grammar Max Characters",
        description=(
            "Most characters of JSON schema, regex, grammar or choices one structured-output "
            "request may send, refused before compiling. 0: no limit."
        ),
        ge=0,
    )

    # -- Multimodal Settings ----------------------------------------------------------------
    limit_mm_per_prompt: str = _multimodal(
        '{"image": 1}',
        "LIMIT_MM_PER_PROMPT",
        title="Limit Multimodal Items Per Prompt",
        description=(
            "Most images one prompt of a vision-language model may carry (all messages of a "
            'chat together), as vLLM writes it: JSON such as `{"image": 4}` (or '
            '`{"image": {"count": 4}}`), or `image=4`. A modality not named allows 1, vLLM\'s '
            "default; 0 refuses that modality. A request over it is a 400 naming the limit, "
            "before any image is fetched. Video and audio inputs are refused whatever it says."
        ),
        allowed='a JSON object of counts by modality (`{"image": 4}`) or `image=4`',
    )
    max_image_bytes: int = _multimodal(
        DEFAULT_MAX_IMAGE_BYTES,
        "MAX_IMAGE_BYTES",
        title="Max Image Bytes",
        description=(
            "Largest image file one request part may send or point to (20 MiB by default), "
            "checked before decoding: a data URL's size, a fetched body as it arrives, a local "
            f"file's size. Images are also refused above {MAX_IMAGE_PIXELS:,} pixels "
            "(8192 x 8192), read from the file's header before any pixel is decoded."
        ),
        ge=1,
    )
    media_fetch_timeout: float = _multimodal(
        DEFAULT_MEDIA_FETCH_TIMEOUT,
        "MEDIA_FETCH_TIMEOUT",
        "VLLM_IMAGE_FETCH_TIMEOUT",
        title="Media Fetch Timeout",
        description=(
            "Seconds one image URL may take to fetch, from the name lookup to the last byte, "
            "redirects included (vLLM's VLLM_IMAGE_FETCH_TIMEOUT, also read). Past it the "
            "request gets a 400."
        ),
        gt=0.0,
        allow_inf_nan=False,
    )
    allow_private_image_urls: bool = _multimodal(
        False,
        "ALLOW_PRIVATE_IMAGE_URLS",
        title="Allow Private Image URLs",
        description=(
            "Fetch image URLs whose host is a loopback, link-local, private, shared, reserved "
            "or multicast address (the worker's own network, the cloud metadata service). Off: "
            "such a URL, or a redirect to one, is a 400; every address a name resolves to is "
            "checked, and the fetch goes to the checked address."
        ),
    )
    allowed_local_media_path: str | None = _multimodal(
        None,
        "ALLOWED_LOCAL_MEDIA_PATH",
        title="Allowed Local Media Path",
        description=(
            "A directory whose images requests may name as `file://` URLs (vLLM's "
            "--allowed-local-media-path); files outside it, symlinks leading out included, are "
            "refused. Unset: file URLs are refused."
        ),
        allowed="an absolute path of an existing directory",
    )

    @field_validator("*", mode="after")
    @classmethod
    def _check_choices(cls, value: Any, info: Any) -> Any:
        extra = field_extra(cls.model_fields[info.field_name])
        choices = extra.get("choices")
        if choices is not None and value is not None and value not in choices:
            raise ValueError(CHOICES_MSG)
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _check_json_object(cls, value: Any, info: Any) -> Any:
        if value is not None and field_extra(cls.model_fields[info.field_name]).get("json_object"):
            parse_json_object(value)
        return value

    @field_validator("generation_config", mode="after")
    @classmethod
    def _check_generation_config(cls, value: str) -> str:
        if value not in ("auto", "vllm") and not os.path.isfile(
            os.path.join(value, GENERATION_CONFIG_FILE)
        ):
            raise ValueError(f"not auto, vllm or a directory holding {GENERATION_CONFIG_FILE}")
        return value

    @field_validator("override_generation_config", mode="after")
    @classmethod
    def _check_override_generation_config(cls, value: str | None) -> str | None:
        if value is not None:
            for name, v in parse_json_object(value).items():
                if name not in DEFAULTABLE:
                    raise ValueError(f"{name!r} cannot be set; keys: {', '.join(DEFAULTABLE)}")
                check_value(name, v)
        return value

    @field_validator("lora_modules", mode="after")
    @classmethod
    def _check_lora_modules(cls, value: str | None) -> str | None:
        if value is not None:
            parse_lora_modules(value)
        return value

    @field_validator("limit_mm_per_prompt", mode="after")
    @classmethod
    def _check_limit_mm_per_prompt(cls, value: str) -> str:
        parse_limit_mm_per_prompt(value)
        return value

    @field_validator("allowed_local_media_path", mode="after")
    @classmethod
    def _check_allowed_local_media_path(cls, value: str | None) -> str | None:
        if value is not None and not (os.path.isabs(value) and os.path.isdir(value)):
            raise ValueError("not an existing directory")
        return value

    @field_validator("responses_store_url", mode="after")
    @classmethod
    def _check_responses_store_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            check_store_url(value.get_secret_value())
        return value

    @field_validator("device", mode="after")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE_RE.match(value):
            raise ValueError("not a device")
        return value


def parse_json_object(text: str) -> dict[str, Any]:
    """A JSON-object setting's value; ValueError naming where the JSON breaks."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos})"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"must be a JSON object, got {type(data).__name__}")
    return data


def parse_lora_modules(text: str) -> list[dict[str, str | None]]:
    """LORA_MODULES as [{"name", "path", "base_model_name"}]: worker-vllm's JSON (one object
    or a list) or vLLM's `name=path` pairs; ValueError saying what is wrong."""
    text = text.strip()
    if not text:
        return []
    if text[0] in "[{":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"not valid JSON ({e})") from None
        items = data if isinstance(data, list) else [data]
        out = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise ValueError('each adapter must be an object with "name" and "path"')
            if not isinstance(item.get("path"), str) or not item["path"]:
                raise ValueError(f'adapter {item["name"]!r} has no "path"')
            unknown = set(item) - {"name", "path", "base_model_name"}
            if unknown:
                raise ValueError(f"adapter {item['name']!r}: unknown keys {sorted(unknown)}")
            out.append(
                {
                    "name": item["name"],
                    "path": item["path"],
                    "base_model_name": item.get("base_model_name"),
                }
            )
    else:
        out = []
        for pair in re.split(r"[\s,]+", text):
            name, sep, path = pair.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"{pair!r} is not name=path")
            out.append({"name": name, "path": path, "base_model_name": None})
    names = [m["name"] for m in out]
    if len(set(names)) != len(names):
        raise ValueError("adapter names must be unique")
    return out


# -- what a field is, in words -----------------------------------------------------------------


def field_extra(field: FieldInfo) -> dict[str, Any]:
    """The metadata `_setting` stored: env, aliases, category, and choices or allowed."""
    extra = field.json_schema_extra
    return extra if isinstance(extra, dict) else {}


# Every name a setting is read under (its env name and aliases) -> the field's name.
ENV_TO_FIELD: dict[str, str] = {
    env: name
    for name, field in SettingsFields.model_fields.items()
    for env in (field_extra(field)["env"], *field_extra(field)["aliases"])
}


def field_kind(field: FieldInfo) -> str:
    """The field's type: SecretStr, bool, int, float or str."""
    ann = field.annotation
    text = getattr(ann, "__name__", None) or str(ann)
    for kind in ("SecretStr", "bool", "int", "float", "str"):
        if kind in text:
            return kind
    return "str"


def _bounds(field: FieldInfo) -> str:
    parts = []
    for m in field.metadata:
        if isinstance(m, annotated_types.Ge):
            parts.append(f">= {m.ge:g}")
        elif isinstance(m, annotated_types.Gt):
            parts.append(f"> {m.gt:g}")
        elif isinstance(m, annotated_types.Le):
            parts.append(f"<= {m.le:g}")
        elif isinstance(m, annotated_types.Lt):
            parts.append(f"< {m.lt:g}")
    return " and ".join(parts)


def allowed_values(field: FieldInfo) -> str:
    """What a setting accepts, in words (for errors and the docs)."""
    extra = field_extra(field)
    if "allowed" in extra:
        return extra["allowed"]
    if "choices" in extra:
        return "one of " + ", ".join(str(c) for c in extra["choices"])
    kind = field_kind(field)
    bounds = _bounds(field)
    if kind == "bool":
        return "0, 1, true or false"
    if kind == "int":
        return f"an integer {bounds}".rstrip()
    if kind == "float":
        return f"a number {bounds}".rstrip()
    return (
        "a non-empty string"
        if any(isinstance(m, annotated_types.MinLen) for m in field.metadata)
        else "a string"
    )


def shown_value(settings: SettingsFields, env: str) -> str:
    """The value of the setting read under `env`, as logs show it: `***` for a secret."""
    value = getattr(settings, ENV_TO_FIELD[env])
    if isinstance(value, SecretStr):
        return "***"
    return repr(value) if isinstance(value, str) else str(value)

"""Every environment variable the worker reads, validated once at start-up.

The deployed worker is configured only by env vars (the RunPod console writes them), so this
module is the worker's whole configuration surface: each setting carries its env name, aliases,
title, description, type, default and console category as first-class metadata. `docs/settings.md`
(`python -m serverless_llm.worker.settings --markdown`) and, later, the console form
`worker-config.json` are generated from it, so code and documentation cannot drift.

A bad value stops start-up with one line naming the variable, the value and what is allowed.
A setting the engine cannot honour yet is never dropped silently: `Settings.limitations()` lists
it, as a warning when the worker still serves the same outputs without it (a performance or
memory knob) and as an error when it would change what is served (see `_LIMITS`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import annotated_types
from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from ..engine.config import (
    ATTENTION_BACKENDS,
    BLOCK_SIZES,
    DTYPE_CHOICES,
    LOAD_FORMATS,
    ConfigError,
    EngineConfig,
)
from .batching import BatchSizes

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_BASE_PATH = "/runpod-volume"

# Console categories, in the order the form and the docs show them.
LLM = "LLM Settings"
TOKENIZER = "Tokenizer Settings"
SYSTEM = "System Settings"
STREAMING = "Streaming Settings"
OPENAI = "OpenAI Settings"
SERVERLESS = "Serverless Settings"
CATEGORIES = (LLM, TOKENIZER, SYSTEM, STREAMING, OPENAI, SERVERLESS)

QUANTIZATION_METHODS = (
    "awq",
    "gptq",
    "squeezellm",
    "fp8",
    "bitsandbytes",
    "marlin",
    "awq_marlin",
    "gptq_marlin",
    "compressed-tensors",
)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class SettingsError(ValueError):
    """A setting has a value the worker cannot start with. str() is one line naming the
    variable, the value and what is allowed, printed as the worker's last words."""


def _setting(
    default: Any,
    env: str,
    *aliases: str,
    title: str,
    description: str,
    category: str,
    choices: tuple[Any, ...] | None = None,
    allowed: str | None = None,
    **constraints: Any,
) -> Any:
    """A Field whose metadata the docs and the console form are generated from. `env` is the
    documented name; `aliases` are other names read too (first one set wins, `env` first)."""
    extra: dict[str, Any] = {"category": category, "env": env, "aliases": list(aliases)}
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


class Settings(BaseSettings):
    """The worker's configuration, read from the environment (`Settings.from_env()`)."""

    model_config = SettingsConfigDict(
        env_ignore_empty=True,  # the console sends "" for a field left blank: that is unset
        extra="ignore",
        populate_by_name=True,
        validate_default=False,
    )

    # -- LLM Settings -----------------------------------------------------------------------
    model_name: str | None = _setting(
        None,
        "MODEL_NAME",
        title="Model",
        description=(
            "Hugging Face repo id (e.g. `Qwen/Qwen2.5-0.5B-Instruct`), local directory or `.gguf` "
            "file of the model to serve. Required by the deployed worker, unless the image has a "
            "model baked in; the local devserver serves the embedded "
            f"{EMBEDDED_MODEL_NAME} (GGUF) when it is unset."
        ),
        category=LLM,
    )
    model_revision: str | None = _setting(
        None,
        "MODEL_REVISION",
        title="Model Revision",
        description="Branch, tag or commit of the model repo. Unset: `main`.",
        category=LLM,
    )
    max_model_len: int | None = _setting(
        None,
        "MAX_MODEL_LEN",
        title="Max Model Length",
        description=(
            "Most tokens (prompt plus output) one request may hold. Unset: the model's maximum."
        ),
        category=LLM,
        ge=1,
    )
    base_path: str = _setting(
        DEFAULT_BASE_PATH,
        "BASE_PATH",
        title="Base Path",
        description=(
            "Storage root: models are downloaded to `<BASE_PATH>/huggingface-cache/hub`. "
            "`/runpod-volume` is the network volume when one is attached, so one worker downloads "
            "and all load. If the default cannot be written (a local run), the Hugging Face "
            "cache is used instead."
        ),
        category=LLM,
        min_length=1,
    )
    load_format: str = _setting(
        "auto",
        "LOAD_FORMAT",
        title="Load Format",
        description=(
            "Weight format to load: `auto` (safetensors, else PyTorch .bin, or a .gguf file), "
            "`safetensors`, `pt`, `gguf` (dequantized once at load), or `dummy` (random weights, "
            "for testing)."
        ),
        category=LLM,
        choices=LOAD_FORMATS,
    )
    hf_token: SecretStr | None = _setting(
        None,
        "HF_TOKEN",
        title="Hugging Face Token",
        description="Token for private or gated models. Never written to any log.",
        category=LLM,
    )
    quantization: str | None = _setting(
        None,
        "QUANTIZATION",
        title="Quantization",
        description=(
            "Quantization method of an already quantized checkpoint. Not supported yet: setting "
            "it stops start-up (use an unquantized model, or a `.gguf` file)."
        ),
        category=LLM,
        choices=QUANTIZATION_METHODS,
    )
    trust_remote_code: bool = _setting(
        False,
        "TRUST_REMOTE_CODE",
        title="Trust Remote Code",
        description=(
            "Allow code from the model repo when reading its config and tokenizer. The model "
            "itself always runs this engine's own implementation."
        ),
        category=LLM,
    )
    seed: int = _setting(
        0,
        "SEED",
        title="Seed",
        description="Seed of the engine's random generators (requests may set their own).",
        category=LLM,
        ge=0,
    )
    kv_cache_dtype: str = _setting(
        "auto",
        "KV_CACHE_DTYPE",
        title="KV Cache Data Type",
        description=(
            "Data type of the KV cache; `auto` uses the model's. fp8 is not supported yet: "
            "another value is reported at start-up and the cache keeps the model's dtype."
        ),
        category=LLM,
        choices=KV_CACHE_DTYPES,
    )
    dtype: str = _setting(
        "auto",
        "DTYPE",
        title="Data Type",
        description=(
            "Precision of weights and activations. `auto`: the checkpoint's (float16 on GPU for "
            "float32 checkpoints, float32 on CPU)."
        ),
        category=LLM,
        choices=DTYPE_CHOICES,
    )

    # -- Tokenizer Settings -----------------------------------------------------------------
    tokenizer_name: str | None = _setting(
        None,
        "TOKENIZER_NAME",
        title="Tokenizer",
        description="Repo id or directory of a tokenizer to use instead of the model's own.",
        category=TOKENIZER,
    )
    tokenizer_revision: str | None = _setting(
        None,
        "TOKENIZER_REVISION",
        title="Tokenizer Revision",
        description="Branch, tag or commit of the tokenizer repo.",
        category=TOKENIZER,
    )
    custom_chat_template: str | None = _setting(
        None,
        "CUSTOM_CHAT_TEMPLATE",
        title="Custom Chat Template",
        description=(
            "Jinja chat template that replaces the model's, for chat requests on both routes."
        ),
        category=TOKENIZER,
    )

    # -- System Settings --------------------------------------------------------------------
    gpu_memory_utilization: float = _setting(
        0.95,
        "GPU_MEMORY_UTILIZATION",
        title="GPU Memory Utilization",
        description=(
            "Fraction of GPU memory the engine may use (weights, activations and KV cache); the "
            "KV cache gets what is left after a profiling pass. No effect on CPU."
        ),
        category=SYSTEM,
        gt=0.0,
        le=1.0,
        allow_inf_nan=False,
    )
    max_parallel_loading_workers: int | None = _setting(
        None,
        "MAX_PARALLEL_LOADING_WORKERS",
        title="Max Parallel Loading Workers",
        description=(
            "Load the model in batches with this many workers (matters with tensor "
            "parallelism only). Not supported yet: a value is reported at start-up."
        ),
        category=SYSTEM,
        ge=1,
    )
    block_size: int = _setting(
        16,
        "BLOCK_SIZE",
        title="Block Size",
        description="Tokens per KV cache block.",
        category=SYSTEM,
        choices=BLOCK_SIZES,
    )
    swap_space: float = _setting(
        0.0,
        "SWAP_SPACE",
        title="Swap Space",
        description=(
            "CPU memory (GiB) to swap preempted requests to. Preempted requests are recomputed "
            "instead; swapping is not supported yet and a value above 0 is reported at start-up."
        ),
        category=SYSTEM,
        ge=0.0,
        allow_inf_nan=False,
    )
    enforce_eager: bool = _setting(
        False,
        "ENFORCE_EAGER",
        title="Enforce Eager",
        description=(
            "Always run eagerly, without CUDA graphs. The engine does not capture CUDA graphs "
            "yet, so it always runs eagerly."
        ),
        category=SYSTEM,
    )
    max_seq_len_to_capture: int = _setting(
        8192,
        "MAX_SEQ_LEN_TO_CAPTURE",
        "MAX_CONTEXT_LEN_TO_CAPTURE",
        title="Max Sequence Length to Capture",
        description=(
            "Longest context covered by CUDA graphs. Not supported yet (no CUDA graphs): a value "
            "set explicitly is reported at start-up."
        ),
        category=SYSTEM,
        ge=1,
    )
    disable_custom_all_reduce: bool = _setting(
        False,
        "DISABLE_CUSTOM_ALL_REDUCE",
        title="Disable Custom All-Reduce",
        description=(
            "Disable the custom all-reduce kernel of tensor parallelism. The engine runs on one "
            "device and never all-reduces, so either value is honoured."
        ),
        category=SYSTEM,
    )
    tensor_parallel_size: int = _setting(
        1,
        "TENSOR_PARALLEL_SIZE",
        title="Tensor Parallel Size",
        description=(
            "Number of GPUs to shard the model over. Not supported yet: a value above 1 is "
            "reported at start-up and the model runs on one device."
        ),
        category=SYSTEM,
        ge=1,
    )
    max_num_seqs: int = _setting(
        256,
        "MAX_NUM_SEQS",
        title="Max Number of Sequences",
        description="Most requests the engine runs in one step; the rest wait in its queue.",
        category=SYSTEM,
        ge=1,
    )
    max_num_batched_tokens: int | None = _setting(
        None,
        "MAX_NUM_BATCHED_TOKENS",
        title="Max Batched Tokens",
        description=(
            "Token budget of one engine step (long prompts are prefilled in chunks of at most "
            "this). Unset: 8192 on GPU, 2048 on CPU."
        ),
        category=SYSTEM,
        ge=1,
    )
    enable_prefix_caching: bool = _setting(
        True,
        "ENABLE_PREFIX_CACHING",
        title="Enable Prefix Caching",
        description=(
            "Reuse the KV cache of prompt prefixes shared between requests (system prompts, "
            "chat history)."
        ),
        category=SYSTEM,
    )
    attention_backend: str = _setting(
        "auto",
        "ATTENTION_BACKEND",
        title="Attention Backend",
        description=(
            "`auto` picks the best available for the device; `torch` is the reference "
            "implementation, `triton` the GPU kernels."
        ),
        category=SYSTEM,
        choices=ATTENTION_BACKENDS,
    )
    device: str = _setting(
        "auto",
        "DEVICE",
        title="Device",
        description="`auto` (CUDA when available, else CPU), `cpu`, `cuda` or `cuda:N`.",
        category=SYSTEM,
        allowed="auto, cpu, cuda or cuda:N",
    )
    cpu_kv_cache_space: float = _setting(
        4.0,
        "CPU_KV_CACHE_SPACE",
        "VLLM_CPU_KV_CACHE_SPACE",
        title="CPU KV Cache Space",
        description="Size of the KV cache in GiB when running on CPU.",
        category=SYSTEM,
        gt=0.0,
        allow_inf_nan=False,
    )
    num_gpu_blocks_override: int | None = _setting(
        None,
        "NUM_GPU_BLOCKS_OVERRIDE",
        "NUM_KV_BLOCKS",
        title="KV Cache Blocks Override",
        description=(
            "Exact number of KV cache blocks, overriding GPU_MEMORY_UTILIZATION and "
            "CPU_KV_CACHE_SPACE (testing and debugging)."
        ),
        category=SYSTEM,
        ge=1,
    )

    # -- Streaming Settings -----------------------------------------------------------------
    default_batch_size: int = _setting(
        50,
        "DEFAULT_BATCH_SIZE",
        title="Default Batch Size",
        description=(
            "Most tokens sent in one streamed message (the largest batch). Jobs may override it "
            "with `max_batch_size`."
        ),
        category=STREAMING,
        ge=1,
    )
    default_min_batch_size: int = _setting(
        1,
        "DEFAULT_MIN_BATCH_SIZE",
        "MIN_BATCH_SIZE",
        title="Default Min Batch Size",
        description=(
            "Tokens in the first streamed message; each next one is multiplied by the growth "
            "factor up to DEFAULT_BATCH_SIZE (1, 3, 9, 27, 50, 50, ... by default). Jobs may "
            "override it with `min_batch_size`."
        ),
        category=STREAMING,
        ge=1,
    )
    default_batch_size_growth_factor: float = _setting(
        3.0,
        "DEFAULT_BATCH_SIZE_GROWTH_FACTOR",
        "BATCH_SIZE_GROWTH_FACTOR",
        title="Default Batch Size Growth Factor",
        description=(
            "Factor by which each streamed message grows; 1 or less means every message holds "
            "DEFAULT_BATCH_SIZE tokens. Jobs may override it with `batch_size_growth_factor`."
        ),
        category=STREAMING,
        gt=0.0,
        allow_inf_nan=False,
    )

    # -- OpenAI Settings --------------------------------------------------------------------
    raw_openai_output: bool = _setting(
        True,
        "RAW_OPENAI_OUTPUT",
        title="Raw OpenAI Output",
        description=(
            "Streamed OpenAI jobs yield SSE text (`data: {...}\\n\\n`), as the `/openai/v1` "
            "route needs; off, they yield lists of chunk objects."
        ),
        category=OPENAI,
    )
    openai_served_model_name_override: str | None = _setting(
        None,
        "OPENAI_SERVED_MODEL_NAME_OVERRIDE",
        title="Served Model Name",
        description=(
            "The model name clients send and `/v1/models` lists. Unset: MODEL_NAME (the repo id "
            f"it was built with for a baked image, `{EMBEDDED_MODEL_NAME}` for the embedded "
            "model)."
        ),
        category=OPENAI,
        min_length=1,
    )
    openai_response_role: str = _setting(
        "assistant",
        "OPENAI_RESPONSE_ROLE",
        title="Response Role",
        description="Role of the model's messages in chat completions.",
        category=OPENAI,
        min_length=1,
    )
    enable_auto_tool_choice: bool = _setting(
        False,
        "ENABLE_AUTO_TOOL_CHOICE",
        title="Enable Auto Tool Choice",
        description=(
            'Let chat requests with `tools` use `tool_choice: "auto"` (the default then): the '
            "model's text is parsed into `tool_calls` by TOOL_CALL_PARSER. Named and "
            "`required` tool choices work without it."
        ),
        category=OPENAI,
    )
    tool_call_parser: str | None = _setting(
        None,
        "TOOL_CALL_PARSER",
        title="Tool Call Parser",
        description=(
            'How the model writes tool calls, for `tool_choice: "auto"`: `hermes`, '
            "`mistral`, `llama3_json`, `internlm`, `jamba`, or a name TOOL_PARSER_PLUGIN "
            "registers. Needed with ENABLE_AUTO_TOOL_CHOICE."
        ),
        category=OPENAI,
        min_length=1,
    )
    tool_parser_plugin: str | None = _setting(
        None,
        "TOOL_PARSER_PLUGIN",
        title="Tool Parser Plugin",
        description=(
            "Path of a Python file that registers more tool call parsers (a `ToolParser` "
            'subclass with `@register_tool_parser("name")`, or a `TOOL_PARSERS` dict); loaded '
            "at startup, before TOOL_CALL_PARSER is checked."
        ),
        category=OPENAI,
        min_length=1,
    )

    # -- Serverless Settings ----------------------------------------------------------------
    max_concurrency: int = _setting(
        300,
        "MAX_CONCURRENCY",
        title="Max Concurrency",
        description=(
            "Most jobs one worker takes at once. The engine queues what does not fit in a step, "
            "so this tunes load balancing across workers, not memory."
        ),
        category=SERVERLESS,
        ge=1,
    )
    disable_log_stats: bool = _setting(
        True,
        "DISABLE_LOG_STATS",
        title="Disable Log Stats",
        description=(
            "Off: log engine statistics (jobs, queued and running requests, KV cache use) every "
            "10 seconds while busy."
        ),
        category=SERVERLESS,
    )
    disable_log_requests: bool = _setting(
        True,
        "DISABLE_LOG_REQUESTS",
        title="Disable Log Requests",
        description=(
            "Off: log each job's route, prompt length and sampling parameters (never the prompt "
            "text)."
        ),
        category=SERVERLESS,
    )

    # -- validation -------------------------------------------------------------------------

    @field_validator("*", mode="after")
    @classmethod
    def _check_choices(cls, value: Any, info: Any) -> Any:
        extra = _extra(cls.model_fields[info.field_name])
        choices = extra.get("choices")
        if choices is not None and value is not None and value not in choices:
            raise ValueError("not one of the choices")
        return value

    @field_validator("device", mode="after")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE_RE.match(value):
            raise ValueError("not a device")
        return value

    def _check_tool_parser(self) -> None:
        """Loads TOOL_PARSER_PLUGIN, then checks TOOL_CALL_PARSER names a parser."""
        if self.tool_parser_plugin is None and self.tool_call_parser is None:
            if self.enable_auto_tool_choice:
                raise SettingsError(
                    "ENABLE_AUTO_TOOL_CHOICE needs TOOL_CALL_PARSER (hermes, mistral, "
                    "llama3_json, internlm, jamba, or a plugin's parser)"
                )
            return
        from ..api.openai.tool_parsers import (
            ToolParserError,
            load_tool_parser_plugin,
            tool_parser_names,
        )

        if self.tool_parser_plugin is not None:
            try:
                load_tool_parser_plugin(self.tool_parser_plugin)
            except ToolParserError as e:
                raise SettingsError(str(e)) from None
            except Exception as e:
                raise SettingsError(
                    f"TOOL_PARSER_PLUGIN: loading {self.tool_parser_plugin} failed: "
                    f"{type(e).__name__}: {e}"
                ) from None
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise SettingsError("ENABLE_AUTO_TOOL_CHOICE needs TOOL_CALL_PARSER")
        if self.tool_call_parser is not None and self.tool_call_parser not in tool_parser_names():
            raise SettingsError(
                f"TOOL_CALL_PARSER={self.tool_call_parser!r} is not a tool call parser; "
                f"available: {', '.join(tool_parser_names())}"
            )

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        """Reads and validates the environment (or `environ`), raising SettingsError on the
        first problem, as one line. Settings the engine cannot honour are checked too: an
        error-level limitation raises here; warnings are for `log_startup()`."""
        env = os.environ if environ is None else environ
        try:
            if environ is None:
                settings = cls()
            else:
                # Only the variables we know, so a dict behaves exactly like the environment.
                settings = cls.model_validate(
                    {
                        k.upper(): v
                        for k, v in environ.items()
                        if k.upper() in _ENV_TO_FIELD and v != ""
                    }
                )
        except ValidationError as e:
            raise SettingsError(_format_validation_error(e, env)) from None
        errors = [lim for lim in settings.limitations() if lim.level == "error"]
        if errors:
            raise SettingsError(errors[0].message)
        settings._check_tool_parser()
        try:
            settings.engine_config()
        except ConfigError as e:
            raise SettingsError(f"invalid settings: {e}") from None
        return settings

    # -- derived values ---------------------------------------------------------------------

    @property
    def served_model_name(self) -> str:
        """The name OpenAI clients send as `model` and `/v1/models` lists."""
        return self.openai_served_model_name_override or self.model_name or EMBEDDED_MODEL_NAME

    @property
    def batch_sizes(self) -> BatchSizes:
        """The stream batch sizes of a job that sets none of its own."""
        return BatchSizes(
            max_batch_size=self.default_batch_size,
            min_batch_size=self.default_min_batch_size,
            growth_factor=self.default_batch_size_growth_factor,
        )

    @property
    def download_dir(self) -> str | None:
        """Where models are downloaded: `<BASE_PATH>/huggingface-cache/hub`, as worker-vllm
        laid it out (a network volume it populated is reused). The default BASE_PATH on a
        machine where it cannot be created (a local run) falls back to the HF cache."""
        base = os.path.expanduser(self.base_path)
        if self.base_path == DEFAULT_BASE_PATH and not _can_create(base):
            return None
        return os.path.join(base, "huggingface-cache", "hub")

    def engine_config(self) -> EngineConfig:
        """The engine's configuration from these settings. Raises ConfigError when the engine
        refuses a combination."""
        kwargs: dict[str, Any] = dict(
            model=self.model_name,
            revision=self.model_revision,
            tokenizer=self.tokenizer_name,
            tokenizer_revision=self.tokenizer_revision,
            load_format=self.load_format,
            dtype=self.dtype,
            seed=self.seed,
            trust_remote_code=self.trust_remote_code,
            download_dir=self.download_dir,
            hf_token=self.hf_token.get_secret_value() if self.hf_token else None,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_space_gib=self.cpu_kv_cache_space,
            num_kv_blocks=self.num_gpu_blocks_override,
            device=self.device,
            attention_backend=self.attention_backend,
        )
        if _engine_has("enable_prefix_caching"):
            kwargs["enable_prefix_caching"] = self.enable_prefix_caching
        return EngineConfig(**kwargs)

    # -- reporting --------------------------------------------------------------------------

    def limitations(self) -> list[Limitation]:
        """Settings whose values the engine cannot honour yet, with what happens instead."""
        return [
            Limitation(lim.env, lim.level, f"{lim.env}={self._shown(lim.env)}: {lim.message}")
            for lim in _LIMITS
            if lim.applies(self)
        ]

    def non_default(self) -> dict[str, str]:
        """Env name -> shown value of every setting that differs from its default; secrets are
        shown as `***`."""
        out: dict[str, str] = {}
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            if value != field.default:
                out[_extra(field)["env"]] = self._shown(_extra(field)["env"])
        return out

    def log_startup(self, log: logging.Logger = logger) -> None:
        """Logs the effective settings (secrets masked) and every limitation."""
        shown = ", ".join(f"{k}={v}" for k, v in self.non_default().items())
        log.info("settings: %s", shown or "all defaults")
        for lim in self.limitations():
            log.warning("%s", lim.message)

    def _shown(self, env: str) -> str:
        name = _ENV_TO_FIELD[env]
        value = getattr(self, name)
        if isinstance(value, SecretStr):
            return "***"
        return repr(value) if isinstance(value, str) else str(value)


# -- limitations of the engine, in one table --------------------------------------------------


@dataclass(frozen=True)
class Limitation:
    env: str
    level: Literal["warning", "error"]
    message: str


@dataclass(frozen=True)
class _Limit:
    """A setting the engine cannot honour yet. `error` when serving without it would change
    what the user gets (the weights could not be read as meant); `warning` when only speed,
    memory or device placement differ, so the worker still serves the same outputs."""

    env: str
    level: Literal["warning", "error"]
    applies: Callable[[Settings], bool]
    message: str


def _engine_has(field_name: str) -> bool:
    return any(f.name == field_name for f in dataclasses.fields(EngineConfig))


_LIMITS: tuple[_Limit, ...] = (
    _Limit(
        "QUANTIZATION",
        "error",
        lambda s: s.quantization is not None,
        "quantized checkpoints are not supported yet; unset QUANTIZATION and serve an "
        "unquantized model or a .gguf file (dequantized at load)",
    ),
    _Limit(
        "KV_CACHE_DTYPE",
        "warning",
        lambda s: s.kv_cache_dtype != "auto",
        "an fp8 KV cache is not supported yet; the cache uses the model's dtype (more memory, "
        "same outputs)",
    ),
    _Limit(
        "TENSOR_PARALLEL_SIZE",
        "warning",
        lambda s: s.tensor_parallel_size > 1,
        "tensor parallelism is not supported yet; the model runs on one device",
    ),
    _Limit(
        "MAX_PARALLEL_LOADING_WORKERS",
        "warning",
        lambda s: s.max_parallel_loading_workers is not None,
        "parallel loading is not supported yet; weights load in one pass",
    ),
    _Limit(
        "SWAP_SPACE",
        "warning",
        lambda s: s.swap_space > 0,
        "swapping to CPU memory is not supported yet; preempted requests are recomputed",
    ),
    _Limit(
        "MAX_SEQ_LEN_TO_CAPTURE",
        "warning",
        lambda s: "max_seq_len_to_capture" in s.model_fields_set,
        "CUDA graphs are not supported yet; every step runs eagerly",
    ),
    _Limit(
        "ENABLE_PREFIX_CACHING",
        "warning",
        lambda s: s.enable_prefix_caching and not _engine_has("enable_prefix_caching"),
        "this engine build has no prefix cache; every prompt is computed in full",
    ),
)


# -- helpers ----------------------------------------------------------------------------------


def _extra(field: FieldInfo) -> dict[str, Any]:
    extra = field.json_schema_extra
    return extra if isinstance(extra, dict) else {}


_ENV_TO_FIELD: dict[str, str] = {}
for _name, _field in Settings.model_fields.items():
    for _env in (_extra(_field)["env"], *_extra(_field)["aliases"]):
        _ENV_TO_FIELD[_env] = _name


def _can_create(path: str) -> bool:
    """Whether `path` exists as a writable directory or could be created, without creating it."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def _kind(field: FieldInfo) -> str:
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
    extra = _extra(field)
    if "allowed" in extra:
        return extra["allowed"]
    if "choices" in extra:
        return "one of " + ", ".join(str(c) for c in extra["choices"])
    kind = _kind(field)
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


def _format_validation_error(error: ValidationError, environ: Any) -> str:
    """One line per ValidationError: the variable as the user spelled it, the value, what is
    allowed. Several bad variables are joined on the same line."""
    upper = {str(k).upper(): v for k, v in environ.items()}
    parts = []
    for err in error.errors():
        loc = str(err["loc"][0]) if err["loc"] else "?"
        name = _ENV_TO_FIELD.get(loc.upper(), loc)
        field = Settings.model_fields.get(name)
        if field is None:
            parts.append(f"{loc}: {err['msg']}")
            continue
        extra = _extra(field)
        # Name the variable that was actually set (an alias such as MIN_BATCH_SIZE).
        env = next((n for n in (extra["env"], *extra["aliases"]) if n in upper), extra["env"])
        value = "***" if _kind(field) == "SecretStr" else repr(err.get("input"))
        parts.append(f"{env}={value} is not valid: expected {allowed_values(field)}")
    return "; ".join(parts)


# -- documentation ----------------------------------------------------------------------------


def settings_metadata() -> list[dict[str, Any]]:
    """Every setting as plain data (env, aliases, title, description, type, default, choices,
    category): what the docs and the console form are generated from."""
    rows = []
    for name, field in Settings.model_fields.items():
        extra = _extra(field)
        kind = _kind(field)
        default = field.default
        rows.append(
            {
                "field": name,
                "env": extra["env"],
                "aliases": list(extra["aliases"]),
                "title": field.title,
                "description": field.description,
                "category": extra["category"],
                "type": {"SecretStr": "secret", "str": "str"}.get(kind, kind),
                "form_type": (
                    "select"
                    if "choices" in extra
                    else {"bool": "toggle", "int": "number", "float": "number"}.get(kind, "text")
                ),
                "default": default,
                "choices": list(extra.get("choices", [])),
                "allowed": allowed_values(field),
            }
        )
    return rows


def _md_default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "1 (true)" if value else "0 (false)"
    return f"`{value}`"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_markdown() -> str:
    """docs/settings.md, generated from the Settings class."""
    rows = settings_metadata()
    out = [
        "# Worker settings",
        "",
        "<!-- Generated by `python -m serverless_llm.worker.settings --markdown`; do not edit. -->",
        "",
        "The worker is configured only by environment variables. An empty value means unset.",
        "Booleans accept `0`/`1`/`true`/`false`. A bad value stops start-up with one line naming",
        "the variable, the value and what is allowed. `HF_TOKEN` is never written to a log.",
        "",
    ]
    for category in CATEGORIES:
        out += [f"## {category}", "", "| Variable | Default | Allowed | Description |"]
        out.append("|---|---|---|---|")
        for row in rows:
            if row["category"] != category:
                continue
            name = f"`{row['env']}`"
            if row["aliases"]:
                name += " (also read: " + ", ".join(f"`{a}`" for a in row["aliases"]) + ")"
            desc = f"**{row['title']}.** {row['description']}"
            out.append(
                f"| {name} | {_md_default(row['default'])} | {_md_cell(row['allowed'])} "
                f"| {_md_cell(desc)} |"
            )
        out.append("")
    out += [
        "## Settings the engine cannot honour yet",
        "",
        "Reported at start-up, never ignored silently. A *warning* when the worker still serves",
        "the same outputs without it (only speed, memory or placement differ); an *error* stops",
        "start-up when serving without it would change what is served.",
        "",
        "| Variable | Level | What happens |",
        "|---|---|---|",
    ]
    for lim in _LIMITS:
        out.append(f"| `{lim.env}` | {lim.level} | {_md_cell(lim.message)} |")
    out += [
        "",
        "## Differences from worker-vllm",
        "",
        "- `DEFAULT_MIN_BATCH_SIZE` and `DEFAULT_BATCH_SIZE_GROWTH_FACTOR` are read under their",
        "  documented names (worker-vllm documented them but read `MIN_BATCH_SIZE` and",
        "  `BATCH_SIZE_GROWTH_FACTOR`, which are still accepted as aliases).",
        "- `SWAP_SPACE` defaults to 0: preempted requests are recomputed, which gives identical",
        "  output.",
        "- Native jobs default to `max_tokens` 100, capped to what fits in `MAX_MODEL_LEN` when",
        "  the job does not set it.",
        "- `MODEL_NAME` unset: the deployed worker (`python -m serverless_llm.worker`) stops at",
        "  start with a one-line reason, unless the image has a model baked in; the local",
        f"  devserver serves the embedded {EMBEDDED_MODEL_NAME}.",
        "",
    ]
    return "\n".join(out)


def load_settings_or_exit() -> Settings:
    """For entry points: the settings, or one line on stderr and exit status 2."""
    try:
        return Settings.from_env()
    except SettingsError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m serverless_llm.worker.settings",
        description="Print the settings reference, or check the current environment.",
    )
    ap.add_argument("--markdown", action="store_true", help="print docs/settings.md")
    args = ap.parse_args(argv)
    if args.markdown:
        sys.stdout.write(settings_markdown())
        return 0
    settings = load_settings_or_exit()
    for key, value in settings.non_default().items():
        print(f"{key}={value}")
    for lim in settings.limitations():
        print(f"{lim.level}: {lim.message}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

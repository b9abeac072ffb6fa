"""The inference engine. What the layers above it (api, worker) may use is exported here and
nothing else: the async engine's public face (`EngineClient`, implemented by `AsyncEngine`), the
request and output types, and the few helpers the routes share with the engine."""

from .async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from .client import EngineClient, ModelInfo
from .config import (
    ATTENTION_BACKENDS,
    BLOCK_SIZES,
    DTYPE_CHOICES,
    LOAD_FORMATS,
    ConfigError,
    EngineConfig,
)
from .cpu_tuning import release_free_memory, resident_bytes
from .errors import InvalidRequestError, LoRAError, SamplingParamsError, StructuredOutputError
from .input_processor import ContextLengthError, PreparedPrompt, PromptInput
from .loader import ModelLoadError
from .lora_adapters import LoRARequest
from .models import UnsupportedModelError
from .multimodal import MultiModalInput
from .outputs import EngineOutput, EngineStats, RequestTimes
from .sampling.logprobs import TokenLogprob
from .sampling.params import (
    BEAM_SEARCH_TEMPERATURE,
    SAMPLING_DEFAULTS,
    SamplingParams,
    choose_sequences,
    sequence_params,
)
from .sampling.structured.spec import (
    StructuredOutputSpec,
    any_whitespace_of,
    resolve_backend,
)
from .tokenizer import ChatTemplateError, apply_chat_template, chat_template_source

__all__ = [
    "MultiModalInput",
    "ATTENTION_BACKENDS",
    "BEAM_SEARCH_TEMPERATURE",
    "BLOCK_SIZES",
    "DTYPE_CHOICES",
    "LOAD_FORMATS",
    "SAMPLING_DEFAULTS",
    "AsyncEngine",
    "ChatTemplateError",
    "ConfigError",
    "ContextLengthError",
    "EngineClient",
    "EngineConfig",
    "EngineDeadError",
    "EngineOutput",
    "EngineStats",
    "RequestTimes",
    "InvalidRequestError",
    "LoRAError",
    "LoRARequest",
    "ModelInfo",
    "ModelLoadError",
    "PreparedPrompt",
    "PromptInput",
    "RequestFailedError",
    "SamplingParams",
    "SamplingParamsError",
    "StructuredOutputError",
    "StructuredOutputSpec",
    "TokenLogprob",
    "UnsupportedModelError",
    "any_whitespace_of",
    "apply_chat_template",
    "chat_template_source",
    "choose_sequences",
    "release_free_memory",
    "resident_bytes",
    "resolve_backend",
    "sequence_params",
]

"""A serverless LLM worker with its own paged-attention engine."""

from .engine.lora_adapters import LoRARequest
from .engine.outputs import CompletionOutput, RequestOutput
from .engine.sampling.params import SamplingParams
from .llm import LLM

__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

"""The engine as the layers above it see it: what the API routes and the worker may use, and
nothing else (vLLM's EngineClient is the idea). `AsyncEngine` implements it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .generation_defaults import SamplingDefaults
from .input_processor import PreparedPrompt, PromptInput
from .lora_adapters import LoRARequest
from .outputs import EngineOutput, EngineStats
from .sampling.params import SamplingParams
from .sampling.structured.grammar import CompiledGrammar
from .sampling.structured.spec import StructuredOutputSpec


@dataclass(frozen=True)
class ModelInfo:
    """What was loaded and how, fixed once the engine is built."""

    source: str  # the hub id, directory or file it came from
    dtype: str  # "float32", "bfloat16", ...
    device: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    tensor_parallel_size: int = 1
    image_input: bool = False  # a vision-language model: prompts may carry images
    image_placeholder: str | None = None  # the text one image stands for in a prompt
    # Defaults for sampling parameters a request leaves unset (generation_defaults.py).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)


class EngineClient(Protocol):
    @property
    def model_config(self) -> Any:
        """The model's transformers config."""

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def tokenizer(self) -> Any: ...

    def stats(self) -> EngineStats: ...

    def add_output_observer(self, observer: Callable[[list[EngineOutput]], None]) -> None:
        """`observer` sees every step's outputs, before the next step (for metrics)."""

    def tokenize_prompt(self, prompt: str | list[int]) -> PromptInput:
        """A text or token-id prompt checked and as token ids (InvalidRequestError if bad)."""

    def check_token_ids(self, token_ids: list[int], param: str | None = None) -> None:
        """InvalidRequestError naming `param` when an id is outside the vocabulary."""

    async def compile_grammar(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """The compiled grammar (cached), or InvalidRequestError naming the field."""

    def prepare_prompt(self, prompt: str | list[int], params: SamplingParams) -> PreparedPrompt:
        """A prompt validated once for requests with `params` (tokenized or checked, fitted:
        ContextLengthError when it does not fit). Blocking: call it off the event loop."""

    async def prepare(
        self,
        prompt: str | list[int] | PreparedPrompt,
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> PreparedPrompt:
        """`prepare_prompt`, its grammar compiled and its adapter read: what `generate` takes
        without validating again."""

    def generate(
        self,
        prompt: str | list[int] | PreparedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> AsyncIterator[EngineOutput]: ...

    def check_priority(self, priority: int) -> None:
        """InvalidRequestError naming `priority` unless `generate` would take it (non-zero
        needs the priority scheduling policy)."""

    def load_lora(self, lora_request: LoRARequest) -> None:
        """Reads an adapter now (at start, for the adapters a worker serves); LoRAError if it
        cannot be served."""

    def remove_lora(self, lora_request: LoRARequest) -> None:
        """Forgets an adapter once the requests using it have finished (they finish with it);
        returns at once."""

    async def abort(self, request_id: str) -> None: ...

    async def shutdown(self) -> None: ...

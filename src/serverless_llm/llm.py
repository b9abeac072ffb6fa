"""The offline API, shaped like vLLM's: `LLM(model=...)` then `llm.generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence

from .engine.config import EngineConfig
from .engine.engine import LLMEngine
from .engine.outputs import CompletionOutput, RequestOutput
from .engine.sampling.params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Loads a model once and generates for batches of prompts, all scheduled together.

    `model` is a hub id, a local directory or a .gguf file (None: the embedded SmolLM2);
    every other keyword is an `EngineConfig` field (dtype, max_model_len, block_size, ...).
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        kwargs.setdefault("show_progress", False)
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"{len(prompts)} prompts but {len(params)} sampling params: give one or one each"
                )
        engine = self.engine
        # Validate everything before scheduling anything, so a bad prompt leaves nothing behind.
        requests = []
        for prompt, p in zip(prompts, params):
            requests.append(engine.make_request(prompt, p, request_id=f"llm-{self._counter}"))
            self._counter += 1
        for req in requests:
            engine.add(req)
        try:
            while engine.has_unfinished_requests():
                engine.step()
        except BaseException:
            for req in requests:
                engine.abort_request(req.request_id)
            raise
        return [
            RequestOutput(
                request_id=req.request_id,
                prompt=req.prompt_text,
                prompt_token_ids=req.prompt_token_ids,
                outputs=[
                    CompletionOutput(
                        index=0,
                        text=req.detokenizer.text,
                        token_ids=list(req.output_token_ids),
                        finish_reason=req.finish_reason.value if req.finish_reason else None,
                        stop_reason=req.stop_reason,
                    )
                ],
            )
            for req in requests
        ]

"""The offline API, shaped like vLLM's: `LLM(model=...)` then `llm.generate(prompts, params)`.

Beam search runs either way vLLM has offered it: `generate` with
`SamplingParams(use_beam_search=True, best_of=w, n=k, temperature=0)` (the k best of w beams, as
`CompletionOutput`s), or `beam_search(prompts, BeamSearchParams(beam_width=w, max_tokens=m))`
(all w beams, as `BeamSearchOutput`s).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .engine.config import EngineConfig
from .engine.llm_engine import LLMEngine
from .engine.lora_adapters import LoRARequest
from .engine.multimodal import MultiModalInput
from .engine.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    RequestOutput,
    position_logprobs,
)
from .engine.pooling import embed_params, score_pairs
from .engine.request import Request
from .engine.sampling.beam_search import BeamSearchParams
from .engine.sampling.params import SamplingParams, choose_sequences, sequence_params

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence"]

Prompt = str | list[int] | dict[str, Any]


def _engine_prompt(prompt):
    """vLLM's prompt forms as the engine takes them: a string, token ids, or a dict with
    `prompt` (text with the model's image placeholders) and `multi_modal_data: {"image": one
    PIL image or a list}`, or `prompt_token_ids`."""
    if not isinstance(prompt, dict):
        return prompt
    mm = prompt.get("multi_modal_data") or {}
    unknown = set(mm) - {"image"}
    if unknown:
        raise ValueError(f"multi_modal_data: {sorted(unknown)} are not served (images only)")
    if "image" in mm:
        if "prompt" not in prompt:
            raise ValueError("a prompt with images needs its text as `prompt`")
        images = mm["image"]
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        return MultiModalInput(prompt["prompt"], images)
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    return prompt["prompt"]


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's result of `LLM.embed` (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """One prompt's result of `LLM.classify` (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's result of `LLM.score` (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool


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

    def close(self) -> None:
        """Stops the other tensor-parallel ranks (a no-op without tensor parallelism); an
        engine dropped without it stops them when it is collected."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.generate`; `lora_request`: one adapter for every prompt, or one (or
        None, the base model) per prompt; `priority`: one per prompt, lower served first (needs
        `scheduling_policy="priority"` unless all are 0)."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = [_engine_prompt(p) for p in prompts]
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
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(
                    f"{len(prompts)} prompts but {len(loras)} LoRA requests: give one or one each"
                )
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(
                f"{len(prompts)} prompts but {len(priorities)} priorities: give one each"
            )
        engine = self.engine
        engine.check_generates()
        for value in priorities:
            engine.check_priority(value)
        # Validate everything before scheduling anything, so a bad prompt leaves nothing behind.
        # A prompt with n (or best_of) sequences becomes that many engine requests (a beam
        # search, one).
        groups: list[list[Request]] = []
        for prompt, p, lora, rank in zip(prompts, params, loras, priorities):
            group = []
            children = sequence_params(p)
            prepared = engine.prepare(prompt, children[0], lora)  # validated once
            for i, child in enumerate(children):
                rid = f"llm-{self._counter}" + (f".{i}" if len(children) > 1 else "")
                req = engine.inputs.make_request(prepared, child, request_id=rid)
                req.priority = rank
                group.append(req)
            self._counter += 1
            groups.append(group)
        requests = [req for group in groups for req in group]
        self._run(requests)
        failed = [engine.failed.pop(req.request_id, None) for req in requests]
        if exc := next((e for e in failed if e is not None), None):
            # The others finished (the engine isolates a failure), but a batch call has one
            # result: the failure.
            raise RuntimeError(f"a request failed in output processing: {exc}") from exc
        return [self._result(group, p) for group, p in zip(groups, params)]

    def _run(self, requests: list) -> None:
        """Adds `requests` and steps the engine until nothing is left; an error or interrupt on
        the way aborts them (their KV blocks are freed) and is raised."""
        engine = self.engine
        for req in requests:
            engine.add(req)
        try:
            while engine.has_unfinished_requests():
                engine.step()
        except BaseException:
            for req in requests:
                engine.abort_request(req.request_id)
            raise

    def embed(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed` (a model loaded with task="embed"): each prompt's pooled final
        hidden state, as `out.outputs.embedding`, all prompts prefilled together."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        engine = self.engine
        requests = []
        for prompt in prompts:  # validated before scheduling anything
            params = embed_params(truncate_prompt_tokens)
            prepared = engine.inputs.prepare(prompt, params)
            requests.append(
                engine.build_embed_request(prepared, f"llm-embed-{self._counter}", dimensions)
            )
            self._counter += 1
        self._run(requests)
        return [
            EmbeddingRequestOutput(
                req.request_id, list(req.prompt_token_ids), EmbeddingOutput(req.embedding), True
            )
            for req in requests
        ]

    def classify(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's `LLM.classify` (a ...ForSequenceClassification model): each prompt's
        probabilities per label (`out.outputs.probs`; the labels: `engine.labels`)."""
        reqs = self._pool(self._prompt_list(prompts), "classify", truncate_prompt_tokens)
        return [
            ClassificationRequestOutput(
                r.request_id, list(r.prompt_token_ids), ClassificationOutput(r.embedding), True
            )
            for r in reqs
        ]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        truncate_prompt_tokens: int | None = None,
        instruction: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`: one text_1 against each text_2, or pairs one-to-one; each pair's
        relevance in [0, 1] (`out.outputs.score`) from a one-label cross-encoder head or a
        causal LM reranker served with task="score" (Qwen3-Reranker's yes/no recipe, with
        `instruction` as its task line)."""
        engine = self.engine
        engine.check_pooling_task("score")
        pairs = score_pairs(text_1, text_2)
        prompts = [engine.score_prompt(q, d, instruction) for q, d in pairs]
        reqs = self._pool(prompts, "score", truncate_prompt_tokens)
        return [
            ScoringRequestOutput(
                r.request_id, list(r.prompt_token_ids), ScoringOutput(r.embedding[0]), True
            )
            for r in reqs
        ]

    @staticmethod
    def _prompt_list(prompts) -> list:
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            return [prompts]
        return list(prompts)

    def _pool(self, prompts: list, task: str, truncate_prompt_tokens: int | None) -> list:
        """Pooling requests of `task` for `prompts`, all validated before any is scheduled,
        run to the end; the finished requests (their `embedding` holds the result)."""
        engine = self.engine
        requests = []
        for prompt in prompts:
            prepared = engine.inputs.prepare(prompt, embed_params(truncate_prompt_tokens))
            rid = f"llm-{task}-{self._counter}"
            requests.append(engine.build_embed_request(prepared, rid, task=task))
            self._counter += 1
        self._run(requests)
        return requests

    def beam_search(
        self,
        prompts: Sequence[Prompt | dict[str, Any]],
        params: BeamSearchParams,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: prompts as strings, token-id lists or `{"prompt": ...}` /
        `{"prompt_token_ids": [...]}`; each result holds all beam_width beams, best first."""
        plain: list[Prompt] = []
        for prompt in prompts:
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
            plain.append(prompt)
        results = self.generate(plain, params.to_sampling_params())
        return [
            BeamSearchOutput(
                [
                    BeamSearchSequence(
                        tokens=[*r.prompt_token_ids, *o.token_ids],
                        logprobs=o.logprobs or [],
                        cum_logprob=o.cumulative_logprob or 0.0,
                        text=o.text,
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                    )
                    for o in r.outputs
                ]
            )
            for r in results
        ]

    def _result(self, group: list[Request], params: SamplingParams) -> RequestOutput:
        if group[0].beam is not None:
            return self._beam_result(group[0])
        decode = self._decode_token
        chosen = choose_sequences(group, lambda r: r.out.cumulative_logprob, params)
        show_logprobs = params.logprobs is not None
        outputs = []
        for index, req in enumerate(chosen):
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=req.out.text,
                    token_ids=list(req.output_token_ids),
                    finish_reason=req.finish_reason.value if req.finish_reason else None,
                    stop_reason=req.stop_reason,
                    cumulative_logprob=req.out.cumulative_logprob,
                    logprobs=[position_logprobs(e, decode) for e in req.out.logprobs]
                    if show_logprobs
                    else None,
                    speculation=dataclasses.replace(req.spec_counts)
                    if req.spec_counts.verifications
                    else None,
                )
            )
        first = group[0]
        prompt_lp = None
        if first.out.prompt_logprobs is not None:
            prompt_lp = [
                None if e is None else position_logprobs(e, decode)
                for e in first.out.prompt_logprobs
            ]
        return RequestOutput(
            request_id=first.request_id.split(".")[0],
            prompt=first.out.prompt_text,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            prompt_logprobs=prompt_lp,
        )

    def _beam_result(self, root: Request) -> RequestOutput:
        """A beam search's n best sequences, best first."""
        decode = self._decode_token
        show_logprobs = root.params.logprobs is not None
        outputs = [
            CompletionOutput(
                index=index,
                text=out.new_text,
                token_ids=list(out.new_token_ids),
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                cumulative_logprob=out.cumulative_logprob,
                logprobs=[position_logprobs(e, decode) for e in out.logprobs]
                if show_logprobs
                else None,
            )
            for index, out in enumerate(root.beam.outputs or [])
        ]
        prompt_lp = None
        if root.out.prompt_logprobs is not None:
            prompt_lp = [
                None if e is None else position_logprobs(e, decode)
                for e in root.out.prompt_logprobs
            ]
        return RequestOutput(
            request_id=root.request_id,
            prompt=root.out.prompt_text,
            prompt_token_ids=root.prompt_token_ids,
            outputs=outputs,
            prompt_logprobs=prompt_lp,
        )

    def _decode_token(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

"""A request's way in: prompt tokenizing, every check a bad request could trip over, the
context-length rule, grammar compilation, and the `Request` the scheduler will run.

Everything here runs before a request touches the scheduler, so an invalid request never holds
blocks. A prompt is validated once (`prepare` -> `PreparedPrompt`: tokenized, fitted, its
grammar compiled and its adapter read by the async engine); the API routes prepare every prompt
of a job before any of its requests is queued, so a multi-request job fails whole, and the
requests built from a prepared prompt (`build_request`, one per sequence) check nothing again.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import InvalidRequestError
from .multimodal import MultiModalInput, MultiModalPrompt
from .request import Request
from .sampling.logits_processors import RequestSamplingState
from .sampling.params import SamplingParams, SamplingParamsError
from .sampling.structured.grammar import CompiledGrammar, GrammarCompiler
from .sampling.structured.spec import StructuredOutputError, StructuredOutputSpec
from .stop_rule import StopRule
from .tokenizer import IncrementalDetokenizer, StopStringMatcher

if TYPE_CHECKING:
    from .lora_adapters import LoRAAdapter, LoRARequest


class ContextLengthError(InvalidRequestError):
    """The prompt and the output asked for do not fit in max_model_len. The numbers are kept so
    each route can word the error its clients expect; `max_tokens` is None when none was set."""

    def __init__(self, num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        n = num_prompt_tokens
        if max_tokens is None:
            message = (
                f"the prompt has {n} tokens, which leaves no room for output within "
                f"max_model_len={max_model_len}"
            )
        else:
            message = (
                f"prompt length ({n} tokens) plus max_tokens ({max_tokens}) is "
                f"{n + max_tokens}, more than max_model_len={max_model_len}"
            )
        super().__init__(message)


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """The context-length rule: the prompt and `max_tokens` (or, with none, at least one token)
    fit within max_model_len; ContextLengthError otherwise."""
    room = 1 if max_tokens is None else max_tokens
    if num_prompt_tokens + room > max_model_len:
        raise ContextLengthError(num_prompt_tokens, max_tokens, max_model_len)


def structured_error(e: StructuredOutputError) -> InvalidRequestError:
    """A StructuredOutputError as the request's error, its message naming the field."""
    param = getattr(e, "param", None)
    message = str(e)
    if param and param not in message:
        message = f"{param}: {message}"
    return InvalidRequestError(message, param)


@dataclass(frozen=True, eq=False)
class PreparedPrompt:
    """A prompt the engine has validated once (`InputProcessor.prepare`, `AsyncEngine.prepare`):
    its token ids as the model will see them (checked, truncated, fitted to the context for
    `max_tokens`), its text when given as text and not truncated, and what the engine compiled
    or read for it (the grammar of its structured output, its adapter). Requests built from it
    (one per sequence) are not checked, tokenized, fitted or compiled again."""

    token_ids: list[int]
    text: str | None
    max_tokens: int | None  # the fit it was checked for
    truncate: int | None
    max_model_len: int
    grammar: CompiledGrammar | None = None
    lora: LoRARequest | None = None
    adapter: LoRAAdapter | None = None
    mm: MultiModalPrompt | None = None  # its images, processed

    def with_max_tokens(self, max_tokens: int | None) -> PreparedPrompt:
        """The same prompt fitted for another max_tokens (ContextLengthError if it does not
        fit): a route that shrinks its default output to the room the prompt leaves."""
        check_context(len(self.token_ids), max_tokens, self.max_model_len)
        return dataclasses.replace(self, max_tokens=max_tokens)

    def check_fits(self, params: SamplingParams) -> None:
        """A request's parameters must be the ones the prompt was fitted for (a programming
        error otherwise); and, a guard rather than a check, the context must hold them."""
        if (params.max_tokens, params.truncate_prompt_tokens) != (self.max_tokens, self.truncate):
            raise ValueError(
                f"a prompt prepared for max_tokens={self.max_tokens}, truncate="
                f"{self.truncate} cannot run max_tokens={params.max_tokens}, truncate="
                f"{params.truncate_prompt_tokens}: prepare it for those"
            )
        n = len(self.token_ids)
        if n == 0:
            raise ContextLengthError(n, self.max_tokens, self.max_model_len)
        check_context(n, self.max_tokens, self.max_model_len)


@dataclass
class PromptInput:
    """A prompt as the engine takes it: its token ids, and its text when it was given as text."""

    token_ids: list[int]
    text: str | None = None
    mm: MultiModalPrompt | None = None


@dataclass
class ImageInputs:
    """What a vision-language model's requests are processed with: its family, the
    transformers processor, and the limits an image prompt must keep."""

    family: object  # multimodal.VisionFamily
    processor: object
    max_span: int | None = None  # the longest image span one step can take (whole images)


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: set[int],
        *,
        grammar_compile_timeout: float = 15.0,
        grammar_max_chars: int = 256 << 10,
    ) -> None:
        self.tokenizer = tokenizer
        self.grammar_compile_timeout = grammar_compile_timeout
        self.grammar_max_chars = grammar_max_chars
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._next_id = 0
        self._grammar_compiler: GrammarCompiler | None = None  # made on the first grammar
        self._grammar_lock = threading.Lock()
        self.images: ImageInputs | None = None  # set by the engine for a vision model

    # -- prompts ----------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int] | MultiModalInput) -> PromptInput:
        if isinstance(prompt, MultiModalInput):
            return self.process_images(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            return PromptInput(self.tokenizer.encode(prompt), prompt)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise InvalidRequestError("a token-id prompt must be a list of integers")
            self.check_token_ids(prompt)
            return PromptInput(list(prompt))
        raise InvalidRequestError("the prompt must be a string or a list of token ids")

    def image_placeholder(self) -> str | None:
        """The text one image stands for in a prompt (None: a text model)."""
        vision = self.images
        return None if vision is None else vision.family.image_placeholder(vision.processor)

    def process_images(self, prompt: MultiModalInput) -> PromptInput:
        """A prompt with images through the model's processor: the token ids with every image
        expanded, and the images' spans and data. InvalidRequestError when the model takes no
        images or the placeholders and images disagree."""
        vision = self.images
        if vision is None:
            if not prompt.images:
                return self.tokenize_prompt(prompt.text)
            raise InvalidRequestError("this model does not take images (it is a text model)")
        if not prompt.text:
            raise InvalidRequestError("the prompt is empty")
        try:
            mm = vision.family.process(
                vision.processor, prompt.text, list(prompt.images), prompt.add_special_tokens
            )
        except (ValueError, TypeError, OSError) as e:
            raise InvalidRequestError(f"the prompt's images cannot be processed: {e}") from None
        if vision.max_span is not None:
            for item in mm.items:
                if item.length > vision.max_span:
                    raise InvalidRequestError(
                        f"an image takes {item.length} tokens, more than one step computes "
                        f"(max_num_batched_tokens={vision.max_span})"
                    )
        return PromptInput(list(mm.token_ids), prompt.text, mm if mm.items else None)

    def check_token_ids(self, token_ids: list[int], param: str | None = None) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is out of range: the vocabulary has {self.vocab_size} tokens",
                param,
            )

    def fit_prompt(
        self, token_ids: list[int], max_tokens: int | None, truncate: int | None = None
    ) -> list[int]:
        """The prompt as the model will see it: its last `truncate` tokens (when set), checked
        to be non-empty and to leave room for `max_tokens` (or at least one token) within
        max_model_len. ContextLengthError when it does not fit."""
        if truncate is not None and len(token_ids) > truncate:
            token_ids = token_ids[-truncate:]
        n = len(token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty (it encodes to no tokens)")
        check_context(n, max_tokens, self.max_model_len)
        return token_ids

    # -- grammars ---------------------------------------------------------------------------

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """One per tokenizer, made on first use (it builds the tokenizer's grammar tables)."""
        if self._grammar_compiler is None:
            with self._grammar_lock:
                if self._grammar_compiler is None:
                    self._grammar_compiler = GrammarCompiler(
                        self.tokenizer,
                        vocab_size=self.vocab_size,
                        stop_token_ids=sorted(self.eos_token_ids),
                        compile_timeout=self.grammar_compile_timeout,
                        max_spec_chars=self.grammar_max_chars,
                    )
        return self._grammar_compiler

    def compile_grammar(self, spec: StructuredOutputSpec) -> Future[CompiledGrammar]:
        """Starts compiling a spec off the caller's thread (a cache hit resolves at once). The
        future fails with InvalidRequestError, naming the field, when the schema, regex or
        grammar is invalid. Every grammar of the engine is compiled through here. Cancelling the
        future withdraws the request: a compilation no request waits for is stopped."""
        done: Future[CompiledGrammar] = Future()
        inner = self.grammar_compiler.compile_async(spec)

        def withdraw(f: Future[CompiledGrammar]) -> None:
            if f.cancelled():
                inner.cancel()

        def settle(f: Future[CompiledGrammar]) -> None:
            if f.cancelled() or not done.set_running_or_notify_cancel():
                return
            e = f.exception()
            if isinstance(e, StructuredOutputError):
                done.set_exception(structured_error(e))
            elif e is not None:
                done.set_exception(e)
            else:
                done.set_result(f.result())

        done.add_done_callback(withdraw)
        inner.add_done_callback(settle)
        return done

    # -- requests ---------------------------------------------------------------------------

    def prepare(
        self,
        prompt: str | list[int] | PreparedPrompt,
        params: SamplingParams,
        compiled_grammar: CompiledGrammar | None = None,
    ) -> PreparedPrompt:
        """Validates a prompt once for requests with `params`: tokenized (or its ids checked)
        and fitted to the context for params.max_tokens and truncate_prompt_tokens (the same
        for every sequence of a prompt; their other parameters are each request's, checked when
        it is built). A prompt already prepared for the same fit is returned as it is (with the
        grammar, when given)."""
        if isinstance(prompt, PreparedPrompt):
            prompt.check_fits(params)
            if compiled_grammar is not None and prompt.grammar is None:
                prompt = dataclasses.replace(prompt, grammar=compiled_grammar)
            return prompt
        prompt_input = self.tokenize_prompt(prompt)
        truncate = params.truncate_prompt_tokens
        if prompt_input.mm is not None and truncate is not None:
            if len(prompt_input.token_ids) > truncate:
                raise InvalidRequestError(
                    "truncate_prompt_tokens would cut a prompt with images; send it whole",
                    "truncate_prompt_tokens",
                )
        token_ids = self.fit_prompt(prompt_input.token_ids, params.max_tokens, truncate)
        text = prompt_input.text if len(token_ids) == len(prompt_input.token_ids) else None
        return PreparedPrompt(
            token_ids,
            text,
            params.max_tokens,
            truncate,
            self.max_model_len,
            compiled_grammar,
            mm=prompt_input.mm,
        )

    def check_params(self, params: SamplingParams) -> None:
        """The checks of `params` against this model (vocabulary, min_tokens). A request runs
        one sequence: `n` and `best_of` are for whoever fans a prompt out (see
        sequence_params), except with beam search, where the request runs best_of (else n)
        beams and returns n (the caller makes its group)."""
        if params.num_sequences > 1 and not params.use_beam_search:
            raise InvalidRequestError(
                "an engine request runs one sequence: fan n / best_of out with "
                "sequence_params (LLM.generate and the API routes do)",
                "n",
            )
        try:
            params.check_vocab(self.vocab_size)
        except SamplingParamsError as e:
            raise InvalidRequestError(str(e), e.param) from None
        self._check_min_tokens(params)

    def make_request(
        self,
        prompt: str | list[int] | PreparedPrompt,
        params: SamplingParams,
        request_id: str | None = None,
        compiled_grammar: CompiledGrammar | None = None,
    ) -> Request:
        """Validates (unless `prompt` is prepared already) and builds a request."""
        return self.build_request(
            self.prepare(prompt, params, compiled_grammar), params, request_id
        )

    def build_request(
        self, prepared: PreparedPrompt, params: SamplingParams, request_id: str | None = None
    ) -> Request:
        """The request of a prepared prompt: nothing is tokenized, fitted or compiled again
        (a grammar not compiled yet is compiled here, blocking: the offline path's). Only the
        request's own parameters are checked."""
        self.check_params(params)
        prepared.check_fits(params)
        token_ids = prepared.token_ids
        n = len(token_ids)
        max_total = self.max_model_len if params.max_tokens is None else n + params.max_tokens
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        req = Request(request_id, list(token_ids), params, max_total_tokens=max_total)
        req.stop_rule = StopRule.of(params, self.eos_token_ids, max_total - n)
        req.out.prompt_text = prepared.text
        req.lora, req.lora_adapter = prepared.lora, prepared.adapter
        req.mm = prepared.mm
        if params.use_beam_search:
            return req
        req.sampling = RequestSamplingState(params, token_ids, req.stop_rule)
        if params.structured is not None:
            grammar = prepared.grammar
            if grammar is None:
                grammar = self.compile_grammar(params.structured).result()
            req.grammar = grammar.matcher(extra_stop_token_ids=params.stop_token_ids)
            req.grammar_open = not params.structured_after
        req.out.detokenizer = self.detokenizer(token_ids, params)
        if params.stop:
            req.out.stop_matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        if params.logprobs is not None:
            req.out.logprobs = []
            req.out.cumulative_logprob = 0.0
        if params.prompt_logprobs is not None:
            req.out.prompt_logprobs = [None]
        return req

    def detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer,
            prompt_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )

    def _check_min_tokens(self, params: SamplingParams) -> None:
        if not (params.min_tokens and params.allowed_token_ids):
            return
        stops = StopRule.of(params, self.eos_token_ids, None).stop_ids
        if set(params.allowed_token_ids) <= stops:
            raise InvalidRequestError(
                "allowed_token_ids holds only end-of-sequence and stop tokens, which "
                "min_tokens forbids: nothing could be sampled",
                "allowed_token_ids",
            )

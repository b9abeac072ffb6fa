"""The synchronous engine: owns the model, the KV cache, the scheduler and the sampler; `step()`
runs one scheduled batch and returns what each request produced.

Everything a bad request could trip over is checked in `make_request`, before the request
touches the scheduler, so an invalid request never holds blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

import torch

from .config import ConfigError, EngineConfig
from .kv_cache import BlockPool, allocate_kv_cache
from .model_builder import load_model, num_kv_blocks
from .model_runner import ModelRunner
from .outputs import EngineOutput
from .request import FinishReason, Request, RequestStatus
from .sampling.beam_search import BeamGroup, BeamSearch, HeldKV, Hypothesis
from .sampling.logits_processors import RequestSamplingState
from .sampling.logprobs import TokenLogprob
from .sampling.params import SamplingParams, SamplingParamsError
from .sampling.sampler import Sampler, SamplingBatch
from .scheduler import Scheduler
from .tokenizer import IncrementalDetokenizer, StopStringMatcher, eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """The request cannot be served as given; the message says why (shown to the client) and
    `param` names the parameter at fault, when one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def structured_error(e: Exception) -> InvalidRequestError:
    """A StructuredOutputError as the request's error, its message naming the field."""
    param = getattr(e, "param", None)
    message = str(e)
    if param and param not in message:
        message = f"{param}: {message}"
    return InvalidRequestError(message, param)


@dataclass
class PromptInput:
    text: str | None
    token_ids: list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        loaded = load_model(config)
        self.resolved = resolved = loaded.resolved
        self.hf_config = hf_config = loaded.hf_config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.max_model_len = loaded.max_model_len
        self.backend = loaded.backend
        self.model = model = loaded.model
        if config.max_num_batched_tokens is not None:
            self.max_num_batched_tokens = config.max_num_batched_tokens
        else:
            self.max_num_batched_tokens = 8192 if self.device.type == "cuda" else 2048
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens={self.max_num_batched_tokens}: must be >= 1")

        self.tokenizer = load_tokenizer(
            resolved.tokenizer_dir, trust_remote_code=config.trust_remote_code
        )
        self.eos_token_ids = eos_token_ids(self.tokenizer, hf_config, self._generation_config())
        self.vocab_size = hf_config.vocab_size

        self.block_size = config.block_size
        num_blocks = num_kv_blocks(config, loaded, self.block_size, self.max_num_batched_tokens)
        if num_blocks * self.block_size < self.max_model_len:
            raise ConfigError(
                f"the KV cache holds {num_blocks * self.block_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}: lower max_model_len or give the cache more memory"
            )
        self.kv_caches = allocate_kv_cache(
            model.num_layers,
            num_blocks,
            self.block_size,
            model.num_kv_heads,
            model.head_dim,
            self.dtype,
            self.device,
        )
        self.block_pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_pool, self.block_size, config.max_num_seqs, self.max_num_batched_tokens
        )
        self.runner = ModelRunner(
            self.model, self.kv_caches, self.backend, self.block_size, self.device
        )
        self.sampler = Sampler(config.seed, self.device)
        self._sampling_cache: dict = {}  # reused per-row sampler tensors between steps
        self.requests: dict[str, Request] = {}
        self._unfinished_beam_steps: set[BeamGroup] = set()  # some beams reported, not all
        self._next_id = 0
        self._grammar_compiler = None  # created on the first structured request
        self._grammar_lock = threading.Lock()
        self._bitmask = None
        logger.info(
            "engine ready in %.1fs: model=%s dtype=%s device=%s backend=%s max_model_len=%d "
            "kv_blocks=%d (block_size %d, %d tokens)",
            time.perf_counter() - t0,
            resolved.source,
            str(self.dtype).replace("torch.", ""),
            self.device,
            self.backend.name,
            self.max_model_len,
            num_blocks,
            self.block_size,
            num_blocks * self.block_size,
        )

    # -- set-up helpers ---------------------------------------------------------------------

    def _generation_config(self):
        try:
            from transformers import GenerationConfig

            return GenerationConfig.from_pretrained(self.resolved.model_dir)
        except Exception:  # no generation_config.json: the model config's ids are enough
            return None

    # -- structured output -------------------------------------------------------------------

    @property
    def grammar_compiler(self):
        """The engine's GrammarCompiler (one per tokenizer; created on first use)."""
        if self._grammar_compiler is None:
            with self._grammar_lock:
                if self._grammar_compiler is None:
                    from .sampling.structured import GrammarCompiler

                    self._grammar_compiler = GrammarCompiler(
                        self.tokenizer,
                        vocab_size=self.vocab_size,
                        stop_token_ids=sorted(self.eos_token_ids),
                    )
        return self._grammar_compiler

    def compile_grammar(self, spec):
        """The compiled grammar of a spec (cached); InvalidRequestError naming the field when
        the schema, regex or grammar is invalid."""
        from .sampling.structured import StructuredOutputError

        try:
            return self.grammar_compiler.compile(spec)
        except StructuredOutputError as e:
            raise structured_error(e) from None

    # -- requests ---------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int]) -> PromptInput:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            return PromptInput(prompt, self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise InvalidRequestError("a token-id prompt must be a list of integers")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token id {bad[0]} is out of range: the vocabulary has {self.vocab_size} tokens"
                )
            return PromptInput(None, list(prompt))
        raise InvalidRequestError("the prompt must be a string or a list of token ids")

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        compiled_grammar=None,
    ) -> Request:
        """Validates and builds a request without touching the scheduler. The request runs one
        sequence: `n` and `best_of` are for whoever fans a prompt out (see sequence_params),
        except with beam search, where the request runs best_of (else n) beams and returns n."""
        if params.num_sequences > 1 and not params.use_beam_search:
            raise InvalidRequestError(
                "an engine request runs one sequence: fan n / best_of out with "
                "sequence_params (LLM.generate and the API routes do)",
                "n",
            )
        pi = self.tokenize_prompt(prompt)
        try:
            params.check_vocab(self.vocab_size)
        except SamplingParamsError as e:
            raise InvalidRequestError(str(e), e.param) from None
        token_ids = pi.token_ids
        if (
            params.truncate_prompt_tokens is not None
            and len(token_ids) > params.truncate_prompt_tokens
        ):
            token_ids = token_ids[-params.truncate_prompt_tokens :]
            pi = PromptInput(None, token_ids)
        n = len(token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty (it encodes to no tokens)")
        if params.min_tokens and params.allowed_token_ids:
            stops = set(params.stop_token_ids) | (
                set() if params.ignore_eos else self.eos_token_ids
            )
            if set(params.allowed_token_ids) <= stops:
                raise InvalidRequestError(
                    "allowed_token_ids holds only end-of-sequence and stop tokens, which "
                    "min_tokens forbids: nothing could be sampled",
                    "allowed_token_ids",
                )
        limit = self.max_model_len
        if params.max_tokens is None:
            if n >= limit:
                raise InvalidRequestError(
                    f"the prompt has {n} tokens, which leaves no room for output within "
                    f"max_model_len={limit}"
                )
            max_total = limit
        else:
            if n + params.max_tokens > limit:
                raise InvalidRequestError(
                    f"prompt length ({n} tokens) plus max_tokens ({params.max_tokens}) is "
                    f"{n + params.max_tokens}, more than max_model_len={limit}"
                )
            max_total = n + params.max_tokens
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        req = Request(request_id, token_ids, params, max_total_tokens=max_total)
        req.prompt_text = pi.text
        if params.use_beam_search:
            req.beam = self._beam_group(req)
            return req
        req.sampling = RequestSamplingState(params, token_ids, self.eos_token_ids)
        if params.structured is not None:
            if compiled_grammar is None:
                compiled_grammar = self.compile_grammar(params.structured)
            req.grammar = compiled_grammar.matcher(extra_stop_token_ids=params.stop_token_ids)
        req.detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        if params.stop:
            req.stop_matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        if params.logprobs is not None:
            req.logprobs = []
            req.cumulative_logprob = 0.0
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        return req

    def _beam_group(self, root: Request) -> BeamGroup:
        """The search and its first step: the prompt, as transformers starts (one beam)."""
        p = root.params
        search = BeamSearch(
            width=p.num_sequences,
            max_new_tokens=root.max_total_tokens - root.num_prompt_tokens,
            eos_token_ids=() if p.ignore_eos else sorted(self.eos_token_ids),
            stop_token_ids=p.stop_token_ids,
            min_tokens=p.min_tokens,
            length_penalty=p.length_penalty,
            early_stopping=p.early_stopping,
            logprobs=p.logprobs,
        )
        member = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
        # The search needs more top tokens than a client may ask for (2 * width or more).
        member.logprobs = min(search.tokens_per_beam, self.vocab_size)
        first = member
        if p.prompt_logprobs is not None:
            first = dataclasses.replace(member, logprobs=None, prompt_logprobs=p.prompt_logprobs)
            first.logprobs = member.logprobs
        sampling = RequestSamplingState(member, root.prompt_token_ids, self.eos_token_ids)
        group = BeamGroup(root, search, member, sampling)
        group.spawn(first)
        return group

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        if req.beam is None:
            self.scheduler.add(req)
            return
        for member in req.beam.members:
            self.scheduler.add(member)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Request:
        req = self.make_request(prompt, params or SamplingParams(), request_id)
        self.add(req)
        return req

    def abort_request(self, request_id: str) -> EngineOutput | None:
        """Stops a request and frees its blocks now. Unknown or finished ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.beam is None:
            self.scheduler.finish(req, FinishReason.ABORT)
        else:
            for member in req.beam.members:
                if not member.finished:
                    self.scheduler.finish(member, FinishReason.ABORT)
            self._release_held(req.beam)
            req.status = RequestStatus.FINISHED
            req.finish_reason = FinishReason.ABORT
        return self._output(req, [], "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        batch = self.scheduler.schedule()
        if not batch.requests and self._drop_waiting_beam_blocks():
            batch = self.scheduler.schedule()
        if not batch.requests:
            if self.scheduler.running or self.scheduler.waiting:
                # Nothing fits (only possible if a single request outgrew the cache).
                raise RuntimeError("scheduler made no progress: the KV cache is too small")
            return []
        sample_reqs, logits = self.runner.execute(batch)
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
            self.scheduler.cache_computed_blocks(req)
        if not sample_reqs:
            return []
        sb = SamplingBatch.build(
            sample_reqs, self.vocab_size, self.device, cache=self._sampling_cache
        )
        self._fill_grammar_masks(sample_reqs, sb)
        sampled = self.sampler(logits, sb)
        logprobs = sampled.logprobs or [None] * len(sample_reqs)
        outputs = []
        for req, tok, lp in zip(sample_reqs, sampled.token_ids, logprobs):
            if req.beam is None:
                outputs.append(self._process_token(req, tok, lp))
                continue
            out = self._beam_step(req, lp)
            if out is not None:
                outputs.append(out)
        # A beam search whose step is split across engine steps must not hold blocks while it
        # waits for its other beams (those may need them to run): its next beams will find
        # their prefixes in the cache instead.
        for group in self._unfinished_beam_steps:
            self._release_held(group)
        self._unfinished_beam_steps.clear()
        return outputs

    def _fill_grammar_masks(self, reqs: list[Request], sb: SamplingBatch) -> None:
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return
        from .sampling.structured import allocate_bitmask, fill_bitmasks

        need = max(len(reqs), self.config.max_num_seqs)
        if self._bitmask is None or self._bitmask.shape[0] < need:
            self._bitmask = allocate_bitmask(need, self.vocab_size)
        fill_bitmasks([reqs[i].grammar for i in rows], self._bitmask, rows)
        sb.set_grammar(self._bitmask, rows)

    # -- beam search --------------------------------------------------------------------------

    def _beam_step(self, member: Request, top: TokenLogprob) -> EngineOutput | None:
        """A beam's one-step request has its top tokens: it ends, handing its blocks to the
        group. Once every beam of the step has reported, the search moves on and the next beams
        start from their parents' blocks, queued ahead of new requests."""
        group = member.beam
        j = member.beam_index
        group.tops[j] = top
        if member.prompt_logprobs is not None:
            group.root.prompt_logprobs = member.prompt_logprobs
        # Taken before the request ends, which would free them.
        group.held[j] = HeldKV(member.block_ids, member.block_hashes, member.num_computed_tokens)
        member.block_ids, member.block_hashes = [], []
        self.scheduler.finish(member, FinishReason.STOP)
        if not group.complete:
            self._unfinished_beam_steps.add(group)
            return None
        self._unfinished_beam_steps.discard(group)
        if group.search.step(group.tops):
            self._release_held(group)
            return self._finish_beam_search(group)
        held = group.held
        children = group.spawn()
        self._fork_blocks(held, [beam.parent for beam in group.search.live], children)
        for child in reversed(children):
            self.scheduler.add(child, front=True)
        return None

    def _fork_blocks(
        self, held: list[HeldKV | None], parents: list[int], children: list[Request]
    ) -> None:
        """Gives each new beam its parent's KV, so it computes only its new token: the first
        child of a parent takes the parent's blocks, the others share its full blocks and get a
        copy of its last, partly filled one (copy-on-write done at once, as the first child is
        about to write into it). Without room for a copy, a beam computes that block's tokens
        again. Blocks of beams nobody extends are freed (their full blocks stay cached)."""
        pool, bs = self.block_pool, self.block_size
        for b, kv in enumerate(held):
            if kv is not None and b not in parents:
                pool.free(kv.block_ids)
        taken = [False] * len(held)
        copies: list[tuple[int, int]] = []
        for child, b in zip(children, parents):
            kv = held[b]
            if kv is None:  # released: the cached prefix serves when it is admitted
                continue
            if not taken[b]:
                taken[b] = True
                child.block_ids = kv.block_ids
                child.block_hashes = kv.block_hashes
                child.num_computed_tokens = kv.num_computed_tokens
                continue
            full = kv.num_computed_tokens // bs
            pool.share(kv.block_ids[:full])
            child.block_ids = kv.block_ids[:full]
            child.block_hashes = kv.block_hashes[:full]
            child.num_computed_tokens = full * bs
            if kv.num_computed_tokens > full * bs:
                new = pool.allocate(1)
                if new is not None:
                    copies.append((kv.block_ids[full], new[0]))
                    child.block_ids.append(new[0])
                    child.num_computed_tokens = kv.num_computed_tokens
        if copies:
            src = torch.tensor([a for a, _ in copies], device=self.device)
            dst = torch.tensor([b for _, b in copies], device=self.device)
            for cache in self.kv_caches:
                cache[:, dst] = cache[:, src]

    def _release_held(self, group: BeamGroup) -> None:
        for j, kv in enumerate(group.held):
            if kv is not None:
                self.block_pool.free(kv.block_ids)
                group.held[j] = None

    def _drop_waiting_beam_blocks(self) -> bool:
        """Nothing could be scheduled: beams waiting with their parents' blocks may be what
        fills the cache. They let go (their prefixes stay cached) so the queue can move."""
        dropped = False
        for req in self.scheduler.waiting:
            if req.beam is not None and req.block_ids:
                self.block_pool.free(req.block_ids)
                req.block_ids, req.block_hashes = [], []
                req.num_computed_tokens = 0
                dropped = True
        return dropped

    def _finish_beam_search(self, group: BeamGroup) -> EngineOutput:
        root = group.root
        self.requests.pop(root.request_id, None)
        outputs = [self._hypothesis_output(root, h) for h in group.search.best(root.params.n)]
        group.outputs = outputs
        best = outputs[0]
        root.status = RequestStatus.FINISHED
        root.finish_reason = FinishReason(best.finish_reason)
        root.stop_reason = best.stop_reason
        root.output_token_ids = list(best.new_token_ids)
        return dataclasses.replace(best, sequences=outputs)

    def _hypothesis_output(self, root: Request, hyp: Hypothesis) -> EngineOutput:
        """A finished beam as a whole output, its text decoded as a streamed one would be (the
        stop token's text left out unless include_stop_str_in_output)."""
        p = root.params
        shown = hyp.token_ids
        if hyp.finish_reason == "stop" and not p.include_stop_str_in_output:
            shown = shown[:-1]
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            root.prompt_token_ids,
            skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens,
        )
        text = detokenizer.add(shown) + detokenizer.flush()
        return EngineOutput(
            request_id=root.request_id,
            new_token_ids=list(hyp.token_ids),
            new_text=text,
            finished=True,
            finish_reason=hyp.finish_reason,
            stop_reason=hyp.stop_reason,
            num_prompt_tokens=root.num_prompt_tokens,
            num_output_tokens=len(hyp.token_ids),
            logprobs=hyp.logprobs if p.logprobs is not None else None,
            cumulative_logprob=hyp.cumulative_logprob,
            prompt_logprobs=root.prompt_logprobs,
        )

    def _process_token(self, req: Request, tok: int, lp: TokenLogprob | None) -> EngineOutput:
        """Appends a sampled token, decides whether the request ends (vLLM's rules) and returns
        the text it releases."""
        p = req.params
        req.output_token_ids.append(tok)
        req.sampling.on_token(tok)
        if lp is not None:
            req.logprobs.append(lp)
            req.cumulative_logprob += lp.logprob
        num_out = len(req.output_token_ids)
        reason: FinishReason | None = None
        # EOS and stop tokens count once min_tokens are out (they are masked before that).
        if num_out >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos_token_ids:
                reason = FinishReason.STOP
            elif tok in p.stop_token_ids:
                reason = FinishReason.STOP
                req.stop_reason = tok
        if req.grammar is not None and reason is None:
            if not req.grammar.accept_token(tok):
                logger.warning(
                    "request %s: token %d breaks its grammar (another constraint disagreed); "
                    "finishing it",
                    req.request_id,
                    tok,
                )
                reason = FinishReason.STOP
            elif req.grammar.is_terminated():  # the grammar's stop token: the output is complete
                reason = FinishReason.STOP
                if tok in p.stop_token_ids:
                    req.stop_reason = tok
        elif req.grammar is not None:
            req.grammar.accept_token(tok)
        stopped_by_token = reason is not None
        # The text of the token that stopped the request is not output (vLLM), unless asked.
        text = "" if stopped_by_token and not p.include_stop_str_in_output else None
        if text is None:
            text = req.detokenizer.add([tok])
        if reason is None and req.num_tokens >= req.max_total_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            # An output that ends inside a multi-byte character still shows what it has.
            text += req.detokenizer.flush()
        matcher = req.stop_matcher
        if matcher is not None:
            if stopped_by_token:
                text = matcher.flush() + text
            else:
                text, hit = matcher.feed(text, active=num_out >= p.min_tokens)
                if hit is not None:
                    reason = FinishReason.STOP
                    req.stop_reason = hit
                elif reason is not None:
                    text += matcher.flush()
        if text:
            req.text_chunks.append(text)
        if reason is not None:
            req.finish_reason = reason
            self.scheduler.finish(req, reason)
            self.requests.pop(req.request_id, None)
        return self._output(req, [tok], text, None if lp is None else [lp])

    @staticmethod
    def _output(
        req: Request,
        new_ids: list[int],
        text: str,
        logprobs: list[TokenLogprob] | None = None,
    ) -> EngineOutput:
        finished = req.status is RequestStatus.FINISHED
        prompt_logprobs = None
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent and new_ids:
            prompt_logprobs = req.prompt_logprobs
            req.prompt_logprobs_sent = True
        return EngineOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            new_text=text,
            finished=finished,
            finish_reason=req.finish_reason.value if finished and req.finish_reason else None,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            logprobs=logprobs,
            cumulative_logprob=req.cumulative_logprob,
            prompt_logprobs=prompt_logprobs,
        )

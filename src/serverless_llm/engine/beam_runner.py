"""Beam search in the engine: a search request runs its beams as one-step requests that the
scheduler treats like any other, and forks their KV blocks between steps.

The search itself (which tokens extend which beams, scores, when to stop) is
`sampling/beam_search.BeamSearch`, transformers' rules step by step. This module is the engine's
side: each step, every live beam runs as a request that computes its last token's logits,
reports its top tokens and ends, handing its KV blocks to the group. Once all have reported, the
next beams start from their parents' blocks, so each step computes one token per beam. Blocks
move only through the KV cache manager (a finished beam's stay there under its id until its
children take them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from .input_processor import InputProcessor
from .kv_cache_manager import KVCacheManager
from .outputs import EngineOutput
from .request import FinishReason, Request, RequestStatus
from .sampling.beam_search import BeamSearch, Hypothesis
from .sampling.logits_processors import RequestSamplingState
from .sampling.logprobs import TokenLogprob
from .sampling.params import SamplingParams
from .scheduler import Scheduler
from .stop_rule import StopRule


@dataclass(slots=True)
class HeldKV:
    """A beam that has reported: its blocks stay with the KV cache manager under `owner` (its
    finished one-step request) for the beams that extend it."""

    owner: Request
    num_computed_tokens: int


@dataclass(eq=False)
class BeamGroup:
    """One beam search request: `root` is the request the caller holds (its id, prompt and
    parameters), never scheduled; `members` are the current step's one-step requests."""

    root: Request
    search: BeamSearch
    member_params: SamplingParams  # greedy, logprobs = the search's tokens_per_beam
    sampling: RequestSamplingState  # shared: greedy without processors keeps no state
    members: list[Request] = field(default_factory=list)
    tops: list[TokenLogprob | None] = field(default_factory=list)
    held: list[HeldKV | None] = field(default_factory=list)
    step_count: int = 0
    outputs: list[EngineOutput] | None = None  # the n best, once finished

    @property
    def complete(self) -> bool:
        """Whether every live beam of the step has reported."""
        return all(t is not None for t in self.tops)

    def spawn(self, first_params: SamplingParams | None = None) -> list[Request]:
        """One request per live beam (the prompt alone at first), without blocks yet.
        `first_params`: for the first step, which may compute prompt_logprobs."""
        root = self.root
        self.members = []
        for j, beam in enumerate(self.search.live):
            member = Request(
                f"{root.request_id}/beam{self.step_count}.{j}",
                root.prompt_token_ids,
                first_params or self.member_params,
                max_total_tokens=root.max_total_tokens,
                output_token_ids=list(beam.token_ids),
            )
            member.sampling = self.sampling
            member.lora, member.lora_adapter = root.lora, root.lora_adapter
            member.priority = root.priority
            member.beam = self
            member.beam_index = j
            if member.params.prompt_logprobs is not None:
                member.out.prompt_logprobs = [None]
            self.members.append(member)
        self.tops = [None] * len(self.members)
        self.held = [None] * len(self.members)
        self.step_count += 1
        return self.members


class BeamSearchRunner:
    def __init__(
        self,
        scheduler: Scheduler,
        kv: KVCacheManager,
        copy_blocks: Callable[[list[tuple[int, int]]], None],
        inputs: InputProcessor,
    ) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.copy_blocks = copy_blocks  # the runner's: (src, dst) block pairs, in every layer
        self.inputs = inputs
        self._unfinished_steps: set[BeamGroup] = set()  # some beams reported, not all

    def start(self, root: Request) -> None:
        """Makes `root` a beam search and queues its first step: the prompt, as transformers
        starts (one beam)."""
        p = root.params
        search = BeamSearch(
            width=p.num_sequences,
            stop_rule=root.stop_rule,
            length_penalty=p.length_penalty,
            early_stopping=p.early_stopping,
            logprobs=p.logprobs,
        )
        member = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
        # The search needs more top tokens than a client may ask for (2 * width or more).
        member.logprobs = min(search.tokens_per_beam, self.inputs.vocab_size)
        first = member
        if p.prompt_logprobs is not None:
            first = dataclasses.replace(member, logprobs=None, prompt_logprobs=p.prompt_logprobs)
            first.logprobs = member.logprobs
        # Members run greedy and never stop on their own: the search's rule decides.
        no_stop = StopRule.of(member, (), None)
        sampling = RequestSamplingState(member, root.prompt_token_ids, no_stop)
        group = BeamGroup(root, search, member, sampling)
        root.beam = group
        for m in group.spawn(first):
            self.scheduler.add(m)

    def abort(self, group: BeamGroup) -> None:
        for member in group.members:
            if not member.finished:
                self.scheduler.finish(member, FinishReason.ABORT)
        self._release_held(group)
        group.root.status = RequestStatus.FINISHED
        group.root.finish_reason = FinishReason.ABORT

    def on_top_tokens(self, member: Request, top: TokenLogprob) -> EngineOutput | None:
        """A beam's one-step request has its top tokens: it ends, handing its blocks to the
        group. Once every beam of the step has reported, the search moves on and the next beams
        start from their parents' blocks, queued ahead of new requests. Returns the search's
        output when it ends."""
        group = member.beam
        j = member.beam_index
        group.tops[j] = top
        if member.out.prompt_logprobs is not None:
            group.root.out.prompt_logprobs = member.out.prompt_logprobs
        self.scheduler.finish_keeping_blocks(member, FinishReason.STOP)
        group.held[j] = HeldKV(member, member.num_computed_tokens)
        if not group.complete:
            self._unfinished_steps.add(group)
            return None
        self._unfinished_steps.discard(group)
        if group.search.step(group.tops):
            self._release_held(group)
            return self._finish(group)
        held = group.held
        children = group.spawn()
        self._fork_blocks(held, [beam.parent for beam in group.search.live], children)
        for child in reversed(children):
            self.scheduler.add(child, front=True)
        return None

    def end_step(self) -> None:
        """A search whose step is split across engine steps must not hold blocks while it waits
        for its other beams (those may need them to run): its next beams will find their
        prefixes in the cache instead."""
        for group in self._unfinished_steps:
            self._release_held(group)
        self._unfinished_steps.clear()

    def drop_waiting_blocks(self) -> bool:
        """Nothing could be scheduled: beams waiting with their parents' blocks may be what
        fills the cache. They let go (their prefixes stay cached) so the queue can move."""
        return self.scheduler.release_waiting_blocks(lambda req: req.beam is not None)

    def _fork_blocks(
        self, held: list[HeldKV | None], parents: list[int], children: list[Request]
    ) -> None:
        """Gives each new beam its parent's KV, so it computes only its new token: the first
        child of a parent takes the parent's blocks, the others share its full blocks and get a
        copy of its last, partly filled one (copy-on-write done at once, as the first child is
        about to write into it). Without room for a copy, a beam computes that block's tokens
        again. Blocks of beams nobody extends are freed (their full blocks stay cached)."""
        kv = self.kv
        for b, held_kv in enumerate(held):
            if held_kv is not None and b not in parents:
                kv.free(held_kv.owner)
        first_child: dict[int, Request] = {}
        copies: list[tuple[int, int]] = []
        for child, b in zip(children, parents):
            held_kv = held[b]
            if held_kv is None:  # released: the cached prefix serves when it is admitted
                continue
            if b not in first_child:
                first_child[b] = child
                continue
            computed, pairs = kv.fork(held_kv.owner, child, held_kv.num_computed_tokens)
            child.num_computed_tokens = computed
            copies.extend(pairs)
        for b, child in first_child.items():  # the parent's own blocks, once the others forked
            kv.transfer(held[b].owner, child)
            child.num_computed_tokens = held[b].num_computed_tokens
        self.copy_blocks(copies)

    def _release_held(self, group: BeamGroup) -> None:
        for j, held_kv in enumerate(group.held):
            if held_kv is not None:
                self.kv.free(held_kv.owner)
                group.held[j] = None

    def _finish(self, group: BeamGroup) -> EngineOutput:
        root = group.root
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
        detokenizer = self.inputs.detokenizer(root.prompt_token_ids, p)
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
            prompt_logprobs=root.out.prompt_logprobs,
            times=root.times,
        )

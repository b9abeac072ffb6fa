"""The scheduler: each step, a token budget handed out across running and waiting requests.

There is no prefill phase and no decode phase. A request has `num_computed_tokens` (K/V already
in the cache) and `num_tokens` (prompt plus output so far); a step gives it some of the
difference. A decode is a grant of one token, a prefill a grant of many, a chunked prefill a
grant smaller than what is left, so the model always runs one ragged batch.

Order of service: running requests first (oldest first), so requests in flight keep producing
tokens; then waiting requests while budget, blocks and `max_num_seqs` allow. When a running
request needs a block and none is free, the newest running request is preempted: its blocks
are freed, its computed tokens forgotten, and it goes back to the head of the queue, to be
recomputed later (its prompt plus the output it already has, so the output continues exactly).

Under the `priority` policy (vLLM's), the queue is kept in (priority, arrival) order, lower
first, and the running request preempted is the worst by the same key: the largest priority
value, the latest arrival among equals. A preempted request keeps its arrival, so it returns to
its place in the queue. As in vLLM, a waiting request never preempts running ones to get in:
priority decides who waits and who gives way when those running outgrow the cache.

Blocks are the KV cache manager's (kv_cache_manager.py): the scheduler asks it for a request's
cached prefix, for the blocks a grant needs, and to free them; it never holds block ids itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .request import FinishReason, Request, RequestStatus
from .sampling.logprobs import TokenLogprob
from .stop_rule import Stop


@dataclass
class Sampled:
    """What a step produced for one request: its new tokens (one, or several to append in order
    until one stops it) with their logprobs, and how many computed tokens to roll back (a
    speculative step's rejected drafts)."""

    request: Request
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None = None
    rollback: int = 0


@dataclass
class Update:
    """One request's outcome of a step: the tokens it kept (those after a stop are dropped), the
    text they released, their logprobs, and the error that failed it alone, if any."""

    request: Request
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    error: Exception | None = None


# The output side of a token: (request, token, logprob, the stop rule's verdict) -> (the text it
# releases, the final verdict). output_processor.process_token.
TokenOutput = Callable[
    [Request, int, "TokenLogprob | None", "Stop | None"], tuple[str, "Stop | None"]
]


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Speculative decoding: request id -> the draft tokens its grant verifies after its last
    # token (its grant is 1 + len(drafts)); speculative.py.
    drafts: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_loras: int = 0,
        policy: str = "fcfs",
        max_num_partial_prefills: int = 1,
    ) -> None:
        self.kv = kv
        # Prompts prefilled side by side (vLLM's --max-num-partial-prefills); see _prefill_cap.
        self.max_num_partial_prefills = max_num_partial_prefills
        self.by_priority = policy == "priority"
        self.max_loras = max_loras  # distinct adapters running at once (0: no adapters)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._arrivals = 0
        self._fronts = 0  # arrivals handed to `front` requests under the priority policy
        # Gemma 3: an image's tokens attend to each other both ways, so a chunk never ends
        # inside an image's span (set by the engine for such models).
        self.whole_images = False
        # Encoders: a request's tokens attend to each other both ways, so its prompt is
        # computed in one step, never in chunks (set by the engine for such models).
        self.whole_prompts = False
        # KV blocks (src, dst) to copy in every layer (the model runner's; set by the engine).
        self.copy_blocks: Callable[[list[tuple[int, int]]], None] = _no_copies
        # Speculative decoding (set by the engine when on): (request, the most drafts this
        # step's budget leaves room for) -> draft tokens to verify after its next token.
        self.propose: Callable[[Request, int], list[int]] | None = None
        # Called whenever a request's blocks are freed (its end, abort, preemption): a draft
        # model's cache frees its blocks too (set by the engine; draft_model.py).
        self.on_free: Callable[[Request], None] | None = None

    # -- queue management -------------------------------------------------------------------

    def add(self, request: Request, front: bool = False) -> None:
        """`front`: ahead of the queue, for work that continues a request already in flight
        (the next beams of a beam search)."""
        if front and self.by_priority:
            # Ahead of every request of its priority: an arrival before them all.
            self._fronts -= 1
            request.arrival = self._fronts
        else:
            request.arrival = self._arrivals
            self._arrivals += 1
        request.status = RequestStatus.WAITING
        if self.by_priority:
            self._queue_in_order(request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _queue_in_order(self, request: Request) -> None:
        """Puts `request` in the queue at its (priority, arrival) place (priority policy)."""
        key = _rank(request)
        for i, other in enumerate(self.waiting):
            if _rank(other) > key:
                self.waiting.insert(i, request)
                return
        self.waiting.append(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Removes a request wherever it is and frees its blocks at once."""
        self.finish_keeping_blocks(request, reason)
        self._free_blocks(request)

    def finish_keeping_blocks(self, request: Request, reason: FinishReason) -> None:
        """Ends a request whose KV lives on (a beam's, for the beams that extend it): its blocks
        stay with the KV cache manager under its id, for the caller to fork or free."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = RequestStatus.FINISHED
        if request.finish_reason is None:
            request.finish_reason = reason

    def release_waiting_blocks(self, which: Callable[[Request], bool]) -> bool:
        """Frees the blocks that waiting requests chosen by `which` hold (they compute again, or
        find their prefixes in the cache, once admitted). Whether any were freed."""
        released = False
        for req in self.waiting:
            if self.kv.holds(req) and which(req):
                self._free_blocks(req)
                req.num_computed_tokens = 0
                released = True
        return released

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        out = ScheduledBatch()
        budget = self.max_num_batched_tokens
        cap = self._prefill_cap()
        partial = 0  # grants this step that leave part of a prompt for later

        # Running requests, oldest first. A preempted request leaves `running`, so iterate over
        # a snapshot and skip those already gone.
        running = list(self.running)
        for i, req in enumerate(running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue
            left = req.num_tokens - req.num_computed_tokens
            num_new = self._chunk(req, self._grant(left, budget, cap, partial))
            if num_new <= 0:
                continue
            partial += cap is not None and num_new < left
            drafts = None
            # Drafts take only budget that leaves a token for each running request after this
            # one (a decode is never put off for another request's drafts).
            room = budget - 1 - (len(running) - i - 1)
            if self.propose is not None and left == 1 and room > 0:
                drafts = self.propose(req, room) or None
                if drafts:
                    num_new += len(drafts)
            while not self._grow(req, req.num_computed_tokens + num_new):
                if drafts:  # no room for the drafts' KV: decode one token before preempting
                    num_new, drafts = 1, None
                    continue
                victim = max(self.running, key=_rank) if self.by_priority else self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
                if victim in out.requests:  # scheduled earlier in this step: its grant returns
                    i = out.requests.index(victim)
                    budget += out.num_new_tokens[i]
                    del out.requests[i], out.num_new_tokens[i]
                    out.drafts.pop(victim.request_id, None)
            if req.status is not RequestStatus.RUNNING:
                continue
            if drafts and self.kv.state_pool is not None:
                # Recurrent layers: their state is copied aside first, for a rollback to go
                # back to (kv_cache_manager.snapshot_state); no spare slot, no drafts. A slot
                # stays for each waiting request: drafts never keep one from starting.
                free = self.kv.state_pool.num_free > len(self.waiting)
                copy = self.kv.snapshot_state(req, req.num_computed_tokens) if free else None
                if copy is None:
                    num_new, drafts = 1, None
                else:
                    self.copy_blocks([copy])
            if drafts:
                out.drafts[req.request_id] = drafts
            out.requests.append(req)
            out.num_new_tokens.append(num_new)
            budget -= num_new

        # Waiting requests, in order, unless this step had to preempt (no room for newcomers).
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            req = self.waiting[0]
            if req.lora_id and not self._lora_fits(req.lora_id):
                break  # first come, first served: it waits for an adapter slot to free
            self._take_cached_prefix(req)
            left = req.num_tokens - req.num_computed_tokens
            num_new = self._chunk(req, self._grant(left, budget, cap, partial))
            partial += cap is not None and 0 < num_new < left
            # No grant: its next image does not fit what is left of this step's budget, or
            # MAX_NUM_PARTIAL_PREFILLS prompts are part-way already.
            if num_new <= 0:
                self._free_blocks(req)
                req.num_computed_tokens = 0
                break
            if not self._grow(req, req.num_computed_tokens + num_new):
                self._free_blocks(req)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.requests.append(req)
            out.num_new_tokens.append(num_new)
            budget -= num_new
        return out

    # -- a step's outcome ----------------------------------------------------------------------

    def update(
        self, batch: ScheduledBatch, sampled: list[Sampled], output: TokenOutput
    ) -> list[Update]:
        """Applies a step's outcome in one place: every scheduled request's computed tokens
        advance (less any rolled back); each sampled token is appended and judged by the stop
        rule and the output side (`output`), until one stops the request (later ones are
        dropped); every block that became full is keyed and what left a window is released;
        finished requests end and free their blocks. A request whose output side raises is
        reported with its error (the caller aborts it); the others go on."""
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
        updates = []
        ended: list[tuple[Request, Stop]] = []
        for s in sampled:
            req = s.request
            if s.rollback:
                self.rollback(req, req.num_computed_tokens - s.rollback)
            up = Update(req)
            updates.append(up)
            lps = s.logprobs or [None] * len(s.token_ids)
            try:
                for tok, lp in zip(s.token_ids, lps):
                    req.output_token_ids.append(tok)
                    stop = req.stop_rule.check(tok, len(req.output_token_ids))
                    text, stop = output(req, tok, lp, stop)
                    up.token_ids.append(tok)
                    if lp is not None:
                        up.logprobs.append(lp)
                    up.text += text
                    if stop is not None:
                        ended.append((req, stop))
                        if req.num_computed_tokens >= req.num_tokens:
                            # A verified speculative run cut short: the KV of the tokens
                            # after the stop goes, so no block is keyed with them.
                            self.rollback(req, req.num_tokens - 1)
                        break
            except Exception as exc:  # this request's own fault: it fails, the others go on
                up.error = exc
        for req in batch.requests:
            if not req.finished:  # blocks of requests ending now are cached before they go
                self.cache_computed_blocks(req)
            if self.kv.state_pool is not None and req.request_id in batch.drafts:
                self.kv.drop_snapshot(req)  # every draft kept (a rollback took it otherwise)
        copies = self.kv.take_copies()  # recurrent states of prefixes, kept for later requests
        if copies:
            self.copy_blocks(copies)
        for req, stop in ended:
            req.finish_reason = stop.reason
            req.stop_reason = stop.stop_reason
            self.finish(req, stop.reason)
        return updates

    def rollback(self, req: Request, num_computed: int) -> None:
        """Forgets the KV of `req`'s tokens from `num_computed` on (rejected speculative tokens):
        the blocks that held only those go back to the pool. Tokens still uncomputed are
        computed again by a later grant."""
        computed, copies = self.kv.rollback(req, max(0, num_computed))
        req.num_computed_tokens = computed
        if copies:
            self.copy_blocks(copies)

    def _prefill_cap(self) -> int | None:
        """The most tokens one prompt's chunk may take this step when several prompts are to
        be prefilled side by side (max_num_partial_prefills > 1): the step's budget shared
        among up to that many prompts, those part-way and those waiting. None: no cap (one
        prompt at a time, taking what budget is left, as with max_num_partial_prefills 1)."""
        n = self.max_num_partial_prefills
        if n <= 1:
            return None
        # Waiting prompts count only as far as there are seats for them this step.
        seats = max(0, self.max_num_seqs - len(self.running))
        prefilling = min(len(self.waiting), seats) + sum(
            1 for r in self.running if r.num_tokens - r.num_computed_tokens > 1
        )
        k = min(n, prefilling)
        return None if k <= 1 else max(1, self.max_num_batched_tokens // k)

    def _grant(self, left: int, budget: int, cap: int | None, partial: int) -> int:
        """Tokens to offer a request with `left` to compute: what the budget allows; with a
        prefill cap, at most the cap for a prompt, and none for a prompt that would be left
        part-way when max_num_partial_prefills prompts already are."""
        want = min(left, budget)
        if cap is None or left <= 1:
            return want
        want = min(want, cap)
        if want < left and partial >= self.max_num_partial_prefills:
            return 0
        return want

    def _chunk(self, req: Request, num_new: int) -> int:
        """`num_new`, shortened so the chunk does not end inside an image's span when images
        attend both ways (0: the next image needs more budget than this step has left); with
        `whole_prompts`, the whole prompt or nothing."""
        if self.whole_prompts:
            return num_new if num_new >= req.num_tokens - req.num_computed_tokens else 0
        start = req.num_computed_tokens
        end = start + num_new
        if self.kv.state_pool is not None and self.kv.pool.enable_prefix_caching:
            # Recurrent layers keep their state only as of a step's end: a prompt's chunk ends
            # at its last block boundary first, so that prefix's state is cached for later
            # requests (kv_cache_manager.cache_full_blocks).
            boundary = req.num_prompt_tokens // self.block_size * self.block_size
            if start < boundary < end:
                end, num_new = boundary, boundary - start
        if not self.whole_images or req.mm is None:
            return num_new
        for item in req.mm.items:
            if item.offset < end < item.end:
                end = max(start, item.offset)
        return end - start

    def _lora_fits(self, lora_id: int) -> bool:
        active = {r.lora_id for r in self.running if r.lora_id}
        return lora_id in active or len(active) < self.max_loras

    # -- blocks -----------------------------------------------------------------------------

    def _take_cached_prefix(self, req: Request) -> None:
        """Starts a request after the longest prefix already in the cache. At least its last
        token is always computed (it yields the logits to sample from), so the blocks it writes
        are never shared ones."""
        if req.num_computed_tokens or self.kv.holds(req):
            return
        if req.needs_prompt_logprobs:  # cached positions would yield no logits
            return
        if req.pooling is not None and not req.pooling.reuse_prefix:
            return  # every row is pooled (mean, CLS) or the attention is bidirectional
        max_blocks = (req.num_tokens - 1) // self.block_size
        if max_blocks == 0:
            return
        tokens = req.prompt_token_ids + req.output_token_ids
        req.num_computed_tokens = self.kv.take_cached_prefix(
            req, tokens, max_blocks, req.prefix_salt(self.kv.block_size)
        )
        copies = self.kv.take_copies()  # a cached prefix's recurrent state into its slot
        if copies:
            self.copy_blocks(copies)

    def cache_computed_blocks(self, req: Request) -> None:
        """After a step: keys each block of `req` that has just become full and computed, and
        lets go of what fell out of its sliding windows."""
        self.kv.cache_full_blocks(
            req, req.num_computed_tokens, req.token_slice, req.prefix_salt(self.kv.block_size)
        )
        self.kv.release_out_of_window(req, req.num_computed_tokens)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Makes `req` hold enough blocks for `num_tokens` tokens; False if the pool is short."""
        return self.kv.allocate(req, req.num_computed_tokens, num_tokens)

    def _free_blocks(self, req: Request) -> None:
        self.kv.free(req)
        if self.on_free is not None:
            self.on_free(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free_blocks(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            self._queue_in_order(req)
        else:
            self.waiting.appendleft(req)


def _rank(req: Request) -> tuple[int, int]:
    """A request's place under the priority policy: lower is served first, higher given up
    first."""
    return (req.priority, req.arrival)


def _no_copies(pairs: list[tuple[int, int]]) -> None:
    raise RuntimeError("this scheduler has no KV cache to copy blocks in")

"""Speculative decoding's `draft_model` proposer: a smaller model of the same tokenizer, with its
own paged KV cache, run for k greedy steps to propose k tokens for each speculating request.
The target verifies them exactly as it verifies ngram's (speculative.py, greedy acceptance).

Before the scheduler forms a step (`LLMEngine.step`), `propose_for` drafts for every running
request whose next grant is a decode and that may speculate, all in one batch: a first ragged
pass feeds each request's tokens the draft has not computed yet (its whole prompt the first
time, after that the tokens the last verification added) and takes the argmax at its last row
as draft 1; then k - 1 one-token passes feed draft i and take draft i + 1. The scheduler then
takes up to as many as its budget leaves (`take`).

The draft's KV follows the request's accepted tokens lazily. After drafting, the draft cache
holds the request's first n tokens and drafts 1 .. k-1 (`Fed`). At the next drafting, the
drafts that are now the request's own tokens (accepted) stay; the KV of the others is rolled
back, and the tokens the target added since are fed in the first pass. So the draft's KV is
always the request's true prefix; its blocks are freed when the request ends, is aborted or is
preempted (the scheduler's `on_free` hook), or when the draft's pool has no room for it (it then
decodes without drafts and catches up later). The first pass feeds at most the step's token
budget over all requests: a long prompt's catch-up is chunked over several steps, and the
request drafts once it is caught up.

Drafting is greedy (the argmax): a deterministic proposal, the one that stays correct under
rejection sampling as well (its proposal distribution q is one-hot).

The draft's blocks come from the same cache budget as the target's (split in proportion to
their bytes a token, so both hold the same number of tokens: `split_blocks`); it keeps no prefix
cache (its blocks are never shared, so roll-back never copies).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import ConfigError
from .kv_cache import BlockPool
from .kv_cache_manager import KVCacheManager
from .model_runner import HostBatch, ModelRunner, PromptLogprobWork
from .request import Request


@dataclass
class Fed:
    """What one request's draft cache holds: its first `computed` tokens, then `drafts` (the
    drafts fed after them, at positions computed, computed + 1, ...)."""

    computed: int = 0
    drafts: list[int] = field(default_factory=list)


def split_blocks(num_blocks: int, target_bytes: int, draft_bytes: int) -> int:
    """The blocks each cache gets when the memory of `num_blocks` target blocks is shared by the
    target's and the draft's caches, both holding the same number of blocks (tokens)."""
    return max(1, num_blocks * target_bytes // (target_bytes + draft_bytes))


def check_same_tokenizer(target_tok, target_vocab: int, draft_tok, draft_vocab: int, name: str):
    """ConfigError unless the draft scores the target's token ids: the same vocabulary size and
    (when the draft has a tokenizer of its own) the same token -> id map."""
    if draft_vocab != target_vocab:
        raise ConfigError(
            f"speculative_config draft model {name!r} has a vocabulary of {draft_vocab} tokens, "
            f"the target {target_vocab}: a draft must share the target's tokenizer"
        )
    if draft_tok is None:
        return
    a, b = target_tok.get_vocab(), draft_tok.get_vocab()
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()))[:3]
        raise ConfigError(
            f"speculative_config draft model {name!r}: its tokenizer differs from the target's "
            f"({len(a)} and {len(b)} entries; e.g. {differ}): a draft must share the target's "
            "tokenizer"
        )


class DraftModel:
    def __init__(self, loaded, num_blocks: int, block_size: int, max_step_tokens: int) -> None:
        self.loaded = loaded
        self.source = loaded.resolved.source
        layout = loaded.cache_layout()
        if layout.has_state:
            raise ConfigError(
                f"speculative_config draft model {self.source!r} has recurrent layers, whose "
                "state cannot be rolled back: a draft must be an attention-only model"
            )
        self.block_size = block_size
        self.max_step_tokens = max_step_tokens
        self.num_blocks = num_blocks
        self.kv_bytes_per_token = loaded.kv_bytes_per_token()
        self.kv_caches = loaded.allocate_kv_cache(num_blocks, block_size)
        self.pool = BlockPool(num_blocks, enable_prefix_caching=False)
        self.kv = KVCacheManager(self.pool, layout, block_size)
        self.runner = ModelRunner(
            loaded.model, self.kv_caches, loaded.backend, block_size, loaded.device, layout
        )
        self.runner.kv = self.kv
        self.fed: dict[Request, Fed] = {}
        self.proposals: dict[Request, list[int]] = {}

    # -- the scheduler's side -------------------------------------------------------------------

    def take(self, req: Request, k: int) -> list[int]:
        """Up to `k` of this step's drafts for `req` ([] when it has none)."""
        return self.proposals.pop(req, [])[:k] if k > 0 else []

    def free(self, req: Request) -> None:
        """Forgets `req`: its draft blocks go back to the pool (its end, abort or preemption)."""
        self.kv.free(req)
        self.fed.pop(req, None)
        self.proposals.pop(req, None)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    # -- drafting -------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose_for(self, wanted: list[tuple[Request, int]]) -> None:
        """Drafts up to k tokens for each (request, k) of `wanted` (requests whose next grant is
        a decode), in one batch; `take` hands them out."""
        self.proposals.clear()
        budget = self.max_step_tokens
        first: list[tuple[Request, int, list[int]]] = []  # (request, start, tokens fed)
        drafting: list[tuple[Request, int]] = []  # (request, k) whose first pass drafts
        for req, k in wanted:
            if budget <= 0:
                break
            start = self._sync(req)
            n = req.num_tokens
            end = min(n, start + budget)
            writes = n + k - 1 if end == n else end  # drafts 1 .. k-1 are fed after the pass
            if not self.kv.allocate(req, start, writes):
                self.free(req)  # no room: it decodes without drafts and catches up later
                continue
            first.append((req, start, req.token_slice(start, end)))
            budget -= end - start
            if end == n:
                drafting.append((req, k))
            else:
                self.fed[req] = Fed(end)
        if not first:
            return
        sampled = {req for req, _ in drafting}
        firsts = self._run(first, sampled)  # in the order of `first`, sampled requests only
        order = [req for req, _, _ in first if req in sampled]
        drafts = {req: [tok] for req, tok in zip(order, firsts)}
        step = [(req, k) for req, k in drafting if k > 1]
        for j in range(1, max((k for _, k in drafting), default=1)):
            step = [(req, k) for req, k in step if k > j]
            if not step:
                break
            rows = [(req, req.num_tokens + j - 1, [drafts[req][-1]]) for req, _ in step]
            for (req, _), tok in zip(step, self._run(rows, {req for req, _ in step})):
                drafts[req].append(tok)
        for req, k in drafting:
            self.fed[req] = Fed(req.num_tokens, drafts[req][: k - 1])
            self.proposals[req] = drafts[req]

    def _sync(self, req: Request) -> int:
        """Rolls `req`'s draft cache back to its longest prefix that is still the request's own
        (the drafts since accepted stay); returns how many tokens it holds."""
        fed = self.fed.pop(req, None)
        if fed is None:  # nothing drafted yet (or freed): its blocks went with its record
            return 0
        keep = fed.computed
        n = req.num_tokens
        for tok in fed.drafts:
            if keep >= n or req.token_slice(keep, keep + 1)[0] != tok:
                break
            keep += 1
        keep = min(keep, n - 1)  # the last token is always fed: its row gives draft 1
        computed, copies = self.kv.rollback(req, keep)
        assert not copies, "draft blocks are never shared"
        return computed

    def _run(self, rows: list[tuple[Request, int, list[int]]], sampled: set) -> list[int]:
        """One draft forward over `rows` (request, first position, tokens); the argmax at the
        last row of each request in `sampled`, in the order of `rows`."""
        h, _ = draft_batch(
            self.kv, self.block_size, [(req, start, start, ids) for req, start, ids in rows],
            [i for i, (req, _, _) in enumerate(rows) if req in sampled],
        )  # fmt: skip
        logits, _ = self.runner.run(h)
        if logits is None:
            return []
        return logits.argmax(dim=-1).tolist()

    def check(self) -> None:
        """Asserts the draft pool's books balance and hold only known requests' blocks."""
        self.kv.check()
        assert set(self.kv.owners()) <= set(self.fed), "draft blocks of a forgotten request"


def draft_batch(kv, block_size: int, rows, sampled: list[int]) -> tuple[HostBatch, list[int]]:
    """A draft pool's forward as one host batch: `rows` (request, its first cache index,
    its first position, tokens; the cache index and the position differ where a head's cache
    starts past the prompt's start), the one-token rows first as the runner orders a step;
    the last token of each row listed in `sampled` (indices into `rows`, in order) is
    sampled. Returns the batch and each row's first index in it, in the order of `rows`."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][3]) != 1)  # decodes first
    groups = kv.layout.num_groups
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[list[int]] = [[] for _ in range(groups)]
    tables: list[list[list[int]]] = [[] for _ in range(groups)]
    query_lens: list[int] = []
    seq_lens: list[int] = []
    first = [0] * len(rows)
    for i in order:
        req, lo, start, ids = rows[i]
        first[i] = len(input_ids)
        hi = lo + len(ids)  # cache indices lo .. hi - 1
        input_ids.extend(ids)
        positions.extend(range(start, start + len(ids)))
        for g, blocks in enumerate(kv.block_tables(req)):
            slots[g].extend(blocks[p // block_size] * block_size + p % block_size
                            for p in range(lo, hi))  # fmt: skip
            tables[g].append(blocks)
        query_lens.append(len(ids))
        seq_lens.append(hi)
    h = HostBatch(
        input_ids=input_ids,
        positions=positions,
        slots=slots,
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables=[_table(t) for t in tables],
        num_decodes=sum(1 for n in query_lens if n == 1),
        sample_reqs=[],
        sample_idx=[first[i] + len(rows[i][3]) - 1 for i in sampled],
        prompt_work=PromptLogprobWork(),
    )
    return h, first


def _table(tables: list[list[int]]) -> torch.Tensor:
    """[requests, longest] int32, padded with block 0."""
    out = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int32)
    for r, t in enumerate(tables):
        out[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return out

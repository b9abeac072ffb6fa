"""The accept/resample step of speculative decoding over a ragged batch, for deterministic
proposals (ngram, a greedy draft model: q is one-hot on the draft): a Triton kernel and its torch
reference.

Request b owns rows cu_rows[b] .. cu_rows[b + 1] - 1 of `probs`: one per draft and a last one
for the token after them, each the (unnormalised) distribution plain decoding would sample from
at that position. Row r holds the draft it verifies (`draft_ids[r]`, -1 on a request's last
row) and one uniform u_r. The row's draw y_r is the inverse CDF of its distribution at u_r, in
vocabulary order: the first token whose cumulative weight passes u_r * total (never a token of
weight 0). The request keeps y_r for its rows in order up to and including the first row whose
draw is not its draft. That is rejection sampling with q one-hot on the draft x: x is kept with
probability p(x) (= min(1, p(x) / q(x))), and a rejected row gives y_r conditioned on y_r != x,
which is the normalised residual max(p - q, 0); a request whose drafts are all kept gets its
last row's draw from p. One uniform per row, so the draws are those plain decoding would make
from the same uniforms.

The engine's verification (sampling/verify.py) takes the same draws from the sampler itself
(the sampler's own inverse CDF, which for truncating rows runs over the kept candidates in
probability order); this step is for a caller holding the processed probabilities. The
reference runs on CPU; the kernel, one program per request, is tested against it under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from .triton_lazy import jit, next_power_of_2

tl = None  # triton.language, bound at the first launch (see triton_lazy)

__all__ = ["rejection_sample", "rejection_sample_reference", "rejection_sample_triton"]


def _check(probs, cu_rows, draft_ids, uniforms) -> None:
    rows = probs.shape[0]
    if probs.dim() != 2 or draft_ids.shape != (rows,) or uniforms.shape != (rows,):
        raise ValueError("probs [R, V], draft_ids [R] and uniforms [R] must agree")
    if cu_rows.dim() != 1 or cu_rows.numel() < 1:
        raise ValueError("cu_rows must be [B + 1]")


def rejection_sample_reference(
    probs: torch.Tensor, cu_rows: torch.Tensor, draft_ids: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [R] int64: request b's kept tokens at rows cu_rows[b] .. cu_rows[b] +
    num_kept[b] - 1, -1 on its other rows; num_kept [B] int32)."""
    _check(probs, cu_rows, draft_ids, uniforms)
    rows, vocab = probs.shape
    w = probs.float().clamp(min=0.0)
    cdf = w.cumsum(dim=-1)
    total = cdf[:, -1:] if vocab else cdf
    drawn = torch.searchsorted(cdf, uniforms.float().unsqueeze(1) * total, right=True).squeeze(1)
    last = vocab - 1 - (w > 0).flip(-1).int().argmax(dim=-1)
    drawn = torch.where(drawn >= vocab, last, drawn)  # u * total rounded up to the total
    tokens = torch.full((rows,), -1, dtype=torch.int64, device=probs.device)
    bounds = cu_rows.tolist()
    kept = []
    drawn_list, draft_list = drawn.tolist(), draft_ids.tolist()
    for b in range(len(bounds) - 1):
        n = 0
        for r in range(bounds[b], bounds[b + 1]):
            n += 1
            if drawn_list[r] != draft_list[r]:
                break
        tokens[bounds[b] : bounds[b] + n] = drawn[bounds[b] : bounds[b] + n]
        kept.append(n)
    return tokens, torch.tensor(kept, dtype=torch.int32, device=probs.device)


@jit
def _rejection_kernel(
    probs_ptr,
    cu_rows_ptr,
    draft_ptr,
    u_ptr,
    tokens_ptr,
    kept_ptr,
    stride_row,
    vocab,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(cu_rows_ptr + b)
    end = tl.load(cu_rows_ptr + b + 1)
    cols = tl.arange(0, BLOCK_V)
    alive = tl.full([], 1, tl.int32)
    kept = tl.full([], 0, tl.int32)
    for r in range(start, end):
        row_ptr = probs_ptr + (r + tl.zeros([], tl.int64)) * stride_row
        # Pass 1: the row's total weight and its last token of positive weight.
        total = tl.full([], 0.0, tl.float32)
        last = tl.full([], -1, tl.int32)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + cols
            mask = offs < vocab
            p = tl.maximum(tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32), 0.0)
            total += tl.sum(p, axis=0)
            last = tl.maximum(last, tl.max(tl.where(p > 0.0, offs, -1), axis=0))
        target = tl.load(u_ptr + r).to(tl.float32) * total
        # Pass 2: the first token whose cumulative weight passes the target.
        below = tl.full([], 0.0, tl.float32)
        found = tl.full([], 0, tl.int32) + vocab
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + cols
            mask = offs < vocab
            p = tl.maximum(tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32), 0.0)
            cdf = below + tl.cumsum(p, axis=0)
            found = tl.minimum(found, tl.min(tl.where((cdf > target) & mask, offs, vocab), axis=0))
            below += tl.sum(p, axis=0)
        drawn = tl.where(found >= vocab, last, found)
        draft = tl.load(draft_ptr + r).to(tl.int32)
        tl.store(tokens_ptr + r, tl.where(alive > 0, drawn, -1).to(tl.int64))
        kept += alive
        alive = tl.where(drawn == draft, alive, 0)
    tl.store(kept_ptr + b, kept)


def rejection_sample_triton(
    probs: torch.Tensor, cu_rows: torch.Tensor, draft_ids: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel, with `rejection_sample_reference`'s contract."""
    _check(probs, cu_rows, draft_ids, uniforms)
    rows, vocab = probs.shape
    probs = probs if probs.stride(-1) == 1 else probs.contiguous()
    batch = cu_rows.numel() - 1
    tokens = torch.empty(rows, dtype=torch.int64, device=probs.device)
    kept = torch.empty(batch, dtype=torch.int32, device=probs.device)
    if batch:
        _rejection_kernel[(batch,)](
            probs,
            cu_rows.to(torch.int32).contiguous(),
            draft_ids.to(torch.int64).contiguous(),
            uniforms.float().contiguous(),
            tokens,
            kept,
            probs.stride(0),
            vocab,
            BLOCK_V=min(1024, max(16, next_power_of_2(vocab))),
        )
    return tokens, kept


def rejection_sample(
    probs: torch.Tensor, cu_rows: torch.Tensor, draft_ids: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on CUDA, the reference elsewhere."""
    if probs.is_cuda:
        return rejection_sample_triton(probs, cu_rows, draft_ids, uniforms)
    return rejection_sample_reference(probs, cu_rows, draft_ids, uniforms)

"""The truncation samplers and smoothing, applied to the most likely tokens of each row.

Order (Aphrodite's): top-k, top-p, top-a, min-p, tfs, eta, epsilon, typical, then quadratic
smoothing. Every sampler but typical keeps a prefix of the tokens sorted by logit, so once one
of them has cut a row inside its K most likely tokens, everything after it only needs those K:
a full sort of a 50k vocabulary costs more than the model's decode step on a CPU, `topk(64)`
a few percent of it.

So each row runs the chain on its top-K candidates, K = 64 first (or more for a large top_k).
While a row is still "open" (nothing cut yet, the kept set may reach past the candidates), a
sampler that needs the whole distribution gets it from per-row values computed over the
vocabulary: its log-normaliser (top-p, top-a, eta, epsilon) and entropy (eta). When a sampler
would keep more than the candidates, the row is retried with K = 1024, then with the whole
vocabulary sorted, where everything is exact. Which level a row ends at depends on its own
logits and parameters only, never on the rest of the batch, so seeded sampling stays
batch-independent.

Definitions, each checked against transformers' warpers or a written-out formula in the tests:
- top_k: keep logits >= the k-th largest (ties kept).
- top_p: transformers' nucleus: drop tokens whose mass above them is >= p (the token that
  crosses p is kept).
- top_a: drop p < top_a * p_max^2; min_p: drop p < min_p * p_max (p renormalised over what
  survives the samplers before).
- tfs: Aphrodite's tail-free sampling on the second differences of the sorted probabilities.
- eta: drop p < min(eta, sqrt(eta) * exp(-entropy)); epsilon: drop p < epsilon (both given in
  units of 1e-4, as Aphrodite); each keeps the most likely token.
- typical_p: transformers' locally typical sampling (keeps the token that crosses the mass).
- smoothing: logit -> max - k d^2 + s d^3 with d = logit - max, k = f (3 - c) / 2,
  s = f (c - 1) / 2 (kalomaze's quadratic/cubic sampling as Aphrodite applies it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from .ops import block_topk, draw, row_logsumexp, sort_descending

__all__ = ["CANDIDATE_LEVELS", "TruncationParams", "sample_truncated", "smooth"]

# Candidate counts tried before sorting the whole vocabulary.
CANDIDATE_LEVELS = (64, 1024)

_NEG_INF = float("-inf")


@dataclass
class TruncationParams:
    """Per-row parameters of the rows that truncate, as [m] tensors on the logits' device (None
    where no row uses the sampler; inactive rows hold the neutral value)."""

    top_k: torch.Tensor | None = None  # int64, 0 = off
    top_p: torch.Tensor | None = None
    top_a: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    tfs: torch.Tensor | None = None
    eta: torch.Tensor | None = None  # probability units (eta_cutoff * 1e-4)
    epsilon: torch.Tensor | None = None  # probability units (epsilon_cutoff * 1e-4)
    typical: torch.Tensor | None = None
    smoothing_factor: torch.Tensor | None = None
    smoothing_curve: torch.Tensor | None = None
    # Rows whose first sampler needs the vocabulary's log-normaliser / entropy while open.
    needs_lse: torch.Tensor | None = None  # bool
    needs_entropy: torch.Tensor | None = None  # bool
    # Rows whose first sampler needs the whole sorted vocabulary (tfs, typical).
    needs_full: torch.Tensor | None = None  # bool

    def take(self, rows: torch.Tensor | None) -> TruncationParams:
        if rows is None:
            return self
        return TruncationParams(
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
                for f in fields(self)
            }
        )


def smooth(
    logits: torch.Tensor, factor: torch.Tensor, curve: torch.Tensor, active: torch.Tensor
) -> torch.Tensor:
    """Quadratic/cubic smoothing of rows where `active`; removed tokens (-inf) stay removed."""
    mx = logits.amax(dim=-1, keepdim=True)
    d = logits - mx
    f = factor.unsqueeze(1)
    c = curve.unsqueeze(1)
    k = f * (3 - c) / 2
    s = f * (c - 1) / 2
    new = mx - k * d * d + s * d * d * d
    keep = torch.isfinite(logits) & active.unsqueeze(1)
    return torch.where(keep, new, logits)


def _chain(
    vals: torch.Tensor,
    p: TruncationParams,
    full: bool,
    lse: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs every sampler on candidates `vals` [r, K] (sorted descending, temperature applied).

    `full`: the candidates are the whole vocabulary. Returns (w, retry): w holds the surviving
    candidates' logits (-inf where removed), retry the rows whose kept set may reach past the
    candidates.
    """
    r, K = vals.shape
    w = vals.clone()
    is_open = torch.full((r,), not full, dtype=torch.bool, device=vals.device)
    retry = torch.zeros(r, dtype=torch.bool, device=vals.device)

    def log_norm() -> torch.Tensor:
        z = torch.logsumexp(w, dim=-1)
        if not full and lse is not None:
            z = torch.where(is_open, lse, z)
        return z.unsqueeze(1)

    def close(active: torch.Tensor, spills: torch.Tensor | None) -> None:
        """Active open rows are closed now; those whose kept set spills past the candidates
        must be retried with more."""
        nonlocal is_open, retry
        if full:
            return
        if spills is None:
            retry = retry | (active & is_open)
        else:
            retry = retry | (active & is_open & spills)
        is_open = is_open & ~active

    if p.top_k is not None:
        k = p.top_k
        active = k > 0
        kth = vals.gather(1, (k.clamp(min=1) - 1).unsqueeze(1))
        w.masked_fill_((w < kth) & active.unsqueeze(1), _NEG_INF)
        # Ties running to the end may go on past the candidates (not -inf ones: no mass).
        close(active, (vals[:, -1] >= kth[:, 0]) & torch.isfinite(kth[:, 0]))

    if p.top_p is not None:
        top_p = p.top_p
        active = top_p < 1.0
        q = (w - log_norm()).exp()
        cum = q.cumsum(dim=-1)
        w.masked_fill_(((cum - q) >= top_p.unsqueeze(1)) & active.unsqueeze(1), _NEG_INF)
        close(active, cum[:, -1] < top_p)

    if p.top_a is not None:
        top_a = p.top_a
        active = top_a > 0.0
        q = (w - log_norm()).exp()
        threshold = top_a * q[:, 0] * q[:, 0]
        remove = q < threshold.unsqueeze(1)
        remove[:, 0] = False
        w.masked_fill_(remove & active.unsqueeze(1), _NEG_INF)
        close(active, q[:, -1] >= threshold)

    if p.min_p is not None:
        min_p = p.min_p
        active = min_p > 0.0
        # Scale-free: probabilities relative to the most likely token need no normaliser.
        q = (w - w[:, :1]).exp()
        remove = q < min_p.unsqueeze(1)
        remove[:, 0] = False
        w.masked_fill_(remove & active.unsqueeze(1), _NEG_INF)
        close(active, q[:, -1] >= min_p)

    if p.tfs is not None:
        tfs = p.tfs
        active = tfs < 1.0
        close(active, None)  # needs the whole sorted distribution
        q = torch.softmax(w, dim=-1)
        if full:
            d2 = q.diff(dim=-1).diff(dim=-1).abs()
        else:  # the tokens past the candidates are removed: zeros, two of which reach into d2
            d2 = F.pad(q, (0, 2)).diff(dim=-1).diff(dim=-1).abs()
        cdf = (d2 / d2.sum(dim=-1, keepdim=True)).cumsum(dim=-1)
        beyond = cdf > tfs.unsqueeze(1)
        first = torch.zeros(r, 1, dtype=torch.bool, device=vals.device)
        if full:
            remove = torch.cat([first, beyond, ~first], dim=1)
        else:
            remove = torch.cat([first, beyond[:, : K - 1]], dim=1)
        w.masked_fill_(remove & active.unsqueeze(1), _NEG_INF)

    for name in ("eta", "epsilon"):
        cutoff = getattr(p, name)
        if cutoff is None:
            continue
        active = cutoff > 0.0
        log_q = w - log_norm()
        q = log_q.exp()
        if name == "eta":
            ent = -(q * log_q).nansum(dim=-1)
            if not full and entropy is not None:
                ent = torch.where(is_open, entropy, ent)
            threshold = torch.minimum(cutoff, cutoff.sqrt() * (-ent).exp())
        else:
            threshold = cutoff
        remove = (q < threshold.unsqueeze(1)) & (w < w.amax(dim=-1, keepdim=True))
        w.masked_fill_(remove & active.unsqueeze(1), _NEG_INF)
        close(active, q[:, -1] >= threshold)

    if p.typical is not None:
        mass = p.typical
        active = mass < 1.0
        close(active, None)  # needs the whole distribution
        log_q = torch.log_softmax(w, dim=-1)
        q = log_q.exp()
        ent = -(log_q * q).nansum(dim=-1, keepdim=True)
        shifted = (-log_q - ent).abs()
        sorted_shift, order = shifted.sort(dim=-1)
        cum = w.gather(1, order).softmax(dim=-1).cumsum(dim=-1)
        last = (cum < mass.unsqueeze(1)).sum(dim=1).clamp_(max=K - 1)
        remove_sorted = sorted_shift > sorted_shift.gather(1, last.unsqueeze(1))
        remove_sorted[:, 0] = False
        remove = remove_sorted.scatter(1, order, remove_sorted)
        w.masked_fill_(remove & active.unsqueeze(1), _NEG_INF)

    if p.smoothing_factor is not None:
        w = smooth(w, p.smoothing_factor, p.smoothing_curve, p.smoothing_factor > 0.0)
    return w, retry


def sample_plain(
    logits: torch.Tensor,
    u: torch.Tensor,
    smoothing: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows that truncate nothing: a draw from the whole (smoothed) distribution, in vocabulary
    order. Returns (token ids, final logits when asked)."""
    if smoothing is not None:
        factor, curve = smoothing
        logits = smooth(logits, factor, curve, factor > 0.0)
    return draw(logits, u), (logits if return_logits else None)


def _vocab_norms(x: torch.Tensor, need_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-normaliser (and entropy) of each row of tempered logits `x`."""
    lse = row_logsumexp(x)
    entropy = None
    if need_entropy:
        # H = lse - sum(p * x); masked tokens (p = 0, x = -inf) add nothing.
        p = torch.softmax(x, dim=-1)
        entropy = lse - (p * x).nansum(dim=-1)
    return lse, entropy


def sample_truncated(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    params: TruncationParams,
    u: torch.Tensor,
    return_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draws one token per row of `logits` [m, V] (penalised, temperature not yet applied;
    `temperature` is [m, 1]) after the truncation chain. Returns (token ids [m], the final
    logits [m, V] with -inf where removed, when asked: for tests and references)."""
    m, V = logits.shape
    device = logits.device
    levels = [K for K in CANDIDATE_LEVELS if K < V] + [V]
    # A row starts at the first level with more candidates than its top_k (top_k itself must
    # be decidable: the k-th candidate and one past it), or at the full sort when its first
    # sampler needs the whole distribution.
    start = torch.zeros(m, dtype=torch.int64, device=device)
    if params.top_k is not None:
        for K in levels[:-1]:
            start += (params.top_k >= K).long()
    if params.needs_full is not None:
        start = torch.where(params.needs_full, len(levels) - 1, start)

    lse = entropy = None
    if params.needs_lse is not None and bool(params.needs_lse.any()):
        rows = params.needs_lse.nonzero().squeeze(1)
        need_entropy = params.needs_entropy is not None and bool(params.needs_entropy[rows].any())
        row_lse, row_entropy = _vocab_norms(
            logits.index_select(0, rows) / temperature[rows], need_entropy
        )
        lse = torch.full((m,), float("nan"), device=device).index_copy_(0, rows, row_lse)
        if row_entropy is not None:
            entropy = torch.full((m,), float("nan"), device=device)
            entropy.index_copy_(0, rows, row_entropy)

    tokens = torch.empty(m, dtype=torch.int64, device=device)
    final = torch.full((m, V), _NEG_INF, device=device) if return_logits else None
    carried: torch.Tensor | None = None
    for level, K in enumerate(levels):
        rows = (start == level).nonzero().squeeze(1)
        if carried is not None:
            rows = torch.cat([rows, carried])
        if rows.numel() == 0:
            continue
        everything = rows.numel() == m and level == 0 and carried is None
        xs = logits if everything else logits.index_select(0, rows)
        if K < V:
            vals, ids = block_topk(xs, K)
        else:
            vals, ids = sort_descending(xs)
        take = None if everything else rows
        vals = vals / (temperature if take is None else temperature[take])
        w, retry = _chain(
            vals,
            params.take(take),
            full=K == V,
            lse=None if lse is None else (lse if take is None else lse[take]),
            entropy=None if entropy is None else (entropy if take is None else entropy[take]),
        )
        done = ~retry
        all_done = bool(done.all())
        if not all_done:
            w, ids, done_rows = w[done], ids[done], rows[done]
            carried = rows[retry]
        else:
            done_rows, carried = rows, None
        if done_rows.numel():
            pos = draw(w, u[done_rows])
            tokens[done_rows] = ids.gather(1, pos.unsqueeze(1)).squeeze(1)
            if final is not None:
                final[done_rows] = torch.full_like(xs[: len(done_rows)], _NEG_INF).scatter(
                    1, ids, w
                )
    return tokens, final

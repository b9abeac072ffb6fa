"""What attention is fed each step, by every backend alike: the ragged batch's metadata and the
shape of one attention layer.

A step's batch is ragged: request `i` brings `query_lens[i]` new tokens (1 for a decode, more for
a prefill or a prefill chunk) whose K/V are written into the cache at `slot_mapping`, and its
queries attend causally to everything up to their own position, `seq_lens[i]` keys in all, read
through `block_tables[i]`. The model runner puts decode requests first, so the first
`num_decodes` tokens are exactly the decode tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B + 1] int32: request i's tokens are [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # [B] int32: keys each request attends to (context + new)
    context_lens: torch.Tensor  # [B] int32: keys already in the cache before this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token; < 0 means padding
    num_decodes: int  # requests 0..num_decodes-1 have exactly one new token
    max_query_len: int
    max_seq_len: int
    # Host copies, for decisions in Python without a device sync.
    query_lens_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    block_size: int = 16
    # What a backend precomputes once per step and reuses in every layer.
    backend_state: dict = field(default_factory=dict)
    # Recurrent layers (hybrid models): each request's state slot (kv_cache_manager.StatePool),
    # and whether it continues a state (it had tokens computed before this step) or starts from
    # zeros. None for a model without recurrent layers.
    state_slots: torch.Tensor | None = None  # [B] int32
    has_initial_state: torch.Tensor | None = None  # [B] bool
    # Per token, whether it is one of its request's prompt tokens (not a generated one fed
    # back): a layer that treats the two differently reads it (Nemotron-H's Mamba-2 limits the
    # time step of prompt tokens only, as transformers does). With recurrent layers only.
    prompt_rows: torch.Tensor | None = None  # [T] bool
    # Bidirectional spans (Gemma 3's images): per request, None (causal) or per new token the
    # position of the last key it attends to: its own position, or for a token in a span that
    # attends both ways the span's last position (the whole span is in the step's chunk).
    key_limits_host: list[list[int] | None] | None = None

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_host)


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """One attention layer's shape and score options. A score is q.k * scale, then
    `logit_softcap` * tanh(score / `logit_softcap`) when set (Gemma 2), then
    + alibi_slopes[h] * (j - p) for the query at position p and key j when `alibi_slopes` is
    set (float32 [num_heads], already scaled as the model family needs; on the model's device,
    or each layer copies it there), then the causal and window mask. With `sinks` ([num_heads],
    any float dtype: gpt-oss's learned per-head logits) the softmax takes one more logit per
    head, sinks[h], that has no value: it only adds exp(sinks[h]) to the denominator."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # a query attends to the last `sliding_window` keys
    # Chunked local attention (Llama 4): the query at position p attends only to the keys of its
    # own chunk of `chunk_size` positions, p - p % chunk_size <= j <= p.
    chunk_size: int | None = None
    logit_softcap: float | None = None
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    # An 8-bit float cache holds k / k_scale and v / v_scale (kv_write); readers multiply back.
    # Per layer; 1.0 unless the checkpoint gives them. Unused by a cache in the model dtype.
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        slopes = self.alibi_slopes
        if slopes is not None and tuple(slopes.shape) != (self.num_heads,):
            raise ValueError(f"alibi_slopes is {tuple(slopes.shape)}, expected ({self.num_heads},)")
        sinks = self.sinks
        if sinks is not None and tuple(sinks.shape) != (self.num_heads,):
            raise ValueError(f"sinks is {tuple(sinks.shape)}, expected ({self.num_heads},)")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit_softcap must be > 0, got {self.logit_softcap}")

    # Written out, since dataclass's would compare the slopes tensor with `==` (a tensor, not a
    # bool) and hash it by identity: equal specs have equal slopes by value.
    def _plain(self) -> tuple:
        return (
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.scale,
            self.sliding_window,
            self.chunk_size,
            self.logit_softcap,
            self.k_scale,
            self.v_scale,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AttentionSpec):
            return NotImplemented
        if self._plain() != other._plain():
            return False
        return _same(self.alibi_slopes, other.alibi_slopes) and _same(self.sinks, other.sinks)

    def __hash__(self) -> int:
        return hash((*self._plain(), self.alibi_slopes is None, self.sinks is None))


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal per-head tensors of two specs (by value), or both absent."""
    if a is None or b is None:
        return a is b
    return a is b or (a.device == b.device and a.dtype == b.dtype and torch.equal(a, b))

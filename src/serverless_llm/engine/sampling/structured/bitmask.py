"""The batch's token bitmask: one int32 row per sequence, one bit per token of the model's
vocabulary. `allocate_bitmask` once per engine, `fill_bitmasks` from the sequences' matchers
before a step, `apply_bitmask` to the logits (disallowed tokens to -inf)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .xgrammar_import import require_xgrammar, xgr

if TYPE_CHECKING:
    from .grammar import GrammarMatcher

__all__ = ["allocate_bitmask", "allow_only", "apply_bitmask", "fill_bitmasks"]

# ---------------------------------------------------------------------------------------------
# Batch helpers
# ---------------------------------------------------------------------------------------------

_batch_fillers: dict[int, Any] = {}
_batch_lock = threading.Lock()


def allocate_bitmask(batch_size: int, vocab_size: int, *, pin: bool | None = None) -> torch.Tensor:
    """A (batch_size, ceil(vocab_size / 32)) int32 CPU tensor, every token allowed. Allocate it
    once per engine (max batch size, the model's vocab size) and reuse it: filling a row
    overwrites it, and rows not filled are simply not applied. Pinned when CUDA is there, so the
    copy to the GPU can be asynchronous."""
    require_xgrammar()
    mask = xgr.allocate_token_bitmask(batch_size, vocab_size)
    if pin is None:
        pin = torch.cuda.is_available()
    return mask.pin_memory() if pin else mask


def fill_bitmasks(
    matchers: Sequence[GrammarMatcher],
    bitmask: torch.Tensor,
    rows: Sequence[int] | None = None,
    *,
    threads: int = 0,
) -> None:
    """Fills `bitmask[rows[i]]` from `matchers[i]` (rows default to 0..len-1). Large batches use
    xgrammar's threaded batch filler (`threads`: 0 = half the cores); it releases the GIL, so
    it may run on a thread while the model computes the step's logits."""
    if not matchers:
        return
    rows = list(range(len(matchers))) if rows is None else list(rows)
    if len(rows) != len(matchers):
        raise ValueError("fill_bitmasks: one row per matcher")
    done = [i for i, m in enumerate(matchers) if m.is_terminated()]
    if done:  # xgrammar refuses to fill for those; they get their stop tokens only
        for i in done:
            matchers[i].fill_bitmask(bitmask, rows[i])
        ended = set(done)
        live = [i for i in range(len(matchers)) if i not in ended]
        matchers, rows = [matchers[i] for i in live], [rows[i] for i in live]
    if len(matchers) < 4:
        for m, r in zip(matchers, rows):
            m.fill_bitmask(bitmask, r)
        return
    with _batch_lock:
        filler = _batch_fillers.get(threads)
        if filler is None:
            filler = xgr.BatchGrammarMatcher("auto" if threads <= 0 else threads)
            _batch_fillers[threads] = filler
    filler.batch_fill_next_token_bitmask([m._matcher for m in matchers], bitmask, rows)


def allow_only(bitmask: torch.Tensor, row: int, token_ids: Iterable[int]) -> None:
    bitmask[row].zero_()
    for tid in token_ids:
        word, bit = divmod(int(tid), 32)
        if word < bitmask.shape[-1]:
            value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None
) -> None:
    """Sets the disallowed logits of `rows` (default: every row) to -inf, in place.

    `logits` is (batch, vocab) (or one row) on CPU or CUDA, any float dtype; bitmask row i
    belongs to logits row i, and the bitmask may have more rows (allocated for the largest
    batch). Apply it last, after penalties and logit processors (they may raise a logit the
    grammar forbids), and before temperature/top-k/top-p/min-p and the draw."""
    require_xgrammar()
    if logits.dim() == 1:
        logits, bitmask = logits.unsqueeze(0), bitmask.reshape(1, -1)
    batch, vocab = logits.shape
    if bitmask.shape[-1] * 32 < vocab:
        raise ValueError(
            f"bitmask covers {bitmask.shape[-1] * 32} tokens but the logits have {vocab}: "
            "allocate it with the model's vocab size"
        )
    if rows is not None:
        rows = list(rows)
        if not rows:
            return
    if logits.device.type == "cpu" and bitmask.device.type == "cpu" and _LITTLE_ENDIAN:
        _apply_bitmask_cpu(logits, bitmask[:batch], rows)
        return
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(
        logits, bitmask, vocab_size=vocab, indices=rows, backend=xgrammar_backend(logits)
    )


def xgrammar_backend(logits: torch.Tensor) -> str:
    """xgrammar's kernel for these logits: its Triton kernel on CUDA (the one launch of guided
    decoding the kernel warm-up lists, kernel_warmup.py), its CPU kernel, or torch."""
    if logits.device.type == "cuda" and _triton_ok():
        return "triton"
    if logits.device.type == "cpu" and logits.dtype in _CPU_DTYPES:
        return "cpu"
    return "torch_native"


def _apply_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> None:
    """One vectorized pass: the inverted bitmask unpacked to a (batch, vocab) bool tensor, then
    masked_fill_. About 5x faster than xgrammar's CPU kernel at batch 32 x 49k (0.7 vs 3-5 ms)."""
    disallowed = np.invert(bitmask.numpy())
    if rows is not None and len(rows) < disallowed.shape[0]:
        keep = np.zeros(disallowed.shape[0], dtype=bool)
        keep[rows] = True
        disallowed[~keep] = 0  # rows without a grammar: nothing disallowed
    bits = np.unpackbits(disallowed.view(np.uint8), axis=-1, bitorder="little")
    mask = torch.from_numpy(bits[:, : logits.shape[-1]]).view(torch.bool)
    logits.masked_fill_(mask, float("-inf"))


_LITTLE_ENDIAN = sys.byteorder == "little"
_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

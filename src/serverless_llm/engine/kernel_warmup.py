"""Kernel warm-up: every Triton specialisation the loaded model can launch, listed and compiled
before the first request, so none compiles on the request path.

Listing (`list_launches`): the model runner runs a sweep of synthetic steps, with every Triton
launch recorded instead of run (kernels/launch_keys.py). The launchers are the ones that serve
traffic, so the list is what they launch, not a copy of their choices that could drift: each
step's shapes pass through the same tile choosers, split heuristics and alignment facts. The
sweep covers the axes those choices read: decode batches (1, 2, 3, 15, 16, 17 rows and the
largest, against contexts at every power of two up to max_model_len), prompts of 2, 3, 15, 16,
17 tokens and every power of two (and one past it) up to the step's token budget, prompt chunks
over a context, and 0-17 decodes with one to four prompts (or chunks) after them; with LoRA on,
the same steps with an adapter on every row; each step with block tables of each width class. An
encoder's steps are whole prompts only (`SweepLimits.whole_prompts`: every length class, one to
max_num_seqs of them, no decode, no context), through its bidirectional (DENSE_KV) attention.
Guided decoding's mask kernel (xgrammar's, on CUDA) through the sampler's calls of it
(`_grammar_launches`). A vision-language model whose image tokens attend both ways (Gemma 3's
rule: `ModelRunner.bidirectional_images`) runs its image steps through the paged kernel's
HAS_LIMITS variant: the sweep's steps with prompts run again with each prompt one image span
(`_host_batch(image_spans=True)`). The vision tower's own launches (its attention kernel, whose
tile choice reads the longest sequence of patches, tiles or windows of a call) through synthetic
images of every size class (`IMAGE_SIDES`, square and 1:2) run through the family's processor
and the tower (`_vision_launches`), when the caller hands the engine's image inputs.
The rows write no KV (slot -1) and the outputs are never read, so the sweep changes nothing in
the cache. A launch the sweep missed would still compile at its first use; the engine then logs
it by name (`watch_request_path`), so the gap is visible.

Compiling (`compile_launches`): each listed specialisation through `launch_keys.compile_spec`,
the same steps as Triton's own launch, in a pool of threads; the results land in Triton's cache
directory (TRITON_CACHE_DIR), where the first real launch finds them. Only on CUDA: the CPU
path runs no Triton, and under the interpreter there is nothing to compile.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .kernels.launch_keys import LaunchSpec, compile_spec, record_launches
from .model_runner import HostBatch, ModelRunner, PromptLogprobWork

logger = logging.getLogger(__name__)

# A LoRA adapter id no request uses: the sweep's rows take adapter slot 0 under it.
SWEEP_LORA_ID = -1


@dataclass(frozen=True)
class SweepLimits:
    """What bounds a step's shapes: tokens a step may compute, requests a step may hold, the
    longest context."""

    token_budget: int
    max_num_seqs: int
    max_model_len: int
    # An encoder's steps: whole prompts only (no decodes, no chunks over a context, no cache).
    whole_prompts: bool = False


def _powers(limit: int, start: int = 1) -> list[int]:
    out, p = [], start
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def sweep_steps(limits: SweepLimits) -> list[tuple[list[int], list[int]]]:
    """The synthetic steps, each (query lengths, sequence lengths) per request, decodes first."""
    budget, seqs, max_len = limits.token_budget, limits.max_num_seqs, limits.max_model_len
    steps: list[tuple[list[int], list[int]]] = []
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()

    def add(q: list[int], s: list[int]) -> None:
        if sum(q) > budget or len(q) > seqs or max(s) > max_len or any(a > b for a, b in zip(q, s)):
            return
        key = (tuple(q), tuple(s))
        if key not in seen:
            seen.add(key)
            steps.append((q, s))

    rows = sorted({n for n in (1, 2, 3, 15, 16, 17, seqs) if n <= min(seqs, budget)})
    if limits.whole_prompts:
        return _whole_prompt_steps(limits, rows, add, steps)
    contexts = sorted({*_powers(max_len, 2), max_len})
    for n in rows:  # decode-only steps
        for ctx in contexts:
            add([1] * n, [ctx] * n)
    lengths = sorted({2, 3, 15, 16, 17, budget, *_powers(budget, 2)}
                     | {p + 1 for p in _powers(budget, 2)})  # fmt: skip
    for t in lengths:  # a prompt from scratch, and a chunk over a context
        t = min(t, budget, max_len)
        if t < 2:
            continue
        add([t], [t])
        for ctx in (limits.token_budget, max_len - t):
            if ctx > 0:
                add([t], [min(ctx + t, max_len)])
    # Decodes (none, or a few) with one to four prompts after them: the prompt launch's first
    # token (an int argument) and its tile list's length (a pointer into a 2-row tensor) take
    # every alignment class.
    for nd in (0, 1, 2, 3, 15, 16, 17):
        for k in (1, 2, 3, 4):
            for t in (2, 16, 17, (budget - nd) // k):
                for ctx in (0, max_len - t):  # a first chunk, or a last one (split-KV)
                    if t >= 2:
                        add([1] * nd + [t] * k, [max_len] * nd + [ctx + t] * k)
    return steps


def _whole_prompt_steps(limits: SweepLimits, rows: list[int], add, steps: list) -> list:
    """An encoder's steps: n whole prompts of length t (every length class of the sweep, and
    1), each after n - 1 one-token prompts (few tiles over a long prompt: split-KV), all
    n of length t (the most tiles), and as many of length t as the budget holds."""
    top = min(limits.token_budget, limits.max_model_len)
    lengths = sorted({1, 2, 3, 15, 16, 17, top, *_powers(top, 2)}
                     | {p + 1 for p in _powers(top, 2)})  # fmt: skip
    for t in (t for t in lengths if t <= top):
        fill = max(1, min(limits.max_num_seqs, limits.token_budget // t))
        for n in sorted({*rows, fill}):
            add([1] * (n - 1) + [t], [1] * (n - 1) + [t])  # one-token rows first, as the runner
            add([t] * n, [t] * n)
    return steps


def table_widths(needed: int) -> list[int]:
    """Block-table widths to try for a step whose longest request needs `needed` blocks. The
    width is an int argument (the tables' row stride) that Triton tells apart as 1, a multiple
    of 16 or any other, and a step's width follows from its longest request: at least the
    blocks it needs, more when it holds more (allocated ahead). Never narrower than needed: MLA
    gathers a prompt's context through its table (a read past a row's end would be a device
    fault), so the one-block class comes from steps whose requests fit one block
    (`sweep_tables`)."""
    widths = {needed, -(-needed // 16) * 16}
    widths.add(needed + 1 if (needed + 1) % 16 else needed + 2)
    return sorted(widths)


def sweep_tables(limits: SweepLimits, block_size: int) -> list[tuple[list[int], list[int], int]]:
    """The sweep's steps with their block-table widths: (query lengths, sequence lengths,
    width). The steps of `sweep_steps` and, for the one-block width (a step of short requests:
    any mix of decodes and prompts that fit one block), the same sweep with contexts of at most
    one block."""
    short = SweepLimits(limits.token_budget, limits.max_num_seqs,
                        min(block_size, limits.max_model_len))  # fmt: skip
    out: list[tuple[list[int], list[int], int]] = []
    seen: set = set()
    for q, s in sweep_steps(limits) + sweep_steps(short):
        for width in table_widths(max(1, -(-max(s) // block_size))):
            key = (tuple(q), tuple(s), width)
            if key not in seen:
                seen.add(key)
                out.append((q, s, width))
    return out


def _host_batch(
    runner: ModelRunner,
    query_lens: list[int],
    seq_lens: list[int],
    lora: bool,
    width: int = 0,
    image_spans: bool = False,
):
    """A HostBatch of dummy tokens that write no KV (slot -1), its block tables (all block 0)
    `width` blocks wide (default: what the longest request needs). `image_spans`: each prompt
    row (more than one token) is an image whose tokens attend both ways, to its last key."""
    bs = runner.block_size
    groups = runner.layout.num_groups
    encoder = is_encoder(runner)
    ids: list[int] = []
    positions: list[int] = []
    sample_idx: list[int] = []
    lora_rows: list[tuple[int, int, int]] = []
    for q, s in zip(query_lens, seq_lens):
        if lora:
            lora_rows.append((SWEEP_LORA_ID, len(ids), q))
        ids.extend([0] * q)
        positions.extend(range(s - q, s))
        if not encoder:  # an encoder has no LM head: its rows are pooled, never sampled
            sample_idx.append(len(ids) - 1)
    blocks = width or max(1, -(-max(seq_lens) // bs))
    table = torch.zeros(len(seq_lens), blocks, dtype=torch.int32)
    has_state = runner.layout.has_state
    key_limits = None
    if image_spans and any(q > 1 for q in query_lens):
        key_limits = [[s - 1] * q if q > 1 else None for q, s in zip(query_lens, seq_lens)]
    return HostBatch(
        input_ids=ids,
        positions=positions,
        slots=[[-1] * len(ids) for _ in range(groups)],
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        block_tables=[table for _ in range(groups)],
        num_decodes=sum(1 for q in query_lens if q == 1),
        sample_reqs=[],
        sample_idx=sample_idx,
        prompt_work=PromptLogprobWork(),
        lora_rows=lora_rows,
        state_slots=[1] * len(seq_lens) if has_state else None,
        prompt_rows=[True] * len(ids) if has_state else None,
        key_limits=key_limits,
    )


def is_encoder(runner: ModelRunner) -> bool:
    return bool(getattr(runner.model, "is_encoder", False))


# Image sides of the vision sweep (pixels; each square and 1:2 both ways): the processors turn
# them into sequences of a few patches (a dynamic-resolution family's smallest image) to
# thousands (its tile choice stops growing at 128 rows), tiles, or one fixed size.
IMAGE_SIDES = (28, 56, 112, 224, 448, 896)


def _vision_launches(tower, images) -> None:
    """The tower's launches for one synthetic image of each size class: each through the
    family's processor (whose resizing, tiling or cropping makes the shapes the tower sees) and
    the tower alone, one image a call (a call's tile choice reads its longest sequence, which a
    single image of that size reaches)."""
    from PIL import Image

    family, processor = images.family, images.processor
    placeholder = family.image_placeholder(processor)
    device = next(tower.parameters()).device
    sizes = {(w, h) for side in IMAGE_SIDES for w, h in ((side, side), (side, 2 * side),
                                                         (2 * side, side))}  # fmt: skip
    for w, h in sorted(sizes):
        image = Image.new("RGB", (w, h), (120, 60, 200))
        try:
            prompt = family.process(processor, placeholder, [image], add_special_tokens=False)
        except Exception:  # noqa: BLE001 - a size this processor refuses: no request sends it
            continue
        for item in prompt.items:
            tower.encode([{k: _to_device(v, device) for k, v in item.data.items()}])


def _to_device(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


@torch.inference_mode()
def list_launches(runner: ModelRunner, limits: SweepLimits, image_inputs=None) -> list[LaunchSpec]:
    """Every specialisation the runner's model launches over the sweep (see the module doc);
    `image_inputs` (the engine's `ImageInputs`: family and processor) adds its vision tower's."""
    variants = [False] + ([True] if runner.lora_step is not None else [])
    images = bool(getattr(runner, "bidirectional_images", False))
    captured, runner.captured = runner.captured, None  # the sweep runs eagerly
    runner.lora_slots[SWEEP_LORA_ID] = 0
    try:
        with record_launches(execute=False) as rec:
            for lora in variants:
                for q, s, width in sweep_tables(limits, runner.block_size):
                    runner.run(_host_batch(runner, q, s, lora, width))
                    if images and any(n > 1 for n in q):  # the same step as image spans
                        runner.run(_host_batch(runner, q, s, lora, width, image_spans=True))
            if not is_encoder(runner):
                _grammar_launches(runner, limits)
            if image_inputs is not None and getattr(runner, "vision_tower", None) is not None:
                _vision_launches(runner.vision_tower, image_inputs)
    finally:
        runner.captured = captured
        runner.lora_slots.pop(SWEEP_LORA_ID, None)
    return rec.specs


def _grammar_launches(runner: ModelRunner, limits: SweepLimits) -> None:
    """Guided decoding's launches: the sampler's two calls of `apply_bitmask` (structured/
    bitmask.py; xgrammar's Triton kernel on CUDA) on float32 logits of the model's own
    vocabulary, for each row count of the sweep's decode batches: the grammar rows of a batch
    (indices given) and the fallback for rows the processors left empty (a gathered copy, no
    indices). Nothing when xgrammar is not installed (no guided decoding then)."""
    try:
        from .sampling.structured.bitmask import allocate_bitmask, apply_bitmask
        from .sampling.structured.xgrammar_import import require_xgrammar

        require_xgrammar()
    except (ImportError, RuntimeError):
        return
    seqs = limits.max_num_seqs
    for n in sorted({k for k in (1, 2, 3, 15, 16, 17, seqs) if k <= seqs}):
        logits, _ = runner.run(_host_batch(runner, [1] * n, [2] * n, False))
        if logits is None:
            return
        x = logits.float()
        mask = allocate_bitmask(n, x.shape[-1])
        rows = list(range(n))
        apply_bitmask(x, mask[:n], rows)
        apply_bitmask(x[rows].clone(), mask[rows])


def compile_launches(specs: Iterable[LaunchSpec], target=None, workers: int | None = None) -> int:
    """Compiles every spec (into Triton's cache) on a pool of threads; returns how many."""
    specs = list(specs)
    workers = workers or min(len(specs), os.cpu_count() or 1) or 1
    with ThreadPoolExecutor(workers, thread_name_prefix="kernel-warmup") as pool:
        for _ in pool.map(lambda s: compile_spec(s, target), specs):
            pass
    return len(specs)


@dataclass
class WarmupResult:
    specs: int
    list_seconds: float
    compile_seconds: float
    cache_hits: int

    def describe(self) -> str:
        return (
            f"{self.specs} kernel specialisations listed in {self.list_seconds:.1f}s, ready in "
            f"{self.compile_seconds:.1f}s ({self.cache_hits} from the cache, "
            f"{self.specs - self.cache_hits} compiled)"
        )


def warm_up(runner: ModelRunner, limits: SweepLimits, image_inputs=None) -> WarmupResult:
    """Lists and compiles the model's kernels (CUDA), its vision tower's with `image_inputs`;
    counts Triton's cache hits through its compilation listener."""
    from triton import knobs

    t0 = time.perf_counter()
    specs = list_launches(runner, limits, image_inputs)
    t1 = time.perf_counter()
    hits = 0
    previous = knobs.compilation.listener

    def listener(*, cache_hit: bool, **kwargs) -> None:
        nonlocal hits
        hits += bool(cache_hit)
        if previous is not None:
            previous(cache_hit=cache_hit, **kwargs)

    knobs.compilation.listener = listener
    try:
        compile_launches(specs)
    finally:
        knobs.compilation.listener = previous
    return WarmupResult(len(specs), t1 - t0, time.perf_counter() - t1, hits)


def watch_request_path() -> None:
    """From now on, logs every Triton compile (a cache miss): a specialisation the warm-up did
    not list, compiled on a request's path."""
    from triton import knobs

    previous = knobs.compilation.listener

    def listener(*, src, cache_hit: bool, **kwargs) -> None:
        if not cache_hit:
            logger.warning(
                "a Triton kernel compiled on the request path (not in the warm-up's list): %s",
                getattr(src, "name", src),
            )
        if previous is not None:
            previous(src=src, cache_hit=cache_hit, **kwargs)

    knobs.compilation.listener = listener

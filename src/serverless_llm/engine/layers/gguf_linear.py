"""A GGUF checkpoint served from its quantized blocks on CPU (QUANTIZED_WEIGHTS=packed): no float
copy of the weights the blocks hold, on disk or in memory.

A decode step on a CPU is bound by the bytes of weight it reads: the float32 copy of a Q4_1
model is ~6.7x the file's blocks. While the model is still on the meta device (no storage yet),
`take_gguf_blocks` gives every linear whose tensors are of a type with a qb32 layout
(kernels/gguf_blocks.py) a GGUFBlockLinear holding the file's blocks in our layout, the token
embedding a GGUFBlockEmbedding (rows dequantized at lookup) and the LM head (tied: the
embedding's blocks; else `output.weight`) its blocks too, so `materialize` allocates only what is
left (norms, biases, any tensor of another type), which the loader reads from the file as float
(loader/gguf_direct.py). A step of at most `block_rows` rows runs the few-row block linear (int8
or float inputs, GGUF_BLOCK_INPUTS); larger steps (prefill) the many-row GEMM on the blocks,
`block_rows` measured per weight shape at the first start on a machine (`choose_block_rows`).
`finish_gguf_blocks` then attaches the whole-layer native decode on the blocks.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from ..kernels.cpu_native import cache_dir
from ..kernels.gguf_blocks import (
    FILE_TYPES,
    QB32,
    BlockKernels,
    FileTensor,
    QB32Desc,
    QB32StepsDesc,
    from_gguf_blocks,
)
from .linear import PackedLinear, cpu_identity

logger = logging.getLogger(__name__)

BLOCK_ROWS = 16  # steps of at most this many rows take the few-row linear, until measured
# One row always takes the few-row kernel (the GEMM pads its rows to 16: ~15x the arithmetic; a
# busy machine's timings once chose the GEMM there); past 32 rows the GEMM's cost grows with the
# rows while the few-row kernel re-reads the weight every 4 rows: never measured there.
ROW_CANDIDATES = (2, 4, 8, 16, 32)
WHOLE_LAYER_ROWS = 64  # decode steps of up to this many rows run the whole-layer native call


class GGUFBlockLinear(PackedLinear):
    """A linear on qb32 blocks only: the few-row kernel for steps of <= block_rows rows, the
    many-row GEMM above. A PackedLinear in name (the whole-layer native decode takes it: see
    `finish_gguf_blocks`), with no oneDNN or panel weight."""

    def __init__(
        self,
        blocks: QB32,
        kernels: BlockKernels,
        path: str = "float",
        bias: torch.Tensor | None = None,
        gemm: str = "float",
    ) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = blocks.shape
        self.packed, self.panels, self.native, self.native_rows = None, None, None, 0
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.blocks, self.kernels = blocks, kernels
        self.path = path  # the few-row kernel's: "best" (int8 inputs) or "float"
        self.gemm = gemm  # the many-row GEMM's inputs: "float" (x as it is) or "int16"
        self.desc = QB32Desc.of(blocks, path, gemm)
        # for the whole-layer native decode: few-row up to block_rows, the GEMM past it
        self.steps = QB32StepsDesc(self.desc, BLOCK_ROWS)

    @property
    def block_rows(self) -> int:
        return self.steps.few_rows

    @block_rows.setter
    def block_rows(self, rows: int) -> None:
        self.steps.few_rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        bias = self.bias
        if x2.shape[0] <= self.block_rows:
            out = self.kernels.linear(x2, self.blocks, bias, self.path)
        else:
            out = self.kernels.gemm(x2, self.blocks, bias, self.gemm)
        return out.view(*lead, self.out_features).to(x.dtype)


class GGUFBlockEmbedding(nn.Module):
    """The token embedding on qb32 blocks: a lookup dequantizes the rows it takes. `weight` is
    an empty float32 tensor (the model reads its dtype and device)."""

    def __init__(self, blocks: QB32, kernels: BlockKernels) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = blocks.shape
        self.blocks, self.kernels = blocks, kernels
        self.weight = torch.empty(0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.rows(self.blocks, ids)


def _unpermute_rows(n_rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's converter's q/k permutation (it interleaves each
    head's two rotary halves): the rows the float checkpoint has, as indices of the file's."""
    half = n_rows // heads // 2
    return torch.arange(n_rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


def permutes_qk(hf_config) -> bool:
    """Whether llama.cpp's converter stored this family's q/k rows permuted (llama-style
    models, which transformers' GGUF loader reverses too)."""
    return getattr(hf_config, "model_type", None) in ("llama", "mistral")


def _parts(hf_config, i: int) -> dict[str, list[tuple[str, int | None]]]:
    """Per fused linear of layer i: the GGUF tensors it stacks, with the head count for q/k
    (their rows are permuted in the file)."""
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    b = f"blk.{i}."
    return {
        "self_attn.qkv_proj": [(b + "attn_q.weight", heads), (b + "attn_k.weight", kv),
                               (b + "attn_v.weight", None)],
        "self_attn.o_proj": [(b + "attn_output.weight", None)],
        "mlp.gate_up_proj": [(b + "ffn_gate.weight", None), (b + "ffn_up.weight", None)],
        "mlp.down_proj": [(b + "ffn_down.weight", None)],
    }  # fmt: skip


def _blocks_of(tensors: dict, parts, unpermute: bool) -> QB32 | None:
    got = []
    for name, heads in parts:
        t = tensors.get(name)
        if t is None or t.type_name not in FILE_TYPES:
            return None
        try:
            w = from_gguf_blocks(t.data, t.type_name, t.shape[0])
        except ValueError:  # e.g. inputs that are not whole blocks
            return None
        if heads is not None and unpermute:
            w = w.rows(_unpermute_rows(w.shape[0], heads))
        got.append(w)
    try:
        return got[0] if len(got) == 1 else QB32.cat(got)
    except ValueError:
        return None


def block_inputs() -> str:
    """GGUF_BLOCK_INPUTS: "float" (the default: x quantized per block of 32 to 22-bit codes,
    within a few float32 units in the last place of x, so the product is the dequantized
    weight's up to float32 rounding) or "int8" (x quantized per block to int8, as llama.cpp
    does: ~10-20% faster, but tokens part from the float path's at near ties). Prefill steps
    (the GEMM) take x as it is either way."""
    raw = os.environ.get("GGUF_BLOCK_INPUTS", "").strip().lower() or "float"
    if raw not in ("float", "int8"):
        raise ValueError(f"GGUF_BLOCK_INPUTS={raw!r}: expected float or int8")
    return raw


def gemm_inputs() -> str:
    """GGUF_GEMM_INPUTS, the many-row GEMM's inputs (prefill, batches past block_rows): "int16"
    (the default; with AVX-512 VNNI: x quantized per block of 32 to 16-bit codes, each input
    moved by at most 1/65534 of its block's largest |x|, and integer dots, ~1.4x the float
    GEMM's speed; without VNNI it stays "float") or "float" (x as it is, float FMA)."""
    raw = os.environ.get("GGUF_GEMM_INPUTS", "").strip().lower() or "int16"
    if raw not in ("float", "int16"):
        raise ValueError(f"GGUF_GEMM_INPUTS={raw!r}: expected int16 or float")
    return raw


def _meta_bias(lin: nn.Module) -> torch.Tensor | None:
    bias = getattr(lin, "bias", None)
    return None if bias is None else torch.empty(bias.shape, device="meta")


def take_gguf_blocks(
    model: nn.Module,
    tensors: dict[str, FileTensor],
    hf_config,
    kernels: BlockKernels,
    parts_of=_parts,
) -> set[str]:
    """On a model still on the meta device: every decoder linear (and the token embedding and
    LM head) whose file tensors have a qb32 layout and the right shape becomes a block module
    holding them. `parts_of(hf_config, i)`: layer i's linears (module paths in the layer) and
    the file tensors each stacks (the loader's `gguf_block_parts`, from the family's name map;
    by default llama's names). Returns the GGUF names of the tensors taken (the loader skips
    those); biases stay parameters, loaded as float."""
    from .gguf_kquant_linear import take_kquants

    path = "float" if block_inputs() == "float" else "best"
    gemm = "int16" if kernels.gemm16 and gemm_inputs() == "int16" else "float"
    unpermute = permutes_qk(hf_config)
    # K-quant tensors first, on their dense records (what they take is no longer an nn.Linear
    # or nn.Embedding below)
    taken: set[str] = take_kquants(model, tensors, hf_config, path)
    for i, layer in enumerate(getattr(model, "layers", [])):
        for where, parts in parts_of(hf_config, i).items():
            parent_name, _, name = where.rpartition(".")
            parent = getattr(layer, parent_name, None)
            lin = getattr(parent, name, None)
            if type(lin) is not nn.Linear:
                continue
            blocks = _blocks_of(tensors, parts, unpermute)
            if blocks is None or blocks.shape != (lin.out_features, lin.in_features):
                continue
            setattr(parent, name, GGUFBlockLinear(blocks, kernels, path, _meta_bias(lin), gemm))
            taken.update(n for n, _ in parts)
    emb_t = tensors.get("token_embd.weight")
    emb = getattr(model, "embed_tokens", None)
    emb_blocks = None
    if isinstance(emb, nn.Embedding) and emb_t is not None and emb_t.type_name in FILE_TYPES:
        emb_blocks = _blocks_of(tensors, [("token_embd.weight", None)], False)
        if emb_blocks is not None and emb_blocks.shape == tuple(emb.weight.shape):
            model.embed_tokens = GGUFBlockEmbedding(emb_blocks, kernels)
            taken.add("token_embd.weight")
        else:
            emb_blocks = None
    if getattr(model, "num_labels", None) is not None:
        return taken  # a classifier: no LM head
    if getattr(model, "tied", False):
        if (
            emb_blocks is not None
            and getattr(model, "lm_head_bias", None) is None
            and getattr(model, "packed_lm_head", None) is None
        ):
            model.packed_lm_head = GGUFBlockLinear(emb_blocks, kernels, path, None, gemm)
    else:
        head = getattr(model, "lm_head", None)
        if type(head) is nn.Linear and head.bias is None:
            blocks = _blocks_of(tensors, [("output.weight", None)], False)
            if blocks is not None and blocks.shape == (head.out_features, head.in_features):
                model.lm_head = GGUFBlockLinear(blocks, kernels, path, None, gemm)
                taken.add("output.weight")
    return taken


# -- after loading: rows per shape, the whole-layer decode ------------------------------------


def _time_both(a, b, repeats: int = 7) -> tuple[float, float]:
    """Best of `repeats` timings of a and of b, interleaved (a busy moment hits both)."""
    best_a = best_b = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a()
        best_a = min(best_a, time.perf_counter() - t)
        t = time.perf_counter()
        b()
        best_b = min(best_b, time.perf_counter() - t)
    return best_a, best_b


def choose_block_rows(lin: GGUFBlockLinear) -> tuple[int, list]:
    """The most rows (1, or of ROW_CANDIDATES) at which the few-row kernel is at least as fast
    as the GEMM on this linear's weight, stopping at the first count where it loses. Returns
    (rows, [(rows, few-row s, GEMM s), ...])."""
    chosen, timings = 1, []
    g = torch.Generator().manual_seed(0)
    for m in ROW_CANDIDATES:
        x = torch.randn(m, lin.in_features, generator=g)
        few = functools.partial(lin.kernels.linear, x, lin.blocks, lin.bias, lin.path)
        gemm = functools.partial(lin.kernels.gemm, x, lin.blocks, lin.bias, lin.gemm)
        few(), gemm()  # warm
        t_few, t_gemm = _time_both(few, gemm)
        timings.append((m, t_few, t_gemm))
        if t_few > t_gemm:
            break
        chosen = m
    return chosen, timings


def _shape_key(lin: GGUFBlockLinear) -> str:
    b = lin.blocks
    return (f"{lin.out_features}x{lin.in_features}:{b.bits}/{b.group}/{b.d.dtype}:{lin.path}"
            + ("" if lin.gemm == "float" else f":gemm-{lin.gemm}"))  # fmt: skip


def block_rows_file(kernels: BlockKernels, keys: list[str]) -> Path:
    """Where the measured rows for these shapes are kept: the native kernels' cache (shared
    by workers on a network volume or baked into an image), under a key of the CPU
    (`cpu_identity`: model name, flags, cores, threads), the library and the shapes, so no
    worker reads a choice measured on another CPU."""
    what = (4, cpu_identity(), Path(kernels.path).name, tuple(sorted(keys)))
    return cache_dir() / f"gguf-rows-{hashlib.sha256(repr(what).encode()).hexdigest()[:16]}.json"


def set_block_rows(linears: list[GGUFBlockLinear], kernels: BlockKernels) -> str:
    """Each linear's few-row/GEMM threshold: GGUF_BLOCK_ROWS=N for all, unmeasured; else the
    choice cached for this machine and these shapes, or measured (one instance per shape) and
    cached. Returns the start-up line's part."""
    raw = os.environ.get("GGUF_BLOCK_ROWS", "").strip()
    if raw:
        if not raw.isdigit():
            raise ValueError(f"GGUF_BLOCK_ROWS={raw!r}: expected a row count")
        for lin in linears:
            lin.block_rows = int(raw)
        return f"few-row kernel for steps of <= {raw} rows (GGUF_BLOCK_ROWS)"
    groups: dict[str, list[GGUFBlockLinear]] = {}
    for lin in linears:
        groups.setdefault(_shape_key(lin), []).append(lin)
    path = block_rows_file(kernels, list(groups))
    try:
        saved = json.loads(path.read_text())
        rows = {k: int(saved[k]) for k in groups}
        how = f"cached in {path}"
    except (OSError, ValueError, KeyError, TypeError):
        # one thread: both kernels split the outputs across threads alike, and on a busy
        # machine a parallel region's barrier waits out whole scheduler slices, which swamped
        # the difference being measured
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            rows = {k: choose_block_rows(group[0])[0] for k, group in groups.items()}
        finally:
            torch.set_num_threads(threads)
        how = "measured"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(rows))
        except OSError:
            pass  # measured again at the next start
    for key, group in groups.items():
        for lin in group:
            lin.block_rows = rows[key]
    chosen = ", ".join(f"{k.split(':')[0]}: <= {r}" for k, r in rows.items())
    return f"few-row kernel up to, GEMM past: {chosen} ({how})"


def _whole_layer(layer, kernels: BlockKernels, native):
    """The layer's whole-layer native decode (models/decoder.py's NativeDecodeLayer) on its
    block linears (cpu_native.c calls gguf_blocks.c's qb32_steps_desc through
    decoder_layer_t.qlinear: each linear's few-row kernel or GEMM by its block_rows), for decode
    steps of up to WHOLE_LAYER_ROWS rows, where the layer's shape fits it; None (the per-op
    path) otherwise, or unless all four linears have blocks."""
    from ..models.decoder import NativeDecodeLayer
    from .gguf_kquant_linear import KQuantLinear, layer_descs

    linears = NativeDecodeLayer.linears_of(layer)
    if not all(isinstance(lin, (GGUFBlockLinear, KQuantLinear)) for lin in linears):
        return None
    rows = WHOLE_LAYER_ROWS
    # attach() asks for panels and native rows; the blocks stand in for both
    for lin in linears:
        lin.panels, lin.native_rows = torch.empty(0), rows
    try:
        NativeDecodeLayer.attach(layer, native, False)
    finally:
        for lin in linears:
            lin.panels, lin.native_rows = None, 0
    whole = layer.native_decode
    if whole is not None:
        w = whole.weights
        w.qkv_w = w.o_w = w.up_w = w.down_w = None
        if any(isinstance(lin, KQuantLinear) for lin in linears):  # per-part dispatch
            w.qlinear, (w.qkv_q, w.o_q, w.up_q, w.down_q) = layer_descs(linears)
        else:
            w.qlinear = kernels.steps_desc_address
            w.qkv_q, w.o_q, w.up_q, w.down_q = (ctypes.addressof(lin.steps) for lin in linears)
    return whole


def finish_gguf_blocks(model: nn.Module, kernels: BlockKernels) -> str:
    """After loading (and `optimize_for_cpu`): each block linear's row threshold, and the
    whole-layer native decode on the blocks where a layer's four linears have them. Returns the
    start-up line."""
    from .gguf_kquant_linear import KQuantEmbedding, KQuantLinear

    linears = [m for m in model.modules() if isinstance(m, GGUFBlockLinear)]
    head = getattr(model, "packed_lm_head", None)
    if isinstance(head, GGUFBlockLinear) and head not in linears:
        linears.append(head)
    kq = [m for m in model.modules() if isinstance(m, KQuantLinear)]
    if isinstance(head, KQuantLinear) and head not in kq:
        kq.append(head)
    if not linears and not kq:
        return "GGUF blocks: no tensor of the file has a block layout; all float"
    rows_line = set_block_rows(linears, kernels) if linears else "no qb32 linears"
    if kq:
        rows_line += (f"; {len(kq)} linears with K-quant parts on their dense records, few-row "
                      f"kernel up to {kq[0].block_rows} rows")  # fmt: skip
    native = getattr(model, "native", None)
    whole = 0
    for layer in getattr(model, "layers", []):
        if hasattr(layer, "native_decode") and native is not None:
            layer.native_decode = _whole_layer(layer, kernels, native)
            whole += layer.native_decode is not None
    held = sum(lin.blocks.nbytes() for lin in linears + kq)
    emb = getattr(model, "embed_tokens", None)
    if isinstance(emb, (GGUFBlockEmbedding, KQuantEmbedding)) and not any(
        lin.blocks is emb.blocks for lin in linears + kq
    ):
        held += emb.blocks.nbytes()
    inputs = ("float" if (linears + kq)[0].path == "float" else "int8") + " inputs"
    if linears:
        inputs += f", GEMM {linears[0].gemm} inputs"
    isa = "AVX-512" if kernels.vnni else "AVX2" if kernels.avx2 else "portable C"
    what = f"{len(linears) + len(kq)} linears"
    if isinstance(emb, (GGUFBlockEmbedding, KQuantEmbedding)):
        what += " and the token embedding"
    return (
        f"GGUF blocks: {what} kept in the file's blocks ({held / 2**20:.0f} MiB, no float copy; "
        f"{inputs}; {isa}); {rows_line}; whole decode layers on blocks: {whole}"
    )

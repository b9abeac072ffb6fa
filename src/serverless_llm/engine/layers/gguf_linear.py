"""A GGUF checkpoint's linears computed from its quantized blocks on CPU (QUANTIZED_WEIGHTS=packed).

A decode step on a CPU is bound by the bytes of weight it reads: the float32 copy of a Q4_1
model is ~6.7x the file's blocks. After the model is loaded from its converted float copy and
packed for oneDNN, `attach_gguf_blocks` maps the .gguf file's tensors again (`read_tensors`) and
gives each linear whose tensor is of a type with a qb32 layout (kernels/gguf_blocks.py: Q4_0,
Q4_1, Q8_0) that weight in the layout, checked against the float weight it replaces (a probe
through both must agree, else the linear stays float with a warning line). Steps of at most
`BLOCK_ROWS` rows (decodes) then run the native block linear; larger steps (prefill) keep
oneDNN's float weight, which this first slice still holds.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch
from torch import nn

from ..kernels.gguf_blocks import (
    FILE_TYPES,
    QB32,
    BlockKernels,
    QB32Desc,
    from_gguf_blocks,
    read_tensors,
)
from .linear import PackedLinear, packed_linear

logger = logging.getLogger(__name__)

BLOCK_ROWS = 16  # steps of at most this many rows read the blocks


class GGUFBlockLinear(PackedLinear):
    """A PackedLinear that also holds its weight as qb32 blocks, used for small steps."""

    def __init__(
        self, base: PackedLinear, blocks: QB32, kernels: BlockKernels, path: str = "best"
    ) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = base.out_features, base.in_features
        self.packed, self.bias = base.packed, base.bias
        self.panels, self.native, self.native_rows = None, None, 0
        self.blocks, self.kernels, self.block_rows = blocks, kernels, BLOCK_ROWS
        self.path = path  # the kernel's: "best" (int8 inputs) or "float"
        self.desc = QB32Desc.of(blocks, path)  # for the whole-layer native decode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.block_rows and x.dtype == torch.float32:
            return self.kernels.linear(x, self.blocks, self.bias, self.path)
        return packed_linear(x, self.packed, self.bias)


def _unpermute_rows(n_rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's converter's q/k permutation (it interleaves each
    head's two rotary halves): the rows the float checkpoint has, as indices of the file's."""
    half = n_rows // heads // 2
    return torch.arange(n_rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


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


def _blocks_of(tensors: dict, parts, unpermute: bool = True) -> QB32 | None:
    got = []
    for name, heads in parts:
        t = tensors.get(name)
        if t is None or t.type_name not in FILE_TYPES:
            return None
        w = from_gguf_blocks(t.data, t.type_name, t.shape[0])
        if heads is not None and unpermute:
            w = w.rows(_unpermute_rows(w.shape[0], heads))
        got.append(w)
    try:
        return got[0] if len(got) == 1 else QB32.cat(got)
    except ValueError:
        return None


def _agrees(lin: PackedLinear, blocks: QB32, kernels: BlockKernels) -> bool:
    """Whether the blocks hold the float weight `lin` was packed from: a probe row through both
    (the block linear's int8 activations cost well under 5% of the output's largest value; a
    wrong row order or tensor costs about all of it)."""
    if blocks.shape != (lin.out_features, lin.in_features):
        return False
    x = torch.randn(1, lin.in_features, generator=torch.Generator().manual_seed(0))
    want = packed_linear(x, lin.packed, None)
    got = kernels.linear(x, blocks)
    return bool((got - want).abs().max() <= 0.05 * want.abs().max())


def _whole_layer(layer, kernels: BlockKernels, native):
    """The layer's whole-layer native decode (models/decoder.py's NativeDecodeLayer) on its
    block linears (cpu_native.c calls the block linear through decoder_layer_t.qlinear), for
    steps of <= BLOCK_ROWS rows, where the layer's shape fits it; None (the per-op path)
    otherwise, or unless all four linears have blocks. Whether the float panels won at this
    machine's measurement does not matter here: the blocks replace them."""
    from ..models.decoder import NativeDecodeLayer

    linears = NativeDecodeLayer.linears_of(layer)
    if not all(isinstance(lin, GGUFBlockLinear) for lin in linears):
        return None
    # attach() asks for panels and native rows; the blocks stand in for both
    for lin in linears:
        lin.panels, lin.native_rows = torch.empty(0), BLOCK_ROWS
    try:
        NativeDecodeLayer.attach(layer, native, False)
    finally:
        for lin in linears:
            lin.panels, lin.native_rows = None, 0
    whole = layer.native_decode
    if whole is not None:
        w = whole.weights
        w.qkv_w = w.o_w = w.up_w = w.down_w = None
        w.qlinear = kernels.linear_desc_address
        w.qkv_q, w.o_q, w.up_q, w.down_q = (ctypes.addressof(lin.desc) for lin in linears)
    return whole


def block_inputs() -> str:
    """GGUF_BLOCK_INPUTS: "float" (default where the CPU has AVX-512: x multiplies the codes
    as float32, the dequantized weight's product up to rounding) or "int8" (x quantized per
    block to int8 and integer dots, as llama.cpp does: faster, but tokens part from the float
    path's at near ties)."""
    raw = os.environ.get("GGUF_BLOCK_INPUTS", "").strip().lower() or "float"
    if raw not in ("float", "int8"):
        raise ValueError(f"GGUF_BLOCK_INPUTS={raw!r}: expected float or int8")
    return raw


def attach_gguf_blocks(model: nn.Module, gguf_path: str, hf_config, kernels: BlockKernels) -> str:
    """Swaps the model's packed linears (and a tied LM head) for GGUFBlockLinear where the file
    has their tensors in a qb32 type and they check out; turns the whole-layer native decode off
    for layers that got one. Returns the start-up line."""
    tensors = read_tensors(gguf_path)
    inputs = block_inputs()
    if inputs == "float" and not kernels.has_float:
        inputs = "int8"  # float inputs are built for AVX-512 only
    kernel_path = "float" if inputs == "float" else "best"
    done, kept, held = 0, [], 0
    for i, layer in enumerate(getattr(model, "layers", [])):
        swapped = False
        for path, parts in _parts(hf_config, i).items():
            parent_name, _, name = path.rpartition(".")
            parent = getattr(layer, parent_name, None)
            lin = getattr(parent, name, None)
            if not isinstance(lin, PackedLinear):
                continue
            blocks = _blocks_of(tensors, parts)
            ok = blocks is not None and _agrees(lin, blocks, kernels)
            if blocks is not None and not ok and parts[0][1]:
                # the converter reorders q/k rows for llama's rotary layout only; others as is
                blocks = _blocks_of(tensors, parts, unpermute=False)
                ok = blocks is not None and _agrees(lin, blocks, kernels)
            if not ok:
                kept.append(f"{i}.{path}")
                continue
            setattr(parent, name, GGUFBlockLinear(lin, blocks, kernels, kernel_path))
            done, swapped, held = done + 1, True, held + blocks.nbytes()
        if swapped and hasattr(layer, "native_decode"):
            native = getattr(model, "native", None)
            layer.native_decode = None if native is None else _whole_layer(layer, kernels, native)
    head = getattr(model, "packed_lm_head", None)
    emb = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if isinstance(head, PackedLinear) and emb is not None and emb.type_name in FILE_TYPES:
        blocks = from_gguf_blocks(emb.data, emb.type_name, emb.shape[0])
        if _agrees(head, blocks, kernels):
            model.packed_lm_head = GGUFBlockLinear(head, blocks, kernels, kernel_path)
            done, held = done + 1, held + blocks.nbytes()
        else:
            kept.append("lm_head")
    if kept:
        logger.warning("GGUF blocks do not match the float weights of %s; those stay float",
                       ", ".join(kept[:8]))  # fmt: skip
    return (
        f"GGUF blocks: {done} linears read their quantized blocks ({held / 2**20:.0f} MiB) for "
        f"steps of <= {BLOCK_ROWS} rows ({inputs} inputs; "
        f"{'AVX-512' if kernels.vnni else 'AVX2' if kernels.avx2 else 'portable C'})"
    )

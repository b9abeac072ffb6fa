"""GGUF K-quant tensors (Q4_K, Q5_K, Q6_K) served from their dense records (kernels/gguf_kquants.py)
instead of gguf_blocks' widened qb32 form, and fused linears whose parts have different types
kept part by part.

`take_kquants` runs first inside `take_gguf_blocks` (layers/gguf_linear.py), on the model still
on meta: each decoder linear with at least one K-quant part becomes a `KQuantLinear` whose parts
are K-quant records or qb32 blocks (the other types), stacked along the outputs; adjacent parts of
one layout are joined. The token embedding of a K-quant type becomes a `KQuantEmbedding` and a
tied LM head a KQuantLinear on the same records. Every step runs gguf_kquants.c's
`kq_multi_desc`: each part by its own kernel (few-row up to its threshold, gguf_blocks.c's GEMM
past it), and the whole-layer native decode calls the same function (`layer_descs`).
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import nn

from ..kernels import gguf_blocks as gb
from ..kernels import gguf_kquants as gk
from .linear import PackedLinear


class KQParts:
    """The parts of a KQuantLinear (KQ or QB32 each), for the bytes held."""

    def __init__(self, parts: list) -> None:
        self.parts = parts

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


def few_rows() -> int:
    """GGUF_BLOCK_ROWS when set (as for the qb32 linears), else gguf_kquants.FEW_ROWS."""
    raw = os.environ.get("GGUF_BLOCK_ROWS", "").strip()
    return int(raw) if raw.isdigit() else gk.FEW_ROWS


def kquant_path(path: str) -> str:
    """The K-quant parts' few-row path for the layer's `path` ("float" or "best", from
    GGUF_BLOCK_INPUTS): GGUF_KQUANT_INPUTS, when set, picks the K-quant parts' inputs alone
    ("float": 22-bit, "i15": 15-bit, two byte dots a code byte, "int8"), else they follow
    `path`."""
    raw = os.environ.get("GGUF_KQUANT_INPUTS", "").strip().lower()
    if not raw:
        return path
    if raw not in ("float", "i15", "int8"):
        raise ValueError(f"GGUF_KQUANT_INPUTS={raw!r}: expected float, i15 or int8")
    return "best" if raw == "int8" else raw


def served(w: gk.KQ, path: str, vnni: bool) -> gk.KQ:
    """w in the record order its kernel streams fastest (one thread, weights from memory,
    session 23): tiled (gguf_kquants.tiled) for int8 inputs on AVX-512 VNNI (one row: 33-35
    against 23-25 GB/s on a 7168x1280 Q4_K, four rows faster too); row after row for the float
    and i15 inputs, whose dots bind them more (tiled, a 1280x3584 Q6_K with float inputs read
    26-29 against 31-33 GB/s at one row, and both kinds lost ~10% at four rows), and on the
    AVX2 path (tiles of 4 rows: row after row 1.1-2.3x faster, every input kind)."""
    return gk.tiled(w) if vnni and kquant_path(path) == "best" else gk.untiled(w)


class KQuantLinear(PackedLinear):
    """A linear of parts in their own layouts (K-quant records or qb32 blocks), run by
    kq_multi_desc. A PackedLinear in name, so the whole-layer native decode can take it."""

    def __init__(self, parts: list, kernels: gk.KQuantKernels, path: str = "float",
                 bias: torch.Tensor | None = None) -> None:  # fmt: skip
        nn.Module.__init__(self)
        parts = [served(p, path, kernels.vnni) if isinstance(p, gk.KQ) else p for p in parts]
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self.packed, self.panels, self.native, self.native_rows = None, None, None, 0
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.parts, self.kernels, self.path = parts, kernels, path
        self.blocks = parts[0] if len(parts) == 1 else KQParts(parts)
        rows = few_rows()
        descs, n0 = [], 0
        for p in parts:
            if isinstance(p, gk.KQ):
                descs.append((kernels.steps_address, kernels.desc(p, kquant_path(path), rows), n0))
            else:
                d = gb.QB32StepsDesc(gb.QB32Desc.of(p, path), rows)
                descs.append((kernels.qb32_steps_address, d, n0))
            n0 += p.shape[0]
        self.descs = [d for _, d, _ in descs]
        self.multi = gk.KQMulti.of(descs)

    @property
    def block_rows(self) -> int:
        return self.descs[0].few_rows

    @block_rows.setter
    def block_rows(self, rows: int) -> None:
        for d in self.descs:
            d.few_rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        out = self.kernels.multi(x2, self.multi, self.out_features, self.bias)
        return out.view(*lead, self.out_features).to(x.dtype)


class KQuantEmbedding(nn.Module):
    """The token embedding on K-quant records: a lookup dequantizes the rows it takes."""

    def __init__(self, blocks: gk.KQ, kernels: gk.KQuantKernels) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = blocks.shape
        self.blocks, self.kernels = blocks, kernels
        self.weight = torch.empty(0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.rows(self.blocks, ids)


def _same_layout(a, b) -> bool:
    if isinstance(a, gk.KQ) or isinstance(b, gk.KQ):
        return isinstance(a, gk.KQ) and isinstance(b, gk.KQ) and a.type_name == b.type_name
    return (a.bits, a.group, a.d.dtype) == (b.bits, b.group, b.d.dtype)


def parts_of(tensors: dict, parts, unpermute: bool, kernels=None) -> list | None:
    """The layouts of a fused linear's GGUF tensors (K-quant records for Q4_K/Q5_K/Q6_K, qb32
    blocks for the other block types), adjacent ones of one layout joined; None where a tensor
    is missing, of a type with neither layout, or none of them is a K-quant."""
    from .gguf_linear import _unpermute_rows

    got: list = []
    if not any(getattr(tensors.get(n), "type_name", None) in gk.TYPES for n, _ in parts):
        return None
    for name, heads in parts:
        t = tensors.get(name)
        if t is None or (t.type_name not in gk.TYPES and t.type_name not in gb.FILE_TYPES):
            return None
        try:
            if t.type_name in gk.TYPES:
                w = gk.from_file_blocks(t.data, t.type_name, t.shape[0], kernels)
            else:
                w = gb.from_gguf_blocks(t.data, t.type_name, t.shape[0])
        except ValueError:  # inputs that are not whole blocks
            return None
        if heads is not None and unpermute:
            w = w.rows(_unpermute_rows(w.shape[0], heads))
        if got and _same_layout(got[-1], w) and got[-1].shape[1] == w.shape[1]:
            got[-1] = type(w).cat([got[-1], w])
        else:
            got.append(w)
    if len({p.shape[1] for p in got}) != 1:
        return None
    return got


def take_kquants(model: nn.Module, tensors: dict, hf_config, path: str) -> set[str]:
    """On a model still on meta: each decoder linear with a K-quant part, the token embedding
    of a K-quant type and a tied LM head over it, on K-quant records (see the module's text).
    Returns the GGUF names taken; without the K-quant kernels (their warning says why) or
    either AVX-512 VNNI or AVX2 nothing, and gguf_blocks' qb32 form takes them as before."""
    from .gguf_linear import _meta_bias, _parts, permutes_qk

    if not any(t.type_name in gk.TYPES for t in tensors.values()):
        return set()
    kernels = gk.load()
    if kernels is None or kernels.qb32_steps_address is None or not (kernels.vnni or kernels.avx2):
        # the portable loop is for tests; with AVX2 alone the records' tiled AVX2 path ran
        # 1.2-2.1x qb32's AVX2 path at one row (forced on the AVX-512 machine, session 23)
        return set()
    unpermute = permutes_qk(hf_config)
    taken: set[str] = set()
    for i, layer in enumerate(getattr(model, "layers", [])):
        for where, parts in _parts(hf_config, i).items():
            parent_name, _, name = where.rpartition(".")
            parent = getattr(layer, parent_name, None)
            lin = getattr(parent, name, None)
            if type(lin) is not nn.Linear:
                continue
            got = parts_of(tensors, parts, unpermute, kernels)
            if got is None or (sum(p.shape[0] for p in got), got[0].shape[1]) != (
                lin.out_features,
                lin.in_features,
            ):
                continue
            setattr(parent, name, KQuantLinear(got, kernels, path, _meta_bias(lin)))
            taken.update(n for n, _ in parts)
    emb_t = tensors.get("token_embd.weight")
    emb = getattr(model, "embed_tokens", None)
    if isinstance(emb, nn.Embedding) and emb_t is not None and emb_t.type_name in gk.TYPES:
        try:
            # in the order a tied head serves, for the lookup and the head alike (one copy)
            w = gk.from_file_blocks(emb_t.data, emb_t.type_name, emb_t.shape[0], kernels)
            w = served(w, path, kernels.vnni)
        except ValueError:
            w = None
        if w is not None and w.shape == tuple(emb.weight.shape):
            model.embed_tokens = KQuantEmbedding(w, kernels)
            taken.add("token_embd.weight")
            tied = getattr(model, "tied", False) and getattr(model, "num_labels", None) is None
            if tied and getattr(model, "lm_head_bias", None) is None:
                model.packed_lm_head = KQuantLinear([w], kernels, path)
    head = getattr(model, "lm_head", None)
    if (
        getattr(model, "num_labels", None) is None
        and not getattr(model, "tied", False)
        and type(head) is nn.Linear
        and head.bias is None
    ):
        got = parts_of(tensors, [("output.weight", None)], False, kernels)
        if got is not None and (got[0].shape == (head.out_features, head.in_features)):
            model.lm_head = KQuantLinear(got, kernels, path)
            taken.add("output.weight")
    return taken


def layer_descs(linears) -> tuple[int, list[int]]:
    """For the whole-layer native decode of a layer whose linears are KQuantLinear or
    GGUFBlockLinear: (kq_multi_desc's address, each linear's descriptor address); a
    GGUFBlockLinear gets a one-part KQMulti of its qb32 steps descriptor."""
    from .gguf_linear import GGUFBlockLinear

    kernels = next(lin.kernels for lin in linears if isinstance(lin, KQuantLinear))
    out = []
    for lin in linears:
        if isinstance(lin, GGUFBlockLinear):
            lin.multi = gk.KQMulti.of([(kernels.qb32_steps_address, lin.steps, 0)])
        out.append(ctypes.addressof(lin.multi))
    return kernels.multi_address, out

"""Linear layers of quantized checkpoints: GPTQ, AWQ, compressed-tensors pack-quantized and
FP8 (issue 16; the layouts are described in docs/quantization.md).

A `QuantLinear` takes the place of an nn.Linear in a decoder layer before the weights load. The
loader hands it the checkpoint's tensors (`take`) as they stream past, per part (the q, k and v
of a fused qkv_proj, the gate and up of a gate_up_proj, or the whole module): `qweight`,
`qzeros`, `scales` and GPTQ's `g_idx`; `weight_packed`, `weight_scale`, `weight_shape`; or an
FP8 `weight` with its `weight_scale` (per tensor, channel or block; DeepSeek names the block
scales `weight_scale_inv`); or a plain float `weight` for a module the quantizer left alone. As
soon as a part's tensors are all there, they are checked against the scheme and the module's
shape (an error names the tensor) and unpacked into one common form, whatever the
producer's packing: for integers, values q [out, in], zero points and scales [out, groups] and
the group of each input column; for FP8, the weight and a float32 scale per output row, or with
block scales the weight, its float32 block grid and the grid row of each output row. When
every part is in, the module settles into its working form:

- "dequantize": the float weight, computed once in float32, handed back as a plain nn.Linear
  (on CPU the packed oneDNN linears then serve it: see docs/quantization.md for why this beats
  torch's int4 CPU kernels);
- "packed": the weight stays at its bit width in memory. Integer weights: input columns sorted
  by group (act-order checkpoints hold them permuted; the input is permuted to match at each
  call), packed 32 // bits to an int32 along the input, with scales and zero points
  [groups, out] (`PackedWeight`; the Triton GEMM where the backend uses kernels, else its torch
  reference). FP8 weights: their bytes and scales (`Fp8Weight`), or with block scales their
  bytes and block grid (`Fp8BlockWeight`, kernels/fp8_block.py's block-scaled GEMM).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.fp8 import FP8, fp8_linear, fp8_linear_ref
from ..kernels.fp8_block import block_rows, fp8_block_dequantize, fp8_block_forward
from ..kernels.w4a16 import (
    AWQ_ORDER,
    dequantize_grouped,
    pack_int32,
    unpack_int32,
    w4a16_linear,
    w4a16_linear_ref,
)
from ..loader.quantization import QuantScheme

WHOLE = -1  # part index of a tensor that covers every part at once (a fused checkpoint tensor)
_QUANT_KINDS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "fp8": ("weight", "weight_scale"),
    "packed_int": ("weight_packed", "weight_scale", "weight_shape", "weight_g_idx"),
}
# The group of each input row: optional (absent, i // group_size), so a part waits for it only
# until the last tensor.
_OPTIONAL = {"g_idx", "weight_g_idx"}
# Tensors a checkpoint may carry that the engine does not need: a static FP8 activation scale
# (activations are quantized per token at each call instead; docs/quantization.md; transformers
# names it `activation_scale`), and the [out, in] shape older compressed-tensors versions wrote
# beside a block-FP8 weight they had padded to whole blocks (the padding is cut off at load).
_UNUSED_KINDS = {"fp8": ("input_scale", "activation_scale", "weight_shape_original")}
MODES = ("dequantize", "packed", "forms")  # "forms": the unpacked parts kept (`forms`), MoE experts


class QuantLoadError(KeyError):
    """A checkpoint tensor disagrees with its config or its module; the message names it."""

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0])


class QuantLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        scheme: QuantScheme,
        parts: tuple[int, ...],
        mode: str,
        use_kernels: bool = False,
        num_groups: int | None = None,
    ) -> None:
        """`num_groups`: more groups than the inputs span, for a row-parallel rank's share of
        an act-order checkpoint (models/sharding.py: its inputs' groups are spread over the
        whole input's)."""
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"quantized linear mode {mode!r}: allowed {', '.join(MODES)}")
        if sum(parts) != out_features:
            raise ValueError(f"parts {parts} do not add up to {out_features} outputs")
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.parts, self.mode, self.use_kernels = scheme, parts, mode, use_kernels
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.group_size = in_features if scheme.group_size == -1 else scheme.group_size
        self.num_groups = num_groups or -(-in_features // self.group_size)
        self._staged: dict[int, dict[str, tuple[str, torch.Tensor]]] = {}
        self._ready: dict[int, tuple] = {}  # part -> unpacked form (or ("float", weight))
        self.rows: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.weight: torch.Tensor | None = None  # "dequantize", or a module left unquantized
        self.packed: nn.ModuleList | None = None  # "packed": PackedWeight, one per act-order
        self.settled = False
        self.forms: list[tuple] | None = None  # mode "forms": the settled parts, unpacked
        self.took_quantized = False  # some part came as integer tensors

    def extra_repr(self) -> str:
        s = self.scheme
        return (
            f"in={self.in_features}, out={self.out_features}, {s.method} {s.bits}-bit, "
            f"group={s.group_size}, mode={self.mode}"
        )

    # -- loading -------------------------------------------------------------------------------

    def _part_size(self, part: int) -> int:
        return self.out_features if part == WHOLE else self.parts[part]

    def take(
        self,
        kind: str,
        part: int,
        name: str,
        tensor: torch.Tensor,
        rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """One checkpoint tensor `name` of kind `kind` for part `part` (WHOLE: all parts);
        `rows` reorders the output rows of a whole fused tensor into the module's order."""
        kinds = _QUANT_KINDS[self.scheme.method]
        if kind in _UNUSED_KINDS.get(self.scheme.method, ()):
            return
        if kind == "weight_scale_inv" and self.scheme.method == "fp8":
            kind = "weight_scale"  # DeepSeek's name; the scale multiplies all the same
        if kind not in (*kinds, "weight"):
            raise QuantLoadError(
                f"checkpoint tensor {name!r}: a {self.scheme.method} module has no {kind!r} "
                f"tensor (expected {', '.join(kinds)})"
            )
        if self.settled or part in self._ready or (part != WHOLE and WHOLE in self._staged):
            raise QuantLoadError(f"checkpoint tensor {name!r} arrives twice")
        if rows is not None:
            self.rows = rows
        staged = self._staged.setdefault(part, {})
        if kind in staged:
            raise QuantLoadError(f"checkpoint tensor {name!r} arrives twice")
        staged[kind] = (name, tensor)
        self._try_unpack(part, final=False)

    def _try_unpack(self, part: int, final: bool) -> None:
        """Unpacks `part` once its tensors are all staged. GPTQ's g_idx is optional (absent, it
        is i // group_size), so before the last tensor (`final`) a part waits for it."""
        staged = self._staged[part]
        if "weight" in staged and staged["weight"][1].dtype != FP8:
            name, w = staged.pop("weight")
            if staged:
                other = next(iter(staged.values()))[0]
                raise QuantLoadError(f"checkpoint tensor {name!r} is unquantized, but {other!r} is")
            shape = (self._part_size(part), self.in_features)
            if tuple(w.shape) != shape:
                raise QuantLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(w.shape)}, expected {shape}"
                )
            self._ready[part] = ("float", w.float())  # a linear the quantizer left alone
        else:
            need = [k for k in _QUANT_KINDS[self.scheme.method] if k not in _OPTIONAL or not final]
            if any(k not in staged for k in need):
                return
            self._ready[part] = self._unpack(part, staged)
            self.took_quantized = True
        del self._staged[part]
        if WHOLE in self._ready or all(i in self._ready for i in range(len(self.parts))):
            self._settle()

    def _unpack(self, part: int, staged: dict) -> tuple:
        """The part in one common form: ("int", q [out, in] uint8, zeros and scales
        [out, groups], g_idx [in]) for GPTQ and AWQ, ("fp8", weight [out, in], float32 scale
        [out]) for FP8, ("fp8_block", weight [out, in], float32 block scales [ceil(out / bn),
        ceil(in / bk)], the scale row of each output row [out], bk) for block FP8."""
        s = self.scheme
        n, k, groups = self._part_size(part), self.in_features, self.num_groups
        per = 32 // s.bits

        def tensor(kind: str, shape: tuple[int, ...], dtypes: tuple) -> torch.Tensor:
            name, t = staged[kind]
            if tuple(t.shape) != shape:
                raise QuantLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, expected {shape} "
                    f"for {s.bits}-bit {s.method} with group_size {s.group_size} "
                    f"({k} inputs, {n} outputs)"
                )
            if t.dtype not in dtypes:
                raise QuantLoadError(
                    f"checkpoint tensor {name!r} is {t.dtype}, expected one of {dtypes}"
                )
            return t

        ints = (torch.int32,)
        floats = (torch.float16, torch.bfloat16, torch.float32)
        packed_n = -(-n // per)
        if s.method == "fp8" and s.block is not None:
            return self._unpack_fp8_block(n, k, staged)
        if s.method == "fp8":
            w = tensor("weight", (n, k), (FP8,))
            name, scale = staged["weight_scale"]
            if scale.dtype not in floats or tuple(scale.shape) not in ((), (1,), (n,), (n, 1)):
                raise QuantLoadError(
                    f"checkpoint tensor {name!r} is {scale.dtype} {tuple(scale.shape)}; a scale "
                    f"per tensor (() or (1,)) or per output channel (({n},) or ({n}, 1)) in a "
                    "float dtype was expected"
                )
            return ("fp8", w, scale.float().reshape(-1).expand(n).contiguous())

        def group_of_rows(kind: str) -> torch.Tensor:
            if kind not in staged:
                return torch.arange(k) // self.group_size
            g_idx = tensor(kind, (k,), (torch.int32, torch.int64)).long()
            if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
                raise QuantLoadError(
                    f"checkpoint tensor {staged[kind][0]!r} names groups outside 0..{groups - 1}"
                )
            return g_idx

        if s.method == "packed_int":
            # compressed-tensors pack-quantized: values packed along each output row's inputs,
            # stored with the offset 2 ** (bits - 1) that makes a signed value unsigned.
            name, shape = staged["weight_shape"]
            if [int(v) for v in shape.reshape(-1).tolist()] != [n, k]:
                raise QuantLoadError(
                    f"checkpoint tensor {name!r} says {shape.tolist()}, expected [{n}, {k}]"
                )
            packed_k = -(-k // per)
            q = unpack_int32(tensor("weight_packed", (n, packed_k), ints), s.bits, dim=1)[:, :k]
            scales = tensor("weight_scale", (n, groups), floats)
            zeros = torch.full((n, groups), 1 << (s.bits - 1), dtype=torch.int32)
            g_idx = group_of_rows("weight_g_idx")
            return ("int", q.to(torch.uint8).contiguous(), zeros, scales, g_idx)
        if s.method == "gptq":
            if k % per:
                raise QuantLoadError(f"{staged['qweight'][0]!r}: {k} inputs do not pack by {per}")
            q = unpack_int32(tensor("qweight", (k // per, n), ints), s.bits, dim=0).t()
            zeros = unpack_int32(tensor("qzeros", (groups, packed_n), ints), s.bits, dim=1)
            zeros = zeros[:, :n] + 1  # the v1 format stores each zero point minus one
            g_idx = group_of_rows("g_idx")
        else:
            qw = tensor("qweight", (k, packed_n), ints)
            q = unpack_int32(qw, s.bits, dim=1, order=AWQ_ORDER)[:, :n].t()
            zeros = unpack_int32(tensor("qzeros", (groups, packed_n), ints), 4, 1, AWQ_ORDER)
            zeros = zeros[:, :n]
            g_idx = torch.arange(k) // self.group_size
        scales = tensor("scales", (groups, n), floats)
        return ("int", q.to(torch.uint8).contiguous(), zeros.t().contiguous(), scales.t(), g_idx)

    def _unpack_fp8_block(self, n: int, k: int, staged: dict) -> tuple:
        """A block-FP8 part: the e4m3 weight [n, k] (older compressed-tensors versions padded
        it to whole blocks: the padding is cut off) and its block scales, float32."""
        bn, bk = self.scheme.block
        rows, cols = -(-n // bn), -(-k // bk)
        name, w = staged["weight"]
        fits = w.dim() == 2 and w.shape[0] in (n, rows * bn) and w.shape[1] in (k, cols * bk)
        if w.dtype != FP8 or not fits:
            raise QuantLoadError(
                f"checkpoint tensor {name!r} is {w.dtype} {tuple(w.shape)}, expected "
                f"float8_e4m3fn ({n}, {k}) ({k} inputs, {n} outputs)"
            )
        name, scale = staged["weight_scale"]
        scale_types = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e8m0fnu)
        if scale.dtype not in scale_types or tuple(scale.shape) != (rows, cols):
            raise QuantLoadError(
                f"checkpoint tensor {name!r} is {scale.dtype} {tuple(scale.shape)}; expected a "
                f"float scale per {bn}x{bk} block, ({rows}, {cols}) for {k} inputs and {n} "
                "outputs"
            )
        w = w[:n, :k].contiguous()
        return ("fp8_block", w, scale.float().contiguous(), block_rows(n, bn), bk)

    def missing(self) -> list[str]:
        """What the checkpoint left out, after the last tensor (also unpacks GPTQ parts that
        came without g_idx)."""
        for part in list(self._staged):
            self._try_unpack(part, final=True)
        if self.settled:
            return []
        kinds = _QUANT_KINDS[self.scheme.method]
        if self._staged:
            part, staged = next(iter(self._staged.items()))
            lack = [k for k in kinds if k not in staged and k not in _OPTIONAL]
            module = next(iter(staged.values()))[0].rpartition(".")[0]
            return [f"{module}.{k}" for k in lack]
        return [f"part {i} of {self.parts}" for i in range(len(self.parts)) if i not in self._ready]

    def _settle(self) -> None:
        forms = (
            [self._ready[WHOLE]]
            if WHOLE in self._ready
            else [self._ready[i] for i in range(len(self.parts))]
        )
        self._ready.clear()
        if self.mode == "forms":
            self.forms = forms
            self.settled = True
            return
        if self.mode == "dequantize" or any(f[0] == "float" for f in forms):
            w = torch.cat([_dequantize(f) for f in forms])
            self.weight = w if self.rows is None else self.rows(w).reshape(w.shape)
            self.settled = True
            return
        if forms[0][0] == "fp8_block":
            # Each part keeps its own grid of block scales (a part's rows need not fill whole
            # blocks): the grids are stacked and each row points at its part's.
            offsets = torch.tensor([0] + [f[2].shape[0] for f in forms[:-1]]).cumsum(0)
            w, scale = (torch.cat([f[i] for f in forms]) for i in (1, 2))
            rows = torch.cat([f[3] + int(o) for f, o in zip(forms, offsets)])
            if self.rows is not None:
                w, rows = (self.rows(t).reshape(t.shape) for t in (w, rows))
            self.packed = nn.ModuleList([Fp8BlockWeight(w, scale, rows, forms[0][4])])
            self.settled = True
            return
        if forms[0][0] == "fp8":
            w, scale = (torch.cat([f[i] for f in forms]) for i in (1, 2))
            if self.rows is not None:
                w, scale = (self.rows(t).reshape(t.shape) for t in (w, scale))
            self.packed = nn.ModuleList([Fp8Weight(w, scale)])
            self.settled = True
            return
        # Parts that share their act-order permutation (q, k and v of one input, as GPTQ
        # writes them: they see the same Hessian) pack into one weight; a part with its own
        # permutation gets its own packed weight and matmul.
        runs: list[list[tuple]] = []
        for f in forms:
            if runs and torch.equal(runs[-1][0][4], f[4]):
                runs[-1].append(f)
            else:
                runs.append([f])
        packed = []
        for run in runs:
            q, zeros, scales = (torch.cat([f[i] for f in run]) for i in (1, 2, 3))
            if self.rows is not None:
                q, zeros, scales = (self.rows(t).reshape(t.shape) for t in (q, zeros, scales))
            packed.append(PackedWeight(q, zeros, scales, run[0][4], self.scheme.bits))
        self.packed = nn.ModuleList(packed)  # on CPU: the model moves it (`_settle_quantized`)
        self.settled = True

    def init_dummy(self, g: torch.Generator) -> None:
        """Random weights (LOAD_FORMAT=dummy) in the scheme's shape: values uniform over the
        range, the zero point mid-range, scales like a 0.02-std float weight."""
        bits, n, k = self.scheme.bits, self.out_features, self.in_features
        if self.scheme.method == "fp8":
            w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8)
            self._ready = {WHOLE: ("fp8", w, torch.full((n,), 2e-4))}
            if self.scheme.block is not None:
                bn, bk = self.scheme.block
                scale = torch.full((-(-n // bn), -(-k // bk)), 2e-4)
                self._ready = {WHOLE: ("fp8_block", w, scale, block_rows(n, bn), bk)}
            self._settle()
            return
        top = 1 << bits
        q = torch.randint(0, top, (n, k), generator=g, dtype=torch.uint8)
        zeros = torch.full((n, self.num_groups), top // 2, dtype=torch.int32)
        scales = torch.full((n, self.num_groups), 0.04 / top, dtype=torch.float16)
        g_idx = torch.arange(k) // self.group_size
        self._ready = {WHOLE: ("int", q, zeros, scales, g_idx)}
        self._settle()

    # -- running -------------------------------------------------------------------------------

    def to_linear(self) -> nn.Linear:
        """The settled float weight as a plain nn.Linear (mode "dequantize")."""
        lin = nn.Linear(
            self.in_features, self.out_features, bias=self.bias is not None, device="meta"
        )
        lin.weight = nn.Parameter(self.weight, requires_grad=False)
        if self.bias is not None:
            lin.bias = self.bias
        return lin

    def _apply(self, fn, recurse=True):
        # model.to(dtype/device) must reach the float weight of a settled "dequantize" module,
        # a plain attribute rather than a parameter.
        super()._apply(fn, recurse)
        if self.weight is not None:
            self.weight = fn(self.weight)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight.to(x.dtype), self.bias)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        outs = [p(flat, self.use_kernels) for p in self.packed]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


class PackedWeight(nn.Module):
    """A weight at its bit width: `qweight` int32 [in / (32 / bits), out], input rows sorted by
    group and packed lowest bits first; `scales`, `zeros` [groups, out]; `g_idx` int32 [in],
    the group of each packed row; `perm` (None when already in order) the input column of
    each packed row."""

    def __init__(self, q, zeros, scales, g_idx, bits: int) -> None:
        super().__init__()
        self.bits = bits
        self.perm = None
        if bool((g_idx[1:] < g_idx[:-1]).any()):
            self.perm = torch.argsort(g_idx, stable=True)
            q, g_idx = q[:, self.perm], g_idx[self.perm]
        self.register_buffer("qweight", pack_int32(q.t(), bits, dim=0))
        self.register_buffer("scales", scales.t().contiguous())
        self.register_buffer("zeros", zeros.t().to(scales.dtype).contiguous())
        self.register_buffer("g_idx", g_idx.to(torch.int32))

    def _apply(self, fn, recurse=True):
        apply_keeping_dtype(self, fn, recurse, ("scales", "zeros"))
        if self.perm is not None:  # a plain attribute: model.to(device) must still move it
            self.perm = fn(self.perm)
        return self

    def forward(self, x: torch.Tensor, use_kernels: bool) -> torch.Tensor:
        fn = w4a16_linear if use_kernels else w4a16_linear_ref
        return fn(x, self.qweight, self.scales, self.zeros, self.g_idx, self.perm, self.bits)


def _dequantize(form: tuple) -> torch.Tensor:
    """A part's float32 weight [out, in] from its unpacked form."""
    if form[0] == "float":
        return form[1]
    if form[0] == "fp8":
        return form[1].float() * form[2][:, None]
    if form[0] == "fp8_block":
        return fp8_block_dequantize(*form[1:])
    return dequantize_grouped(*form[1:])


class Fp8Weight(nn.Module):
    """An FP8 (e4m3) weight [out, in] with a float32 scale per output channel; activations are
    quantized per token at each call (kernels/fp8.py: `torch._scaled_mm` on GPUs that run it,
    else the float32 reference). The weight is kept as its bytes (uint8), which model.to(dtype)
    leaves alone, and the scales stay float32."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight_bits", weight.contiguous().view(torch.uint8))
        self.register_buffer("scale", scale.float())

    def _apply(self, fn, recurse=True):
        return apply_keeping_dtype(self, fn, recurse, ("scale",))

    def forward(self, x: torch.Tensor, use_kernels: bool) -> torch.Tensor:
        weight = self.weight_bits.view(FP8)
        fn = fp8_linear if use_kernels else fp8_linear_ref
        return fn(x, weight, self.scale)


class Fp8BlockWeight(nn.Module):
    """An FP8 (e4m3) weight [out, in] with a float32 scale per block (kernels/fp8_block.py):
    the weight's bytes (uint8, which model.to(dtype) leaves alone), the stacked block grids of
    its parts `scale` [grid rows, ceil(in / block_k)] (float32 whatever the model dtype), and
    `row_block` int32 [out], the grid row of each output row. Run by the block-scaled Triton
    GEMM where the backend uses kernels, else by its reference (dequantize, then matmul)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, row_block, block_k: int):
        super().__init__()
        self.block_k = block_k
        self.register_buffer("weight_bits", weight.contiguous().view(torch.uint8))
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("row_block", row_block.to(torch.int32).contiguous())

    def _apply(self, fn, recurse=True):
        return apply_keeping_dtype(self, fn, recurse, ("scale",))

    def forward(self, x: torch.Tensor, use_kernels: bool) -> torch.Tensor:
        weight = self.weight_bits.view(FP8)
        return fp8_block_forward(x, weight, self.scale, self.row_block, self.block_k, use_kernels)


def apply_keeping_dtype(module: nn.Module, fn, recurse: bool, names: tuple[str, ...]):
    """nn.Module._apply, except that buffers `names` only follow the device: model.to(dtype)
    must not round quantization scales (float16 GPTQ scales in a bfloat16 model lose three
    bits; the kernels read any float dtype)."""
    kept = {n: module._buffers[n] for n in names}
    nn.Module._apply(module, fn, recurse)
    for n, t in kept.items():
        module._buffers[n] = t.to(module._buffers[n].device)
    return module

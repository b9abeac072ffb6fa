"""Integer-weight checkpoints (GPTQ, AWQ): how their packed tensors read, as torch references.

Issue 16 builds a Triton W4A16 GEMM on these layouts; this module holds the references it will
be tested against (dequantize, then matmul), written from the formats as their producers
document and write them:

- **GPTQ** (AutoGPTQ / GPTQModel, the "v1" checkpoint format transformers and vLLM read):
  `qweight` int32 [in / p, out] where p = 32 / bits, each int32 holding p consecutive *input*
  rows of one output column, the first in the lowest bits; `qzeros` int32 [groups, out / p],
  packed the same way along the *output* columns, each stored as the zero point minus one;
  `scales` [groups, out]; `g_idx` int32 [in], the group of each input row (i // group_size
  unless the checkpoint was quantized in activation order, desc_act). Weight (i, o) is
  scales[g, o] * (q[i, o] - (stored_zero[g, o] + 1)) with g = g_idx[i].
- **AWQ**, GEMM layout (AutoAWQ): `qweight` int32 [in, out / 8], each int32 holding 8 *output*
  columns of one input row, in the interleaved order AWQ_ORDER (field k, bits 4k..4k+3, holds
  column 8c + AWQ_ORDER[k]); `qzeros` int32 [groups, out / 8] in the same order, stored as is;
  `scales` [groups, out]. Weight (i, o) is scales[g, o] * (q[i, o] - zero[g, o]) with
  g = i // group_size.

Both dequantize to nn.Linear's [out, in] layout in the scales' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field k of an AWQ int32 holds column AWQ_ORDER[k]


def unpack_int32(packed: Tensor, bits: int, dim: int, order: Sequence[int] | None = None) -> Tensor:
    """The `bits`-wide unsigned fields of int32 `packed`, 32 // bits per element, laid out along
    `dim` (which grows by that factor), lowest bits first; with `order`, field k of each element
    goes to position order[k] of its group. int32 result."""
    if 32 % bits:
        raise ValueError(f"{bits}-bit fields do not tile an int32")
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    mask = (1 << bits) - 1
    moved = packed.movedim(dim, -1).to(torch.int32)
    fields = (moved.unsqueeze(-1) >> shifts) & mask  # [..., n, per]: field k at index k
    if order is not None:
        if sorted(order) != list(range(per)):
            raise ValueError(f"order {list(order)} is not a permutation of 0..{per - 1}")
        inverse = [0] * per
        for k, pos in enumerate(order):
            inverse[pos] = k
        fields = fields[..., inverse]  # position j takes the field that holds it
    return fields.flatten(-2).movedim(-1, dim)


def dequantize_gptq(
    qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int
) -> Tensor:
    """A GPTQ (v1) linear's weight, [out, in] in the scales' dtype."""
    q = unpack_int32(qweight, bits, dim=0)  # [in, out]
    zeros = unpack_int32(qzeros, bits, dim=1) + 1  # [groups, out]
    if q.shape[0] != g_idx.shape[0] or zeros.shape != scales.shape:
        raise ValueError(
            f"GPTQ shapes disagree: qweight gives {tuple(q.shape)}, g_idx {tuple(g_idx.shape)}, "
            f"qzeros {tuple(zeros.shape)}, scales {tuple(scales.shape)}"
        )
    g = g_idx.long()
    w = (q - zeros[g]).to(scales.dtype) * scales[g]
    return w.t().contiguous()


def dequantize_awq(qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int) -> Tensor:
    """An AWQ (GEMM layout, 4-bit) linear's weight, [out, in] in the scales' dtype."""
    q = unpack_int32(qweight, 4, dim=1, order=AWQ_ORDER)  # [in, out]
    zeros = unpack_int32(qzeros, 4, dim=1, order=AWQ_ORDER)  # [groups, out]
    groups = -(-q.shape[0] // group_size)
    if zeros.shape != scales.shape or zeros.shape[0] != groups or q.shape[1] != scales.shape[1]:
        raise ValueError(
            f"AWQ shapes disagree: qweight gives {tuple(q.shape)}, qzeros {tuple(zeros.shape)}, "
            f"scales {tuple(scales.shape)}, group size {group_size}"
        )
    g = torch.arange(q.shape[0], device=q.device) // group_size
    w = (q - zeros[g]).to(scales.dtype) * scales[g]
    return w.t().contiguous()

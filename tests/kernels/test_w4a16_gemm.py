"""The W4A16/W8A16 Triton GEMM (interpreted on CPU, compiled on a GPU) against its torch
reference, dequantize-then-matmul, on the packed layout QuantLinear builds: rows from 1 to 64,
4 and 8 bits, group sizes that do not divide the K tile (48 against 64) and whole-input groups,
act-order permutations, output widths that are not multiples of the N tile, bias, and K split
across programs (few rows).

Tolerances: the kernel dequantizes in float32 like the reference; in float16 it rounds the
weight to float16 before the dot (the reference multiplies in float32), so float16 compares
within about two fp16 ulps of the output scale; float32 to summation order only."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm.engine.kernels.w4a16 import (  # noqa: E402
    _gemm_blocks,
    pack_int32,
    w4a16_linear,
    w4a16_linear_ref,
)
from tests.kernels.batch import DEVICE  # noqa: E402


def _packed(k: int, n: int, bits: int, group: int, act_order: bool, seed: int):
    """A random packed weight in QuantLinear's layout (rows sorted by group) and its perm."""
    g = torch.Generator().manual_seed(seed)
    top = 1 << bits
    groups = -(-k // group)
    q = torch.randint(0, top, (k, n), generator=g)
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.005).half()
    zeros = torch.randint(1, top, (groups, n), generator=g).half()
    g_idx = torch.arange(k) // group
    perm = torch.randperm(k, generator=g) if act_order else None
    return pack_int32(q, bits, dim=0), scales, zeros, g_idx.int(), perm


@pytest.mark.parametrize("m", [1, 5, 16, 33, 64])
@pytest.mark.parametrize(
    ("bits", "group", "act_order"),
    [(4, 48, False), (4, 48, True), (8, 32, True), (4, -1, False)],
    ids=["4b-g48", "4b-g48-actorder", "8b-g32-actorder", "4b-whole"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_gemm_matches_the_reference(m, bits, group, act_order, dtype):
    k, n = 144, 72  # 3 groups of 48; N not a multiple of the 64-wide tile
    qweight, scales, zeros, g_idx, perm = _packed(
        k, n, bits, k if group == -1 else group, act_order, seed=m * 7 + bits
    )
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    to = {"device": DEVICE}
    args = [t.to(**to) if t is not None else None for t in (qweight, scales, zeros, g_idx, perm)]
    scales_d, zeros_d = args[1].to(dtype), args[2].to(dtype)
    got = w4a16_linear(
        x.to(**to), args[0], scales_d, zeros_d, args[3], args[4], bits, bias.to(**to)
    )
    want = w4a16_linear_ref(x, qweight, scales.to(dtype), zeros.to(dtype), g_idx, perm, bits, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    scale = want.float().abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol * scale, rtol=0)


def test_few_rows_split_k_and_many_do_not():
    """Decoding rows split K to fill the GPU; prefill rows do not (the launch parameters are
    what the GEMM test above covers at small K, checked here at model sizes)."""
    assert _gemm_blocks(1, 4096, 4096)[3] > 1
    assert _gemm_blocks(4096, 4096, 4096)[3] == 1
    for m, n, k in [(1, 4096, 4096), (16, 14336, 4096), (256, 4096, 14336)]:
        bm, bn, bk, _ = _gemm_blocks(m, n, k)
        assert min(bm, bn, bk) >= 16 and all(b & (b - 1) == 0 for b in (bm, bn, bk))


def test_split_k_sums_the_same():
    """K long enough that one row's product splits across programs."""
    k, n, bits = 1024, 64, 4
    qweight, scales, zeros, g_idx, perm = _packed(k, n, bits, 128, True, seed=3)
    assert _gemm_blocks(1, n, k)[3] > 1
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(0))
    dev = [t.to(DEVICE) for t in (qweight, scales.float(), zeros.float(), g_idx, perm)]
    got = w4a16_linear(x.to(DEVICE), *dev, bits)
    want = w4a16_linear_ref(x, qweight, scales.float(), zeros.float(), g_idx, perm, bits)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4 * want.abs().max().item(), rtol=0)

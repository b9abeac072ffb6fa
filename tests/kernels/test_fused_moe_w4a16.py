"""The packed-expert MoE kernel (4/8-bit experts dequantized in the K loop) under the
interpreter (compiled on a GPU) against its torch reference and against the float MoE path on
the dequantized weights: act-order experts (each its own permutation) and ordered ones, groups
that do not divide the K tile, 4 and 8 bits, float32 and float16, experts with no token."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm.engine.kernels.fused_moe import fused_moe_reference  # noqa: E402
from serverless_llm.engine.kernels.fused_moe_w4a16 import (  # noqa: E402
    fused_moe_w4a16,
    fused_moe_w4a16_reference,
    pack_experts,
)
from tests.kernels.batch import DEVICE  # noqa: E402


def _experts(num: int, out: int, k: int, bits: int, group: int, act_order: bool, g):
    forms, floats = [], []
    groups = -(-k // group)
    for _ in range(num):
        q = torch.randint(0, 1 << bits, (out, k), generator=g, dtype=torch.uint8)
        zeros = torch.randint(1, 1 << bits, (out, groups), generator=g)
        scales = ((torch.rand(out, groups, generator=g) * 0.02 + 0.005) / (1 << (bits - 4))).half()
        g_idx = torch.arange(k) // group
        if act_order:
            g_idx = g_idx[torch.randperm(k, generator=g)]
        forms.append((q, zeros, scales, g_idx))
        floats.append((q.float() - zeros.float()[:, g_idx]) * scales.float()[:, g_idx])
    return forms, torch.stack(floats)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "bits,group,act_order,tokens,top_k",
    [(4, 48, True, 7, 2), (4, 32, False, 19, 3), (8, 64, True, 5, 1)],
)
def test_packed_experts_match_the_float_path(dtype, bits, group, act_order, tokens, top_k):
    g = torch.Generator().manual_seed(bits * 10 + tokens)
    E, H, inter = 6, 96, 64
    f13, w13 = _experts(E, 2 * inter, H, bits, group, act_order, g)
    f2, w2 = _experts(E, H, inter, bits, group, act_order, g)
    p13, p2 = pack_experts(f13, bits), pack_experts(f2, bits)
    assert (p13.perm is not None) == act_order
    x = torch.randn(tokens, H, generator=g)
    scores = torch.randn(tokens, E, generator=g)
    scores[:, E - 1] -= 100  # an expert with no token
    ids = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=g)
    want = fused_moe_reference(x.double(), w13.double(), w2.double(), weights.double(), ids)
    ref = fused_moe_w4a16_reference(x.to(dtype), p13, p2, weights, ids)
    x, weights, ids = x.to(dtype).to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)
    got = fused_moe_w4a16(x, p13.to(DEVICE), p2.to(DEVICE), weights, ids)
    assert got.dtype == dtype
    # float16: the reference rounds the weights and the intermediate to float16 (the kernel
    # only the intermediate), so the bound is relative to the output's scale
    top = float(want.abs().max())
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0, atol=1e-2 * top)
    torch.testing.assert_close(ref.double(), want, **tol)
    torch.testing.assert_close(got.double().cpu(), want, **tol)

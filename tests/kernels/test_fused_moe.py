"""The fused MoE Triton kernels (interpreted on CPU, compiled on a GPU) against the torch path,
float32 and float16 (and with FP8 experts, e4m3 bytes decoded in the kernel), over random routings that include experts receiving no token, one token and
every token; top-k from 1 to 8; token counts that are not multiples of the row tile. Also the
alignment on its own: every row appears once, in its expert's run, and blocks name the right
expert.

Tolerances: float32 differs from the reference only in summation order; float16 rounds the
gate/up output to float16 like the reference, but applies the router weight in float32 before
the store and sums a token's k outputs in float32 (the reference rounds after each), so float16
compares within a few fp16 ulps of the output's scale."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm.engine.kernels.fused_moe import (  # noqa: E402
    Fp8Experts,
    fused_moe,
    fused_moe_fp8,
    fused_moe_fp8_reference,
    fused_moe_reference,
    moe_align,
    moe_tiles,
)
from tests.kernels.batch import DEVICE  # noqa: E402


def _case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    scores = torch.randn(tokens, experts, generator=g)
    scores[:, 0] += 100  # expert 0 gets every token
    if top_k < experts:
        scores[:, experts - 1] -= 100  # the last expert gets none
    if _one_token_expert(tokens, experts, top_k):
        scores[:, 1] -= 50  # expert 1 gets exactly one token
        scores[tokens // 2, 1] += 100
    ids = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=g)
    return x, w13, w2, weights, ids


def _one_token_expert(tokens: int, experts: int, top_k: int) -> bool:
    return tokens > 1 and 2 <= top_k <= experts - 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "tokens,experts,top_k",
    [(1, 8, 2), (5, 8, 1), (13, 8, 3), (37, 6, 2), (19, 8, 8), (70, 4, 2)],
)
def test_fused_moe_matches_the_torch_path(dtype, tokens, experts, top_k):
    x, w13, w2, weights, ids = _case(tokens, experts, top_k, 48, 40, seed=tokens + top_k)
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    assert counts[0] == tokens
    if top_k < experts:
        assert counts[experts - 1] == 0
    if _one_token_expert(tokens, experts, top_k):
        assert counts[1] == 1
    args = [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights)]
    ids = ids.to(DEVICE)
    got = fused_moe(*args, ids)
    want = fused_moe_reference(*args, ids)
    assert got.dtype == dtype and got.shape == x.shape
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=4e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def _fp8(w: torch.Tensor) -> Fp8Experts:
    """w [E, N, K] as e4m3 with a scale per expert and channel (amax / 448), and one channel of
    expert 0 given a scale 30x its amax, so its codes are small and subnormal ones occur."""
    scale = w.abs().amax(-1) / 448
    scale[0, 0] = w[0, 0].abs().max() * 30
    codes = (w / scale[:, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return Fp8Experts(codes.view(torch.uint8), scale.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (13, 8, 3), (37, 6, 2), (70, 4, 2)])
def test_fused_moe_fp8_matches_its_reference(dtype, tokens, experts, top_k):
    """FP8 experts (e4m3 bytes, channel scales) through the same grouped GEMM: equal to the
    experts dequantized and run by the torch path; and the dequantized experts are the codes
    times the scales."""
    x, w13, w2, weights, ids = _case(tokens, experts, top_k, 48, 40, seed=tokens * top_k)
    f13, f2 = _fp8(w13), _fp8(w2)
    deq = f13.dequantize(torch.float32)
    codes = f13.weight.view(torch.float8_e4m3fn).float()
    assert torch.equal(deq, codes * f13.scale[:, :, None])
    assert bool((f13.weight[0, 0] & 0x78 == 0).any())  # subnormal codes present
    dev = [Fp8Experts(f.weight.to(DEVICE), f.scale.to(DEVICE)) for f in (f13, f2)]
    xd, wd, idd = x.to(dtype).to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)
    got = fused_moe_fp8(xd, *dev, wd, idd)
    want = fused_moe_fp8_reference(xd, *dev, wd, idd)
    assert got.dtype == dtype and got.shape == x.shape
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=4e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh"])
def test_fused_moe_other_activation(act):
    x, w13, w2, weights, ids = _case(9, 6, 2, 32, 24, seed=5)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights)]
    got = fused_moe(*args, ids.to(DEVICE), act)
    want = fused_moe_reference(*args, ids.to(DEVICE), act)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_non_gated_experts(dtype):
    """Nemotron-H's experts: w13 holds the up rows alone, out = w2 @ relu(w13 @ x)^2. The
    reference equals that definition per token; the kernel equals the reference."""
    x, w13, w2, weights, ids = _case(13, 6, 2, 32, 24, seed=9)
    w13 = w13[:, :24]  # [E, I, H]
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            want[t] += weights[t, j] * (w2[e] @ torch.relu(w13[e] @ x[t]).square())
    ref = fused_moe_reference(x, w13, w2, weights, ids, "relu2", gated=False)
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
    args = [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights)]
    got = fused_moe(*args, ids.to(DEVICE), "relu2", gated=False)
    ref = fused_moe_reference(*args, ids.to(DEVICE), "relu2", gated=False)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=4e-3)
    torch.testing.assert_close(got.float(), ref.float(), **tol)


@pytest.mark.parametrize(
    "tokens,experts,top_k,block_m", [(1, 64, 2, 16), (29, 8, 3, 16), (50, 5, 2, 32)]
)
def test_alignment_groups_rows_by_expert(tokens, experts, top_k, block_m):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    rows, block_expert = moe_align(ids, experts, block_m)
    n = tokens * top_k
    assert rows.numel() % block_m == 0 and block_expert.numel() == rows.numel() // block_m
    real = rows[rows < n]
    assert sorted(real.tolist()) == list(range(n))  # every row once
    flat = ids.reshape(-1)
    for b, e in enumerate(block_expert.tolist()):
        block = rows[b * block_m : (b + 1) * block_m]
        block = block[block < n]
        if e < 0:
            assert block.numel() == 0
        else:
            assert bool((flat[block.long()] == e).all())
    # within an expert, rows keep their order (a stable sort)
    for e in range(experts):
        mine = real[flat[real.long()] == e].tolist()
        assert mine == sorted(mine)
    # the decode case needs few blocks: at most one per chosen expert
    if tokens == 1:
        assert (block_expert >= 0).sum() == top_k


def test_tiles_grow_with_rows_per_expert():
    assert moe_tiles(2, 64, torch.float16)[0] == 16  # decode: a few rows per expert
    assert moe_tiles(4096, 8, torch.float16)[0] == 64  # prefill: hundreds per expert
    assert moe_tiles(4096, 8, torch.float32)[2] == 32

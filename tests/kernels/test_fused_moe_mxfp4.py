"""The MXFP4 MoE kernel (experts kept 4-bit, E2M1 decoded in the K loop; interpreted on CPU,
compiled on a GPU) against its torch reference (the experts dequantized, then the float path),
float32 and float16, with and without gpt-oss's expert biases and clamped SwiGLU; and the
reference against the float path on the weights the packer's own decoder gives.

Tolerances as in test_fused_moe.py: float32 differs only in summation order; float16 in the
roundings of the weight tile to fp16 and of the router weight's product."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm.engine.kernels.activation import ClampedSwiGLU  # noqa: E402
from serverless_llm.engine.kernels.fused_moe import fused_moe_reference  # noqa: E402
from serverless_llm.engine.kernels.fused_moe_mxfp4 import (  # noqa: E402
    Mxfp4Experts,
    fused_moe_mxfp4,
    fused_moe_mxfp4_reference,
)
from tests.engine.mxfp4_pack import mxfp4_pack, mxfp4_unpack  # noqa: E402
from tests.kernels.batch import DEVICE  # noqa: E402

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


def _experts(w: torch.Tensor) -> tuple[Mxfp4Experts, torch.Tensor]:
    """w [E, N, K] packed by the tests' packer, and the float32 values it stands for."""
    blocks, scales = mxfp4_pack(w)  # [E, N, K / 32, 16], [E, N, K / 32]
    # one block of expert 0 with a scale 8x its own and one 2^-30 of it
    scales[0, 0, 0] += 3
    scales[0, 1, 0] -= 30
    return Mxfp4Experts.from_checkpoint(blocks, scales), mxfp4_unpack(blocks, scales)


def _case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 2 / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    scores = torch.randn(tokens, experts, generator=g)
    scores[:, 0] += 100  # expert 0 gets every token
    ids = scores.topk(top_k, dim=-1).indices
    weights = torch.softmax(torch.rand(tokens, top_k, generator=g), dim=-1)
    b13 = torch.randn(experts, 2 * inter, generator=g)
    b2 = torch.randn(experts, hidden, generator=g)
    return x, w13, w2, weights, ids, b13, b2


def test_reference_is_the_float_path_on_the_decoded_weights():
    x, w13, w2, weights, ids, b13, b2 = _case(9, 4, 2, 64, 32, seed=0)
    p13, f13 = _experts(w13)
    p2, f2 = _experts(w2)
    act = ClampedSwiGLU(1.702, 7.0)
    got = fused_moe_mxfp4_reference(x, p13, p2, weights, ids, act, b13, b2)
    want = fused_moe_reference(x, f13, f2, weights, ids, act, b13=b13, b2=b2)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.equal(p13.dequantize(0), f13[0])


@DTYPES
@pytest.mark.parametrize("biased", [False, True], ids=["plain", "gpt-oss"])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (13, 8, 4), (70, 4, 2)])
def test_kernel_matches_reference(dtype, biased, tokens, experts, top_k):
    x, w13, w2, weights, ids, b13, b2 = _case(tokens, experts, top_k, 96, 64, seed=tokens)
    p13, _ = _experts(w13)
    p2, _ = _experts(w2)
    p13 = Mxfp4Experts(p13.blocks.to(DEVICE), p13.scales.to(DEVICE))
    p2 = Mxfp4Experts(p2.blocks.to(DEVICE), p2.scales.to(DEVICE))
    act = ClampedSwiGLU(1.702, 7.0) if biased else "silu"
    biases = [t.to(dtype).to(DEVICE) for t in (b13, b2)] if biased else [None, None]
    x, weights, ids = x.to(dtype).to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)
    got = fused_moe_mxfp4(x, p13, p2, weights, ids, act, *biases)
    want = fused_moe_mxfp4_reference(x, p13, p2, weights, ids, act, *biases)
    assert got.dtype == dtype and got.shape == x.shape
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_checkpoint_shapes_are_checked():
    with pytest.raises(ValueError, match="expected"):
        Mxfp4Experts.from_checkpoint(
            torch.zeros(2, 4, 3, 8, dtype=torch.uint8), torch.zeros(2, 4, 3)
        )
    with pytest.raises(ValueError, match="disagree"):
        Mxfp4Experts.from_checkpoint(
            torch.zeros(2, 4, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.uint8)
        )


def test_bench_runs_tiny(capsys):
    """bench/mxfp4_gemm.py's CPU smoke size (the GPU figures come from bench/gpu_checks.sh)."""
    if torch.cuda.is_available():
        pytest.skip("the tiny run is the CPU's")
    from bench.mxfp4_gemm import main

    assert main(["--tiny"]) == 0
    assert "SUMMARY mxfp4_vs_matmul_min_small_m=" in capsys.readouterr().out

"""FP8 weights with per-token FP8 activations (kernels/fp8.py): the reference against the
arithmetic written out; a zero activation row stays finite; off CUDA the dispatcher runs the
reference (on a GPU `pytest -m gpu` checks `torch._scaled_mm` through the same comparison in
its start-up probe)."""

from __future__ import annotations

import torch

from serverless_llm.engine.kernels.fp8 import (
    FP8,
    fp8_linear,
    fp8_linear_ref,
    native_out_dtype,
    quantize_per_token,
)


def test_reference_is_per_token_fp8_times_scaled_fp8_weight():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=g) * torch.tensor([[1.0], [10.0], [0.01], [3.0]])
    w = (torch.randn(24, 32, generator=g) * 50).to(FP8)
    scale = torch.rand(24, generator=g) * 0.01 + 1e-3
    bias = torch.randn(24, generator=g)
    want = torch.empty(4, 24)
    for m in range(4):
        s = x[m].abs().max() / 448
        xq = (x[m] / s).to(FP8).float() * s
        want[m] = (w.float() * scale[:, None]) @ xq
    got = fp8_linear_ref(x, w, scale, bias)
    torch.testing.assert_close(got, want + bias, rtol=1e-5, atol=1e-5)
    # the quantized row uses FP8's whole range: its largest magnitude lands on 448
    x8, xs = quantize_per_token(x)
    assert torch.equal(x8.float().abs().amax(1), torch.full((4,), 448.0))
    assert xs.shape == (4, 1)


def test_a_zero_row_stays_finite():
    w = torch.ones(16, 16).to(FP8)
    out = fp8_linear_ref(torch.zeros(2, 16), w, torch.ones(16))
    assert torch.equal(out, torch.zeros(2, 16))


def test_off_cuda_the_reference_runs():
    assert native_out_dtype(torch.device("cpu"), torch.float32) is None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 32, generator=g)
    w = (torch.randn(16, 32, generator=g) * 50).to(FP8)
    s = torch.rand(16, generator=g) * 0.01
    assert torch.equal(fp8_linear(x, w, s), fp8_linear_ref(x, w, s))

"""FP8 weights (kernels/fp8.py). With per-token FP8 activations: the reference against the
arithmetic written out; a zero activation row stays finite. Weight-only (W8A16, GPUs without
FP8 arithmetic): the Triton kernel under the interpreter against its reference, every e4m3
byte decoded exactly; off CUDA the dispatcher has no `_scaled_mm` and runs that kernel, or the
reference where the kernel's self-check fails (on a GPU `pytest -m gpu` checks both paths at
model shapes)."""

from __future__ import annotations

import logging

import pytest
import torch

from serverless_llm.engine.kernels import fp8 as fp8_module
from serverless_llm.engine.kernels.fp8 import (
    FP8,
    fp8_linear,
    fp8_linear_ref,
    fp8_w8a16_linear,
    fp8_w8a16_ref,
    native_out_dtype,
    quantize_per_token,
    w8a16_works,
)
from tests.kernels.batch import DEVICE  # noqa: E402

# Every e4m3fn byte but NaN's two: both zeros, the subnormals, the normals up to +-448.
CODES = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)


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


def test_w8a16_kernel_decodes_every_byte_exactly():
    """x = identity: the kernel's output is the decoded weight itself, for all 254 codes."""
    w = CODES.reshape(2, 127).repeat(1, 2)[:, :160].reshape(16, 20).contiguous().view(FP8)
    assert set(w.view(torch.uint8).flatten().tolist()) == set(CODES.tolist())
    got = fp8_w8a16_linear(
        torch.eye(20, device=DEVICE), w.to(DEVICE), torch.ones(16, device=DEVICE)
    )
    assert torch.equal(got.cpu(), w.float().t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 48, 96), (16, 64, 64), (37, 80, 200), (70, 33, 129)])
def test_w8a16_kernel_matches_its_reference(dtype, m, n, k):
    """Rows from one token to prefill tiles, N and K off the tiles (masks), split K at few rows;
    the activations not quantized (unlike the W8A8 reference)."""
    g = torch.Generator().manual_seed(m * n)
    w = CODES[torch.randint(0, len(CODES), (n, k), generator=g)].view(FP8)
    s = torch.rand(n, generator=g) * 0.01 + 1e-4
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    got = fp8_w8a16_linear(*(t.to(DEVICE) for t in (x, w, s, bias))).cpu()
    want = fp8_w8a16_ref(x, w, s, bias)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max())
    exact = (x.double() @ w.double().t()) * s.double() + bias.double()
    torch.testing.assert_close(want.double(), exact, rtol=2e-3, atol=2e-3 * exact.abs().max())


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU's dispatch (CUDA: test_w4a16_gpu.py)")
def test_off_cuda_the_kernel_or_the_reference_runs(monkeypatch, caplog):
    """No `_scaled_mm` off CUDA: the dispatcher runs the W8A16 kernel (the interpreter here);
    where the kernel's self-check fails, a warning and the dequantizing W8A8 reference."""
    assert native_out_dtype(torch.device("cpu"), torch.float32) is None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 32, generator=g)
    w = (torch.randn(16, 32, generator=g) * 50).to(FP8)
    s = torch.rand(16, generator=g) * 0.01
    monkeypatch.setattr(fp8_module, "_W8A16_OK", {})
    assert w8a16_works(torch.device("cpu"), torch.float32)
    torch.testing.assert_close(fp8_linear(x, w, s), fp8_w8a16_ref(x, w, s))

    def broken(x, weight, scale, bias=None):
        return fp8_w8a16_ref(x, weight, scale, bias) * 1.5

    monkeypatch.setattr(fp8_module, "_W8A16_OK", {})
    monkeypatch.setattr(fp8_module, "fp8_w8a16_linear", broken)
    with caplog.at_level(logging.WARNING, logger=fp8_module.__name__):
        assert torch.equal(fp8_linear(x, w, s), fp8_linear_ref(x, w, s))
    assert "disagrees with its reference" in caplog.text
    assert fp8_module._W8A16_OK == {("cpu", torch.float32): False}

"""Block-scaled FP8 weights (kernels/fp8_block.py, DeepSeek's `weight_block_size` layout): the
reference (dequantize, then matmul) against the arithmetic written out; the Triton GEMM under
the interpreter against the reference at small shapes whose N and K are not multiples of the
block (partial blocks at both edges), with the weight read as Triton's e4m3 type (Ada, Hopper)
and as bytes through the integer codec (older GPUs), every e4m3 byte decoded exactly, parts
with their own block grids fused into one weight; the block-scaled expert GEMM of fused_moe
against its reference; the layer's dispatch; and bench/fp8_block_gemm.py's CPU smoke size.
On a GPU, the same tests run compiled (bench/gpu_checks.sh)."""

from __future__ import annotations

import logging

import pytest
import torch

from serverless_llm.engine.kernels import fp8_block as fp8_block_module
from serverless_llm.engine.kernels.fp8_block import (
    FP8,
    block_kernel_works,
    block_rows,
    fp8_block_dequantize,
    fp8_block_forward,
    fp8_block_linear,
    fp8_block_ref,
)
from tests.kernels.batch import DEVICE

pytest.importorskip("triton")

# Every e4m3fn byte but NaN's two: both zeros, the subnormals, the normals up to +-448.
CODES = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)


def _skip_e4m3_type_before_sm89(as_bytes: bool) -> None:
    """Triton's e4m3 type does not compile on GPUs before sm89: there, bytes only."""
    if not as_bytes and DEVICE.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's e4m3 type needs sm89 (the bytes path serves older GPUs)")


def _weight(n: int, k: int, block: tuple[int, int], g: torch.Generator):
    """Random e4m3 codes [n, k] and block scales of very different sizes."""
    w = CODES[torch.randint(0, len(CODES), (n, k), generator=g)].view(FP8)
    grid = (-(-n // block[0]), -(-k // block[1]))
    scale = torch.rand(grid, generator=g) * 0.01 * 10.0 ** torch.randint(-2, 2, grid, generator=g)
    return w, scale


def test_reference_is_the_block_dequantized_weight_times_x():
    """Weight (n, k) is e4m3 value times scale[n // bn, k // bk], partial blocks included."""
    g = torch.Generator().manual_seed(0)
    n, k, block = 40, 70, (16, 32)
    w, scale = _weight(n, k, block, g)
    want_w = torch.empty(n, k)
    for i in range(n):
        for j in range(k):
            want_w[i, j] = float(w[i, j].float()) * float(scale[i // 16, j // 32])
    got_w = fp8_block_dequantize(w, scale, block_rows(n, 16), 32)
    assert torch.equal(got_w, want_w)
    x = torch.randn(3, k, generator=g)
    bias = torch.randn(n, generator=g)
    torch.testing.assert_close(fp8_block_ref(x, w, scale, block_rows(n, 16), 32, bias),
                               x @ want_w.t() + bias, rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("as_bytes", [False, True], ids=["e4m3", "bytes"])
def test_kernel_decodes_every_byte_exactly(as_bytes):
    """x = identity, every scale 1: the output is the decoded weight itself, all 254 codes."""
    _skip_e4m3_type_before_sm89(as_bytes)
    w = CODES.reshape(2, 127).repeat(1, 2)[:, :160].reshape(16, 20).contiguous().view(FP8)
    scale = torch.ones(1, 1)
    got = fp8_block_linear(torch.eye(20, device=DEVICE), w.to(DEVICE), scale.to(DEVICE),
                           block_rows(16, 128, DEVICE), 128, e4m3_bytes=as_bytes)  # fmt: skip
    assert torch.equal(got.cpu(), w.float().t())


@pytest.mark.parametrize("as_bytes", [False, True], ids=["e4m3", "bytes"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "m,n,k,block",
    [
        (1, 48, 200, (128, 128)),  # decode, one partial row of blocks, K = 1.56 blocks
        (16, 200, 130, (128, 128)),  # split K over two block columns, N = 1.56 blocks
        (37, 33, 256, (16, 64)),  # prefill tiles, many small blocks, masked rows
        (70, 136, 96, (128, 64)),  # more rows than a tile, K = 1.5 blocks
    ],
)
def test_kernel_matches_its_reference(as_bytes, dtype, m, n, k, block):
    _skip_e4m3_type_before_sm89(as_bytes)
    g = torch.Generator().manual_seed(m * n + k)
    w, scale = _weight(n, k, block, g)
    rows = block_rows(n, block[0])
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    args = (x, w, scale, rows)
    got = fp8_block_linear(*(t.to(DEVICE) for t in args), block[1], bias.to(DEVICE),
                           e4m3_bytes=as_bytes).cpu()  # fmt: skip
    want = fp8_block_ref(*args, block[1], bias)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max())


def test_fused_parts_keep_their_own_block_grids():
    """q (40 rows) and k (24 rows) of one input, each quantized in its own 32 x 64 blocks: their
    grids stacked, each row pointing at its part's (`row_block`), one GEMM gives both."""
    g = torch.Generator().manual_seed(3)
    (wq, sq), (wk, sk) = _weight(40, 160, (32, 64), g), _weight(24, 160, (32, 64), g)
    w, scale = torch.cat([wq, wk]), torch.cat([sq, sk])
    rows = torch.cat([block_rows(40, 32), block_rows(24, 32) + sq.shape[0]])
    x = torch.randn(5, 160, generator=g)
    want = torch.cat(
        [fp8_block_ref(x, wq, sq, block_rows(40, 32), 64),
         fp8_block_ref(x, wk, sk, block_rows(24, 32), 64)], dim=1,
    )  # fmt: skip
    torch.testing.assert_close(fp8_block_ref(x, w, scale, rows, 64), want, rtol=0, atol=0)
    got = fp8_block_linear(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), rows.to(DEVICE), 64)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_shapes_that_do_not_fit_are_refused():
    w, scale = _weight(8, 96, (8, 64), torch.Generator().manual_seed(0))
    x = torch.randn(2, 96)
    with pytest.raises(ValueError, match="block_k 32 is not a multiple of 64"):
        fp8_block_linear(x, w, scale, block_rows(8, 8), 32)
    with pytest.raises(ValueError, match=r"scales \(1, 2\) and row_block \(8,\) do not fit"):
        fp8_block_linear(x, w, scale, block_rows(8, 8), 128)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU's dispatch")
def test_dispatch_kernel_reference_and_a_failed_self_check(monkeypatch, caplog):
    """With kernels: the GEMM after its self-check; blocks it cannot tile (K blocks not a
    multiple of 64) and a device where the self-check fails run the reference (a warning
    once); without kernels, the reference."""
    g = torch.Generator().manual_seed(1)
    w, scale = _weight(24, 128, (16, 64), g)
    rows = block_rows(24, 16)
    x = torch.randn(3, 128, generator=g)
    calls = []
    kernel = fp8_block_module.fp8_block_linear
    monkeypatch.setattr(fp8_block_module, "fp8_block_linear",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))  # fmt: skip
    monkeypatch.setattr(fp8_block_module, "_WORKS", {})
    want = fp8_block_ref(x, w, scale, rows, 64)
    torch.testing.assert_close(fp8_block_forward(x, w, scale, rows, 64, True), want)
    assert len(calls) == 2  # the probe, then the call
    assert torch.equal(fp8_block_forward(x, w, scale, rows, 64, False), want)
    w32, s32 = _weight(24, 128, (16, 32), g)
    fp8_block_forward(x, w32, s32, rows, 32, True)
    assert len(calls) == 2

    def broken(*args, **kw):
        return kernel(*args, **kw) * 1.5

    monkeypatch.setattr(fp8_block_module, "_WORKS", {})
    monkeypatch.setattr(fp8_block_module, "fp8_block_linear", broken)
    with caplog.at_level(logging.WARNING, logger=fp8_block_module.__name__):
        assert torch.equal(fp8_block_forward(x, w, scale, rows, 64, True), want)
        assert not block_kernel_works(torch.device("cpu"), torch.float32)
    assert caplog.text.count("disagrees with its reference") == 1


def test_block_scaled_experts_match_their_reference():
    """fused_moe's grouped GEMM with block scales (DeepSeek's experts kept 8-bit): gate/up
    rows each in their own 16 x 64 blocks (48 rows: three blocks, the gate's last block
    shared with nothing), K not a multiple of the block, against the dequantized experts."""
    from serverless_llm.engine.kernels.fused_moe import (
        Fp8BlockExperts,
        fused_moe_fp8_block,
        fused_moe_fp8_block_reference,
    )

    g = torch.Generator().manual_seed(4)
    E, H, inter = 5, 96, 40
    w13, w2 = [], []
    for _ in range(E):
        gate, up = _weight(inter, H, (16, 64), g), _weight(inter, H, (16, 64), g)
        w13.append((torch.cat([gate[0], up[0]]), torch.cat([gate[1], up[1]])))
        w2.append(_weight(H, inter, (16, 64), g))
    grid13 = -(-inter // 16)
    rows13 = torch.cat([block_rows(inter, 16), block_rows(inter, 16) + grid13])

    def stack(pairs, rows):
        weight = torch.stack([w for w, _ in pairs]).view(torch.uint8)
        scale = torch.rand(len(pairs), *pairs[0][1].shape, generator=g) * 2e-3 + 1e-4
        return Fp8BlockExperts(weight.to(DEVICE), scale.to(DEVICE), rows.to(DEVICE), 64)

    e13, e2 = stack(w13, rows13), stack(w2, block_rows(H, 16))
    x = torch.randn(7, H, generator=g)
    ids = torch.randint(0, E, (7, 2), generator=g)
    weights = torch.rand(7, 2, generator=g)
    want = fused_moe_fp8_block_reference(x, e13, e2, weights, ids)
    got = fused_moe_fp8_block(x.to(DEVICE), e13, e2, weights.to(DEVICE), ids.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-4, atol=1e-4 * want.abs().max())


def test_bench_tiny_runs():
    """bench/fp8_block_gemm.py's CPU smoke size (the GPU figures come from
    bench/gpu_checks.sh)."""
    from bench.fp8_block_gemm import main

    assert main(["--tiny"]) == 0

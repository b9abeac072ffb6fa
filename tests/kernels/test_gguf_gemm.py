"""The many-row GEMM on GGUF blocks (kernels/gguf_blocks.c's qb32_gemm, the prefill path) and the
row gather (qb32_rows, the token embedding's lookup) against a float64 dequantize-then-matmul
reference: every type of the layout, rows 1 to 300 (past the kernel's 256-row pass; whole pairs
of row vectors, a lone last vector (rows 1-16 past the pairs) and both), outputs off its 12- and
24-row micro-kernels and 48-row tile, inputs off its 128-input tile. The GEMM takes x as it is,
so it equals the reference up to float32 summation order."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from serverless_llm.engine.kernels import gguf_blocks as gb  # noqa: E402
from tests.kernels.test_gguf_blocks import TYPES, gguf_tensor  # noqa: E402


@pytest.fixture(scope="module")
def kernels():
    k = gb.load()
    assert k is not None, "the GGUF block kernels did not build (is a C compiler installed?)"
    return k


def check(got: torch.Tensor, x: torch.Tensor, w: gb.QB32, bias) -> None:
    want = gb.reference_linear(x, w, bias, quantize_x=False)
    # float32 sums in another order: each output within a few ulps of sum |x| |w|
    scale = x.double().abs() @ gb.dequantize(w, torch.float64).abs().T
    err = (got.double() - want).abs()
    assert (err <= 1e-5 * scale + 1e-6).all(), err.max().item()


def gemm_cases(type_name: str):
    """(x, w, bias) of the gguf package's own blocks of `type_name`: outputs 1, 7, 50 and 97
    (off the 6/12/24-row micro-kernels and the 48-row tile), inputs of 1 to 10 blocks (off the
    input tiles), rows 1 to 300 (past the 256-row pass)."""
    g = torch.Generator().manual_seed(0)
    for n, blocks, rows in ((1, 1, (1, 2, 33)), (7, 3, (5, 64, 129)), (50, 9, (1, 31, 128)),
                            (97, 10, (17, 300))):  # fmt: skip
        k = blocks * 32
        raw, _ = gguf_tensor(type_name, n, k, seed=n)
        w = gb.from_gguf_blocks(raw, type_name, k)
        bias = torch.randn(n, generator=g)
        for m in rows:
            yield torch.randn(m, k, generator=g) * 3, w, bias


@pytest.mark.parametrize("type_name", TYPES)
def test_gemm_equals_the_dequantized_reference(kernels, type_name):
    for x, w, bias in gemm_cases(type_name):
        check(kernels.gemm(x, w, bias), x, w, bias)
        check(kernels.gemm(x, w), x, w, None)


@pytest.mark.parametrize("type_name", sorted(gb.FILE_TYPES))
def test_gemm_on_every_layout(kernels, type_name):
    """Every file type's layout (4-bit nibbles or a byte a code; 32 or 16 inputs per scale;
    float16 or float32 scales), from random file bytes: every code and scale value."""
    g = torch.Generator().manual_seed(1)
    k = 512 if type_name.endswith("_K") else 288
    for n, m in ((5, 3), (61, 128)):
        w = gb.probe_blocks(type_name, n, k, g)
        x = torch.randn(m, k, generator=g)
        bias = torch.randn(n, generator=g)
        check(kernels.gemm(x, w, bias), x, w, bias)
        index = torch.randint(0, n, (9,), generator=g)
        assert torch.equal(kernels.rows(w, index), gb.dequantize(w)[index])


def test_gemm_takes_a_strided_input_and_refuses_a_wrong_width(kernels):
    raw, _ = gguf_tensor("Q4_1", 13, 64)
    w = gb.from_gguf_blocks(raw, "Q4_1", 64)
    x = torch.randn(40, 100)[:, 10:74]
    check(kernels.gemm(x, w), x, w, None)
    with pytest.raises(ValueError, match="inputs"):
        kernels.gemm(torch.randn(3, 32), w)


@pytest.mark.parametrize("type_name", TYPES)
def test_rows_equal_the_dequantized_weight(kernels, type_name):
    raw, _ = gguf_tensor(type_name, 21, 96, seed=4)
    w = gb.from_gguf_blocks(raw, type_name, 96)
    index = torch.tensor([[20, 0, 3], [3, 7, 19]])
    got = kernels.rows(w, index)
    assert got.shape == (2, 3, 96)
    assert torch.equal(got, gb.dequantize(w)[index])
    with pytest.raises(IndexError):
        kernels.rows(w, torch.tensor([21]))
    with pytest.raises(IndexError):
        kernels.rows(w, torch.tensor([-1]))

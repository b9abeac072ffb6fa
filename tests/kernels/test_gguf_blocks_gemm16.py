"""The many-row GEMM with 16-bit inputs (kernels/gguf_blocks.c's qb32_gemm16: x quantized per
block of 32 to codes in [-32767, 32767], VPDPWSSD on AVX-512 VNNI, the same integers in a
portable loop on every machine) against its float64 reference with the same input codes
(`reference_linear(..., levels=GEMM16_LEVELS)`): every layout of the type table, rows 1 to 300
(whole pairs of 16-row vectors, a lone last vector, past the 256-row pass), outputs off its 6-
and 12-row micro-kernels and 48-row tile, inputs off its 256-input tile; its distance from the
plain dequantize-then-matmul bounded by the input codes' rounding (docs/quantization.md); the
integer extremes; and the descriptor flag that makes it the engine's GEMM for a linear."""

from __future__ import annotations

import ctypes

import pytest
import torch

pytest.importorskip("gguf")

from serverless_llm.engine.kernels import gguf_blocks as gb  # noqa: E402
from serverless_llm.engine.layers.gguf_linear import GGUFBlockLinear  # noqa: E402
from tests.kernels.test_gguf_blocks import gguf_tensor  # noqa: E402
from tests.kernels.test_gguf_gemm import gemm_cases  # noqa: E402

PATHS = ("int16", "int16-portable")  # "int16": VNNI where built, else the portable loop too


@pytest.fixture(scope="module")
def kernels():
    k = gb.load()
    assert k is not None, "the GGUF block kernels did not build (is a C compiler installed?)"
    return k


def skip_unless_built(kernels, path):
    if path == "int16" and not kernels.gemm16:
        pytest.skip("this CPU has no AVX-512 VNNI: the portable path (tested) is what int16 runs")


def check(got: torch.Tensor, x: torch.Tensor, w: gb.QB32, bias, what) -> None:
    """Equal to the float64 reference with the same input codes, up to float32 rounding: each
    group's integer dot converted and scaled once, the groups summed in float32; within a few
    ulps of the sum of the terms' magnitudes (|d u| and |c| apart: they cancel)."""
    want = gb.reference_linear(x, w, bias, levels=gb.GEMM16_LEVELS)
    q, scale = gb.quantize_rows_reference(x, gb.GEMM16_LEVELS)
    m, k = x.shape
    xq = (q.view(m, k // 32, 32) * scale.double()[..., None]).reshape(m, k)
    n = w.shape[0]
    u = gb.codes(w).double().view(n, k // w.group, w.group)
    parts = (u * w.d.double().abs()[..., None] + w.c.double().abs()[..., None]).reshape(n, k)
    size = xq.abs() @ parts.T
    err = (got.double() - want).abs()
    assert (err <= 1e-5 * size + 1e-6).all(), (what, err.max().item())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("type_name", sorted(gb.FILE_TYPES))
def test_gemm16_equals_its_reference_on_every_layout(kernels, type_name, path):
    """Random file bytes (every code and scale value) of every type's layout: 4-bit nibbles or
    a byte a code, 32 or 16 inputs per scale, float16 or float32 scales."""
    skip_unless_built(kernels, path)
    g = torch.Generator().manual_seed(3)
    k = 512 if type_name.endswith("_K") else 288  # 288: one tile and a partial one
    for n, rows in ((5, (1, 3, 17)), (61, (16, 32, 33, 128))):
        w = gb.probe_blocks(type_name, n, k, g)
        bias = torch.randn(n, generator=g)
        for m in rows:
            x = torch.randn(m, k, generator=g) * 3
            if m > 2:
                x[1, 64:96] = 0.0  # a whole block of zeros: scale 0
            check(kernels.gemm(x, w, bias, path), x, w, bias, (type_name, n, m))
            check(kernels.gemm(x, w, None, path), x, w, None, (type_name, n, m, "no bias"))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("type_name", ("Q4_0", "Q4_1", "Q8_0"))
def test_gemm16_shapes_off_every_tile(kernels, type_name, path):
    """The gguf package's own blocks; outputs 1, 7, 50 and 97 (off the 6/12-row micro-kernels
    and the 48-row tile), inputs of 1 to 10 blocks (off the 256-input tile), rows 1 to 300."""
    skip_unless_built(kernels, path)
    for x, w, bias in gemm_cases(type_name):
        check(kernels.gemm(x, w, bias, path), x, w, bias, (w.shape, x.shape[0]))


def test_gemm16_paths_agree_and_the_rounding_is_bounded(kernels):
    """Against the plain dequantize-then-matmul each input moves by at most a / 2 (a = its
    block's max|x| / 32767), so an output by at most sum over blocks of a / 2 * sum |w| (plus
    float32 rounding); the inputs really are rounded (not x as it is)."""
    raw, _ = gguf_tensor("Q4_1", 48, 576, seed=3)
    w = gb.from_gguf_blocks(raw, "Q4_1", 576)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(1))
    x[:, 7] *= 50  # an outlier: its block's other inputs keep fewer bits
    got = kernels.gemm(x, w, None, "int16").double()
    portable = kernels.gemm(x, w, None, "int16-portable").double()
    plain = gb.reference_linear(x, w, quantize_x=False)
    _, scale = gb.quantize_rows_reference(x, gb.GEMM16_LEVELS)
    wd = gb.dequantize(w, torch.float64).abs().view(48, 18, 32).sum(-1)  # [N, blocks]
    bound = (scale.double() / 2) @ wd.T + 2e-6 * (1 + plain.abs())
    assert ((got - plain).abs() <= bound).all()
    assert ((portable - plain).abs() <= bound).all()
    assert (got - portable).abs().max() <= 1e-4
    assert (got - plain).abs().max() > 1e-6  # rounded: the float GEMM is within ~1e-6 here
    float_gemm = kernels.gemm(x, w, None, "float").double()
    assert (float_gemm - plain).abs().max() < (got - plain).abs().max()


@pytest.mark.parametrize("path", PATHS)
def test_gemm16_integer_extremes(kernels, path):
    """Every code at 255 (Q8_0's largest, + 128 stored) and inputs at +-32767 in every lane: a
    group's int32 sum of 32 products of 255 * 32767 must not wrap."""
    skip_unless_built(kernels, path)
    raw, _ = gguf_tensor("Q8_0", 13, 64)
    w = gb.from_gguf_blocks(raw, "Q8_0", 64)
    w.qs.fill_(255)
    for sign in (1.0, -1.0):
        x = torch.full((20, 64), sign)
        x[1, ::2] = -sign
        check(kernels.gemm(x, w, None, path), x, w, None, sign)


def test_the_descriptor_flag_picks_the_gemm(kernels):
    """A linear built with gemm="int16" runs the 16-bit GEMM past its block_rows, through
    forward and through the whole-layer decode's entry (qb32_steps_desc); its few-row kernel is
    unchanged; "float" keeps x as it is."""
    raw, _ = gguf_tensor("Q4_1", 40, 96, seed=5)
    w = gb.from_gguf_blocks(raw, "Q4_1", 96)
    x = torch.randn(24, 96, generator=torch.Generator().manual_seed(2))
    int16 = GGUFBlockLinear(w, kernels, "float", None, "int16" if kernels.gemm16 else "float")
    plain = GGUFBlockLinear(w, kernels, "float", None, "float")
    int16.block_rows = plain.block_rows = 8
    want16 = kernels.gemm(x, w, None, "int16")  # on a machine without VNNI: the portable loop
    want_float = kernels.gemm(x, w, None, "float")
    assert torch.equal(plain(x), want_float)
    assert torch.equal(int16(x), want16 if kernels.gemm16 else want_float)
    out = torch.empty(24, 40)
    steps = kernels.lib.qb32_steps_desc
    steps.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 3
    steps.argtypes += [ctypes.c_int64]
    steps(x.data_ptr(), 96, 24, ctypes.addressof(int16.steps), None, out.data_ptr(), 40)
    assert torch.equal(out, int16(x))
    few = kernels.linear(x[:8], w, None, "float")
    assert torch.equal(int16(x[:8]), few) and torch.equal(plain(x[:8]), few)
    if kernels.gemm16:
        assert not torch.equal(want16, want_float)

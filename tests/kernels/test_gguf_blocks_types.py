"""The GGUF types beyond Q4_0/Q4_1/Q8_0 in our qb32 layout (kernels/gguf_blocks.py): Q5_0, Q5_1
(written by the `gguf` package's quantizer), Q4_K, Q5_K, Q6_K (written by tests/kernels/
gguf_packers.py from the published layouts, since the package only dequantizes them) read back
equal to the package's dequantization, also from random file bytes (every code and scale
value); the native linear on each (every path this machine has, the portable one on every
machine) equals its float64 dequantize-then-matmul reference for 1, 3, 17 and 128 rows and
output counts off every tile; stacks of mixed types widen exactly; F32/F16/BF16 read exactly and
the types without a layout (Q2_K, TQ2_0) dequantize as the package does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

from serverless_llm.engine.kernels import gguf_blocks as gb  # noqa: E402
from tests.kernels.gguf_packers import gguf_dequantize, quantize, weight  # noqa: E402

NEW_TYPES = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
ALL_TYPES = ("Q4_0", "Q4_1", "Q8_0") + NEW_TYPES
PATHS = ("vnni", "avx2", "portable", "float", "float-avx2", "float-portable")

# the kernel paths tested: name here -> BlockKernels.linear's path (kernels/gguf_blocks.py PATHS)
KERNEL_PATH = {"vnni": "best", "avx2": "avx2", "portable": "portable", "float": "float",
               "float-avx2": "float-avx2", "float-portable": "float-portable"}  # fmt: skip


def skip_unless_built(kernels, path):
    """Skip a path this CPU or build does not have ("float" is the best path the build has:
    VNNI, else AVX2, else portable; the portable ones run everywhere)."""
    if path == "vnni" and not kernels.vnni:
        pytest.skip("this CPU has no AVX-512 VNNI: the AVX2 or portable path is what it runs")
    if path.endswith("avx2") and not kernels.avx2:
        pytest.skip("this CPU (or build) has no AVX2: the portable path is what it runs")


@pytest.fixture(scope="module")
def kernels():
    k = gb.load()
    assert k is not None, "the GGUF block kernels did not build (is a C compiler installed?)"
    return k


def inputs_of(type_name: str, blocks: int) -> int:
    return blocks * (256 if type_name.endswith("_K") else 32)


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_quantizer_blocks_read_back_as_the_package_dequantizes(type_name):
    k = inputs_of(type_name, 3)
    w = weight(7, k, 0)
    raw = quantize(w, type_name)
    assert raw.shape == (7, k // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]
                         * gb.FILE_TYPES[type_name][0])  # fmt: skip
    ours = gb.from_gguf_blocks(raw, type_name, k)
    assert ours.shape == (7, k)
    want = gguf_dequantize(raw, type_name)
    assert torch.equal(gb.dequantize(ours), want)
    assert (want - torch.from_numpy(w)).abs().max() < 0.05  # the packer really quantized w


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_random_file_bytes_read_back_exactly(type_name):
    """Every code and sub-scale value (including Q6_K's scale -128 and Q4_K's 63s), float16
    scales of any exponent: equal to the package's float32 dequantization, value for value."""
    k = inputs_of(type_name, 2)
    size = gb.FILE_TYPES[type_name][0]
    per = 256 if type_name.endswith("_K") else 32
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (11, k // per, size), generator=g, dtype=torch.uint8)
    for at in gb._HALF_FIELDS[type_name]:  # finite halves of every magnitude
        exp = torch.randint(1, 30, (11, k // per), generator=g, dtype=torch.int16)
        man = torch.randint(0, 1024, (11, k // per), generator=g, dtype=torch.int16)
        sign = torch.randint(0, 2, (11, k // per), generator=g, dtype=torch.int16)
        half = (sign << 15) | (exp << 10) | man
        raw[..., at : at + 2] = half.view(torch.uint8).view(11, k // per, 2)
    raw = raw.reshape(11, -1).numpy()
    ours = gb.from_gguf_blocks(raw, type_name, k)
    assert torch.equal(gb.dequantize(ours), gguf_dequantize(raw, type_name))


def test_layout_sizes():
    """Q5_0/Q5_1: codes a byte, float16 scales; K-quants: float32 sub-block scales (d * sc needs
    up to 19 bits); Q6_K a scale per 16 inputs."""
    for type_name, bits, group, scale in (("Q5_0", 5, 32, torch.float16),
                                          ("Q5_1", 5, 32, torch.float16),
                                          ("Q4_K", 4, 32, torch.float32),
                                          ("Q5_K", 5, 32, torch.float32),
                                          ("Q6_K", 6, 16, torch.float32)):  # fmt: skip
        k = inputs_of(type_name, 1)
        w = gb.from_gguf_blocks(quantize(weight(3, k, 2), type_name), type_name, k)
        assert (w.bits, w.group, w.d.dtype, w.c.dtype) == (bits, group, scale, scale)
        assert w.qs.shape == (3, k // 32, 16 if bits == 4 else 32)
        assert w.d.shape == w.c.shape == (3, k // group)


def test_k_quants_need_whole_super_blocks():
    raw = quantize(weight(2, 256, 0), "Q4_K")
    with pytest.raises(ValueError, match="whole blocks of 256"):
        gb.from_gguf_blocks(raw, "Q4_K", 224)
    with pytest.raises(ValueError, match="no qb32 layout"):
        gb.from_gguf_blocks(raw, "Q3_K", 256)


@pytest.mark.parametrize("type_name", NEW_TYPES)
@pytest.mark.parametrize("path", PATHS)
def test_kernel_equals_the_float64_reference(kernels, type_name, path):
    skip_unless_built(kernels, path)
    # Q5_*: block counts 1, 3 (odd: the VNNI tail), 7; K-quants: 1 and 3 super-blocks
    shapes = ((1, 1), (19, 3), (33, 7)) if not type_name.endswith("_K") else ((1, 1), (19, 3))
    for n, blocks in shapes:
        k = inputs_of(type_name, blocks)
        w = gb.from_gguf_blocks(quantize(weight(n, k, n), type_name), type_name, k)
        g = torch.Generator().manual_seed(n)
        bias = torch.randn(n, generator=g)
        for m in (1, 3, 17, 128):
            x = torch.randn(m, k, generator=g) * 3
            x[0, :5] = 0.0
            x[-1, 32:64] = 0.0  # a whole block of zeros: scale 0
            got = kernels.linear(x, w, bias, path=KERNEL_PATH[path])
            want = gb.reference_linear(x, w, bias, levels=gb.levels_of(KERNEL_PATH[path]))
            err = (got.double() - want).abs().max().item()
            assert err <= 1e-5 * (1 + want.abs().max().item()), (n, k, m, err)


def test_float_inputs_equal_the_dequantized_matmul(kernels):
    """The float path against the plain float64 product of gguf's own dequantized weight."""
    for type_name in NEW_TYPES:
        k = inputs_of(type_name, 2)
        raw = quantize(weight(21, k, 5), type_name)
        w = gb.from_gguf_blocks(raw, type_name, k)
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
        want = x.double() @ gguf_dequantize(raw, type_name).double().T
        got = kernels.linear(x, w, path="float").double()
        assert (got - want).abs().max() <= 1e-5 * (1 + want.abs().max()), type_name


@pytest.mark.parametrize("path", PATHS)
def test_mixed_stack_widens_exactly(kernels, path):
    """A Q4_K q, Q4_K k and Q6_K v (as Q4_K_M files mix them), and a Q8_0 with a Q5_1: one
    stacked weight whose dequantization is the parts', run by every path."""
    skip_unless_built(kernels, path)
    for types in (("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q5_1", "Q4_0")):
        k = 512
        parts = [gb.from_gguf_blocks(quantize(weight(5 + i, k, i), t), t, k)
                 for i, t in enumerate(types)]  # fmt: skip
        both = gb.QB32.cat(parts)
        assert torch.equal(gb.dequantize(both), torch.cat([gb.dequantize(p) for p in parts]))
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(3))
        got = kernels.linear(x, both, path=KERNEL_PATH[path])
        want = gb.reference_linear(x, both, levels=gb.levels_of(KERNEL_PATH[path]))
        assert (got.double() - want).abs().max() <= 1e-5 * (1 + want.abs().max()), types
    # all 4-bit: the nibbles stay, only the scales widen
    four = gb.QB32.cat(
        [parts[2], gb.from_gguf_blocks(quantize(weight(3, k, 9), "Q4_K"), "Q4_K", k)]
    )
    assert four.bits == 4 and four.qs.shape[-1] == 16 and four.d.dtype == torch.float32


def file_tensor(name, type_name, raw, k):
    return gb.FileTensor(name, type_name, (k, raw.shape[0]), raw)


def test_float_tensors_read_exactly():
    w = weight(4, 96, 3)
    f32 = file_tensor("a", "F32", w.view(np.uint8), 96)
    assert torch.equal(gb.tensor_to_float(f32), torch.from_numpy(w))
    f16 = file_tensor("b", "F16", w.astype(np.float16).view(np.uint8), 96)
    assert torch.equal(gb.tensor_to_float(f16), torch.from_numpy(w.astype(np.float16)).float())
    bf = torch.from_numpy(w).bfloat16()
    raw = bf.view(torch.int16).numpy().view(np.uint8)
    assert torch.equal(gb.tensor_to_float(file_tensor("c", "BF16", raw, 96)), bf.float())
    assert torch.equal(gb.tensor_to_float(file_tensor("d", "BF16", quants.quantize(w, gguf.GGMLQuantizationType.BF16), 96)),
                       gguf_dequantize(quants.quantize(w, gguf.GGMLQuantizationType.BF16), "BF16"))  # fmt: skip


@pytest.mark.parametrize("type_name", ["Q2_K", "TQ2_0", "Q4_K"])
def test_other_types_dequantize_as_the_package_does(type_name):
    """Types without a qb32 layout (Q2_K by our packer, TQ2_0 by the package's quantizer) read
    as floats through the package; a type with a layout reads the same way too."""
    w = weight(3, 512, 4)
    raw = quantize(w, type_name)
    got = gb.tensor_to_float(file_tensor("t", type_name, raw, 512))
    assert got.shape == (3, 512)
    assert torch.equal(got, gguf_dequantize(raw, type_name))


def test_an_unknown_type_is_named():
    with pytest.raises(ValueError, match="NOPE"):
        gb.tensor_to_float(file_tensor("t", "NOPE", np.zeros((1, 4), np.uint8), 4))


def test_the_start_up_line_names_the_types_without_a_layout():
    raw = np.zeros((1, 84), np.uint8)
    tensors = {"a": file_tensor("a", "Q2_K", raw, 256), "b": file_tensor("b", "Q2_K", raw, 256),
               "c": file_tensor("c", "IQ4_XS", raw, 256), "d": file_tensor("d", "Q4_K", raw, 256),
               "e": file_tensor("e", "F16", raw, 256)}  # fmt: skip
    line = gb.dequantized_types_line(tensors)
    assert line.endswith("dequantized to float at load: IQ4_XS (1 tensors), Q2_K (2 tensors)")
    assert gb.dequantized_types_line({"d": tensors["d"], "e": tensors["e"]}) is None

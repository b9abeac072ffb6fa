"""GGUF blocks kept quantized on CPU (kernels/gguf_blocks.py and .c): the file's Q4_0, Q4_1 and
Q8_0 blocks, written by the `gguf` package's own quantizer, read into our layout equal the
package's dequantization; the native linear (AVX-512 VNNI where the CPU has it, and the portable
path on every machine; int8 inputs and the 22-bit "float" ones) equals its float64 reference
with the same input codes, rows 1 to 37, shapes off the kernel's steps and its tiles of 8 output
rows and 4 input rows; and its distance from the plain dequantize-then-matmul is the input
codes' (bounded here, documented in docs/quantization.md). Also the q/k row order llama.cpp's converter writes, undone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

from serverless_llm.engine.kernels import gguf_blocks as gb  # noqa: E402
from serverless_llm.engine.layers.gguf_linear import _unpermute_rows  # noqa: E402

TYPES = ("Q4_0", "Q4_1", "Q8_0")

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


def gguf_tensor(type_name: str, n: int, k: int, seed: int = 0):
    """A float [n, k] weight and its blocks as the `gguf` package quantizes them."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.01).astype(np.float32)
    raw = quants.quantize(w, getattr(gguf.GGMLQuantizationType, type_name))
    return raw, getattr(gguf.GGMLQuantizationType, type_name)


@pytest.mark.parametrize("type_name", TYPES)
def test_layout_equals_the_gguf_package_dequantization(type_name):
    raw, qtype = gguf_tensor(type_name, 7, 5 * 32)
    w = gb.from_gguf_blocks(raw, type_name, 5 * 32)
    assert w.shape == (7, 160) and w.bits == (8 if type_name == "Q8_0" else 4)
    want = torch.from_numpy(quants.dequantize(raw, qtype))
    assert torch.equal(gb.dequantize(w), want)
    # the file's bytes, plus c (a float16 per block) where the file derives it from d
    extra = 0 if type_name == "Q4_1" else 7 * 5 * 2
    assert w.nbytes() == raw.nbytes + extra


def test_layout_refuses_what_it_cannot_hold():
    raw, _ = gguf_tensor("Q4_1", 2, 64)
    with pytest.raises(ValueError, match="no qb32 layout"):
        gb.from_gguf_blocks(raw, "Q3_K", 64)
    with pytest.raises(ValueError, match="whole blocks"):
        gb.from_gguf_blocks(raw, "Q4_1", 60)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("path", list(KERNEL_PATH))
def test_kernel_equals_its_reference(kernels, type_name, path):
    skip_unless_built(kernels, path)
    for n, blocks in ((1, 1), (19, 3), (7, 5), (33, 18), (64, 48)):
        k = blocks * 32
        raw, _ = gguf_tensor(type_name, n, k, seed=n)
        w = gb.from_gguf_blocks(raw, type_name, k)
        g = torch.Generator().manual_seed(n)
        bias = torch.randn(n, generator=g)
        for m in (1, 2, 3, 4, 5, 8, 13, 37):
            x = torch.randn(m, k, generator=g) * 3
            x[0, :5] = 0.0  # a zero run in a block
            if blocks > 1:
                x[-1, 32:64] = 0.0  # a whole block of zeros: scale 0
            got = kernels.linear(x, w, bias, path=KERNEL_PATH[path])
            want = gb.reference_linear(x, w, bias, levels=gb.levels_of(KERNEL_PATH[path]))
            err = (got.double() - want).abs().max().item()
            assert err <= 1e-5 * (1 + want.abs().max().item()), (n, k, m, err)


@pytest.mark.parametrize("path", ["best", "float"])
def test_input_codes_cost_is_bounded(kernels, path):
    """Against the plain dequantize-then-matmul: each block of x rounded to 1/(2L) of its
    largest value (L = 127 for int8 inputs, 127 * 2^14 for float ones), so an output moves by
    at most sum |w| * scale / 2, plus float32 rounding."""
    raw, _ = gguf_tensor("Q4_1", 48, 576, seed=3)
    w = gb.from_gguf_blocks(raw, "Q4_1", 576)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(1))
    got = kernels.linear(x, w, path=path).double()
    plain = gb.reference_linear(x, w, quantize_x=False)
    _, scale = gb.quantize_rows_reference(x, gb.levels_of(path))
    wd = gb.dequantize(w, torch.float64).abs().view(48, 18, 32).sum(-1)  # [N, blocks]
    bound = (scale.double() / 2) @ wd.T + 2e-6 * (1 + plain.abs())
    assert ((got - plain).abs() <= bound).all()
    if path == "best":
        assert (got - plain).abs().max() > 1e-3  # the activations really are quantized


def test_a_strided_input_and_no_bias(kernels):
    raw, _ = gguf_tensor("Q8_0", 9, 64)
    w = gb.from_gguf_blocks(raw, "Q8_0", 64)
    x = torch.randn(3, 100)[:, 10:74]
    got = kernels.linear(x, w)
    assert torch.allclose(got.double(), gb.reference_linear(x, w), atol=1e-5)
    with pytest.raises(ValueError, match="inputs"):
        kernels.linear(torch.randn(1, 32), w)


def test_rows_and_stacking_follow_the_weight():
    raw, _ = gguf_tensor("Q4_1", 6, 64)
    w = gb.from_gguf_blocks(raw, "Q4_1", 64)
    order = torch.tensor([5, 0, 3, 1, 2, 4])
    assert torch.equal(gb.dequantize(w.rows(order)), gb.dequantize(w)[order])
    both = gb.QB32.cat([w, w.rows(order)])
    assert torch.equal(gb.dequantize(both), torch.cat([gb.dequantize(w), gb.dequantize(w)[order]]))
    raw8, _ = gguf_tensor("Q8_0", 6, 64)
    w8 = gb.from_gguf_blocks(raw8, "Q8_0", 64)
    mixed = gb.QB32.cat([w, w8])  # widened to one code a byte, exactly
    assert mixed.bits == 8 and torch.equal(gb.dequantize(mixed),
                                           torch.cat([gb.dequantize(w), gb.dequantize(w8)]))  # fmt: skip
    with pytest.raises(ValueError, match="different inputs"):
        gb.QB32.cat([w, gb.from_gguf_blocks(gguf_tensor("Q8_0", 6, 96)[0], "Q8_0", 96)])


def test_unpermute_undoes_the_converters_rotary_order():
    """llama.cpp's converter writes each head's rows as (half, pair) -> (pair, half): row
    h*D + 2i + j of the file is row h*D + j*D/2 + i of the checkpoint."""
    heads, dim = 3, 8
    checkpoint = torch.arange(heads * dim)
    file_rows = checkpoint.view(heads, 2, dim // 2).transpose(1, 2).reshape(-1)
    assert torch.equal(file_rows[_unpermute_rows(heads * dim, heads)], checkpoint)


def written_file(path, alignment=None):
    """A GGUF file written by the `gguf` package: metadata with a long string array (as a
    tokenizer's), float and quantized tensors."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        writer.add_custom_alignment(alignment)
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(3000)])
    writer.add_array("some.numbers", list(range(50)))
    writer.add_uint32("some.count", 7)
    writer.add_string("some.text", "héllo")
    for i, type_name in enumerate(TYPES):
        raw, qtype = gguf_tensor(type_name, 5 + i, 64, seed=i)
        writer.add_tensor(f"blk.0.t{i}.weight", raw, raw_dtype=qtype)
    writer.add_tensor("norm.weight", np.arange(11, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_tensor_table_equals_the_gguf_reader(tmp_path, alignment):
    path = tmp_path / "m.gguf"
    written_file(path, alignment)
    ours = gb.read_tensors(str(path))
    theirs = gguf.GGUFReader(str(path)).tensors
    assert sorted(ours) == sorted(t.name for t in theirs)
    for t in theirs:
        got = ours[t.name]
        assert got.type_name == t.tensor_type.name
        assert got.shape == tuple(int(v) for v in t.shape)
        if got.type_name in gb.FILE_TYPES:
            assert np.array_equal(got.data, t.data)
    assert np.array_equal(ours["norm.weight"].data.view(np.float32).ravel(), np.arange(11))


def test_tensor_table_refuses_other_files(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        gb.read_tensors(str(path))
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(4))
    with pytest.raises(ValueError, match="ends early"):
        gb.read_tensors(str(path))


def test_self_check_passes_and_catches_a_wrong_kernel(kernels, monkeypatch):
    assert gb.self_check(kernels) is None
    right = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda *a, **k: right(*a, **k) + 0.01)
    assert "qb32 linear (Q4_0, 1 rows, best)" in gb.self_check(kernels)

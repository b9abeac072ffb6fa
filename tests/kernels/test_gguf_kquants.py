"""The dense K-quant layout (kernels/gguf_kquants.py): Q4_K, Q5_K and Q6_K tensors written by
tests/kernels/gguf_packers.py (the `gguf` package only dequantizes them) and random file bytes
read back equal to the package's dequantization and to gguf_blocks' qb32 form of the same
blocks; the records keep the file's bytes (Q4_K 148 of 144, Q5_K 180 of 176, Q6_K 210 of 210);
the C repack writes the numpy one's records; the few-row kernel (VNNI and AVX2 where this
machine has them, the portable loop everywhere) equals its float64 reference for 1 to 128 rows,
outputs off every tile and 1, 2, 5 super-blocks, also at the integer extremes; steps past the
few-row threshold run the many-row GEMM (x as it is); the row lookup equals dequantize bit for
bit; a linear stacked from parts of different layouts equals the stacked reference, each part in
its own layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from serverless_llm.engine.kernels import gguf_blocks as gb  # noqa: E402
from serverless_llm.engine.kernels import gguf_kquants as gk  # noqa: E402
from tests.kernels.gguf_packers import gguf_dequantize, quantize, weight  # noqa: E402

TYPES = ("Q4_K", "Q5_K", "Q6_K")
PATHS = ("best", "portable", "avx2", "float", "float-portable", "float-avx2", "i15",
         "i15-portable", "i15-avx2")  # fmt: skip


def skip_unless_built(kernels, path):
    """Skip a path this CPU or build does not have ("best"/"float": VNNI, else AVX2, else the
    portable loop; the portable ones run everywhere)."""
    if path in ("best", "float", "i15") and not (kernels.vnni or kernels.avx2):
        pytest.skip("neither AVX-512 VNNI nor AVX2 here: the portable path is tested below")
    if path.endswith("avx2") and not kernels.avx2:
        pytest.skip("this CPU (or build) has no AVX2")


@pytest.fixture(scope="module")
def kernels():
    k = gk.load()
    assert k is not None, "the K-quant kernels did not build (is a C compiler installed?)"
    return k


def random_blocks(type_name: str, n: int, supers: int, seed: int) -> np.ndarray:
    """Random file bytes: every code, sub-scale and sub-min; float16 fields of every exponent."""
    size = gk.TYPES[type_name][2]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, supers, size), generator=g, dtype=torch.uint8)
    for at in gb._HALF_FIELDS[type_name]:
        exp = torch.randint(1, 30, (n, supers), generator=g, dtype=torch.int16)
        man = torch.randint(0, 1024, (n, supers), generator=g, dtype=torch.int16)
        sign = torch.randint(0, 2, (n, supers), generator=g, dtype=torch.int16)
        raw[..., at : at + 2] = (
            ((sign << 15) | (exp << 10) | man).view(torch.uint8).view(n, supers, 2)
        )
    return raw.reshape(n, -1).numpy()


@pytest.mark.parametrize("type_name", TYPES)
def test_quantizer_blocks_read_back_as_the_package_dequantizes(type_name):
    k = 3 * 256
    raw = quantize(weight(7, k, 0), type_name)
    ours = gk.from_file_blocks(raw, type_name, k)
    assert ours.shape == (7, k)
    assert torch.equal(gk.dequantize(ours), gguf_dequantize(raw, type_name))


@pytest.mark.parametrize("type_name", TYPES)
def test_random_file_bytes_read_back_exactly(type_name):
    raw = random_blocks(type_name, 11, 2, 1)
    ours = gk.from_file_blocks(raw, type_name, 512)
    assert torch.equal(gk.dequantize(ours), gguf_dequantize(raw, type_name))
    # the same values as gguf_blocks' qb32 form of those blocks, field for field
    qb, want = gk.to_qb32(ours), gb.from_gguf_blocks(raw, type_name, 512)
    assert (qb.bits, qb.group) == (want.bits, want.group)
    for got, ref in ((qb.qs, want.qs), (qb.d, want.d), (qb.c, want.c)):
        assert torch.equal(got, ref)


def test_records_keep_the_files_bytes():
    sizes = (("Q4_K", 148, 144), ("Q5_K", 180, 176), ("Q6_K", 210, 210))
    for type_name, record, file_bytes in sizes:
        raw = quantize(weight(3, 512, 2), type_name)
        assert raw.shape == (3, 2 * file_bytes)
        w = gk.from_file_blocks(raw, type_name, 512)
        assert w.data.shape == (3, 2 * record) and w.nbytes() == 3 * 2 * record


def test_whole_super_blocks_and_known_types():
    raw = quantize(weight(2, 256, 0), "Q4_K")
    with pytest.raises(ValueError, match="whole super-blocks"):
        gk.from_file_blocks(raw, "Q4_K", 224)
    with pytest.raises(ValueError, match="no kq layout"):
        gk.from_file_blocks(raw, "Q2_K", 256)


def check(got: torch.Tensor, want: torch.Tensor, what) -> None:
    err = (got.double() - want).abs().max().item()
    assert err <= 1e-5 * (1 + want.abs().max().item()), (what, err)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("path", PATHS)
def test_kernel_equals_the_float64_reference(kernels, type_name, path):
    skip_unless_built(kernels, path)
    # outputs off the 16-row tiles (and the layout's: 37 rows tiled are 16, 16 and 5)
    for n, supers in ((1, 1), (19, 2), (37, 5)):
        k = 256 * supers
        w = gk.from_file_blocks(quantize(weight(n, k, n), type_name), type_name, k)
        ref = gk.to_qb32(w)
        g = torch.Generator().manual_seed(n)
        bias = torch.randn(n, generator=g)
        for m in (1, 2, 3, 4, 5, 17, 128):
            x = torch.randn(m, k, generator=g) * 3
            x[0, :5] = 0.0
            x[-1, 32:64] = 0.0  # a whole block of zeros: scale 0
            want = gb.reference_linear(x, ref, bias, levels=gk.levels_of(path))
            for layout in (w, gk.tiled(w)):
                check(kernels.linear(x, layout, bias, path=path), want, (n, k, m, layout.tiled))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("path", PATHS)
def test_integer_extremes(kernels, type_name, path):
    """Every code at its largest (Q5_K: every fifth bit set) and inputs at +-L in every lane: the
    22-bit inputs' int32 dot
    of 16 products of 63 * L is within 2^31 of zero (a wrap or a saturation would show)."""
    skip_unless_built(kernels, path)
    size = gk.TYPES[type_name][2]
    raw = np.full((9, size), 255, np.uint8)  # codes 15 / 31 / 63, sub-scales and mins 63
    for at in gb._HALF_FIELDS[type_name]:
        raw[:, at : at + 2] = np.array([0.01], np.float16).view(np.uint8)
    w = gk.from_file_blocks(raw, type_name, 256)
    top = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 63}[type_name]
    assert int(gk.codes(w).min()) == int(gk.codes(w).max()) == top
    ref = gk.to_qb32(w)
    for sign in (1.0, -1.0):
        x = torch.full((2, 256), sign)
        x[1, ::2] = -sign
        check(kernels.linear(x, w, None, path=path),
              gb.reference_linear(x, ref, None, levels=gk.levels_of(path)), sign)  # fmt: skip


@pytest.mark.parametrize("type_name", TYPES)
def test_float_inputs_equal_the_dequantized_matmul(kernels, type_name):
    k = 2 * 256
    raw = quantize(weight(21, k, 5), type_name)
    w = gk.from_file_blocks(raw, type_name, k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    want = x.double() @ gguf_dequantize(raw, type_name).double().T
    check(kernels.linear(x, w, path="float"), want, type_name)


@pytest.mark.parametrize("type_name", TYPES)
def test_many_rows_take_the_gemm(kernels, type_name):
    """Past few_rows the GEMM on chunks of rows repacked to qb32 (over 256 outputs: two
    chunks), x as it is: the dequantized weight's product up to float32 summation."""
    assert kernels.gemm_address is not None
    n, k = 300, 512
    w = gk.from_file_blocks(quantize(weight(n, k, 3), type_name), type_name, k)
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(n, generator=g)
    for m in (5, 33):
        x = torch.randn(m, k, generator=g)
        want = gb.reference_linear(x, gk.to_qb32(w), bias, quantize_x=False)
        want_few = gb.reference_linear(x[:4], gk.to_qb32(w), bias, levels=gb.FLOAT_LEVELS)
        for layout in (w, gk.tiled(w)):  # 300 rows tiled: the last tile 12 wide
            check(kernels.steps(x, layout, bias, few_rows=4), want, m)
            # at or under the threshold: the few-row kernel (float inputs)
            check(kernels.steps(x[:4], layout, bias, path="float", few_rows=4), want_few, "few")


@pytest.mark.parametrize("type_name", TYPES)
def test_rows_equal_dequantize(kernels, type_name):
    w = gk.from_file_blocks(random_blocks(type_name, 13, 2, 3), type_name, 512)
    ids = torch.tensor([[12, 0], [5, 5]])
    assert torch.equal(kernels.rows(w, ids), gk.dequantize(w)[ids])
    assert torch.equal(kernels.rows(gk.tiled(w), ids), gk.dequantize(w)[ids])
    with pytest.raises(IndexError):
        kernels.rows(w, torch.tensor([13]))


def test_stacked_parts_keep_their_layouts(kernels):
    """A Q4_K part, a Q6_K part, a Q5_0 qb32 part and a Q5_K part stacked along the outputs (a
    Q4_K_M file's q, k with v; a gate with an up of another type), each run by its own kernel
    through kq_multi_desc: equal to the stacked reference, for few and many rows."""
    k = 512
    q4 = gk.from_file_blocks(quantize(weight(24, k, 1), "Q4_K"), "Q4_K", k)
    q6 = gk.from_file_blocks(quantize(weight(9, k, 2), "Q6_K"), "Q6_K", k)
    q5 = gb.from_gguf_blocks(quantize(weight(11, k, 3), "Q5_0"), "Q5_0", k)
    q5k = gk.from_file_blocks(quantize(weight(7, k, 4), "Q5_K"), "Q5_K", k)
    full = torch.cat([gk.dequantize(q4), gk.dequantize(q6), gb.dequantize(q5), gk.dequantize(q5k)])
    descs, n0 = [], 0
    for p in (q4, q6, q5, q5k):
        if isinstance(p, gk.KQ):
            descs.append((kernels.steps_address, kernels.desc(p, "float", 4), n0))
        else:
            d = gb.QB32StepsDesc(gb.QB32Desc.of(p, "float"), 4)
            descs.append((kernels.qb32_steps_address, d, n0))
        n0 += p.shape[0]
    multi = gk.KQMulti.of(descs)
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(n0, generator=g)
    for m in (1, 3, 12):
        x = torch.randn(m, k, generator=g)
        got = kernels.multi(x, multi, n0, bias)
        xd = x.double()
        if m <= 4:  # the few-row kernels: float inputs, each part to its reference
            q, scale = gb.quantize_rows_reference(x, gb.FLOAT_LEVELS)
            xd = (q.view(m, k // 32, 32) * scale.double()[..., None]).reshape(m, k)
        want = xd @ full.double().T + bias.double()
        check(got, want, m)


@pytest.mark.parametrize("type_name", TYPES)
def test_the_c_repack_equals_numpys(kernels, type_name):
    """kq_from_file (the load's repack) writes the same records as the numpy one, for random
    file bytes (every bit pattern of codes, pairs, scales) and for a quantized tensor."""
    for raw in (random_blocks(type_name, 9, 3, 5), quantize(weight(4, 768, 6), type_name)):
        want = gk.from_file_blocks(raw, type_name, 768)
        got = gk.from_file_blocks(raw, type_name, 768, kernels)
        assert torch.equal(got.data, want.data)


@pytest.mark.parametrize("n", [5, 16, 35, 48])
def test_tiled_records(n):
    """The tiled order (tiles of 16 rows, the last n % 16 wide): record j of row r where the
    kernels read it (kq_rec), the same values, and back to the rows' order; rows and stacking of
    tiled weights take the rows' order."""
    w = gk.from_file_blocks(random_blocks("Q4_K", n, 3, n), "Q4_K", 768)
    t = gk.tiled(w)
    assert t.tiled and t.data.shape == w.data.shape and not torch.equal(t.data, w.data)
    flat, rec = t.data.reshape(-1), 148
    for r in range(n):
        t0 = r - r % 16
        width = min(16, n - t0)
        for j in range(3):
            at = (t0 * 3 + j * width + r % 16) * rec
            assert torch.equal(flat[at : at + rec], w.data[r, j * rec : (j + 1) * rec])
    assert torch.equal(gk.dequantize(t), gk.dequantize(w))
    assert torch.equal(gk.untiled(t).data, w.data)
    index = torch.tensor([n - 1, 0])
    assert torch.equal(t.rows(index).data, w.rows(index).data)
    assert torch.equal(gk.KQ.cat([t, w]).data, torch.cat([w.data, w.data]))

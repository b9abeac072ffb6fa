"""The GPTQ and AWQ readers (kernels/w4a16.py) against checkpoints packed field by field in
plain Python by tests/quant_checkpoints.py from the formats' descriptions (not with the
reader's code): every dequantized weight equals scale * (q - zero) computed from the unpacked
integers."""

from __future__ import annotations

import random

import pytest
import torch

from serverless_llm.engine.kernels.w4a16 import dequantize_awq, dequantize_gptq, unpack_int32
from tests.quant_checkpoints import int32_word, pack_awq, pack_gptq


def _random_ints(rng: random.Random, n: int, m: int, top: int) -> list[list[int]]:
    return [[rng.randrange(top) for _ in range(m)] for _ in range(n)]


def _expected(q, zeros, scales, group_of_row) -> torch.Tensor:
    n_in, n_out = len(q), len(q[0])
    w = torch.empty(n_out, n_in, dtype=scales.dtype)
    for i in range(n_in):
        g = group_of_row[i]
        for o in range(n_out):
            w[o, i] = scales[g, o] * (q[i][o] - zeros[g][o])
    return w


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "desc-act"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_gptq_dequantizes_each_weight(bits, act_order, dtype):
    rng = random.Random(bits * 10 + act_order)
    n_in, n_out, group = 96, 24, 32  # three groups
    top = 1 << bits
    q = _random_ints(rng, n_in, n_out, top)
    zeros = _random_ints(rng, 3, n_out, top - 1)
    zeros = [[z + 1 for z in row] for row in zeros]  # 1..top-1: stored (zero - 1) fits the field
    groups = [i // group for i in range(n_in)]
    if act_order:
        rng.shuffle(groups)
    scales = torch.rand(3, n_out, generator=torch.Generator().manual_seed(bits)).to(dtype) + 0.01
    qweight, qzeros = pack_gptq(q, zeros, bits)
    g_idx = torch.tensor(groups, dtype=torch.int32)
    got = dequantize_gptq(qweight, qzeros, scales, g_idx, bits)
    assert got.shape == (n_out, n_in) and got.dtype == dtype
    torch.testing.assert_close(got, _expected(q, zeros, scales, groups), rtol=0, atol=0)


def test_gptq_one_group_for_all_rows():
    """group_size -1: one group, g_idx all zero."""
    rng = random.Random(5)
    q = _random_ints(rng, 16, 8, 16)
    zeros = [[rng.randrange(1, 16) for _ in range(8)]]
    scales = torch.rand(1, 8) + 0.5
    qweight, qzeros = pack_gptq(q, zeros, 4)
    got = dequantize_gptq(qweight, qzeros, scales, torch.zeros(16, dtype=torch.int32), 4)
    torch.testing.assert_close(got, _expected(q, zeros, scales, [0] * 16), rtol=0, atol=0)


@pytest.mark.parametrize("group", [64, 128])
def test_awq_dequantizes_each_weight(group):
    rng = random.Random(group)
    n_in, n_out = 3 * group, 32
    groups = n_in // group
    q = _random_ints(rng, n_in, n_out, 16)
    zeros = _random_ints(rng, groups, n_out, 16)
    scales = (torch.rand(groups, n_out, generator=torch.Generator().manual_seed(1)) + 0.01).half()
    got = dequantize_awq(pack_awq(q), pack_awq(zeros), scales, group)
    expected = _expected(q, zeros, scales, [i // group for i in range(n_in)])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_fields_with_the_sign_bit_set_unpack_unsigned():
    word = torch.tensor([[int32_word(0xF0000000 | 0x9)]], dtype=torch.int32)  # fields 9, 0.., 15
    assert unpack_int32(word, 4, dim=1).tolist() == [[9, 0, 0, 0, 0, 0, 0, 15]]
    assert unpack_int32(word, 8, dim=0).tolist() == [[9], [0], [0], [0xF0]]


def test_mismatched_shapes_are_refused():
    qweight = torch.zeros(4, 8, dtype=torch.int32)  # 32 input rows of 4 bits
    with pytest.raises(ValueError, match="GPTQ shapes disagree"):
        dequantize_gptq(
            qweight,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, 8),
            torch.zeros(31, dtype=torch.int32),
            4,
        )
    with pytest.raises(ValueError, match="AWQ shapes disagree"):
        dequantize_awq(
            torch.zeros(64, 1, dtype=torch.int32),
            torch.zeros(2, 1, dtype=torch.int32),
            torch.ones(2, 8),
            64,
        )
    with pytest.raises(ValueError, match="do not tile"):
        unpack_int32(qweight, 3, dim=0)

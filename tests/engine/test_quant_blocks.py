"""GPTQ/AWQ integer weights on qb32 blocks on CPU (issue 39 item 2; layers/quant_blocks.py): the
repack is exact (the blocks dequantize to (q - z) * s bit for bit), a layer served from blocks
computes what the dequantized float weight computes, a weight that does not fit keeps its packed
form, and a checkpoint's layers take the whole-layer native decode on the blocks. Greedy tokens
of the GPTQ/AWQ test checkpoints through this path: tests/engine/test_quantized_models.py
(mode "packed", which is this path on CPU)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.kernels import gguf_blocks
from serverless_llm.engine.kernels.w4a16 import dequantize_grouped
from serverless_llm.engine.layers.gguf_linear import GGUFBlockLinear
from serverless_llm.engine.layers.quant_blocks import PermutedBlocks, int_blocks, take_int_blocks
from serverless_llm.engine.layers.quant_linear import PackedWeight
from tests.engine.reference import hf_greedy
from tests.engine.test_engine_vs_transformers import prompts_for
from tests.quant_checkpoints import write_quantized
from tests.tiny_models import build_tiny_model


def _random_int_weight(n, k, bits, group, act_order, scale_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 1 << bits, (n, groups), generator=g, dtype=torch.int32)
    scales = (torch.rand(n, groups, generator=g) * 0.02 + 1e-3).to(scale_dtype)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    return q, zeros, scales, g_idx


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_repack_is_exact(bits, group, act_order, scale_dtype):
    q, zeros, scales, g_idx = _random_int_weight(40, 256, bits, group, act_order, scale_dtype)
    p = PackedWeight(q, zeros, scales, g_idx, bits)
    blocks = int_blocks(p)
    assert blocks is not None and blocks.bits == bits
    want = dequantize_grouped(q, zeros, scales, g_idx)  # [out, in] in the checkpoint's order
    if p.perm is not None:
        want = want[:, p.perm]  # the blocks hold the inputs sorted by group
    assert torch.equal(gguf_blocks.dequantize(blocks), want)


def test_weights_that_do_not_fit_keep_their_packed_form():
    q, zeros, scales, g_idx = _random_int_weight(8, 64, 4, 16, False, torch.float16)
    assert int_blocks(PackedWeight(q, zeros, scales, g_idx, 4)) is None  # 16-input groups
    q, zeros, scales, g_idx = _random_int_weight(8, 48, 4, 48, False, torch.float16)
    assert int_blocks(PackedWeight(q, zeros, scales, g_idx, 4)) is None  # 48 inputs
    q, zeros, scales, g_idx = _random_int_weight(8, 64, 2, 32, False, torch.float16)
    assert int_blocks(PackedWeight(q, zeros, scales, g_idx, 2)) is None  # 2 bits


def test_block_linear_equals_the_dequantized_matmul():
    kernels = gguf_blocks.load()
    assert kernels is not None, "the block kernels did not build on this machine"
    q, zeros, scales, g_idx = _random_int_weight(72, 320, 4, 64, True, torch.float16, seed=2)
    p = PackedWeight(q, zeros, scales, g_idx, 4)
    run = PermutedBlocks(GGUFBlockLinear(int_blocks(p), kernels, "float"), p.perm)
    w = dequantize_grouped(q, zeros, scales, g_idx).double()
    g = torch.Generator().manual_seed(5)
    for rows in (1, 5, 40):  # the few-row kernel and the GEMM (block_rows 16)
        x = torch.randn(rows, 320, generator=g)
        got = run(x)
        want = F.linear(x.double(), w).float()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def awq_llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("awq")
    shape = dict(
        hidden_size=96, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2
    )
    src = build_tiny_model(str(root / "src"), "llama", seed=3, **shape)
    return write_quantized(
        src, str(root / "float"), str(root / "quant"), "awq", 4, 32, False, False, True
    )


def test_layers_in_input_order_take_the_whole_layer_decode(awq_llama, caplog):
    """AWQ keeps inputs in order: each linear becomes a block linear and every layer decodes in
    one native call on its blocks; greedy tokens still equal transformers' on the dequantized
    weights, batched (the GEMM) and one at a time (the whole-layer decode)."""
    float_dir, quant_dir = awq_llama
    with caplog.at_level(logging.INFO):
        llm = LLM(quant_dir, block_size=8, num_kv_blocks=64, quantized_weights="packed")
    model = llm.engine.model
    assert sum(isinstance(m, GGUFBlockLinear) for m in model.modules()) == 2 * 4
    line = next(r.getMessage() for r in caplog.records if "qb32 blocks" in r.getMessage())
    assert "8 linears on qb32 blocks, 0 in their packed form" in line
    if model.native is not None:
        assert "whole decode layers on blocks: 2" in line
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = prompts_for(llm.engine.vocab_size, seed=4)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(float_dir, prompt, 24)
    one = llm.generate([prompts[0]], params)[0]
    assert one.outputs[0].token_ids == hf_greedy(float_dir, prompts[0], 24)


def test_take_int_blocks_counts_what_it_left(awq_llama):
    """A model whose QuantLinears are not settled packed forms is left as it is."""
    _, quant_dir = awq_llama
    llm = LLM(quant_dir, block_size=8, num_kv_blocks=64, quantized_weights="dequantize")
    kernels = gguf_blocks.load()
    assert take_int_blocks(llm.engine.model, kernels) == (0, 0)

"""Every way a checkpoint lays out its weights, split over two tensor-parallel ranks: each
rank's slices (fused, per-head, grouped, transposed Conv1D, per-expert and stacked-expert
tensors, per-head norms, norms over all heads, ALiBi slopes, a single KV head replicated, the
vocabulary padded) give, once all-reduced and gathered, the logits of transformers' own model.
The ranks are threads here (tp_harness.py); test_tensor_parallel.py runs them as processes."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.engine import test_families, test_families_alibi, test_families_gpt, test_families_moe
from tests.engine.family_check import save_family_model
from tests.engine.tp_harness import sharded_logits
from tests.quant_checkpoints import (
    write_fp8,
    write_fp8_block,
    write_pack_quantized,
    write_quantized,
)
from tests.tiny_models import build_tokenizer

# Every family the engine serves, from the family tests' own configs. The layouts among them:
# qkv and gate_up stored fused (phi3), per-head q/k norms stored one head per tensor (stablelm),
# norms over all heads whose statistics span the ranks (olmo2, olmoe), Conv1D weights stored
# [in, out] (gpt2), one KV head replicated on both ranks (gpt_bigcode, falcon_multi_query), qkv
# interleaved per head (gpt_neox, bloom) or grouped per KV head (falcon_new), each rank its
# heads' ALiBi slopes (bloom_6heads), project_in/out replicated (opt_post_ln), experts stacked
# [E, 2I, H] (granitemoe) or in one 2-D tensor with down stored transposed (dbrx), a shared
# expert and its gate (qwen2_moe).
CASES = {
    name: module
    for module in (test_families, test_families_gpt, test_families_alibi, test_families_moe)
    for name in module.CONFIGS
}


@pytest.mark.parametrize("name", list(CASES))
def test_two_rank_logits_equal_transformers(tmp_path, name):
    config = CASES[name].CONFIGS[name](build_tokenizer())
    path = save_family_model(str(tmp_path / name), config)
    ids = [5 + (7 * i) % 300 for i in range(37)]
    out = sharded_logits(path, ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))).logits[0]
    torch.testing.assert_close(out["logits"], ref, atol=2e-4, rtol=2e-4)


def test_each_rank_holds_half_the_weights(tmp_path):
    from tests.tiny_models import build_tiny_model

    path = build_tiny_model(str(tmp_path / "m"), "llama")
    whole = sharded_logits(path, [5, 6, 7], size=1)["bytes"][0]
    halves = sharded_logits(path, [5, 6, 7], size=2)["bytes"]
    for held in halves:  # the norms (a few hundred floats) are the only copies
        assert 0.5 * whole <= held <= 0.52 * whole, (held, whole)


# -- quantized checkpoints ---------------------------------------------------------------------

QUANTIZED = {
    "gptq": lambda src, d: write_quantized(src, f"{d}/f", f"{d}/q", "gptq"),
    "gptq_8bit": lambda src, d: write_quantized(src, f"{d}/f", f"{d}/q", "gptq", bits=8),
    "awq": lambda src, d: write_quantized(src, f"{d}/f", f"{d}/q", "awq"),
    "pack_quantized": lambda src, d: write_pack_quantized(src, f"{d}/f", f"{d}/q"),
    "fp8_tensor": lambda src, d: write_fp8(src, f"{d}/f", f"{d}/q", "fp8", "tensor"),
    "fp8_channel": lambda src, d: write_fp8(
        src, f"{d}/f", f"{d}/q", "compressed-tensors", "channel"
    ),
    # blocks of 16 rows x 32 columns: each rank's q/k/v/gate/up rows and o/down inputs are
    # whole blocks, as a real checkpoint's 128 x 128 blocks are at real sizes
    "block_fp8": lambda src, d: write_fp8_block(src, f"{d}/f", f"{d}/q", "fp8", (16, 32)),
    "block_fp8_ct": lambda src, d: write_fp8_block(
        src, f"{d}/f", f"{d}/q", "compressed-tensors", (16, 32)
    ),
}
IDS = [5 + (7 * i) % 300 for i in range(37)]


@pytest.mark.parametrize("mode", ["dequantize", "packed"])
@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_checkpoints_split_without_unpacking(tmp_path, tiny_llama, name, mode):
    """Packed weights, zero points, scales and group indices sliced along their packed layout
    (a rank's range on pack and group boundaries): two ranks give one rank's logits, each
    holding half the bytes. FP8 held packed quantizes each token's activations per rank (the
    row-parallel layers see half the inputs, as vLLM's ranks do), so it agrees only within the
    FP8 activation noise one rank has against the dequantized weights."""
    _, quant = QUANTIZED[name](tiny_llama, str(tmp_path))
    one = sharded_logits(quant, IDS, size=1, quantized_weights=mode)
    two = sharded_logits(quant, IDS, size=2, quantized_weights=mode)
    for held in two["bytes"]:
        assert 0.49 * one["bytes"][0] < held < 0.52 * one["bytes"][0]
    if name.startswith("fp8") and mode == "packed":
        exact = sharded_logits(quant, IDS, size=1, quantized_weights="dequantize")["logits"]
        noise = (one["logits"] - exact).abs().max()
        assert (two["logits"] - exact).abs().max() < 1.5 * noise
    else:
        torch.testing.assert_close(two["logits"], one["logits"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["dequantize", "packed"])
def test_act_order_gptq_splits_keeping_every_group(tmp_path, tiny_llama, mode):
    """Act-order GPTQ: a row-parallel rank's inputs belong to groups all over the input, so it
    keeps every group's scales and zero points and its inputs' group indices unchanged; two
    ranks give one rank's logits. The column-parallel layers split as without act-order."""
    _, quant = write_quantized(tiny_llama, f"{tmp_path}/f", f"{tmp_path}/q", "gptq", act_order=True)
    one = sharded_logits(quant, IDS, size=1, quantized_weights=mode)
    two = sharded_logits(quant, IDS, size=2, quantized_weights=mode)
    torch.testing.assert_close(two["logits"], one["logits"], atol=1e-4, rtol=1e-4)
    for held in two["bytes"]:  # the row-parallel layers' scales stay whole
        assert 0.49 * one["bytes"][0] < held < 0.6 * one["bytes"][0]


@pytest.mark.parametrize(
    ("method", "act_order", "mode"),
    [("gptq", False, "packed"), ("gptq", True, "packed"), ("gptq", True, "dequantize"),
     ("awq", False, "packed"), ("fp8", False, "dequantize"), ("fp8", False, "packed"),
     ("block_fp8", False, "packed")],
)  # fmt: skip
def test_quantized_moe_splits_each_experts_width(tmp_path, method, act_order, mode):
    """A quantized Qwen2-MoE (experts, shared expert and attention quantized; routers float):
    each rank holds every expert at half its width, sliced along the packed layouts (act-order
    down projections keep every group); two ranks give one rank's logits."""
    tok = build_tokenizer()
    config = test_families_moe.CONFIGS["qwen2_moe"](tok)
    # widths whose halves fall on the test packer's 32-row groups
    config.moe_intermediate_size, config.shared_expert_intermediate_size = 64, 128
    src = save_family_model(str(tmp_path / "src"), config, std=0.1)
    if method == "fp8":
        _, quant = write_fp8(src, f"{tmp_path}/f", f"{tmp_path}/q", "fp8", "tensor")
    elif method == "block_fp8":  # experts held as bytes and 16 x 32 block scales
        _, quant = write_fp8_block(src, f"{tmp_path}/f", f"{tmp_path}/q", "fp8", (16, 32))
    else:
        _, quant = write_quantized(
            src, f"{tmp_path}/f", f"{tmp_path}/q", method, act_order=act_order
        )
    one = sharded_logits(quant, IDS, size=1, quantized_weights=mode)
    two = sharded_logits(quant, IDS, size=2, quantized_weights=mode)
    if method == "fp8" and mode == "packed":
        # The dense FP8 layers held packed quantize activations per token per rank (see
        # test_quantized_checkpoints_split_without_unpacking): within one rank's FP8 noise.
        exact = sharded_logits(quant, IDS, size=1, quantized_weights="dequantize")["logits"]
        noise = (one["logits"] - exact).abs().max()
        assert (two["logits"] - exact).abs().max() < 1.5 * noise
    else:
        torch.testing.assert_close(two["logits"], one["logits"], atol=1e-4, rtol=1e-4)
    for held in two["bytes"]:
        assert held < 0.62 * one["bytes"][0]

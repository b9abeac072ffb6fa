"""The LoRA Triton path (interpreted on CPU, compiled on a GPU) against the torch references:
the grouped shrink and expand (`add_lora`), the all-slots masked form the CPU runs
(`add_lora_masked`) and the per-group reference, in float32 and float16, with tokens of several
adapters interleaved and runs of one, tokens without adapter, token counts that are not
multiples of the row tile, and rank blocks of fused layers (three parts)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm.engine.kernels.lora_delta import (  # noqa: E402
    add_lora,
    add_lora_masked,
    add_lora_padded,
    add_lora_reference,
    padded_rows,
    slot_mask,
)
from tests.kernels.batch import DEVICE  # noqa: E402


def _groups(token_slots: torch.Tensor) -> list:
    return [
        (s, torch.nonzero(token_slots == s).flatten())
        for s in sorted(set(token_slots.tolist()))
        if s >= 0
    ]


def _naive(out, x, a, b, token_slots):
    want = out.clone().double()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            want[t] += b[:, s].double() @ (a[s].double() @ x[t].double())
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "tokens,slots,ranks,layout",
    [(1, 1, 16, "one"), (7, 2, 16, "interleaved"), (37, 4, 48, "runs"), (70, 3, 32, "mixed")],
)
def test_add_lora_matches_the_references(dtype, tokens, slots, ranks, layout):
    g = torch.Generator().manual_seed(tokens)
    k, n = 48, 80
    x = torch.randn(tokens, k, generator=g)
    a = torch.randn(slots, ranks, k, generator=g) / k**0.5
    b = torch.randn(n, slots, ranks, generator=g) / ranks**0.5
    base = torch.randn(tokens, n, generator=g)
    if layout == "interleaved":
        token_slots = torch.arange(tokens) % (slots + 1) - 1  # -1, 0, 1, -1, ...
    elif layout == "runs":
        token_slots = (torch.arange(tokens) * (slots + 1) // tokens) - 1
    else:
        token_slots = torch.randint(-1, slots, (tokens,), generator=g)
    token_slots[0] = 0  # at least one token with an adapter
    want = _naive(base, x, a, b, token_slots)
    x, a, b, base = (t.to(dtype).to(DEVICE) for t in (x, a, b, base))
    token_slots = token_slots.to(DEVICE)
    got = add_lora(base.clone(), x, a, b, token_slots)
    ref = add_lora_reference(base.clone(), x, a, b, _groups(token_slots))
    masked = add_lora_masked(base.clone(), x, a, b, slot_mask(token_slots, slots, ranks, dtype))
    layout = padded_rows(_groups(token_slots), tokens, token_slots.device)
    assert layout.zero_row == bool((token_slots < 0).any())
    padded = add_lora_padded(base.clone(), x, a, b, layout)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for result in (got, ref, masked, padded):
        assert result.dtype == dtype
        torch.testing.assert_close(result.double().cpu(), want, **tol)
    # tokens without an adapter keep the base output exactly
    none = (token_slots < 0).cpu()
    assert torch.equal(got.cpu()[none], base.cpu()[none])
    assert torch.equal(padded.cpu()[none], base.cpu()[none])


def test_padded_layout_spans_the_used_slots_and_reads_slices():
    """Groups given as slices (contiguous runs) and as indices, slots 1 and 3 of 5 in use: the
    layout spans slots 1..3 (slot 2 padding only), and the padded form equals the reference."""
    g = torch.Generator().manual_seed(3)
    tokens, slots, ranks, k, n = 9, 5, 8, 16, 24
    x = torch.randn(tokens, k, generator=g)
    a = torch.randn(slots, ranks, k, generator=g)
    b = torch.randn(n, slots, ranks, generator=g)
    base = torch.randn(tokens, n, generator=g)
    groups = [(3, slice(0, 4)), (1, torch.tensor([5, 7, 8]))]  # tokens 4 and 6: no adapter
    layout = padded_rows(groups, tokens, x.device)
    assert (layout.lo, layout.hi, layout.m, layout.rows, layout.zero_row) == (1, 4, 4, 12, True)
    want = add_lora_reference(base.clone(), x, a, b, groups)
    torch.testing.assert_close(add_lora_padded(base.clone(), x, a, b, layout), want)
    one = padded_rows(groups[:1], 4, x.device)  # every token of a 4-token step in slot 3
    assert not one.zero_row and one.rows == 4
    want = add_lora_reference(base[:4].clone(), x[:4], a, b, groups[:1])
    torch.testing.assert_close(add_lora_padded(base[:4].clone(), x[:4], a, b, one), want)


def test_lora_on_the_triton_backend(tiny_llama, tmp_path):
    """Two adapters and the base mixed in one call on the Triton backend: transformers + peft's
    merged model's tokens for each."""
    pytest.importorskip("peft")
    from serverless_llm import LLM, LoRARequest, SamplingParams
    from tests.engine.reference import hf_greedy
    from tests.lora_adapters import make_adapter

    a1 = make_adapter(tiny_llama, str(tmp_path / "a1"), 8, 16, ["q_proj", "v_proj"], seed=1)
    a2 = make_adapter(tiny_llama, str(tmp_path / "a2"), 16, 8, ["o_proj", "gate_proj"], seed=2)
    llm = LLM(tiny_llama, dtype="float32", attention_backend="triton", enable_lora=True,
              max_loras=2, num_kv_blocks=64, max_model_len=128, block_size=8)  # fmt: skip
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
    loras = [LoRARequest("a1", 1, a1), None, LoRARequest("a2", 2, a2)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=loras)
    refs = [a1 + "-merged", tiny_llama, a2 + "-merged"]
    for prompt, ref, out in zip(prompts, refs, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 6)

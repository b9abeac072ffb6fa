"""bfloat16 on CPU (issue 39 item 3): where the CPU has bfloat16 arithmetic (AVX512_BF16 or
AMX-BF16), DTYPE=bfloat16 packs the linears for oneDNN's bfloat16 GEMM, as float32 models are
packed for its float32 one; elsewhere a bfloat16 model keeps plain nn.Linear (F.linear).

The packing is forced on (or off) here through `cpu_has_bf16`, so both paths run on every
machine: oneDNN computes bfloat16 without the instructions too, only not faster."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.layers import linear
from serverless_llm.engine.layers.linear import PackedLinear

PROMPTS = [[5, 17, 42, 9, 33, 101, 7], [250, 3, 3, 8], [64] * 12 + [19, 2]]
NEW = 12
TOLERANCE = 0.1  # nats: both paths measured 0.028-0.036 here (bfloat16 rounding alone)


def _hf_bf16_scored(path: str, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers in bfloat16: the prompt with its greedy continuation of NEW tokens, and the
    log-probability of each continuation token where it was chosen."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = [model.config.vocab_size + 1]  # never stops early
    config.pad_token_id, config.max_new_tokens, config.do_sample = 0, NEW, False
    ids = torch.tensor([prompt])
    with torch.no_grad():
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        logits = model(seq).logits[0].float()
    seq = seq[0].tolist()
    logp = torch.log_softmax(logits, -1)
    ref = torch.tensor([logp[i - 1, seq[i]].item() for i in range(len(prompt), len(seq))])
    return seq, ref


def test_packed_bfloat16_linear_equals_f_linear():
    """A packed bfloat16 weight computes what F.linear computes from the same bfloat16 weight
    and input (float32 sums, one rounding to bfloat16 at the end: within one bfloat16 step)."""
    if not linear.packed_ops_work(torch.bfloat16):
        pytest.fail("this torch build has no oneDNN bfloat16 packed linear")
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(200, 77, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(77, 200, generator=g))
        lin.bias.copy_(torch.randn(77, generator=g))
    packed = PackedLinear(lin)
    assert packed.packed.dtype == torch.bfloat16 and packed.panels is None
    for m in (1, 3, 32, 70):
        x = torch.randn(m, 200, generator=g).to(torch.bfloat16)
        got = packed(x)
        want = F.linear(x.float(), lin.weight.float(), lin.bias.float())
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(
            got.float(), want, rtol=2**-7, atol=2**-7 * want.abs().max().item()
        )


@pytest.mark.parametrize("has_bf16", [True, False])
def test_bfloat16_model_on_cpu(tiny_llama, monkeypatch, has_bf16):
    """DTYPE=bfloat16 on CPU: linears packed exactly where the CPU has bfloat16 arithmetic;
    its log-probabilities equal transformers' in bfloat16 either way."""
    monkeypatch.setattr(linear, "cpu_has_bf16", lambda: has_bf16)
    llm = LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=64, block_size=8, max_model_len=64)
    model = llm.engine.model
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    plain = [m for m in model.modules() if type(m) is nn.Linear]
    if has_bf16:
        assert packed and not plain
        assert all(m.packed.dtype == torch.bfloat16 and m.native_rows == 0 for m in packed)
    else:
        assert plain and not packed
    # bfloat16 rounds in different places here and in transformers (its norms and residual
    # adds), so greedy paths may part at a near tie: the check is teacher-forced, transformers'
    # own greedy continuation scored by the engine, position by position
    for prompt in PROMPTS:
        seq, ref = _hf_bf16_scored(tiny_llama, prompt)
        out = llm.generate([seq], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
        got = [out.prompt_logprobs[i][seq[i]].logprob for i in range(len(prompt), len(seq))]
        diff = (torch.tensor(got) - ref).abs().max().item()
        assert diff < TOLERANCE, (prompt, diff)

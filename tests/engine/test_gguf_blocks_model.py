"""The embedded SmolLM2 Q4_1 GGUF with QUANTIZED_WEIGHTS=packed: every linear and the tied LM
head read the file's blocks for decode steps (layers/gguf_linear.py), and greedy decoding
follows the float32 path's (QUANTIZED_WEIGHTS=auto: the same weights dequantized once) up to
near ties: the block path quantizes activations to int8 per block, so where the float path's
two best tokens are within a small logprob margin the pick may flip; before that the tokens
and their logprobs agree closely."""

from __future__ import annotations

import pytest

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.layers.gguf_linear import GGUFBlockLinear

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
]
TIE = 0.25  # logprob margin under which the two paths may pick different tokens
CLOSE = 0.15  # largest logprob difference of an agreed token


@pytest.fixture(scope="module")
def engines(model_cache_dir):
    kw = dict(download_dir=model_cache_dir, max_model_len=512, dtype="float32")
    return LLM(None, quantized_weights="auto", **kw), LLM(None, quantized_weights="packed", **kw)


@pytest.mark.slow
def test_packed_gguf_reads_blocks(engines):
    float_llm, packed = engines
    model = packed.engine.runner.model
    blocks = [m for m in model.modules() if isinstance(m, GGUFBlockLinear)]
    assert len(blocks) == 4 * len(model.layers) + 1  # qkv, o, gate_up, down; the LM head
    assert isinstance(model.packed_lm_head, GGUFBlockLinear)
    assert model.packed_lm_head.blocks.bits == 8  # token_embd is Q8_0 in the file
    # the whole-layer native decode runs on the blocks (cpu_native.c calls the block linear)
    for layer in model.layers:
        w = layer.native_decode.weights
        assert w.qlinear == packed.engine.runner.model.packed_lm_head.kernels.linear_desc_address
        assert all((w.qkv_q, w.o_q, w.up_q, w.down_q))
    assert not any(isinstance(m, GGUFBlockLinear) for m in float_llm.engine.runner.model.modules())


@pytest.mark.slow
def test_packed_gguf_follows_the_float_path_up_to_near_ties(engines):
    float_llm, packed = engines
    tok = packed.get_tokenizer()
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=5, ignore_eos=True)
    agreed = 0
    for p in PROMPTS:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        want = float_llm.generate(prompt, params)[0].outputs[0]
        got = packed.generate(prompt, params)[0].outputs[0]
        for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids)):
            if a != b:  # a near tie in both paths' eyes
                assert want.logprobs[i][a].logprob - want.logprobs[i][b].logprob < TIE, (p, i)
                assert got.logprobs[i][b].logprob - got.logprobs[i][a].logprob < TIE, (p, i)
                break
            assert abs(want.logprobs[i][a].logprob - got.logprobs[i][b].logprob) < CLOSE
            agreed += 1
    assert agreed >= len(PROMPTS) * 8  # most of the way, not a divergence at every start

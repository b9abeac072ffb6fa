"""The engine's greedy tokens equal transformers' for every supported family, with many
prompts of different lengths batched together."""

from __future__ import annotations

import random

import pytest

from serverless_llm import LLM, SamplingParams
from tests.engine.reference import hf_greedy

NEW_TOKENS = 64


def prompts_for(
    vocab: int, seed: int = 0, lengths=(1, 3, 7, 12, 20, 31, 45, 60)
) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("kind", ["llama", "llama3", "llama_tied", "mistral", "qwen2"])
def test_greedy_batch_equals_transformers(tiny_model_dirs, kind):
    path = tiny_model_dirs[kind]
    llm = LLM(path, block_size=8, num_kv_blocks=128, max_model_len=256)
    prompts = prompts_for(llm.engine.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, NEW_TOKENS), (kind, len(prompt))
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks


def test_sliding_window_is_exercised(tiny_model_dirs):
    """The Mistral test above only means something if sequences outgrow the window."""
    llm = LLM(tiny_model_dirs["mistral"], num_kv_blocks=64, max_model_len=256)
    window = llm.engine.hf_config.sliding_window
    assert window is not None and window < max(len(p) for p in prompts_for(100)) + NEW_TOKENS
    assert all(layer.self_attn.spec.sliding_window == window for layer in llm.engine.model.layers)


@pytest.mark.slow
def test_smollm2_chat_prompts_equal_transformers(smollm2_dir):
    llm = LLM(smollm2_dir, max_model_len=1024)
    tok = llm.get_tokenizer()
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain paged attention in one sentence.",
        "List three prime numbers.",
        "Hi",
        "Why is the sky blue? Answer briefly, then give one fun fact about light scattering.",
        "Translate 'good morning' into Spanish and German.",
        "What is 17 times 23?",
    ]
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    prompt_ids = [tok.encode(p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompt_ids, params)
    for ids, out in zip(prompt_ids, outs):
        assert out.outputs[0].token_ids == hf_greedy(smollm2_dir, ids, NEW_TOKENS)
    assert "Paris" in outs[0].outputs[0].text

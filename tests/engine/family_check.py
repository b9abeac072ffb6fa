"""Checking a model family against transformers: a tiny random model built from the family's own
transformers config (its characteristic options switched on), saved with the test tokenizer,
then 8 prompts of different lengths generated together, greedy, token for token against
transformers' `generate` one prompt at a time."""

from __future__ import annotations

import os
import random

import torch
import transformers

from serverless_llm import LLM, SamplingParams
from tests.engine.reference import hf_greedy
from tests.tiny_models import build_tokenizer

NEW_TOKENS = 48
LENGTHS = (1, 3, 7, 12, 20, 31, 45, 60)


def tiny_dims(tokenizer, **overrides) -> dict:
    """The usual tiny sizes under transformers' usual names (Llama-shaped configs)."""
    kw = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    kw.update(overrides)
    return kw


def save_family_model(path: str, config, seed: int = 0, std: float = 0.2) -> str:
    """A random model of `config` (the test tokenizer's vocabulary) saved into `path`. Weights
    are widened so greedy picks are clear; norm weights stay near their init plus noise so
    options like Gemma's (1 + w) are exercised."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def family_prompts(vocab: int, seed: int = 0, lengths=LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


def engine_greedy(path: str, prompts, new_tokens: int = NEW_TOKENS, **engine_kw) -> list[list[int]]:
    kw = dict(block_size=8, num_kv_blocks=160, max_model_len=256, dtype="float32")
    kw.update(engine_kw)
    llm = LLM(path, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params)
    pool = llm.engine.block_pool
    assert pool.num_free == pool.num_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outs]


def assert_matches_transformers(
    path: str, new_tokens: int = NEW_TOKENS, lengths=LENGTHS, **engine_kw
):
    """The engine's greedy tokens equal transformers' for every prompt."""
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    prompts = family_prompts(vocab, lengths=lengths)
    got = engine_greedy(path, prompts, new_tokens, **engine_kw)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(path, prompt, new_tokens), f"prompt of {len(prompt)} tokens"

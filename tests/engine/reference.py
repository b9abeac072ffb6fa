"""transformers as the reference: greedy `generate` one prompt at a time."""

from __future__ import annotations

import copy
import functools

import torch
import transformers


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of `prompt_ids`, never stopping early at EOS."""
    model = hf_model(path)
    ids = torch.tensor([prompt_ids])
    # An end-of-sequence id no token can have: generation runs the full length without masking
    # EOS (min_new_tokens would mask it, which is not what ignore_eos means). transformers fills
    # a None eos_token_id back in from the model's defaults, so None cannot be used.
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = [model.config.vocab_size + 1]
    config.pad_token_id = 0
    config.max_new_tokens = max_new_tokens
    config.do_sample = False
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    generated = out[0, len(prompt_ids) :].tolist()
    assert len(generated) == max_new_tokens, "transformers stopped early"
    return generated

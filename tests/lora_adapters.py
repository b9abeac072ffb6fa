"""Random LoRA adapters made with peft, for the LoRA tests: the adapter directory, and beside it
the model with the adapter merged (peft's `merge_and_unload`), the reference."""

from __future__ import annotations

import torch
import transformers

from tests.tiny_models import build_tokenizer


def make_adapter(
    base: str, out: str, r: int, alpha: float, targets, rslora: bool = False, seed: int = 0
) -> str:
    """Saves a peft LoRA adapter of `base` into `out` (weights wide enough to change greedy
    picks) and the merged model into `out`-merged; returns `out`."""
    import peft

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False
    )
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    pm.save_pretrained(out)
    merged = pm.merge_and_unload()
    merged.save_pretrained(out + "-merged")
    build_tokenizer().save_pretrained(out + "-merged")
    return out

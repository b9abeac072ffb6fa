"""Tiny random decoder classifiers and rerankers for the pooling tasks (issue 41): a
Qwen3/Llama `...ForSequenceClassification` and a Qwen3ForCausalLM whose tokenizer has the
"yes" and "no" tokens Qwen3-Reranker's recipe reads. Nothing touches a model hub."""

from __future__ import annotations

import torch
import transformers

from tests.tiny_models import build_tokenizer, tiny_dims


def save_tiny(path: str, config, model_cls, seed: int = 0, extra_tokens=()) -> str:
    """A random `model_cls(config)` (float32, weights widened as tiny_models does) saved as
    safetensors with the test tokenizer (plus `extra_tokens`) into `path`."""
    tokenizer = build_tokenizer()
    if extra_tokens:
        tokenizer.add_tokens(list(extra_tokens))
    config.vocab_size = len(tokenizer)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def tiny_config(kind: str, **overrides):
    """A tiny "qwen3" or "llama" config, untied."""
    tok = build_tokenizer()
    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[kind]
    kw = dict(head_dim=16) if kind == "qwen3" else {}
    return cls(**tiny_dims(tok, **{"tie_word_embeddings": False, **kw, **overrides}))


def build_classifier(path: str, kind: str = "qwen3", num_labels: int = 3) -> str:
    """A `<Kind>ForSequenceClassification` with labels class_0..class_{n-1}."""
    model_cls = {
        "qwen3": transformers.Qwen3ForSequenceClassification,
        "llama": transformers.LlamaForSequenceClassification,
    }[kind]
    config = tiny_config(kind, num_labels=num_labels)
    config.id2label = {i: f"class_{i}" for i in range(num_labels)}
    config.label2id = {v: k for k, v in config.id2label.items()}
    return save_tiny(path, config, model_cls)


def build_reranker(path: str) -> str:
    """A Qwen3ForCausalLM with "yes" and "no" tokens: Qwen3-Reranker's shape."""
    return save_tiny(
        path, tiny_config("qwen3"), transformers.Qwen3ForCausalLM, extra_tokens=("yes", "no")
    )

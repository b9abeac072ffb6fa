"""Tiny random models built from transformers configs, saved with a tokenizer, for tests.

Nothing here touches a model hub: the tokenizer is a byte-level BPE trained in-process on a few
sentences (with multi-byte text, so detokenizer tests have characters split across tokens), and
the weights are random with a fixed seed.
"""

from __future__ import annotations

import os

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Café, naïve, résumé, über, smörgåsbord, crème brûlée.",
    "日本語のテキストと中文文本以及한국어 텍스트.",
    "Emoji: 🙂 🚀 🎉 👍🏽 and math: ∑ ∫ √ π ≈ 3.14159.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time, in a land far away, there lived a small language model.",
]

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size: int = 384) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _base_kwargs(tokenizer, **overrides) -> dict:
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
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return kw


def make_config(kind: str, tokenizer, **overrides) -> transformers.PretrainedConfig:
    if kind == "llama":
        return transformers.LlamaConfig(**_base_kwargs(tokenizer, **overrides))
    if kind == "llama3":
        kw = dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        )
        kw.update(overrides)
        return transformers.LlamaConfig(**_base_kwargs(tokenizer, **kw))
    if kind == "llama_tied":
        kw = dict(tie_word_embeddings=True, num_key_value_heads=1)
        kw.update(overrides)
        return transformers.LlamaConfig(**_base_kwargs(tokenizer, **kw))
    if kind == "mistral":
        kw = dict(sliding_window=24)
        kw.update(overrides)
        return transformers.MistralConfig(**_base_kwargs(tokenizer, **kw))
    if kind == "qwen2":
        kw = dict(tie_word_embeddings=True)
        kw.update(overrides)
        return transformers.Qwen2Config(**_base_kwargs(tokenizer, **kw))
    raise ValueError(kind)


def build_tiny_model(path: str, kind: str = "llama", seed: int = 0, **overrides) -> str:
    """Saves a random `kind` model (safetensors) and its tokenizer into `path`; returns `path`."""
    tokenizer = build_tokenizer()
    config = make_config(kind, tokenizer, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init of this size gives near-uniform logits; widen them so greedy picks are clear.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path

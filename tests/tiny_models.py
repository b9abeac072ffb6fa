"""Tiny random models built from transformers configs, saved with a tokenizer, for tests.

Nothing here touches a model hub: the tokenizer is a byte-level BPE trained in-process on a few
sentences (with multi-byte text, so detokenizer tests have characters split across tokens), and
the weights are random with a fixed seed.
"""

from __future__ import annotations

import copy
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


# The tiny sizes every test model shares, and the names each kind of transformers config gives
# them. A naming leaves out the sizes its configs do not take (Bloom has no intermediate size or
# position limit of its own) or that its tests have always left to the config's default (the KV
# heads of every naming but Llama's).
TINY_SIZES = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, positions=512)
NAMINGS = {
    "llama": dict(
        hidden="hidden_size",
        intermediate="intermediate_size",
        layers="num_hidden_layers",
        heads="num_attention_heads",
        kv_heads="num_key_value_heads",
        positions="max_position_embeddings",
    ),
    # GPT-NeoX, OPT
    "neox": dict(
        hidden="hidden_size",
        intermediate="intermediate_size",
        layers="num_hidden_layers",
        heads="num_attention_heads",
        positions="max_position_embeddings",
    ),
    "falcon": dict(
        hidden="hidden_size",
        intermediate="ffn_hidden_size",
        layers="num_hidden_layers",
        heads="num_attention_heads",
        positions="max_position_embeddings",
    ),
    # GPT-2, GPT-BigCode, GPT-J
    "gpt2": dict(
        hidden="n_embd",
        intermediate="n_inner",
        layers="n_layer",
        heads="n_head",
        positions="n_positions",
    ),
    "bloom": dict(hidden="hidden_size", layers="n_layer", heads="n_head"),
    # MPT, DBRX
    "mpt": dict(hidden="d_model", layers="n_layers", heads="n_heads", positions="max_seq_len"),
}


def tiny_dims(tokenizer, naming: str = "llama", **overrides) -> dict:
    """A tiny config's keyword arguments: `TINY_SIZES` under the field names of `naming` (a key
    of `NAMINGS`), the tokenizer's vocabulary size and special ids, then `overrides` (any field,
    under the config's own name)."""
    kw = {field: TINY_SIZES[size] for size, field in NAMINGS[naming].items()}
    kw.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    kw.update(overrides)
    return kw


# kind -> (config class, its options over the tiny Llama sizes)
KINDS = {
    "llama": (transformers.LlamaConfig, {}),
    "llama3": (
        transformers.LlamaConfig,
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        ),
    ),
    "llama_tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=24)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
}


def make_config(kind: str, tokenizer, **overrides) -> transformers.PretrainedConfig:
    """The `kind` of `KINDS` at the tiny sizes, untied unless the kind ties, then `overrides`."""
    if kind not in KINDS:
        raise ValueError(kind)
    cls, options = KINDS[kind]
    options = copy.deepcopy(options)  # transformers edits the rope parameters it is given
    return cls(**tiny_dims(tokenizer, **{"tie_word_embeddings": False, **options, **overrides}))


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

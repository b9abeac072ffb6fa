"""Tiny random encoders (BERT, XLM-RoBERTa, their sequence-classification cross-encoders) built
from transformers configs and saved with a WordPiece tokenizer made in-process, for tests."""

from __future__ import annotations

import json
import os
import re

import torch
import transformers

from tests.tiny_models import CORPUS

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def build_wordpiece_tokenizer(path: str) -> transformers.PreTrainedTokenizerBase:
    """A BERT tokenizer over the corpus' lowercased words and characters (saved in `path`)."""
    text = " ".join(CORPUS).lower()
    words = sorted(set(re.findall(r"\w+", text)))
    chars = sorted(set(re.sub(r"\s", "", text)))
    vocab = SPECIALS + chars + [f"##{c}" for c in chars] + [w for w in words if len(w) > 1]
    os.makedirs(path, exist_ok=True)
    ids = {w: i for i, w in enumerate(dict.fromkeys(vocab))}
    tok = transformers.BertTokenizer(vocab=ids, do_lower_case=True)
    assert len(tok) == len(ids)
    tok.save_pretrained(path)
    return tok


CONFIGS = {
    "bert": (transformers.BertConfig, transformers.BertModel),
    "bert-cls": (transformers.BertConfig, transformers.BertForSequenceClassification),
    "xlmr": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel),
    "xlmr-cls": (transformers.XLMRobertaConfig, transformers.XLMRobertaForSequenceClassification),
    "nomic": (transformers.NomicBertConfig, transformers.NomicBertModel),
    "nomic-cls": (transformers.NomicBertConfig, transformers.NomicBertForSequenceClassification),
    "jina": (transformers.JinaEmbeddingsV3Config, transformers.JinaEmbeddingsV3Model),
    "jina-cls": (
        transformers.JinaEmbeddingsV3Config,
        transformers.JinaEmbeddingsV3ForSequenceClassification,
    ),
    "modernbert": (transformers.ModernBertConfig, transformers.ModernBertModel),
    "modernbert-cls": (
        transformers.ModernBertConfig,
        transformers.ModernBertForSequenceClassification,
    ),
}


def build_tiny_encoder(path: str, kind: str = "bert", seed: int = 0, **overrides) -> str:
    """A random `kind` encoder (CONFIGS) of 2 layers, width 64, saved with its tokenizer."""
    tok = build_wordpiece_tokenizer(path)
    config_cls, model_cls = CONFIGS[kind]
    dims = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        pad_token_id=tok.pad_token_id,
        hidden_act="gelu",
    )
    if kind.startswith(("xlmr", "jina")):
        dims.update(type_vocab_size=1, max_position_embeddings=130)
    if kind.startswith("nomic"):
        dims.update(hidden_act="silu")
    if kind.startswith("modernbert"):  # 3 layers: global, local, local (window 4 each side)
        del dims["hidden_act"]
        dims.update(
            num_hidden_layers=3,
            hidden_activation="gelu",
            local_attention=8,
            global_attn_every_n_layers=3,
            cls_token_id=tok.cls_token_id,
            sep_token_id=tok.sep_token_id,
            bos_token_id=tok.cls_token_id,
            eos_token_id=tok.sep_token_id,
        )
    if kind.endswith("-cls"):
        dims.update(num_labels=1)
    dims.update(overrides)
    config = config_cls(**dims)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # LayerNorms away from 1/0, so a wrong norm shows
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


def sentence_transformers_files(path: str, mode: str, normalize: bool, dim: int = 64) -> None:
    """modules.json + 1_Pooling/config.json of a sentence-transformers repo (mode: cls, mean,
    last)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        key = {"cls": "cls_token", "mean": "mean_tokens", "last": "lasttoken"}[mode]
        json.dump({"word_embedding_dimension": dim, f"pooling_mode_{key}": True}, f)

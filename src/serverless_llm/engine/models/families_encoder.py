"""Encoder families: a transformers config -> `EncoderSpec` (models/encoder.py), with the map
from the checkpoint's tensor names. BERT (all-MiniLM, bge, e5) and XLM-RoBERTa (bge-m3's dense
embeddings) as base models, and their ...ForSequenceClassification cross-encoders (ms-marco
MiniLM, bge-reranker)."""

from __future__ import annotations

from .encoder import BERT_RULES, EncoderNames, EncoderSpec

# Tensors of heads the engine does not run: the masked-LM head, position-id buffers.
IGNORED = ("embeddings.position_ids", "cls.predictions", "cls.seq_relationship", "lm_head.")


def _common(config, classifier: str | None) -> dict:
    act = config.hidden_act
    if not isinstance(act, str):
        raise ValueError(f"hidden_act {act!r} is not a named activation")
    return dict(
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        max_positions=config.max_position_embeddings,
        eps=config.layer_norm_eps,
        act=act,
        type_vocab_size=getattr(config, "type_vocab_size", 0) or 0,
        classifier=classifier,
        num_labels=config.num_labels if classifier else 0,
    )


def _check(config) -> None:
    kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise ValueError(f"position_embedding_type={kind!r} (only absolute is served)")
    if getattr(config, "is_decoder", False):
        raise ValueError("is_decoder=True: a causal BERT is not served")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError("hidden_size is not a multiple of num_attention_heads")


def bert(config, classifier: str | None = None) -> EncoderSpec:
    _check(config)
    names = EncoderNames(("bert.",), BERT_RULES, IGNORED)
    return EncoderSpec(**_common(config, classifier), names=names)


def xlm_roberta(config, classifier: str | None = None) -> EncoderSpec:
    _check(config)
    names = EncoderNames(("roberta.",), BERT_RULES, IGNORED)
    return EncoderSpec(**_common(config, classifier), position_pad=config.pad_token_id, names=names)


ENCODER_FAMILIES = {
    "BertModel": bert,
    "BertForSequenceClassification": lambda c: bert(c, "bert"),
    "XLMRobertaModel": xlm_roberta,
    "XLMRobertaForSequenceClassification": lambda c: xlm_roberta(c, "roberta"),
    "RobertaModel": xlm_roberta,
    "RobertaForSequenceClassification": lambda c: xlm_roberta(c, "roberta"),
}


def describe_encoder(config) -> EncoderSpec | None:
    """The encoder description of the first architecture in `config.architectures` that an
    encoder family serves; None when none is an encoder."""
    for arch in getattr(config, "architectures", None) or []:
        if arch in ENCODER_FAMILIES:
            spec = ENCODER_FAMILIES[arch](config)
            object.__setattr__(spec, "arch", arch)
            return spec
    return None

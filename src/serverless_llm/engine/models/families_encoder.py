"""Encoder families: a transformers config -> `EncoderSpec` (models/encoder.py), with the map
from the checkpoint's tensor names. BERT (all-MiniLM, bge, e5), XLM-RoBERTa (bge-m3's dense
embeddings), ModernBERT and NomicBERT (nomic-embed-text) as base models, and their ...ForSequenceClassification
cross-encoders (ms-marco MiniLM, bge-reranker, ModernBERT rerankers)."""

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


MODERNBERT_RULES = [
    (r"^embeddings\.tok_embeddings\.", "embed_tokens."),
    (r"^embeddings\.norm\.", "embed_norm."),
    (r"^layers\.(\d+)\.attn_norm\.", r"layers.\1.attn_norm."),
    (r"^layers\.(\d+)\.attn\.Wqkv\.", r"layers.\1.qkv."),
    (r"^layers\.(\d+)\.attn\.Wo\.", r"layers.\1.o_proj."),
    (r"^layers\.(\d+)\.mlp_norm\.", r"layers.\1.mlp_norm."),
    (r"^layers\.(\d+)\.mlp\.Wi\.", r"layers.\1.up."),
    (r"^layers\.(\d+)\.mlp\.Wo\.", r"layers.\1.down."),
    (r"^final_norm\.", "final_norm."),
    (r"^head\.dense\.", "head_dense."),
    (r"^head\.norm\.", "head_norm."),
    (r"^classifier\.", "classifier."),
]


def modernbert(config, classifier: str | None = None) -> EncoderSpec:
    """ModernBERT: pre-LayerNorm, rotary (a base per layer type), GeGLU, local layers with a
    bidirectional window of local_attention // 2 either side, a final norm."""
    if config.hidden_size % config.num_attention_heads:
        raise ValueError("hidden_size is not a multiple of num_attention_heads")
    for kind, params in (config.rope_parameters or {}).items():
        if params and params.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {params.get('rope_type')!r} ({kind}) is not served")
    if bool(config.attention_bias) != bool(config.mlp_bias):
        raise ValueError("attention_bias and mlp_bias differ")
    types = list(config.layer_types)
    thetas = tuple(float(config.rope_parameters[t]["rope_theta"]) for t in types)
    half = config.local_attention // 2
    windows = tuple(half + 1 if t == "sliding_attention" else None for t in types)
    pooling = getattr(config, "classifier_pooling", "cls")
    if classifier and pooling not in ("cls", "mean"):
        raise ValueError(f"classifier_pooling={pooling!r}")
    names = EncoderNames(
        ("model.",), MODERNBERT_RULES, ("decoder.",) if classifier else ("decoder.", "head.")
    )
    return EncoderSpec(
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        max_positions=config.max_position_embeddings,
        eps=config.norm_eps,
        act=config.hidden_activation,
        type_vocab_size=0,
        classifier=classifier,
        num_labels=config.num_labels if classifier else 0,
        names=names,
        pre_norm=True,
        rope_thetas=thetas,
        gated_mlp=True,
        linear_bias=bool(config.attention_bias),
        norm_bias=bool(config.norm_bias),
        windows=windows,
        head_pooling=pooling,
        head_act=getattr(config, "classifier_activation", "gelu"),
        head_bias=bool(getattr(config, "classifier_bias", False)),
    )


NOMIC_RULES = [
    (r"^embeddings\.word_embeddings\.", "embed_tokens."),
    (r"^embeddings\.token_type_embeddings\.", "embed_types."),
    (r"^embeddings\.LayerNorm\.", "embed_norm."),
    (r"^layers\.(\d+)\.self_attn\.q_proj\.", r"layers.\1.qkv.query."),
    (r"^layers\.(\d+)\.self_attn\.k_proj\.", r"layers.\1.qkv.key."),
    (r"^layers\.(\d+)\.self_attn\.v_proj\.", r"layers.\1.qkv.value."),
    (r"^layers\.(\d+)\.self_attn\.o_proj\.", r"layers.\1.o_proj."),
    (r"^layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.attn_norm."),
    (r"^layers\.(\d+)\.mlp\.gate_proj\.", r"layers.\1.up.act."),
    (r"^layers\.(\d+)\.mlp\.up_proj\.", r"layers.\1.up.gate."),
    (r"^layers\.(\d+)\.mlp\.down_proj\.", r"layers.\1.down."),
    (r"^layers\.(\d+)\.post_mlp_layernorm\.", r"layers.\1.mlp_norm."),
    (r"^pooler\.dense\.", "head_dense."),
    (r"^classifier\.", "classifier."),
    # nomic-ai's own names (what its checkpoints hold, and transformers saves back)
    (r"^emb_ln\.", "embed_norm."),
    (r"^encoder\.layers\.(\d+)\.attn\.Wqkv\.", r"layers.\1.qkv."),
    (r"^encoder\.layers\.(\d+)\.attn\.out_proj\.", r"layers.\1.o_proj."),
    (r"^encoder\.layers\.(\d+)\.mlp\.fc11\.", r"layers.\1.up.gate."),
    (r"^encoder\.layers\.(\d+)\.mlp\.fc12\.", r"layers.\1.up.act."),
    (r"^encoder\.layers\.(\d+)\.mlp\.fc2\.", r"layers.\1.down."),
    (r"^encoder\.layers\.(\d+)\.norm1\.", r"layers.\1.attn_norm."),
    (r"^encoder\.layers\.(\d+)\.norm2\.", r"layers.\1.mlp_norm."),
]


def nomic_bert(config, classifier: str | None = None) -> EncoderSpec:
    """NomicBERT (nomic-embed-text) as transformers has it: BERT's post-LayerNorm layers with
    token types, rotary positions over the whole head instead of a position table, bias-free
    q/k/v/o, and a SwiGLU MLP (act(gate) * up)."""
    if config.hidden_size % config.num_attention_heads:
        raise ValueError("hidden_size is not a multiple of num_attention_heads")
    head_dim = getattr(config, "head_dim", None)
    if head_dim not in (None, config.hidden_size // config.num_attention_heads):
        raise ValueError(f"head_dim={head_dim} with hidden_size / heads differing")
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope.get('rope_type')!r} is not served")
    names = EncoderNames(("nomic_bert.",), NOMIC_RULES, IGNORED)
    common = _common(config, classifier)
    return EncoderSpec(
        **common,
        names=names,
        rope_thetas=(float(rope.get("rope_theta", 10000.0)),) * config.num_hidden_layers,
        gated_mlp=True,
        linear_bias=False,
    )


ENCODER_FAMILIES = {
    "NomicBertModel": nomic_bert,
    "NomicBertForSequenceClassification": lambda c: nomic_bert(c, "bert"),
    "ModernBertModel": modernbert,
    "ModernBertForSequenceClassification": lambda c: modernbert(c, "modernbert"),
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

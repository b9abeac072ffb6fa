"""Encoder families: a transformers config -> `EncoderSpec` (models/encoder.py), with the map
from the checkpoint's tensor names. BERT (all-MiniLM, bge, e5), XLM-RoBERTa (bge-m3's dense
embeddings), ModernBERT, NomicBERT (nomic-embed-text) and gte's NewModel (gte-base-en-v1.5,
gte-multilingual-base) as base models, and their ...ForSequenceClassification cross-encoders
(ms-marco MiniLM, bge-reranker, ModernBERT rerankers, gte-multilingual-reranker)."""

from __future__ import annotations

from ..config import ConfigError
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


# transformers' names for the rotary encoders (NomicBert, JinaEmbeddingsV3): embeddings and
# attention, the same in both; each family's own rules follow.
ROTARY_ENCODER_RULES = [
    (r"^embeddings\.word_embeddings\.", "embed_tokens."),
    (r"^embeddings\.token_type_embeddings\.", "embed_types."),
    (r"^embeddings\.LayerNorm\.", "embed_norm."),
    (r"^layers\.(\d+)\.self_attn\.q_proj\.", r"layers.\1.qkv.query."),
    (r"^layers\.(\d+)\.self_attn\.k_proj\.", r"layers.\1.qkv.key."),
    (r"^layers\.(\d+)\.self_attn\.v_proj\.", r"layers.\1.qkv.value."),
    (r"^layers\.(\d+)\.self_attn\.o_proj\.", r"layers.\1.o_proj."),
    (r"^layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.attn_norm."),
]


NOMIC_RULES = ROTARY_ENCODER_RULES + [
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


GTE_RULES = [
    (r"^embeddings\.word_embeddings\.", "embed_tokens."),
    (r"^embeddings\.position_embeddings\.", "embed_positions."),
    (r"^embeddings\.token_type_embeddings\.", "embed_types."),
    (r"^embeddings\.LayerNorm\.", "embed_norm."),
    (r"^encoder\.layer\.(\d+)\.attention\.qkv_proj\.", r"layers.\1.qkv."),
    (r"^encoder\.layer\.(\d+)\.attention\.q_proj\.", r"layers.\1.qkv.query."),
    (r"^encoder\.layer\.(\d+)\.attention\.k_proj\.", r"layers.\1.qkv.key."),
    (r"^encoder\.layer\.(\d+)\.attention\.v_proj\.", r"layers.\1.qkv.value."),
    (r"^encoder\.layer\.(\d+)\.attention\.o_proj\.", r"layers.\1.o_proj."),
    (r"^encoder\.layer\.(\d+)\.attn_ln\.", r"layers.\1.attn_norm."),
    (r"^encoder\.layer\.(\d+)\.mlp\.up_gate_proj\.", r"layers.\1.up."),
    (r"^encoder\.layer\.(\d+)\.mlp\.down_proj\.", r"layers.\1.down."),
    (r"^encoder\.layer\.(\d+)\.mlp_ln\.", r"layers.\1.mlp_norm."),
    (r"^pooler\.dense\.", "head_dense."),
    (r"^classifier\.", "classifier."),
]


def gte(config, classifier: str | None = None) -> EncoderSpec:
    """Alibaba's gte "NewModel" layout (gte-base-en-v1.5, gte-multilingual-base; its code lives
    in the checkpoints' repositories, read here as a described shape, never run):
    post-LayerNorm layers as BERT's (attn_ln, mlp_ln), a packed or separate q/k/v projection,
    rotary positions over the whole head (`position_embedding_type` "rope", NTK scaling from
    `rope_scaling` {"type": "ntk", "factor", "mixed_b"}) or an absolute table, a gated MLP
    whose `up_gate_proj` (no bias) holds [up | gate] with the activation on the gate, and for
    ...ForSequenceClassification BERT's pooler (dense + tanh on the first token) then the
    classifier. The checkpoint's unpadding and memory-efficient attention switches are how
    its own code batches; the engine's ragged steps need neither. Refused: logn attention
    scaling, RMSNorm layers, rope scaling other than NTK."""
    if config.hidden_size % config.num_attention_heads:
        raise ValueError("hidden_size is not a multiple of num_attention_heads")
    if getattr(config, "logn_attention_scale", False):
        raise ValueError("logn_attention_scale=True (a length-dependent query scale) is not served")
    norm = getattr(config, "layer_norm_type", "layer_norm") or "layer_norm"
    if norm != "layer_norm":
        raise ValueError(f"layer_norm_type={norm!r} (only layer_norm is served)")
    kind = getattr(config, "position_embedding_type", "rope") or "rope"
    if kind not in ("rope", "absolute"):
        raise ValueError(f"position_embedding_type={kind!r} (rope or absolute are served)")
    # transformers 5 folds rope_theta and rope_scaling into rope_parameters (one dict, with
    # "rope_type"); older releases keep them apart.
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or params
    ntk = mixed_b = None
    stype = scaling.get("rope_type", scaling.get("type")) if kind == "rope" else None
    if stype not in (None, "default"):
        if stype != "ntk":
            raise ValueError(f"rope_scaling type {stype!r} (only ntk is served)")
        ntk = float(scaling["factor"])
        mixed_b = scaling.get("mixed_b")
        mixed_b = None if mixed_b is None else float(mixed_b)
    common = _common(config, classifier)
    thetas = None
    if kind == "rope":
        theta = getattr(config, "rope_theta", None) or params.get("rope_theta") or 10000.0
        thetas = (float(theta),) * config.num_hidden_layers
    names = EncoderNames(("new.",), GTE_RULES, IGNORED, swap_up_halves=True)
    return EncoderSpec(
        **common,
        names=names,
        rope_thetas=thetas,
        gated_mlp=True,
        up_bias=False,
        rope_ntk=ntk,
        rope_mixed_b=mixed_b,
    )


JINA_RULES = ROTARY_ENCODER_RULES + [
    (r"^layers\.(\d+)\.mlp\.fc1\.", r"layers.\1.up."),
    (r"^layers\.(\d+)\.mlp\.fc2\.", r"layers.\1.down."),
    (r"^layers\.(\d+)\.post_mlp_layernorm\.", r"layers.\1.mlp_norm."),
    (r"^pooler\.dense\.", "head_dense."),
    (r"^classifier\.dense\.", "head_dense."),
    (r"^classifier\.out_proj\.", "classifier."),
    # jina's own names (what its checkpoints hold, and transformers saves back)
    (r"^emb_ln\.", "embed_norm."),
    (r"^encoder\.layers\.(\d+)\.mixer\.Wqkv\.", r"layers.\1.qkv."),
    (r"^encoder\.layers\.(\d+)\.mixer\.out_proj\.", r"layers.\1.o_proj."),
    (r"^encoder\.layers\.(\d+)\.mlp\.fc1\.", r"layers.\1.up."),
    (r"^encoder\.layers\.(\d+)\.mlp\.fc2\.", r"layers.\1.down."),
    (r"^encoder\.layers\.(\d+)\.norm1\.", r"layers.\1.attn_norm."),
    (r"^encoder\.layers\.(\d+)\.norm2\.", r"layers.\1.mlp_norm."),
]


def jina_v3(config, classifier: str | None = None) -> EncoderSpec:
    """JinaEmbeddingsV3 as transformers ships it (jina-embeddings-v3's backbone): XLM-R's
    post-LayerNorm layers and token types, rotary positions from 0 over the whole head instead
    of a position table, biased q/k/v/o, a plain fc1 -> act -> fc2 MLP. The checkpoint's own
    remote-code layout (XLMRobertaLoRA, with its per-task LoRA adapters) is refused:
    `REFUSED_ARCHITECTURES`."""
    if config.hidden_size % config.num_attention_heads:
        raise ValueError("hidden_size is not a multiple of num_attention_heads")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope.get('rope_type')!r} is not served")
    names = EncoderNames(("roberta.", "jina_embeddings_v3.", "model."), JINA_RULES, IGNORED)
    theta = float(rope.get("rope_theta", 10000.0))
    return EncoderSpec(
        **_common(config, classifier),
        names=names,
        rope_thetas=(theta,) * config.num_hidden_layers,
    )


# Architectures named in checkpoints whose layout is not served, and why (a ConfigError at
# start says so, instead of the generic unsupported-architecture list).
REFUSED_ARCHITECTURES = {
    "XLMRobertaLoRA": (
        "jina-embeddings-v3's own remote code (XLMRobertaLoRA) is not served: its checkpoint "
        "holds per-task LoRA adapters on XLM-RoBERTa (retrieval.query, retrieval.passage, "
        "separation, classification, text-matching), chosen per request by a task id this "
        "engine's pooling requests do not carry. Serve a JinaEmbeddingsV3Model checkpoint "
        '(transformers\' port, architectures ["JinaEmbeddingsV3Model"]) instead'
    ),
}


ENCODER_FAMILIES = {
    "GteModel": gte,  # transformers' port of NewModel: the same tensor names
    "JinaEmbeddingsV3Model": jina_v3,
    "JinaEmbeddingsV3ForSequenceClassification": lambda c: jina_v3(c, "roberta"),
    "NewModel": gte,
    "NewForSequenceClassification": lambda c: gte(c, "bert"),
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
        if arch in REFUSED_ARCHITECTURES:
            raise ConfigError(f"{arch}: {REFUSED_ARCHITECTURES[arch]}")
        if arch in ENCODER_FAMILIES:
            spec = ENCODER_FAMILIES[arch](config)
            object.__setattr__(spec, "arch", arch)
            return spec
    return None

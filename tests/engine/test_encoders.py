"""Bidirectional encoders (models/encoder.py): tiny random BERT / XLM-RoBERTa checkpoints and
their sequence-classification cross-encoders against transformers, over a ragged batch."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers

from serverless_llm.engine.config import ConfigError, EngineConfig
from serverless_llm.engine.errors import InvalidRequestError
from serverless_llm.engine.kernels.metadata import AttentionMetadata
from serverless_llm.engine.model_builder import load_model
from serverless_llm.llm import LLM
from tests.tiny_encoders import build_tiny_encoder, sentence_transformers_files
from tests.tiny_models import CORPUS

TEXTS = [CORPUS[0], "hello", CORPUS[2] + " " + CORPUS[7], CORPUS[1]]


def _meta(lens: list[int]) -> AttentionMetadata:
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    t = torch.tensor(lens, dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=t,
        context_lens=torch.zeros_like(t),
        block_tables=torch.zeros(len(lens), 0, dtype=torch.int32),
        slot_mapping=torch.empty(0, dtype=torch.int64),
        num_decodes=0,
        max_query_len=max(lens),
        max_seq_len=max(lens),
        query_lens_host=lens,
        seq_lens_host=lens,
    )


def _ragged_forward(model, ids: list[list[int]]) -> list[torch.Tensor]:
    flat = torch.tensor([t for x in ids for t in x])
    pos = torch.tensor([p for x in ids for p in range(len(x))])
    with torch.inference_mode():
        hidden = model(flat, pos, [None] * model.num_layers, _meta([len(x) for x in ids]))
    return list(hidden.split([len(x) for x in ids]))


@pytest.fixture(scope="module", params=["bert", "xlmr", "modernbert", "nomic", "jina"])
def encoder(request, tmp_path_factory):
    return request.param, build_tiny_encoder(
        str(tmp_path_factory.mktemp(request.param)), request.param
    )


def test_hidden_states_equal_transformers(encoder):
    kind, path = encoder
    loaded = load_model(EngineConfig(model=path, dtype="float32"))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    ours = _ragged_forward(loaded.model, ids)
    ref_model = transformers.AutoModel.from_pretrained(path).eval()
    for x, got in zip(ids, ours):
        with torch.no_grad():
            want = ref_model(torch.tensor([x])).last_hidden_state[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "kind", ["bert-cls", "xlmr-cls", "modernbert-cls", "nomic-cls", "jina-cls"]
)
def test_cross_encoder_logits_equal_transformers(kind, tmp_path):
    path = build_tiny_encoder(str(tmp_path / kind), kind, num_labels=3)
    loaded = load_model(EngineConfig(model=path, dtype="float32"))
    model = loaded.model
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model.sep_token_id = tok.sep_token_id
    pairs = [(TEXTS[0], TEXTS[2]), ("hello", "world"), (TEXTS[3], TEXTS[1])]
    enc = [tok(q, d) for q, d in pairs]
    assert kind[:4] not in ("bert", "nomi") or any(1 in e["token_type_ids"] for e in enc)
    ids = [e["input_ids"] for e in enc]
    hidden = _ragged_forward(model, ids)
    assert model.num_labels == 3 and model.classifier_pooling == "cls"
    # (ModernBERT's head reads the CLS row by default, as its config's classifier_pooling)
    with torch.no_grad():
        ours = model.classify(torch.stack([h[0] for h in hidden]))
    ref_model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    for e, got in zip(enc, ours):
        if kind[:4] in ("xlmr", "mode", "jina"):  # one token type: no type ids from them
            e = {k: v for k, v in e.items() if k != "token_type_ids"}
        with torch.no_grad():
            want = ref_model(**{k: torch.tensor([v]) for k, v in e.items()}).logits[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# -- through the engine (LLM.embed / classify / score) ---------------------------------------


def _reference_pooled(path: str, texts, mode: str, normalize: bool) -> list[torch.Tensor]:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ref = transformers.AutoModel.from_pretrained(path).eval()
    out = []
    for t in texts:
        with torch.no_grad():
            h = ref(**tok(t, return_tensors="pt")).last_hidden_state[0]
        vec = {"cls": h[0], "mean": h.mean(0), "last": h[-1]}[mode]
        out.append(F.normalize(vec, dim=-1) if normalize else vec)
    return out


MANY = [CORPUS[i % len(CORPUS)] * (1 + i % 3) for i in range(11)] + ["a", TEXTS[2]]


@pytest.mark.parametrize(
    "layout", [None, ("cls", True), ("mean", True), ("mean", False), ("last", True)]
)
def test_llm_embed_equals_transformers_pooled(encoder, tmp_path, layout):
    """A ragged batch through LLM.embed (several requests a step, whole prompts) equals
    transformers' last hidden state pooled as the sentence-transformers files say (CLS,
    normalised, without them); TASK auto serves an encoder for embeddings."""
    kind, src = encoder
    path = str(tmp_path / "m")
    shutil.copytree(src, path)
    if layout is not None:
        sentence_transformers_files(path, *layout)
    mode, normalize = layout or ("cls", True)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=160)
    assert llm.engine.task == "embed" and llm.engine.pooling.pooling_type == mode
    outs = llm.embed(MANY)
    want = _reference_pooled(path, MANY, mode, normalize)
    for out, w in zip(outs, want):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), w, atol=1e-4, rtol=1e-4)
    assert not llm.engine.requests and not llm.engine.scheduler.running


def test_encoder_refuses_generation(encoder):
    _, path = encoder
    with pytest.raises(ConfigError, match="encoder .*cannot generate"):
        LLM(path, task="generate", dtype="float32")
    llm = LLM(path, dtype="float32")
    with pytest.raises(InvalidRequestError, match="generation is off"):
        llm.generate("hello")


def test_encoder_over_long_input_is_refused_or_truncated(encoder):
    _, path = encoder
    llm = LLM(path, dtype="float32", max_model_len=32)
    long_text = " ".join(CORPUS)
    with pytest.raises(InvalidRequestError, match="32"):
        llm.embed(long_text)
    (out,) = llm.embed(long_text, truncate_prompt_tokens=16)
    assert len(out.prompt_token_ids) == 16
    with pytest.raises(ConfigError, match="exceeds the encoder's maximum length"):
        LLM(path, dtype="float32", max_model_len=1000)


@pytest.mark.parametrize(
    "kind", ["bert-cls", "xlmr-cls", "modernbert-cls", "nomic-cls", "jina-cls"]
)
def test_cross_encoder_score_and_classify_equal_transformers(kind, tmp_path):
    path = build_tiny_encoder(str(tmp_path / kind), kind)
    llm = LLM(path, dtype="float32")
    assert llm.engine.task == "classify"
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    docs = [TEXTS[0], TEXTS[2], "world", TEXTS[3]]
    outs = llm.score("hello there", docs)
    for doc, out in zip(docs, outs):
        enc = tok("hello there", doc, return_tensors="pt")
        if kind[:4] in ("xlmr", "mode", "jina"):
            enc.pop("token_type_ids", None)
        with torch.no_grad():
            logit = ref(**enc).logits[0, 0]
        assert abs(out.outputs.score - torch.sigmoid(logit).item()) < 1e-5


def test_unsupported_architecture_lists_the_encoders():
    from serverless_llm.engine.models.registry import UnsupportedModelError, describe_model

    config = transformers.BertConfig(architectures=["MysteryEncoderModel"])
    with pytest.raises(UnsupportedModelError, match="BertModel.*ModernBertModel.*NomicBertModel"):
        describe_model(config)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu"])
def test_activation_fused_into_a_packed_linear(act):
    """layers/linear.py's post-op: oneDNN's packed linear applying the activation as it writes
    equals the activation after F.linear; an unpacked linear takes the fallback."""
    from serverless_llm.engine.layers.linear import (
        PackedLinear,
        linear_act,
        packed_act_works,
        packed_ops_work,
    )

    assert packed_ops_work() and packed_act_works(act)
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(24, 40)
    x = torch.randn(9, 24, generator=g)
    ref = {"gelu": F.gelu, "relu": F.relu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
    with torch.no_grad():
        want = ref[act](lin(x))
        torch.testing.assert_close(linear_act(PackedLinear(lin), x, act, ref[act]), want)
        torch.testing.assert_close(linear_act(lin, x, act, ref[act]), want)


def test_bert_encoder_fuses_its_gelu_on_cpu(encoder):
    """A float32 BERT-family encoder on CPU runs its (ungated) GELU inside the up projection;
    gated MLPs (ModernBERT, NomicBERT) keep theirs apart. The outputs are what
    test_hidden_states_equal_transformers checks."""
    kind, path = encoder
    model = load_model(EngineConfig(model=path, dtype="float32")).model
    fused = model.fused_act
    assert fused == (None if kind in ("modernbert", "nomic") else "gelu")

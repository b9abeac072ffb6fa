"""Classify and score pooling requests (issue 41): decoder `...ForSequenceClassification`
checkpoints equal transformers' logits; a causal LM served with task="score" follows
Qwen3-Reranker's recipe (its prompt, then softmax over the "no"/"yes" logits at the last
position); Qwen3-Embedding's instruction form equals transformers plus last-token pooling."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import transformers

from serverless_llm.engine.config import ConfigError
from serverless_llm.engine.pooling import (
    RERANKER_INSTRUCTION,
    RERANKER_PREFIX,
    RERANKER_SUFFIX,
    instructed_text,
    score_pairs,
)
from serverless_llm.llm import LLM
from tests.tiny_scorers import build_classifier, build_reranker, save_tiny, tiny_config

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello",
    "Paged attention stores keys and values in fixed-size blocks. " * 3,
    "Café, naïve, résumé",
]
MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory):
    root = tmp_path_factory.mktemp("classifiers")
    return {
        "qwen3": build_classifier(str(root / "qwen3"), "qwen3", 3),
        "llama": build_classifier(str(root / "llama"), "llama", 2),
        "cross": build_classifier(str(root / "cross"), "qwen3", 1),
    }


def _hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_classifier_equals_transformers_logits(classifiers, kind):
    path = classifiers[kind]
    llm = LLM(
        path,
        dtype="float32",
        num_kv_blocks=48,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=24,  # the long text is prefilled in chunks, next to the others
    )
    assert llm.engine.task == "classify"  # auto, from the architecture
    assert llm.engine.labels == [f"class_{i}" for i in range(llm.engine.pooling_head.num_labels)]
    outs = llm.classify(TEXTS)  # one ragged batch
    tok = llm.get_tokenizer()
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32
    ).eval()
    for text, out in zip(TEXTS, outs):
        ids = list(tok.encode(text))
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        probs = np.asarray(out.outputs.probs)
        assert out.outputs.num_classes == logits.numel()
        np.testing.assert_allclose(probs, torch.softmax(logits, -1).numpy(), atol=1e-5)
        # the logits themselves, up to the constant softmax drops
        ours = np.log(probs) - np.log(probs[0])
        theirs = (logits - logits[0]).numpy()
        np.testing.assert_allclose(ours, theirs, atol=1e-4)
    pool = llm.engine.block_pool
    assert pool.num_free == pool.num_blocks and not llm.engine.requests
    with pytest.raises(ValueError, match="generation is off"):
        llm.generate("hi")
    with pytest.raises(ValueError, match="one-label head"):
        llm.score("a", "b")


def test_one_label_cross_encoder_scores_pairs(classifiers):
    path = classifiers["cross"]
    llm = LLM(path, task="score", dtype="float32", num_kv_blocks=32, max_model_len=256)
    tok = llm.get_tokenizer()
    outs = llm.score("What is paged attention?", TEXTS[:3])
    for doc, out in zip(TEXTS[:3], outs):
        ids = list(tok("What is paged attention?", doc)["input_ids"])
        assert out.prompt_token_ids == ids
        logit = _hf_logits(path, ids)
        assert abs(out.outputs.score - torch.sigmoid(logit)[0].item()) < 1e-5


def test_score_pairs():
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q1", "q2"], ["a", "b"]) == [("q1", "a"), ("q2", "b")]
    assert score_pairs("q", "a") == [("q", "a")]
    with pytest.raises(ValueError, match="2 texts and text_2 3"):
        score_pairs(["q1", "q2"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="at least one"):
        score_pairs("q", [])


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """A tiny Qwen3ForCausalLM whose tokenizer has "yes" and "no" tokens, as Qwen3-Reranker's."""
    return build_reranker(str(tmp_path_factory.mktemp("reranker")))


def _recipe_score(model, tok, query: str, doc: str, instruction: str) -> tuple[list[int], float]:
    """Qwen3-Reranker's model card, computed by hand: the prompt's ids and P(yes)."""
    body = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
    ids = (
        tok.encode(RERANKER_PREFIX, add_special_tokens=False)
        + tok.encode(body, add_special_tokens=False)
        + tok.encode(RERANKER_SUFFIX, add_special_tokens=False)
    )
    with torch.no_grad():
        last = model(torch.tensor([ids])).logits[0, -1]
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    pair = torch.stack([last[no], last[yes]])
    return ids, torch.softmax(pair, -1)[1].item()


def test_qwen3_reranker_recipe(reranker):
    llm = LLM(reranker, task="score", dtype="float32", num_kv_blocks=64, max_model_len=512)
    tok = llm.get_tokenizer()
    model = transformers.AutoModelForCausalLM.from_pretrained(reranker, dtype=torch.float32).eval()
    docs = TEXTS
    outs = llm.score("What is paged attention?", docs)
    for doc, out in zip(docs, outs):
        ids, want = _recipe_score(model, tok, "What is paged attention?", doc, RERANKER_INSTRUCTION)
        assert out.prompt_token_ids == ids
        assert abs(out.outputs.score - want) < 1e-5
    paired = llm.score(["q1", "q2"], ["d1", "d2"], instruction="Find the matching code")
    for (q, d), out in zip([("q1", "d1"), ("q2", "d2")], paired):
        _, want = _recipe_score(model, tok, q, d, "Find the matching code")
        assert abs(out.outputs.score - want) < 1e-5
    pool = llm.engine.block_pool
    assert pool.num_free == pool.num_blocks
    # The same pairs again: the template and query's blocks come from the prefix cache (only
    # the last row is read), with the same scores.
    hits = pool.hits
    again = llm.score("What is paged attention?", docs)
    assert pool.hits > hits
    for first, second in zip(outs, again):
        assert abs(first.outputs.score - second.outputs.score) < 1e-5
    assert pool.num_free == pool.num_blocks
    with pytest.raises(ValueError, match="generation is off"):
        llm.generate("hi")


def test_classify_refused_without_a_head(tiny_llama):
    with pytest.raises(ConfigError, match="no classifier head"):
        LLM(tiny_llama, task="classify", num_kv_blocks=16, max_model_len=64)
    llm = LLM(tiny_llama, task="embed", num_kv_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="no classifier head"):
        llm.classify("hello")
    with pytest.raises(ValueError, match="no classifier head"):
        llm.score("a", "b")


def test_score_needs_yes_and_no_tokens(tiny_llama):
    with pytest.raises(ConfigError, match="no token 'no'|no token 'yes'"):
        LLM(tiny_llama, task="score", num_kv_blocks=16, max_model_len=64)


def test_classifier_refuses_generate_task(classifiers):
    with pytest.raises(ConfigError, match="cannot generate"):
        LLM(classifiers["llama"], task="generate", num_kv_blocks=16, max_model_len=64)
    with pytest.raises(ConfigError, match="one-label head"):
        LLM(classifiers["llama"], task="score", num_kv_blocks=16, max_model_len=64)


def test_qwen3_embedding_instruction_and_prompt_name(tmp_path):
    """Qwen3-Embedding: "Instruct: <task>\\nQuery:<text>" then the last token's final hidden
    state, normalised; the same through config_sentence_transformers.json's named prompt."""
    path = save_tiny(str(tmp_path), tiny_config("qwen3"), transformers.Qwen3ForCausalLM)
    task = "Given a web search query, retrieve relevant passages that answer the query"
    with open(os.path.join(path, "config_sentence_transformers.json"), "w") as f:
        json.dump({"prompts": {"query": f"Instruct: {task}\nQuery:", "document": ""}}, f)
    llm = LLM(path, task="embed", dtype="float32", num_kv_blocks=32, max_model_len=MAX_MODEL_LEN)
    assert llm.engine.prompts["query"] == f"Instruct: {task}\nQuery:"
    hf = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    query = "What is paged attention?"
    text = instructed_text(query, task)
    assert text == llm.engine.prompts["query"] + query
    (out,) = llm.embed(text)
    ids = list(tok.encode(text))
    with torch.no_grad():
        last = hf(torch.tensor([ids])).last_hidden_state[0, -1]
    want = torch.nn.functional.normalize(last, dim=-1).numpy()
    np.testing.assert_allclose(out.outputs.embedding, want, atol=1e-5)


def test_vllm_hf_overrides_for_qwen3_reranker(reranker):
    """vLLM's documented way to serve Qwen3-Reranker: hf_overrides naming
    Qwen3ForSequenceClassification with classifier_from_token [no, yes] over the causal LM
    checkpoint; served here as the yes/no scorer (TASK auto: score), the same scores."""
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["no", "yes"],
        "is_original_qwen3_reranker": True,
    }
    llm = LLM(
        reranker, hf_overrides=overrides, dtype="float32", num_kv_blocks=64, max_model_len=512
    )
    assert llm.engine.task == "score"
    plain = LLM(reranker, task="score", dtype="float32", num_kv_blocks=64, max_model_len=512)
    a = llm.score("What is paged attention?", TEXTS[:2])
    b = plain.score("What is paged attention?", TEXTS[:2])
    for x, y in zip(a, b):
        assert abs(x.outputs.score - y.outputs.score) < 1e-6

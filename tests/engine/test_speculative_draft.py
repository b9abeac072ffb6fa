"""Speculative decoding with a draft model (draft_model.py): greedy output token for token what
decoding without it gives (16 prompts x 64 tokens, k = 1, 3, 7, chunked prefill, preemption),
the draft's KV in step with the accepted tokens (a draft that is the target itself has every
draft accepted), no block of either cache left behind after finished and aborted requests, and
a draft of another vocabulary or tokenizer refused at start."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import transformers

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine import speculative
from serverless_llm.engine.config import ConfigError, EngineConfig
from serverless_llm.engine.loader import ModelLoadError
from serverless_llm.engine.speculative import parse_speculative_config
from tests.tiny_models import build_tokenizer, make_config


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    """The backoff after poor drafts (speculative.py; tested in test_speculative.py) off: these
    tests count drafts verified and accepted."""
    monkeypatch.setattr(speculative, "BACKOFF_RATE", 0.0)


def _save(model, tok, path: str) -> str:
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """A 4-layer target whose last two layers add little (their output projections scaled
    down), and drafts: its first two layers plus its norm and head (a high acceptance rate);
    one of another vocabulary size; one whose tokenizer maps ids differently."""
    root = tmp_path_factory.mktemp("draft-models")
    tok = build_tokenizer()
    torch.manual_seed(0)
    target = transformers.AutoModelForCausalLM.from_config(
        make_config("llama", tok, num_hidden_layers=4), dtype=torch.float32
    )
    with torch.no_grad():
        for name, p in target.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
            if ("layers.2." in name or "layers.3." in name) and name.endswith(
                ("o_proj.weight", "down_proj.weight")
            ):
                p.mul_(0.15)
    out = {"target": _save(target, tok, str(root / "target"))}
    draft = transformers.AutoModelForCausalLM.from_config(
        make_config("llama", tok, num_hidden_layers=2), dtype=torch.float32
    )
    missing, _ = draft.load_state_dict(target.state_dict(), strict=False)
    assert not missing
    out["draft"] = _save(draft, tok, str(root / "draft"))
    wide = transformers.AutoModelForCausalLM.from_config(
        make_config("llama", tok, num_hidden_layers=1, vocab_size=len(tok) + 16),
        dtype=torch.float32,
    )
    out["wide"] = _save(wide, tok, str(root / "wide"))
    short = transformers.AutoModelForCausalLM.from_config(
        make_config("llama", tok, num_hidden_layers=1, max_position_embeddings=64),
        dtype=torch.float32,
    )
    out["short"] = _save(short, tok, str(root / "short"))
    other = _save(draft, tok, str(root / "other"))
    path = os.path.join(other, "tokenizer.json")
    with open(path) as f:
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    a, b = sorted(t for t, i in vocab.items() if i > 300)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids: same size, other ids
    with open(path, "w") as f:
        json.dump(spec, f)
    out["other"] = other
    return out


def draft(path: str, k: int) -> dict:
    # every batch size speculates (the off rule: test_speculative.py)
    return {
        "method": "draft_model",
        "model": path,
        "num_speculative_tokens": k,
        "disable_by_batch_size": None,
    }


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def prompts(n: int, seed: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 380) for _ in range(rng.randint(4, 40))] for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
BASE = dict(block_size=8, max_model_len=256, dtype="float32")


def no_blocks_held(llm: LLM) -> None:
    engine = llm.engine
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    drafter = engine.drafter
    assert drafter.pool.num_free == drafter.num_blocks
    assert not drafter.fed and not drafter.kv.owners()
    drafter.check()


@pytest.fixture(scope="module")
def plain_chunked(models) -> list[list[int]]:
    llm = LLM(models["target"], max_num_batched_tokens=24, **BASE)
    return tokens(llm.generate(prompts(16), GREEDY))


def test_config_parses_draft_model_and_vllm_spellings():
    spec = parse_speculative_config(
        '{"method": "draft_model", "model": "some/draft", "num_speculative_tokens": 3}'
    )
    assert (spec.method, spec.model, spec.num_speculative_tokens) == (
        "draft_model",
        "some/draft",
        3,
    )
    # vLLM's spelling: a model without a method is a draft model; tensor parallel size 1 is fine.
    spec = parse_speculative_config(
        {"model": "/d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}
    )
    assert (spec.method, spec.model) == ("draft_model", "/d")
    for bad, says in [
        ({"method": "draft_model", "num_speculative_tokens": 3}, "needs `model`"),
        ({"method": "draft_model", "model": "/d"}, "num_speculative_tokens=None"),
        (
            {"model": "/d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2},
            "draft_tensor_parallel_size=2",
        ),
        ({"method": "medusa", "model": "/d", "num_speculative_tokens": 3}, "'draft_model'"),
    ]:
        with pytest.raises(ConfigError, match=says):
            EngineConfig(speculative_config=bad)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_16_prompts_by_64_tokens_identical_under_chunked_prefill(models, plain_chunked, k):
    # A 24-token step budget: prompts are chunked in the target and caught up by the draft over
    # several steps, and drafts share what a step has left.
    spec = LLM(
        models["target"],
        max_num_batched_tokens=24,
        speculative_config=draft(models["draft"], k),
        **BASE,
    )
    assert tokens(spec.generate(prompts(16), GREEDY)) == plain_chunked
    stats = spec.engine.stats()
    assert stats.spec_drafts > 0
    # The first two layers of this target agree with it most of the time: at least half the
    # single drafts accepted, at least one draft a step on average with longer runs.
    assert stats.spec_accepted_tokens >= stats.spec_drafts * min(k, 2) / 2
    no_blocks_held(spec)


def test_the_target_as_its_own_draft_has_every_draft_accepted(models):
    """The draft's KV is the request's true prefix at every step (caught up, rolled back), so
    a draft that is the target itself proposes exactly what the target then picks."""
    spec = LLM(
        models["target"],
        max_num_batched_tokens=32,
        num_kv_blocks=40,
        max_model_len=128,
        block_size=8,
        dtype="float32",
        speculative_config=draft(models["target"], 3),
    )
    plain = LLM(models["target"], max_model_len=128, block_size=8, dtype="float32")
    ps = prompts(10, seed=7)
    want = tokens(plain.generate(ps, GREEDY))
    assert tokens(spec.generate(ps, GREEDY)) == want
    # Again: the target starts from cached prefixes, the draft (no prefix cache) from scratch.
    assert tokens(spec.generate(ps[:4], GREEDY)) == want[:4]
    stats = spec.engine.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.num_preemptions > 0  # preempted requests' draft caches are rebuilt too
    assert stats.spec_draft_tokens > 100
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    no_blocks_held(spec)


def test_preemption_identical_and_no_blocks_left(models):
    kw = dict(num_kv_blocks=24, max_model_len=96, block_size=8, dtype="float32")
    plain = LLM(models["target"], **kw)
    spec = LLM(models["target"], speculative_config=draft(models["draft"], 3), **kw)
    ps = [p[:40] for p in prompts(10, seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = tokens(plain.generate(ps, params))
    assert tokens(spec.generate(ps, params)) == want
    stats = spec.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_accepted_tokens > 0
    no_blocks_held(spec)
    # The split: with num_kv_blocks each cache holds that many blocks.
    assert spec.engine.drafter.num_blocks == stats.num_kv_blocks == 24


def test_aborted_finished_and_stopped_requests_free_the_draft_blocks(models):
    plain = LLM(models["target"], **BASE)
    spec = LLM(models["target"], speculative_config=draft(models["draft"], 4), **BASE)
    engine = spec.engine
    ps = prompts(8, seed=11)
    full = tokens(plain.generate(ps, GREEDY))
    reqs = []
    for i, p in enumerate(ps):
        if i % 3 == 2:  # a stop token from inside the output: a run cut short
            params = SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=[full[i][20]])
        else:
            params = SamplingParams(temperature=0.0, max_tokens=10 + 7 * i, ignore_eos=True)
        reqs.append((engine.add_request(p, params, request_id=str(i)), i))
    for _ in range(4):
        engine.step()
    assert engine.drafter.kv.owners()  # drafting is under way
    engine.abort_request("0")
    engine.abort_request("4")
    while engine.has_unfinished_requests():
        engine.step()
        engine.drafter.check()
    for req, i in reqs:
        if i in (0, 4):
            continue
        n = len(req.output_token_ids)
        assert req.output_token_ids == full[i][:n]
    no_blocks_held(spec)


def test_a_draft_of_another_vocabulary_or_tokenizer_is_refused_at_start(models):
    with pytest.raises(ConfigError, match=r"vocabulary of 400 tokens, the target 384"):
        LLM(models["target"], speculative_config=draft(models["wide"], 3), **BASE)
    with pytest.raises(ConfigError, match="tokenizer differs from the target's"):
        LLM(models["target"], speculative_config=draft(models["other"], 3), **BASE)
    with pytest.raises(ConfigError, match=r"draft model .*max_model_len=256 exceeds .* 64"):
        LLM(models["target"], speculative_config=draft(models["short"], 3), **BASE)
    with pytest.raises(ModelLoadError, match="draft model '/nonexistent/draft'.* not exist"):
        LLM(models["target"], speculative_config=draft("/nonexistent/draft", 3), **BASE)


def test_the_worker_passes_a_draft_model_config_to_the_engine():
    from serverless_llm.worker.settings import Settings

    value = '{"model": "/models/draft", "num_speculative_tokens": 3}'
    config = Settings.from_env({"SPECULATIVE_CONFIG": value}).engine_config()
    assert config.speculative_config == {"model": "/models/draft", "num_speculative_tokens": 3}
    bad = '{"method": "draft_model", "model": "/d", "num_speculative_tokens": 3, '
    bad += '"draft_tensor_parallel_size": 2}'
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2"):
        Settings.from_env({"SPECULATIVE_CONFIG": bad}).engine_config()


def test_seeded_sampled_requests_keep_their_output_with_a_draft_model(models):
    """Sampled requests verify the draft's greedy proposals by rejection sampling (a one-hot
    proposal): a seeded request's output is plain seeded decoding's, beside greedy ones, under
    preemption and chunked prefill."""
    kw = dict(block_size=8, max_model_len=96, dtype="float32", num_kv_blocks=24)
    kw["max_num_batched_tokens"] = 24
    plain = LLM(models["target"], **kw)
    spec = LLM(models["target"], speculative_config=draft(models["draft"], 3), **kw)
    ps = [p[:30] for p in prompts(10, seed=5)]
    sampled = [
        dict(temperature=0.7),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=0.9, top_k=20, min_p=0.05),
        dict(temperature=1.0, repetition_penalty=1.3),
        dict(temperature=0.0),
    ]
    params = [
        SamplingParams(seed=i, max_tokens=40, ignore_eos=True, **sampled[i % len(sampled)])
        for i in range(len(ps))
    ]
    assert tokens(spec.generate(ps, params)) == tokens(plain.generate(ps, params))
    stats = spec.engine.stats()
    assert stats.num_preemptions > 0
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    no_blocks_held(spec)


@pytest.mark.parametrize(
    "kw", [dict(temperature=0.7), dict(temperature=1.0, top_p=0.8)], ids=["t0.7", "top_p"]
)
def test_sampled_first_and_fifth_token_distribution_is_plain_decodings(models, kw):
    """Unseeded requests, engines seeded differently: the first and fifth sampled tokens of
    DRAWS requests are distributed as without speculation (total variation within sampling
    noise; the bound as in test_speculative.py), drafts accepted on the way."""
    from collections import Counter

    draws = 1000
    base = dict(block_size=8, max_model_len=64, dtype="float32", max_num_seqs=256)
    plain = LLM(models["target"], seed=1, **base)
    spec = LLM(models["target"], seed=2, speculative_config=draft(models["draft"], 3), **base)
    prompt = prompts(1, seed=9)[0][:12]
    params = SamplingParams(max_tokens=5, ignore_eos=True, **kw)
    a = tokens(plain.generate([prompt] * draws, params))
    b = tokens(spec.generate([prompt] * draws, params))
    for pos in (0, 4):
        ca, cb = Counter(t[pos] for t in a), Counter(t[pos] for t in b)
        # Outcomes rarer than 1% pooled together: their per-token counts are noise.
        pooled = {x: (ca[x] + cb[x]) / (2 * draws) for x in ca.keys() | cb.keys()}
        common = {x for x, p in pooled.items() if p >= 0.01}
        ca = Counter(x if x in common else -1 for x in ca.elements())
        cb = Counter(x if x in common else -1 for x in cb.elements())
        pooled = {x: (ca[x] + cb[x]) / (2 * draws) for x in ca.keys() | cb.keys()}
        bound = sum((p / (2 * draws)) ** 0.5 for p in pooled.values()) + 0.08
        tv = 0.5 * sum(abs(ca[x] - cb[x]) for x in pooled) / draws
        assert tv < bound, (pos, tv, bound)
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens > draws // 4
    no_blocks_held(spec)


def test_the_cache_budget_is_split_between_target_and_draft(models, caplog):
    import logging

    budget = 1 << 20
    kw = dict(block_size=8, max_model_len=128, dtype="float32", kv_cache_space_gib=budget / 2**30)
    alone = LLM(models["target"], **kw)
    with caplog.at_level(logging.INFO, logger="serverless_llm.engine.llm_engine"):
        spec = LLM(models["target"], speculative_config=draft(models["draft"], 3), **kw)
    engine, drafter = spec.engine, spec.engine.drafter
    target_block = engine.kv_bytes_per_token * 8
    draft_block = drafter.kv_bytes_per_token * 8
    assert draft_block * 2 == target_block  # 2 of the target's 4 layers
    assert drafter.num_blocks == engine.block_pool.num_blocks
    assert engine.block_pool.num_blocks == budget // (target_block + draft_block)
    assert alone.engine.block_pool.num_blocks == budget // target_block
    line = next(r.getMessage() for r in caplog.records if "KV cache split" in r.getMessage())
    assert f"target {engine.block_pool.num_blocks} blocks" in line
    assert f"draft {drafter.num_blocks} blocks" in line

"""EAGLE heads on models with recurrent layers (issue 40, engine/eagle.py with the snapshot flow of
test_speculative_hybrid.py): a request whose drafts are partly rejected goes back to the state
copied before the verification step and computes its kept tokens again in its next step; the
head drops the verification's rows then and takes them when they come again, so its own KV
holds only what the target has kept. Greedy tokens equal plain decoding's with a random head
(nearly every verification cut: a restore each time) and with a head proposing the target's
argmax often (long runs kept, some cut), k = 1 and 3, under chunked prefill and preemption; every
block of both pools and every state slot (snapshots included) goes back."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from serverless_llm import SamplingParams
from serverless_llm.engine import speculative
from serverless_llm.engine.eagle import HiddenDraft
from serverless_llm.engine.kv_cache import StateCopy
from tests.engine.family_check import family_prompts, save_family_model
from tests.engine.test_hybrid_engine import HYBRIDS, assert_books_whole, engine
from tests.tiny_models import build_tokenizer, make_config

KINDS = ("lfm2", "qwen3_next", "mamba2")  # short convolutions, Gated DeltaNet, no attention
NEW = 24
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
# Chunked prefill (16-token steps) and, where the model attends, preemption (12 blocks).
KW = dict(num_kv_blocks=12, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=6)
# The layers' writes into the residual stream, scaled down in the "bigram" target.
OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "w2.weight", "down_proj")


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(speculative, "BACKOFF_RATE", 0.0)


def _head(path: str, hidden: int, vocab: int, echo: bool, seed: int) -> str:
    """An EAGLE-1 head (one Llama layer without its input norm, fc over [embedding, hidden])
    of the target's width: random, or "echo" (fc = [I | 0], the layer's writes zero: it
    proposes argmax lm_head(embedding of the token))."""
    tok = build_tokenizer()
    config = make_config("llama", tok, num_hidden_layers=1, hidden_size=hidden, vocab_size=vocab)
    config.architectures = ["LlamaForCausalLM"]
    gen = torch.Generator().manual_seed(seed)
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, 0)
    out = {}
    for name, p in layer.state_dict().items():
        if name.startswith("input_layernorm."):
            continue
        if p.dim() < 2:
            out[f"layers.0.{name}"] = 1.0 + torch.randn(p.shape, generator=gen) * 0.1
        elif echo and name.endswith(OUTPUTS):
            out[f"layers.0.{name}"] = torch.zeros(p.shape)
        else:
            out[f"layers.0.{name}"] = torch.randn(p.shape, generator=gen) * 0.2
    out["fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.2
    if echo:
        out["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    save_file({f"model.{k}": v.contiguous() for k, v in out.items()}, f"{path}/model.safetensors")
    return path


def _models(kind: str, root) -> dict[str, str]:
    """A random target of the kind, the same target with its layers' writes into the residual
    stream scaled by 0.03 (nearly a bigram model: the echo head's proposals are mostly its
    argmax, its state still counts), and the two heads."""
    tok = build_tokenizer()
    config = HYBRIDS[kind](tok)
    target = save_family_model(str(root / "target"), config)
    bigram = save_family_model(str(root / "bigram"), config)
    f = f"{bigram}/model.safetensors"
    sd = load_file(f)
    for name, t in sd.items():
        if t.dim() >= 2 and any(o in name for o in OUTPUTS):
            sd[name] = t * 0.03
    save_file(sd, f, metadata={"format": "pt"})
    h, v = config.hidden_size, config.vocab_size
    return {
        "target": target,
        "bigram": bigram,
        "random": _head(str(root / "random"), h, v, echo=False, seed=1),
        "echo": _head(str(root / "echo"), h, v, echo=True, seed=2),
    }


@pytest.fixture(scope="module", params=KINDS)
def models(request, tmp_path_factory) -> dict[str, str]:
    return _models(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory) -> dict[str, str]:
    return _models("lfm2", tmp_path_factory.mktemp("lfm2-echo"))


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _prompts(path: str) -> list[list[int]]:
    return family_prompts(transformers.AutoConfig.from_pretrained(path).vocab_size)[:6]


def _counting_restores(llm) -> list[int]:
    count = [0]
    rollback = llm.engine.kv.rollback

    def counting(owner, num_tokens):
        computed, copies = rollback(owner, num_tokens)
        count[0] += sum(isinstance(c, StateCopy) for c in copies)
        return computed, copies

    llm.engine.kv.rollback = counting
    return count


def assert_head_books_whole(llm) -> None:
    assert_books_whole(llm)
    drafter = llm.engine.drafter
    assert isinstance(drafter, HiddenDraft)
    assert drafter.pool.num_free == drafter.num_blocks, "head blocks leaked"
    assert not drafter.fed and not drafter.kv.owners()
    drafter.check()


def _identical(models: dict[str, str], head: str, k: int) -> None:
    target = models["target" if head == "random" else "bigram"]
    prompts = _prompts(target)
    full = tokens(engine(target).generate(prompts, PARAMS))
    spec = {"method": "eagle", "model": models[head], "num_speculative_tokens": k,
            "disable_by_batch_size": None}  # fmt: skip
    llm = engine(target, speculative_config=spec, **KW)
    assert llm.engine.spec is not None and isinstance(llm.engine.drafter, HiddenDraft)
    restores = _counting_restores(llm)
    assert tokens(llm.generate(prompts, PARAMS)) == full
    stats = llm.engine.stats()
    assert stats.spec_drafts > 0 and restores[0] > 0  # runs were cut and went back
    if head == "echo":
        assert stats.spec_accepted_tokens >= 0.5 * stats.spec_draft_tokens
        assert stats.spec_accepted_tokens < stats.spec_draft_tokens
    if llm.engine.cache_layout.num_groups:
        assert stats.num_preemptions > 0
    assert_head_books_whole(llm)


@pytest.mark.parametrize("k", [1, 3])
def test_a_random_head_on_a_recurrent_model_gives_plain_tokens(models, k):
    """Nearly every draft rejected: a restore at each verification."""
    _identical(models, "random", k)


@pytest.mark.parametrize("k", [1, 3])
def test_a_head_proposing_the_argmax_gives_plain_tokens(lfm2, k):
    """Most drafts kept, some runs cut (the short convolutions' state restored)."""
    _identical(lfm2, "echo", k)


def test_the_head_never_holds_a_rolled_back_row(lfm2):
    """After every step, each request's track (the head's cache index) ends at or before what
    the target has computed: rows of a restored verification are dropped, and come again with
    the kept tokens' chunk."""
    target = lfm2["bigram"]
    spec = {"method": "eagle", "model": lfm2["echo"], "num_speculative_tokens": 3,
            "disable_by_batch_size": None}  # fmt: skip
    llm = engine(target, speculative_config=spec, **KW)
    e = llm.engine
    restores = _counting_restores(llm)
    step = e.step
    checked = [0]

    def watched():
        out = step()
        for req, t in e.drafter.fed.items():
            assert t.done + t.rows.shape[0] <= req.num_computed_tokens
            checked[0] += 1
        return out

    e.step = watched
    llm.generate(_prompts(target), PARAMS)
    assert checked[0] > 0 and restores[0] > 0
    assert_head_books_whole(llm)


def test_an_attention_free_target_leaves_its_head_the_memory_its_states_do_not_take(tmp_path):
    """Mamba-2 has no KV blocks to split the cache memory with: the head's cache gets what the
    state slots leave (it had one block, and so almost never drafted)."""
    models = _models("mamba2", tmp_path)
    target = models["target"]
    prompts = _prompts(target)
    full = tokens(engine(target).generate(prompts, PARAMS))
    spec = {"method": "eagle", "model": models["random"], "num_speculative_tokens": 3}
    llm = engine(
        target, num_kv_blocks=None, kv_cache_space_gib=0.01, max_num_seqs=4, speculative_config=spec
    )
    e = llm.engine
    assert e.drafter.num_blocks * e.block_size >= 4 * e.max_model_len
    assert tokens(llm.generate(prompts, PARAMS)) == full
    # every draft rejected, so every other step verifies (the next recomputes the kept token)
    assert e.stats().spec_draft_tokens >= 0.5 * 3 * (NEW // 2) * len(prompts)
    assert_head_books_whole(llm)

"""Speculative decoding with an EAGLE-1 head (engine/eagle.py), on tiny heads of the published
layout (fc over [embedding, hidden state], one Llama layer without its input_layernorm, the
target's embedding and LM head) with random weights: greedy output token for token what decoding
without speculation gives (16 prompts x 64 tokens, k = 1, 3, 7, chunked prefill, preemption);
the drafts equal an independent computation of EAGLE-1 from transformers' Llama layer and the
target's final hidden states; a head built to propose the target's own argmax has its drafts
accepted; sampled output keeps its distribution; no block left behind; mismatched heads refused
at start."""

from __future__ import annotations

import json
import os
import random
from collections import Counter

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine import speculative
from serverless_llm.engine.config import ConfigError, EngineConfig
from serverless_llm.engine.eagle import HiddenDraft
from serverless_llm.engine.speculative import parse_speculative_config
from tests.engine.draft_recording import record_drafts
from tests.tiny_models import build_tokenizer, make_config


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    """The backoff after poor drafts off: these tests count drafts verified and accepted."""
    monkeypatch.setattr(speculative, "BACKOFF_RATE", 0.0)


def _head_config(tok, **kw) -> transformers.LlamaConfig:
    """An EAGLE-1 head's config.json: a one-layer Llama config of the target's sizes."""
    config = make_config("llama", tok, num_hidden_layers=1, **kw)
    config.architectures = ["LlamaForCausalLM"]
    return config


def _save_head(path: str, config, tensors: dict, bin_file: bool) -> str:
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if bin_file:  # the published heads: pytorch_model.bin with EAGLE's own names
        torch.save(tensors, os.path.join(path, "pytorch_model.bin"))
    else:  # vLLM's converted form: safetensors, names under model.
        save_file({f"model.{k}": v for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))  # fmt: skip
    return path


def _head_tensors(config, target_sd: dict, gen: torch.Generator, bias: bool) -> dict:
    """Random tensors of EAGLE-1's layout (std 0.2; norms near 1)."""
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, 0)
    out = {}
    for name, p in layer.state_dict().items():
        if name.startswith("input_layernorm."):
            continue  # the published heads drop it
        if p.dim() >= 2:
            out[f"layers.0.{name}"] = torch.randn(p.shape, generator=gen) * 0.2
        else:
            out[f"layers.0.{name}"] = 1.0 + torch.randn(p.shape, generator=gen) * 0.1
    h = config.hidden_size
    out["fc.weight"] = torch.randn(h, 2 * h, generator=gen) * 0.2
    if bias:
        out["fc.bias"] = torch.randn(h, generator=gen) * 0.1
    out["embed_tokens.weight"] = target_sd["model.embed_tokens.weight"].clone()
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """A 2-layer target whose layers add little to the token's own embedding (their output
    projections scaled down, its final norm's weight 1): nearly a bigram model, so a head that
    passes the embedding through proposes what it picks. Heads: random (with an fc bias, as
    pytorch_model.bin); "echo" (fc = [I | 0], the layer's outputs zero: it proposes
    argmax lm_head(embedding of the token)); one of another hidden size; one of another vocabulary;
    an EAGLE-3 head's config."""
    root = tmp_path_factory.mktemp("eagle-models")
    tok = build_tokenizer()
    torch.manual_seed(0)
    target = transformers.AutoModelForCausalLM.from_config(
        make_config("llama", tok, num_hidden_layers=2), dtype=torch.float32
    )
    with torch.no_grad():
        for name, p in target.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 if "embed_tokens" in name else 0.2)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(0.01)
    path = str(root / "target")
    target.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    out = {"target": path}
    sd = target.state_dict()
    config = _head_config(tok)
    gen = torch.Generator().manual_seed(1)
    out["random"] = _save_head(
        str(root / "random"), config, _head_tensors(config, sd, gen, True), bin_file=True
    )
    echo = _head_tensors(config, sd, gen, False)
    h = config.hidden_size
    echo["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    for name in list(echo):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            echo[name] = torch.zeros_like(echo[name])
    out["echo"] = _save_head(str(root / "echo"), config, echo, bin_file=False)
    wide = _head_config(tok, hidden_size=32, intermediate_size=64)
    out["wide"] = _save_head(
        str(root / "wide"), wide, _head_tensors(wide, sd, gen, False), bin_file=False
    )
    vocab = _head_config(tok, vocab_size=len(tok) + 16)
    out["vocab"] = _save_head(str(root / "vocab"), vocab, {"fc.weight": torch.zeros(1)}, False)
    e3 = _head_config(tok)
    e3.architectures = ["LlamaForCausalLMEagle3"]
    out["eagle3"] = _save_head(str(root / "eagle3"), e3, {"fc.weight": torch.zeros(1)}, False)
    return out


def eagle(path: str, k: int) -> dict:
    return {
        "method": "eagle",
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


def no_blocks_held(llm: LLM) -> None:
    engine = llm.engine
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    drafter = engine.drafter
    assert isinstance(drafter, HiddenDraft)
    assert drafter.pool.num_free == drafter.num_blocks
    assert not drafter.fed and not drafter.kv.owners()
    drafter.check()


KW = dict(block_size=8, max_model_len=128, dtype="float32", num_kv_blocks=20)


@pytest.fixture(scope="module")
def plain(models) -> list[list[int]]:
    llm = LLM(models["target"], max_num_batched_tokens=24, **KW)
    return tokens(llm.generate(prompts(16), GREEDY))


def test_config_parses_eagle_and_mtp():
    spec = parse_speculative_config({"method": "eagle", "model": "/h", "num_speculative_tokens": 3})
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("eagle", "/h", 3)
    for name in ("mtp", "deepseek_mtp"):
        spec = parse_speculative_config({"method": name, "num_speculative_tokens": 1})
        assert (spec.method, spec.model) == ("mtp", None)
    with pytest.raises(ConfigError, match="method 'eagle' needs `model`"):
        EngineConfig(speculative_config={"method": "eagle", "num_speculative_tokens": 3})
    spec = parse_speculative_config(
        {"method": "eagle3", "model": "/h", "num_speculative_tokens": 2}
    )
    assert (spec.method, spec.model) == ("eagle3", "/h")
    with pytest.raises(ConfigError, match="'medusa': a method not implemented here"):
        EngineConfig(speculative_config={"method": "medusa", "model": "/h", "num_speculative_tokens": 3})  # fmt: skip


@pytest.mark.parametrize("head", ["random", "echo"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_16_prompts_by_64_tokens_identical_under_chunked_prefill_and_preemption(
    models, plain, head, k
):
    # A 24-token step budget chunks the prompts (the head catches up over several steps) and a
    # 20-block cache preempts; the prefix cache gives resumed requests their blocks back, so
    # their head's track starts past the cached prefix.
    spec = LLM(
        models["target"],
        max_num_batched_tokens=24,
        speculative_config=eagle(models[head], k),
        **KW,
    )
    assert tokens(spec.generate(prompts(16), GREEDY)) == plain
    stats = spec.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_drafts > 0
    if head == "echo":  # it proposes the target's own argmax nearly always
        assert stats.spec_accepted_tokens >= 0.7 * stats.spec_draft_tokens
    no_blocks_held(spec)


def test_drafts_equal_eagle_computed_from_transformers(models):
    """Every draft the engine proposes (first pass from the target's hidden states over the
    prompt in chunks, then the head's own outputs) equals EAGLE-1 computed anew over the whole
    sequence: transformers' Llama layer without its input norm, the target's final hidden
    states (after its norm: what its LM head reads) and its LM head."""
    llm = LLM(
        models["target"],
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        speculative_config=eagle(models["random"], 3),
        block_size=8,
        max_model_len=128,
        dtype="float32",
    )
    drafter = llm.engine.drafter
    seen = record_drafts(drafter)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate(prompts(3, seed=5), params)
    assert len(seen) > 10
    target = transformers.AutoModelForCausalLM.from_pretrained(models["target"]).eval()
    config = transformers.AutoConfig.from_pretrained(models["random"])
    config._attn_implementation = "sdpa"
    sd = torch.load(os.path.join(models["random"], "pytorch_model.bin"))
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, 0)
    layer.load_state_dict(
        {k[len("layers.0.") :]: v for k, v in sd.items() if k.startswith("layers.0.")},
        strict=False,
    )
    layer.input_layernorm = torch.nn.Identity()
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    fc = torch.nn.Linear(128, 64)
    fc.load_state_dict({"weight": sd["fc.weight"], "bias": sd["fc.bias"]})
    with torch.no_grad():
        for seq, got in seen:
            n = len(seq)
            hid = target(torch.tensor([seq[: n - 1]]), output_hidden_states=True).hidden_states[-1]
            ids, want = list(seq[1:]), []
            for _ in got:
                x = fc(torch.cat([target.model.embed_tokens(torch.tensor([ids])), hid], -1))
                pos = torch.arange(len(ids))[None]
                y = layer(x, position_embeddings=rotary(x, pos), position_ids=pos)
                y = y[0] if isinstance(y, tuple) else y
                want.append(int(target.lm_head(y[0, -1]).argmax()))
                ids.append(want[-1])
                hid = torch.cat([hid, y[:, -1:]], dim=1)
            assert got == want, (n, got, want)


def test_seeded_and_sampled_distribution_with_the_echo_head(models):
    """Sampled requests verify the head's greedy drafts by rejection sampling: a seeded
    request's output is plain seeded decoding's; unseeded, the fifth token's distribution over
    many requests is plain decoding's (total variation within sampling noise)."""
    kw = dict(block_size=8, max_model_len=64, dtype="float32", max_num_seqs=256)
    plain = LLM(models["target"], seed=1, **kw)
    spec = LLM(models["target"], seed=2, speculative_config=eagle(models["echo"], 3), **kw)
    ps = [p[:20] for p in prompts(6, seed=5)]
    seeded = [
        SamplingParams(seed=i, temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True)
        for i in range(len(ps))
    ]
    assert tokens(spec.generate(ps, seeded)) == tokens(plain.generate(ps, seeded))
    draws = 600
    prompt = prompts(1, seed=9)[0][:12]
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.7)
    a = tokens(plain.generate([prompt] * draws, params))
    b = tokens(spec.generate([prompt] * draws, params))
    ca, cb = Counter(t[4] for t in a), Counter(t[4] for t in b)
    pooled = {x: (ca[x] + cb[x]) / (2 * draws) for x in ca.keys() | cb.keys()}
    common = {x for x, p in pooled.items() if p >= 0.02}
    ca = Counter(x if x in common else -1 for x in ca.elements())
    cb = Counter(x if x in common else -1 for x in cb.elements())
    pooled = {x: (ca[x] + cb[x]) / (2 * draws) for x in ca.keys() | cb.keys()}
    bound = sum((p / (2 * draws)) ** 0.5 for p in pooled.values()) + 0.08
    tv = 0.5 * sum(abs(ca[x] - cb[x]) for x in pooled) / draws
    assert tv < bound, (tv, bound)
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens > draws // 4
    no_blocks_held(spec)


def test_aborted_and_finished_requests_free_the_head_blocks(models):
    spec = LLM(models["target"], speculative_config=eagle(models["echo"], 4), **KW)
    engine = spec.engine
    ps = prompts(6, seed=11)
    for i, p in enumerate(ps):
        params = SamplingParams(temperature=0.0, max_tokens=10 + 5 * i, ignore_eos=True)
        engine.add_request(p, params, request_id=str(i))
    for _ in range(4):
        engine.step()
    assert engine.drafter.kv.owners()
    engine.abort_request("0")
    engine.abort_request("3")
    while engine.has_unfinished_requests():
        engine.step()
        engine.drafter.check()
    no_blocks_held(spec)


def test_mismatched_heads_are_refused_at_start(models):
    kw = dict(block_size=8, max_model_len=64, dtype="float32")
    with pytest.raises(ConfigError, match="hidden_size 32, the target's 64"):
        LLM(models["target"], speculative_config=eagle(models["wide"], 3), **kw)
    with pytest.raises(ConfigError, match="vocabulary of 400 tokens, the target 384"):
        LLM(models["target"], speculative_config=eagle(models["vocab"], 3), **kw)
    with pytest.raises(ConfigError, match="LlamaForCausalLMEagle3 .*method 'eagle3'"):
        LLM(models["target"], speculative_config=eagle(models["eagle3"], 3), **kw)
    bad = os.path.join(os.path.dirname(models["vocab"]), "noconfig")
    os.makedirs(bad, exist_ok=True)
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump({"model_type": "llama"}, f)
    with pytest.raises(Exception, match="eagle model"):
        LLM(models["target"], speculative_config=eagle(bad, 3), **kw)


# -- EAGLE-3 ------------------------------------------------------------------------------------

DRAFT_VOCAB = 256


@pytest.fixture(scope="module")
def eagle3_models(tmp_path_factory) -> dict[str, str]:
    """A 4-layer target (EAGLE-3 reads the streams entering its layers 2, 2 and 1: (2, L // 2,
    L - 3)) and a random EAGLE-3 head of the published layout: fc [h, 3h], a midlayer whose
    q/k/v read 2h, hidden_norm, norm, an lm_head over 256 of the 384 tokens with d2t; and a
    2-layer target, too shallow for the default layers."""
    root = tmp_path_factory.mktemp("eagle3-models")
    tok = build_tokenizer()
    out = {}
    for name, layers in (("target", 4), ("shallow", 2)):
        torch.manual_seed(0)
        m = transformers.AutoModelForCausalLM.from_config(
            make_config("llama", tok, num_hidden_layers=layers), dtype=torch.float32
        )
        with torch.no_grad():
            for p in m.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.2)
        out[name] = str(root / name)
        m.save_pretrained(out[name], safe_serialization=True)
        tok.save_pretrained(out[name])
    config = _head_config(tok, draft_vocab_size=DRAFT_VOCAB)
    config.architectures = ["LlamaForCausalLMEagle3"]
    g = torch.Generator().manual_seed(4)
    h, inter, kv = 64, 128, 32
    shapes = {
        "fc.weight": (h, 3 * h),
        "midlayer.self_attn.q_proj.weight": (h, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, h),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "lm_head.weight": (DRAFT_VOCAB, h),
    }
    tensors = {k: torch.randn(s, generator=g) * 0.2 for k, s in shapes.items()}
    for k in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"midlayer.{k}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    tensors["norm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    ids = torch.randperm(len(tok), generator=g)[:DRAFT_VOCAB].sort().values
    tensors["d2t"] = ids - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(len(tok), dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    out["head"] = _save_head(str(root / "head"), config, tensors, bin_file=False)
    return out


def eagle3(path: str, k: int) -> dict:
    return dict(eagle(path, k), method="eagle3")


@pytest.mark.parametrize("k", [1, 3, 7])
def test_eagle3_16_prompts_by_64_tokens_identical(eagle3_models, k):
    llm_kw = dict(KW, max_num_batched_tokens=24)
    plain = LLM(eagle3_models["target"], **llm_kw)
    want = tokens(plain.generate(prompts(16), GREEDY))
    spec = LLM(
        eagle3_models["target"], speculative_config=eagle3(eagle3_models["head"], k), **llm_kw
    )
    assert tokens(spec.generate(prompts(16), GREEDY)) == want
    stats = spec.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_drafts > 0
    assert spec.engine.runner.captured is None
    no_blocks_held(spec)


def test_eagle3_drafts_equal_the_published_computation(eagle3_models):
    """Every draft equals EAGLE-3 recomputed over the whole sequence in plain torch: fc over the
    target's hidden states entering layers 2, 2, 1 (transformers' hidden_states), the midlayer
    (attention over [input_layernorm(embedding), hidden_norm(hidden)] with the hidden state as
    residual, then the MLP), the final norm, the reduced LM head and d2t; the layer's own
    pre-norm output fused at each further step."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    llm = LLM(
        eagle3_models["target"],
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        speculative_config=eagle3(eagle3_models["head"], 3),
        block_size=8,
        max_model_len=128,
        dtype="float32",
    )
    drafter = llm.engine.drafter
    seen = record_drafts(drafter)
    llm.generate(
        prompts(3, seed=5), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )
    assert len(seen) > 10
    target = transformers.AutoModelForCausalLM.from_pretrained(eagle3_models["target"]).eval()
    config = transformers.AutoConfig.from_pretrained(eagle3_models["head"])
    sd = load_file(os.path.join(eagle3_models["head"], "model.safetensors"))
    w = {k.removeprefix("model."): v for k, v in sd.items()}
    rotary = LlamaRotaryEmbedding(config)
    eps = config.rms_norm_eps

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def lin(x, name):
        return x @ w[name].T

    def midlayer(e, hid):
        x = torch.cat([rms(e, w["midlayer.input_layernorm.weight"]), rms(hid, w["midlayer.hidden_norm.weight"])], -1)  # fmt: skip
        T = x.shape[1]
        q = lin(x, "midlayer.self_attn.q_proj.weight").view(1, T, 4, 16).transpose(1, 2)
        k = lin(x, "midlayer.self_attn.k_proj.weight").view(1, T, 2, 16).transpose(1, 2)
        v = lin(x, "midlayer.self_attn.v_proj.weight").view(1, T, 2, 16).transpose(1, 2)
        cos, sin = rotary(x, torch.arange(T)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        s1 = lin(a.transpose(1, 2).reshape(1, T, 64), "midlayer.self_attn.o_proj.weight") + hid
        x2 = rms(s1, w["midlayer.post_attention_layernorm.weight"])
        g = torch.nn.functional.silu(lin(x2, "midlayer.mlp.gate_proj.weight"))
        return lin(g * lin(x2, "midlayer.mlp.up_proj.weight"), "midlayer.mlp.down_proj.weight") + s1

    with torch.no_grad():
        for seq, got in seen:
            n = len(seq)
            hs = target(torch.tensor([seq[: n - 1]]), output_hidden_states=True).hidden_states
            hid = lin(torch.cat([hs[2], hs[2], hs[1]], -1), "fc.weight")
            ids, want = list(seq[1:]), []
            for _ in got:
                pre = midlayer(target.model.embed_tokens(torch.tensor([ids])), hid)
                d = int(lin(rms(pre[0, -1], w["norm.weight"]), "lm_head.weight").argmax())
                want.append(d + int(w["d2t"][d]))
                ids.append(want[-1])
                hid = torch.cat([hid, pre[:, -1:]], dim=1)
            assert got == want, (n, got, want)


def test_eagle3_refused_on_a_target_too_shallow(eagle3_models):
    kw = dict(block_size=8, max_model_len=64, dtype="float32")
    with pytest.raises(ConfigError, match=r"target layers \(2, 1, -1\).*2 layers"):
        LLM(eagle3_models["shallow"], speculative_config=eagle3(eagle3_models["head"], 3), **kw)


def test_the_cache_budget_is_split_between_target_and_head(models, caplog):
    import logging

    budget = 1 << 20
    kw = dict(block_size=8, max_model_len=128, dtype="float32", kv_cache_space_gib=budget / 2**30)
    with caplog.at_level(logging.INFO, logger="serverless_llm.engine.llm_engine"):
        spec = LLM(models["target"], speculative_config=eagle(models["echo"], 3), **kw)
    engine, drafter = spec.engine, spec.engine.drafter
    assert drafter.kv_bytes_per_token * 2 == engine.kv_bytes_per_token  # 1 layer of 2
    per_block = (engine.kv_bytes_per_token + drafter.kv_bytes_per_token) * 8
    assert drafter.num_blocks == engine.block_pool.num_blocks == budget // per_block
    line = next(r.getMessage() for r in caplog.records if "KV cache split" in r.getMessage())
    assert line.startswith("speculative decoding: eagle ")
    assert f"draft {drafter.num_blocks} blocks" in line

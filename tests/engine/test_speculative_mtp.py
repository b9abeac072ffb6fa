"""Speculative decoding with the target's own multi-token-prediction layer (method `mtp`,
engine/eagle.py), on a tiny DeepSeek V3 (MLA, MoE after a dense first layer) whose checkpoint
carries an MTP layer of DeepSeek's published layout under model.layers.<N>. (enorm, hnorm,
eh_proj, a MoE decoder block, shared_head.norm and .head) with random weights: greedy output
token for token what decoding without speculation gives (16 prompts x 64 tokens, k = 1, 3, 7,
chunked prefill, preemption); the drafts equal the MTP layer computed anew from transformers'
DeepSeek V3 layer and the target's final hidden states; a layer built to propose the target's
own argmax has its drafts accepted; targets without MTP layers, or of another layout, are
refused at start."""

from __future__ import annotations

import os
import random

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine import speculative
from serverless_llm.engine.config import ConfigError
from serverless_llm.engine.eagle import HiddenDraft
from tests.engine.draft_recording import record_drafts
from tests.tiny_models import build_tokenizer, make_config, tiny_dims

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, q_lora_rank=24)
MOE = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
)


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(speculative, "BACKOFF_RATE", 0.0)


def _config(tok, layers: int, mtp: int, arch: str = "deepseek_v3"):
    if arch == "glm4_moe":  # GLM-4.5: Llama's attention with biases and q/k norms, the same MoE
        config = transformers.Glm4MoeConfig(
            **tiny_dims(tok, num_hidden_layers=layers),
            **{k: v for k, v in MOE.items() if k != "routed_scaling_factor"},
            use_qk_norm=True,
            attention_bias=True,
        )
        config.architectures = ["Glm4MoeForCausalLM"]
    else:
        config = transformers.DeepseekV3Config(
            **tiny_dims(tok, num_key_value_heads=4, num_hidden_layers=layers), **MLA, **MOE
        )
        config.architectures = ["DeepseekV3ForCausalLM"]
    config.num_nextn_predict_layers = mtp
    return config


def _build(
    root: str, tok, echo: bool, mtp_tensors: bool = True, mtp: int = 1, arch: str = "deepseek_v3"
) -> str:
    """A 2-layer DeepSeek V3 whose layers add little to the token's embedding (nearly a bigram
    model), and its MTP layer: layer 2 of a 3-layer model of the same weights, with DeepSeek's
    extra tensors. `echo`: eh_proj = [I | 0], the block's outputs zero, shared_head = the
    target's final norm and LM head, so it proposes argmax lm_head(norm(embedding of the
    token)), which is nearly what the target picks."""
    torch.manual_seed(0)
    big = transformers.AutoModelForCausalLM.from_config(
        _config(tok, 3, 0, arch), dtype=torch.float32
    )
    with torch.no_grad():
        for name, p in big.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 if "embed_tokens" in name else 0.2)
                if "layers.2." not in name and ("down_proj" in name or "o_proj" in name):
                    p.mul_(0.002)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    full = os.path.join(root, "full")
    big.save_pretrained(full, safe_serialization=True)
    tensors = load_file(os.path.join(full, "model.safetensors"))
    prefix = "model.layers.2."
    out = {k: v for k, v in tensors.items() if not k.startswith(prefix)}
    if mtp_tensors:
        h = big.config.hidden_size
        g = torch.Generator().manual_seed(3)
        layer = {k: v for k, v in tensors.items() if k.startswith(prefix)}
        if echo:
            for k in layer:
                if "down_proj" in k or "o_proj" in k:
                    layer[k] = torch.zeros_like(layer[k])
            extra = {
                "enorm.weight": torch.ones(h),
                "hnorm.weight": torch.ones(h),
                "eh_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1),
                "shared_head.norm.weight": tensors["model.norm.weight"],
                "shared_head.head.weight": tensors["lm_head.weight"],
            }
        else:
            extra = {
                "enorm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
                "hnorm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
                "eh_proj.weight": 0.2 * torch.randn(h, 2 * h, generator=g),
                "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
                "shared_head.head.weight": 0.2 * torch.randn(len(tok), h, generator=g),
            }
        extra["embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
        out.update(layer)
        out.update({prefix + k: v for k, v in extra.items()})
    path = os.path.join(root, "target")
    os.makedirs(path, exist_ok=True)
    _config(tok, 2, mtp, arch).save_pretrained(path)
    save_file({k: v.clone() for k, v in out.items()}, os.path.join(path, "model.safetensors"))
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    tok = build_tokenizer()
    out = {}
    for name, kw in {
        "random": dict(echo=False),
        "echo": dict(echo=True),
        "none": dict(echo=False, mtp_tensors=False, mtp=0),
        "stripped": dict(echo=False, mtp_tensors=False, mtp=1),
        "glm": dict(echo=False, arch="glm4_moe"),
    }.items():
        out[name] = _build(str(tmp_path_factory.mktemp(f"mtp-{name}")), tok, **kw)
    llama = str(tmp_path_factory.mktemp("mtp-llama"))
    m = transformers.AutoModelForCausalLM.from_config(make_config("llama", tok))
    m.save_pretrained(llama, safe_serialization=True)
    tok.save_pretrained(llama)
    out["llama"] = llama
    return out


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": None}


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def prompts(n: int, seed: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 380) for _ in range(rng.randint(4, 40))] for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
KW = dict(block_size=8, max_model_len=128, dtype="float32", num_kv_blocks=20)


def no_blocks_held(llm: LLM) -> None:
    engine = llm.engine
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    drafter = engine.drafter
    assert isinstance(drafter, HiddenDraft) and drafter.method == "mtp"
    assert drafter.pool.num_free == drafter.num_blocks
    assert not drafter.fed and not drafter.kv.owners()
    drafter.check()


@pytest.fixture(scope="module")
def plain(models) -> dict[str, list[list[int]]]:
    out = {}
    for name in ("random", "echo"):
        llm = LLM(models[name], max_num_batched_tokens=24, **KW)
        out[name] = tokens(llm.generate(prompts(16), GREEDY))
    return out


@pytest.mark.parametrize("layer", ["random", "echo"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_16_prompts_by_64_tokens_identical_under_chunked_prefill_and_preemption(
    models, plain, layer, k
):
    spec = LLM(models[layer], max_num_batched_tokens=24, speculative_config=mtp(k), **KW)
    assert tokens(spec.generate(prompts(16), GREEDY)) == plain[layer]
    stats = spec.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_drafts > 0
    if layer == "echo":  # it proposes the target's own argmax nearly always
        assert stats.spec_accepted_tokens >= 0.7 * stats.spec_draft_tokens
    no_blocks_held(spec)


def test_drafts_equal_the_mtp_layer_computed_from_transformers(models):
    """Every draft equals DeepSeek's MTP computed anew over the whole sequence: the embedding
    zeroed at position 0, eh_proj over [enorm(embedding), hnorm(hidden)], transformers' DeepSeek
    V3 decoder layer (MLA, MoE), shared_head; the target's final hidden states first, then the
    layer's own outputs."""
    llm = LLM(
        models["random"],
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        speculative_config=mtp(3),
        block_size=8,
        max_model_len=128,
        dtype="float32",
    )
    drafter = llm.engine.drafter
    seen = record_drafts(drafter)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate(prompts(3, seed=5), params)
    assert len(seen) > 10
    path = models["random"]
    sd = load_file(os.path.join(path, "model.safetensors"))
    # the 3-layer model the MTP layer was cut from (its layer 2: the checkpoint's block)
    full = os.path.join(os.path.dirname(path), "full")
    big = transformers.AutoModelForCausalLM.from_pretrained(full, attn_implementation="sdpa")
    big = big.eval()
    config = big.config
    target = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    p = "model.layers.2."
    layer, rotary = big.model.layers[2], big.model.rotary_emb

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * w

    with torch.no_grad():
        for seq, got in seen:
            n = len(seq)
            hid = target(torch.tensor([seq[: n - 1]]), output_hidden_states=True).hidden_states[-1]
            ids, want = list(seq[1:]), []
            for _ in got:
                pos = torch.arange(len(ids))[None]
                e = target.model.embed_tokens(torch.tensor([ids]))
                e[pos == 0] = 0
                x = torch.cat(
                    [rms(e, sd[p + "enorm.weight"]), rms(hid, sd[p + "hnorm.weight"])], -1
                )
                x = x @ sd[p + "eh_proj.weight"].T
                y = layer(x, position_embeddings=rotary(x, pos), position_ids=pos)
                y = y[0] if isinstance(y, tuple) else y
                logits = rms(y[0, -1], sd[p + "shared_head.norm.weight"])
                want.append(int((logits @ sd[p + "shared_head.head.weight"].T).argmax()))
                ids.append(want[-1])
                hid = torch.cat([hid, y[:, -1:]], dim=1)
            assert got == want, (n, got, want)


def test_targets_without_mtp_layers_are_refused_at_start(models):
    kw = dict(block_size=8, max_model_len=64, dtype="float32")
    with pytest.raises(ConfigError, match=r"has no multi-token-prediction layers"):
        LLM(models["none"], speculative_config=mtp(1), **kw)
    with pytest.raises(ConfigError, match=r"lacks the layer's tensors under model.layers.2."):
        LLM(models["stripped"], speculative_config=mtp(1), **kw)
    with pytest.raises(ConfigError, match="LlamaForCausalLM is not served with its multi-token"):
        LLM(models["llama"], speculative_config=mtp(1), **kw)


def test_glm4_moe_mtp_layer_identical(models):
    """GLM-4.5 stores its MTP layer DeepSeek's way; its block is a GLM-4.5 MoE layer (q/k/v
    biases, per-head q/k norms, partial rotary)."""
    kw = dict(block_size=8, max_model_len=96, dtype="float32", max_num_batched_tokens=24)
    ps = [p[:24] for p in prompts(8, seed=2)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = tokens(LLM(models["glm"], **kw).generate(ps, params))
    spec = LLM(models["glm"], speculative_config=mtp(3), **kw)
    assert tokens(spec.generate(ps, params)) == want
    assert spec.engine.stats().spec_drafts > 0
    no_blocks_held(spec)

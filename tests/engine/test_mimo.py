"""MiMo (`MiMoForCausalLM`, XiaomiMiMo/MiMo-7B-Base and -RL): Qwen2's decoder whose checkpoint
carries multi-token-prediction layers under `model.mtp_layers.<i>.`, its code (config included)
only in its hub repository. A tiny random Qwen2 of n + 1 layers is saved ("whole"); its first n
layers make a plain Qwen2 checkpoint ("plain") and, under MiMo's config (architectures,
model_type "mimo", num_nextn_predict_layers 1, the hub's auto_map), the MiMo target, whose last
layer is renamed `model.mtp_layers.0.` beside random token_layernorm, hidden_layernorm,
input_proj and final_layernorm.

- The target's config is read without the repository's code, its MTP tensors skipped, and its
  greedy tokens equal transformers' Qwen2ForCausalLM on the plain checkpoint.
- With speculative_config method `mtp`: greedy tokens equal plain decoding's (k = 1, 3, chunked
  prefill, preemption); every draft equals MiMo's MTP layer computed here in torch (the
  embedding zeroed at position 0, input_proj over [hidden_layernorm(hidden),
  token_layernorm(embedding)], transformers' Qwen2 decoder layer, final_layernorm, the LM head;
  each further draft fuses the previous normed output); a checkpoint without the layer is
  refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine import speculative
from serverless_llm.engine.config import ConfigError
from serverless_llm.engine.eagle import HiddenDraft
from serverless_llm.engine.loader import ResolvedModel, load_hf_config
from tests.engine.draft_recording import record_drafts
from tests.engine.family_check import (
    assert_matches_transformers,
    assert_pool_whole,
    family_prompts,
    save_family_model,
)
from tests.tiny_models import TINY_SIZES, build_tokenizer, make_config

NEW = 24
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
KW = dict(block_size=8, dtype="float32", max_model_len=64, max_num_seqs=6)
N = TINY_SIZES["layers"]
MTP = "model.mtp_layers.0."


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(speculative, "BACKOFF_RATE", 0.0)


def _write(path: str, cfg: dict, tensors: dict, like: str) -> str:
    os.makedirs(path)
    for f in os.listdir(like):
        if f not in ("model.safetensors", "config.json"):
            os.link(os.path.join(like, f), os.path.join(path, f))
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    return path


def _mimo(root) -> dict[str, str]:
    """The whole n + 1 layer Qwen2, the plain n layer Qwen2 and the MiMo target (docstring)."""
    config = make_config("qwen2", build_tokenizer(), tie_word_embeddings=False,
                         num_hidden_layers=N + 1, rms_norm_eps=1e-5)  # fmt: skip
    whole = save_family_model(str(root / "whole"), config)  # q/k/v biases random too
    sd = load_file(f"{whole}/model.safetensors")
    last = f"model.layers.{N}."
    plain_sd = {k: v for k, v in sd.items() if not k.startswith(last)}
    cfg = json.load(open(f"{whole}/config.json"))
    cfg["num_hidden_layers"] = N
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:N]
    plain = _write(str(root / "plain"), cfg, plain_sd, whole)
    gen = torch.Generator().manual_seed(5)
    h = config.hidden_size
    mtp = {MTP + k.removeprefix(last): v for k, v in sd.items() if k.startswith(last)}
    mtp[MTP + "input_proj.weight"] = torch.randn(h, 2 * h, generator=gen) * 0.2
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        mtp[MTP + f"{norm}.weight"] = 1.0 + torch.randn(h, generator=gen) * 0.1
    mimo_cfg = {
        **cfg,
        "architectures": ["MiMoForCausalLM"],
        "model_type": "mimo",
        "num_nextn_predict_layers": 1,
        "auto_map": {
            "AutoConfig": "configuration_mimo.MiMoConfig",
            "AutoModel": "modeling_mimo.MiMoModel",
            "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM",
        },
    }
    target = _write(str(root / "target"), mimo_cfg, {**plain_sd, **mtp}, whole)
    return {"whole": whole, "plain": plain, "target": target}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    return _mimo(tmp_path_factory.mktemp("mimo"))


def _prompts(models) -> list[list[int]]:
    return family_prompts(transformers.AutoConfig.from_pretrained(models["plain"]).vocab_size)[:6]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": None}


def test_mimo_config_needs_no_remote_code_and_matches_qwen2(models):
    with pytest.raises(ValueError):  # transformers alone cannot read it
        transformers.AutoConfig.from_pretrained(models["target"], trust_remote_code=False)
    llm = LLM(models["target"], num_kv_blocks=40, **KW)
    hf = llm.engine.hf_config
    assert hf.model_type == "mimo" and hf.num_nextn_predict_layers == 1
    assert isinstance(hf, transformers.Qwen2Config) and hf.sliding_window is None
    # with trust_remote_code but without the repository's files, the same stand-in is read
    t = models["target"]
    hf = load_hf_config(ResolvedModel(t, t, "safetensors", t), trust_remote_code=True)
    assert hf.model_type == "mimo" and hf.architectures == ["MiMoForCausalLM"]
    vocab = transformers.AutoConfig.from_pretrained(models["plain"]).vocab_size
    assert_matches_transformers(models["target"], new_tokens=NEW, lengths=(2, 9, 33),
                                reference=models["plain"], vocab=vocab)  # fmt: skip


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identical_under_chunked_prefill_and_preemption(models, k):
    target = models["target"]
    prompts = _prompts(models)
    full = tokens(LLM(target, num_kv_blocks=160, **KW).generate(prompts, PARAMS))
    llm = LLM(target, num_kv_blocks=12, max_num_batched_tokens=16, speculative_config=mtp(k), **KW)
    drafter = llm.engine.drafter
    assert isinstance(drafter, HiddenDraft) and drafter.head.mimo
    assert tokens(llm.generate(prompts, PARAMS)) == full
    stats = llm.engine.stats()
    assert stats.spec_drafts > 0 and stats.num_preemptions > 0
    assert_pool_whole(llm)
    assert drafter.pool.num_free == drafter.num_blocks and not drafter.fed
    drafter.check()


def test_drafts_equal_mimo_mtp_layer_in_torch(models):
    """Each draft equals MiMo's MTP layer computed anew over the whole sequence from the
    target's final hidden states (after its norm) with transformers' Qwen2 decoder layer."""
    llm = LLM(models["target"], num_kv_blocks=160, max_num_batched_tokens=16,
              speculative_config=mtp(3), **KW)  # fmt: skip
    drafter = llm.engine.drafter
    seen = record_drafts(drafter)
    llm.generate(_prompts(models)[2:5], SamplingParams(temperature=0.0, max_tokens=16))
    assert len(seen) > 10
    whole = transformers.Qwen2ForCausalLM.from_pretrained(models["whole"]).eval()
    target = transformers.Qwen2ForCausalLM.from_pretrained(models["plain"]).eval()
    config = whole.config
    layer = whole.model.layers[N]
    layer.self_attn.config._attn_implementation = "sdpa"
    rotary = whole.model.rotary_emb
    sd = load_file(f"{models['target']}/model.safetensors")
    norms = {}
    for name in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        norms[name] = transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )
        norms[name].weight.data.copy_(sd[MTP + f"{name}.weight"])
    proj = sd[MTP + "input_proj.weight"]
    with torch.no_grad():
        for seq, got in seen:
            m = len(seq)
            hid = target.model(torch.tensor([seq[: m - 1]])).last_hidden_state
            ids, want = list(seq[1:]), []
            for _ in got:
                e = target.model.embed_tokens(torch.tensor([ids])).clone()
                e[:, 0] = 0.0  # the row at position 0
                x = torch.cat([norms["hidden_layernorm"](hid), norms["token_layernorm"](e)], -1)
                x = x @ proj.T
                pos = torch.arange(len(ids))[None]
                y = layer(x, position_embeddings=rotary(x, pos), position_ids=pos)
                y = norms["final_layernorm"](y[0] if isinstance(y, tuple) else y)
                want.append(int(target.lm_head(y[0, -1]).argmax()))
                ids.append(want[-1])
                hid = torch.cat([hid, y[:, -1:]], dim=1)
            assert got == want, (m, got, want)


def test_mimo_without_mtp_layers_is_refused(tmp_path):
    target = _mimo(tmp_path)["target"]
    cfg_path = f"{target}/config.json"
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "num_nextn_predict_layers": 0}, open(cfg_path, "w"))
    with pytest.raises(ConfigError, match="no multi-token-prediction layers"):
        LLM(target, num_kv_blocks=40, speculative_config=mtp(1), **KW)
    json.dump(cfg, open(cfg_path, "w"))
    sd = load_file(f"{target}/model.safetensors")
    save_file({k: v for k, v in sd.items() if not k.startswith("model.mtp_layers.")},
              f"{target}/model.safetensors", metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(ConfigError, match="lacks the layer's tensors under model.mtp_layers.0."):
        LLM(target, num_kv_blocks=40, speculative_config=mtp(1), **KW)
    # without speculation the same checkpoint serves plainly
    out = LLM(target, num_kv_blocks=40, **KW).generate([[5, 6, 7]], PARAMS)
    assert len(out[0].outputs[0].token_ids) == NEW

"""The mtp method on Qwen3-Next and Qwen3.5 (engine/eagle.py, `mtp.` layout): tiny random targets
whose checkpoints carry an MTP layer stored as the released ones do (mtp.pre_fc_norm_embedding,
mtp.pre_fc_norm_hidden, mtp.fc over concat(embedding, hidden), mtp.layers.0: a full-attention
layer of the model's own kind, a MoE on Qwen3-Next and a dense MLP on Qwen3.5, mtp.norm; the
target's LM head). Greedy tokens equal plain decoding's (k = 1, 3, chunked prefill, preemption;
the recurrent layers' snapshots restored); every draft equals the MTP layer computed with
transformers' own Qwen3-Next layer over the target's final hidden states; what is not served is
refused at start."""

from __future__ import annotations

import copy
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
from tests.engine.draft_recording import record_drafts
from tests.engine.family_check import family_prompts, save_family_model
from tests.engine.test_families_linear import CONFIGS
from tests.engine.test_hybrid_engine import assert_books_whole
from tests.tiny_models import build_tokenizer

NEW = 24
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
KW = dict(block_size=8, dtype="float32", max_model_len=64, max_num_seqs=6)


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(speculative, "BACKOFF_RATE", 0.0)


def _with_mtp(kind: str, root) -> dict[str, str]:
    """A target of `kind` with n layers whose checkpoint holds an MTP layer: a model of n + 1
    layers (the last full attention) is saved, its last layer renamed mtp.layers.0 beside
    random mtp.fc and zero-centred norms. Returns the target and the n + 1 layer model."""
    config = CONFIGS[kind](build_tokenizer())
    n = config.num_hidden_layers
    full = copy.deepcopy(config)
    full.num_hidden_layers = n + 1
    full.layer_types = [*config.layer_types, "full_attention"]
    whole = save_family_model(str(root / "whole"), full)
    target = str(root / "target")
    os.makedirs(target)
    for f in os.listdir(whole):
        if f != "model.safetensors":
            os.link(os.path.join(whole, f), os.path.join(target, f))
    sd = load_file(f"{whole}/model.safetensors")
    out = {}
    for name, t in sd.items():
        layer = f"model.layers.{n}."
        out[name.replace(layer, "mtp.layers.0.") if name.startswith(layer) else name] = t
    gen = torch.Generator().manual_seed(3)
    h = config.hidden_size
    out["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen) * 0.2
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = torch.randn(h, generator=gen) * 0.1
    save_file(out, f"{target}/model.safetensors", metadata={"format": "pt"})
    cfg = json.load(open(f"{whole}/config.json"))
    cfg.update(num_hidden_layers=n, layer_types=config.layer_types, mtp_num_hidden_layers=1)
    if "mlp_only_layers" in cfg:
        cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < n]
    os.remove(f"{target}/config.json")
    json.dump(cfg, open(f"{target}/config.json", "w"))
    return {"target": target, "whole": whole}


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def models(request, tmp_path_factory) -> dict[str, str]:
    return _with_mtp(request.param, tmp_path_factory.mktemp(request.param))


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _prompts(path: str) -> list[list[int]]:
    return family_prompts(transformers.AutoConfig.from_pretrained(path).vocab_size)[:6]


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": None}


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identical_under_chunked_prefill_and_preemption(models, k):
    target = models["target"]
    prompts = _prompts(target)
    full = tokens(LLM(target, num_kv_blocks=160, **KW).generate(prompts, PARAMS))
    llm = LLM(target, num_kv_blocks=12, max_num_batched_tokens=16, speculative_config=mtp(k), **KW)
    drafter = llm.engine.drafter
    assert isinstance(drafter, HiddenDraft) and drafter.head.qwen
    assert tokens(llm.generate(prompts, PARAMS)) == full
    stats = llm.engine.stats()
    assert stats.spec_drafts > 0 and stats.num_preemptions > 0
    assert_books_whole(llm)
    assert drafter.pool.num_free == drafter.num_blocks and not drafter.fed
    drafter.check()


def test_drafts_equal_the_mtp_layer_from_transformers(tmp_path):
    """Each draft equals Qwen3-Next's MTP computed anew over the whole sequence: the target's
    final hidden states (after its norm), fc over [pre_fc_norm_embedding(embedding),
    pre_fc_norm_hidden(hidden)], transformers' Qwen3-Next layer (gated attention, partial
    rotary, MoE), mtp.norm, the LM head; each further draft fuses the previous normed output."""
    models = _with_mtp("qwen3_next", tmp_path)
    llm = LLM(models["target"], num_kv_blocks=160, max_num_batched_tokens=16,
              speculative_config=mtp(3), **KW)  # fmt: skip
    drafter = llm.engine.drafter
    seen = record_drafts(drafter)
    llm.generate(_prompts(models["target"])[2:5], SamplingParams(temperature=0.0, max_tokens=16))
    assert len(seen) > 10
    whole = transformers.AutoModelForCausalLM.from_pretrained(models["whole"]).eval()
    config = whole.config
    config._attn_implementation = "sdpa"
    n = config.num_hidden_layers - 1
    target = transformers.AutoModelForCausalLM.from_pretrained(models["target"]).eval()
    layer = whole.model.layers[n]
    layer.self_attn.config._attn_implementation = "sdpa"
    sd = load_file(f"{models['target']}/model.safetensors")
    norm_cls = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRMSNorm
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        norms[name].weight.data.copy_(sd[f"mtp.{name}.weight"])
    fc = sd["mtp.fc.weight"]
    rotary = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRotaryEmbedding(config)
    with torch.no_grad():
        for seq, got in seen:
            m = len(seq)
            hid = target.model(torch.tensor([seq[: m - 1]])).last_hidden_state
            ids, want = list(seq[1:]), []
            for _ in got:
                e = norms["pre_fc_norm_embedding"](target.model.embed_tokens(torch.tensor([ids])))
                x = torch.cat([e, norms["pre_fc_norm_hidden"](hid)], -1) @ fc.T
                pos = torch.arange(len(ids))[None]
                y = layer(x, position_embeddings=rotary(x, pos), position_ids=pos)
                y = norms["norm"](y[0] if isinstance(y, tuple) else y)
                want.append(int(target.lm_head(y[0, -1]).argmax()))
                ids.append(want[-1])
                hid = torch.cat([hid, y[:, -1:]], dim=1)
            assert got == want, (m, got, want)


def test_what_is_not_served_is_refused(tmp_path):
    models = _with_mtp("qwen3_5", tmp_path)
    target = models["target"]
    cfg_path = f"{target}/config.json"
    cfg = json.load(open(cfg_path))

    def with_config(**changes):
        json.dump({**cfg, **changes}, open(cfg_path, "w"))

    with_config(mtp_num_hidden_layers=0)
    with pytest.raises(ConfigError, match="no multi-token-prediction layers"):
        LLM(target, num_kv_blocks=40, speculative_config=mtp(1), **KW)
    with_config(mtp_use_dedicated_embeddings=True)
    with pytest.raises(ConfigError, match="embedding of its own"):
        LLM(target, num_kv_blocks=40, speculative_config=mtp(1), **KW)
    with_config()
    sd = load_file(f"{target}/model.safetensors")
    save_file({k: v for k, v in sd.items() if not k.startswith("mtp.layers.")},
              f"{target}/model.safetensors", metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(ConfigError, match="lacks the layer's tensors under mtp."):
        LLM(target, num_kv_blocks=40, speculative_config=mtp(1), **KW)

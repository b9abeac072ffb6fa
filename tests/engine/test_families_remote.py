"""Families whose code lives in their repositories (trust_remote_code), served as a described
shape under their own weight names. No remote code runs here: a tiny Llama checkpoint is
rewritten under the family's names and config fields (the config keeps model_type "llama", so
transformers reads it without the repository's code), and the engine's tokens on it must equal
transformers' Llama on the original."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.family_check import assert_matches_transformers
from tests.tiny_models import build_tiny_model


def _rewrite(src: str, dst: str, arch: str, extra: dict, rename) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads(open(f"{src}/config.json").read())
    cfg["architectures"] = [arch]
    cfg.update(extra)
    with open(f"{dst}/config.json", "w") as f:
        json.dump(cfg, f)
    state = load_file(f"{src}/model.safetensors")
    save_file(
        {k: v.contiguous() for k, v in rename(state, cfg).items()}, f"{dst}/model.safetensors"
    )
    return dst


def _internlm2(state, cfg):
    h, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // h
    g = h // kvh
    out = {
        "model.tok_embeddings.weight": state["model.embed_tokens.weight"],
        "model.norm.weight": state["model.norm.weight"],
        "output.weight": state["lm_head.weight"],
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        q = state[p + "self_attn.q_proj.weight"].view(kvh, g, d, -1)
        k = state[p + "self_attn.k_proj.weight"].view(kvh, 1, d, -1)
        v = state[p + "self_attn.v_proj.weight"].view(kvh, 1, d, -1)
        out[p + "attention.wqkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])
        out[p + "attention.wo.weight"] = state[p + "self_attn.o_proj.weight"]
        out[p + "feed_forward.w1.weight"] = state[p + "mlp.gate_proj.weight"]
        out[p + "feed_forward.w3.weight"] = state[p + "mlp.up_proj.weight"]
        out[p + "feed_forward.w2.weight"] = state[p + "mlp.down_proj.weight"]
        out[p + "attention_norm.weight"] = state[p + "input_layernorm.weight"]
        out[p + "ffn_norm.weight"] = state[p + "post_attention_layernorm.weight"]
    return out


def _qwen_v1(state, cfg):
    out = {
        "transformer.wte.weight": state["model.embed_tokens.weight"],
        "transformer.ln_f.weight": state["model.norm.weight"],
        "lm_head.weight": state["lm_head.weight"],
    }
    for i in range(cfg["num_hidden_layers"]):
        p, o = f"model.layers.{i}.", f"transformer.h.{i}."
        qkv = [state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
        out[o + "attn.c_attn.weight"] = torch.cat(qkv)
        out[o + "attn.c_attn.bias"] = torch.zeros(sum(t.shape[0] for t in qkv))
        out[o + "attn.c_proj.weight"] = state[p + "self_attn.o_proj.weight"]
        out[o + "mlp.w2.weight"] = state[p + "mlp.gate_proj.weight"]
        out[o + "mlp.w1.weight"] = state[p + "mlp.up_proj.weight"]
        out[o + "mlp.c_proj.weight"] = state[p + "mlp.down_proj.weight"]
        out[o + "ln_1.weight"] = state[p + "input_layernorm.weight"]
        out[o + "ln_2.weight"] = state[p + "post_attention_layernorm.weight"]
    return out


CASES = {
    "InternLM2ForCausalLM": (dict(num_key_value_heads=2), {"bias": False}, _internlm2),
    "QWenLMHeadModel": (
        dict(num_key_value_heads=4, rope_theta=5000.0, rms_norm_eps=1e-5),
        {
            "intermediate_size": 256,  # Qwen counts both halves of its MLP
            "kv_channels": 16,
            "layer_norm_epsilon": 1e-5,
            "rotary_emb_base": 5000.0,
            "rotary_pct": 1.0,
            "no_bias": True,
        },
        _qwen_v1,
    ),
}


@pytest.mark.parametrize("arch", list(CASES))
def test_remote_code_family_under_its_own_names(tmp_path, arch):
    llama_kw, extra, rename = CASES[arch]
    src = build_tiny_model(str(tmp_path / "llama"), "llama", **llama_kw)
    dst = _rewrite(src, str(tmp_path / arch), arch, extra, rename)
    assert_matches_transformers(dst, new_tokens=24, lengths=(2, 9, 33), reference=src, vocab=300)

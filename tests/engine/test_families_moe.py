"""Mixture-of-experts families against transformers (issue 17): a tiny random model from each
family's own config class (6 to 8 experts, top-2 or top-3, a shared expert and dense layers
where the family has them), 8 prompts of different lengths batched together, 48 greedy tokens
each; then with preemption and chunked prefill; then the load's peak memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

from serverless_llm import LLM, SamplingParams
from tests.engine.family_check import (
    NEW_TOKENS,
    family_models_fixture,
    family_prompts,
    greedy_family_test,
    tiny_dims,
)
from tests.engine.reference import hf_greedy
from tests.tiny_models import build_tokenizer


def _longrope(head_dim: int = 16) -> dict:
    """Phi-3.5-MoE's LongRoPE: cos and sin scaled by short_mscale (= long_mscale). A new dict
    each call: transformers edits the rope parameters it is given."""
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.3 * i for i in range(head_dim // 2)],
        "long_factor": [2.0 + i for i in range(head_dim // 2)],
        "short_mscale": 1.4,
        "long_mscale": 1.4,
        "original_max_position_embeddings": 4096,
    }


CONFIGS = {
    "mixtral": lambda tok: transformers.MixtralConfig(
        **tiny_dims(tok), num_local_experts=8, num_experts_per_tok=2, sliding_window=16
    ),
    # layer 1 dense (mlp_only_layers), a shared expert behind its sigmoid gate, no top-k
    # renormalisation
    "qwen2_moe": lambda tok: transformers.Qwen2MoeConfig(
        **tiny_dims(tok, num_hidden_layers=3),
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=96,
        mlp_only_layers=[1],
        norm_topk_prob=False,
    ),
    # every second layer sparse (decoder_sparse_step), top-k renormalised, q/k norms
    "qwen3_moe": lambda tok: transformers.Qwen3MoeConfig(
        **tiny_dims(tok, num_hidden_layers=3, head_dim=24),
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        decoder_sparse_step=2,
        norm_topk_prob=True,
    ),
    "olmoe": lambda tok: transformers.OlmoeConfig(
        **tiny_dims(tok), num_experts=8, num_experts_per_tok=2, clip_qkv=0.8
    ),
    "granitemoe": lambda tok: transformers.GraniteMoeConfig(
        **tiny_dims(tok),
        num_local_experts=6,
        num_experts_per_tok=3,
        embedding_multiplier=3.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=2.0,
    ),
    # fused Wqkv clipped, top-3 of 8 renormalised by the 2-norm, the rope base given where DBRX
    # checkpoints write it (attn_config) and where transformers 5 reads it
    "dbrx": lambda tok: transformers.DbrxConfig(
        **tiny_dims(tok, "mpt"),
        attn_config={"kv_n_heads": 2, "clip_qkv": 0.8, "rope_theta": 5000.0},
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        ffn_config={
            "ffn_hidden_size": 48,
            "moe_num_experts": 8,
            "moe_top_k": 3,
            "moe_normalize_expert_weights": 2.0,
        },
    ),
    # sparsemixer routing (a wide jitter threshold, so its softmaxes mix several experts),
    # LayerNorms with bias, q/k/v/o and LM-head biases, window 16
    "phimoe": lambda tok: transformers.PhimoeConfig(
        **tiny_dims(tok),
        num_local_experts=6,
        num_experts_per_tok=2,
        router_jitter_noise=0.2,
        attention_bias=True,
        lm_head_bias=True,
        sliding_window=16,
    ),
    "phimoe_longrope": lambda tok: transformers.PhimoeConfig(
        **tiny_dims(tok, max_position_embeddings=4 * 4096),
        num_local_experts=6,
        router_jitter_noise=0.2,
        rope_parameters=_longrope(),
    ),
}

family_models = family_models_fixture(CONFIGS)
test_moe_family_greedy_equals_transformers = greedy_family_test(CONFIGS)


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_moe_with_preemption_and_chunked_prefill(family_models, name):
    """A pool too small for the batch (requests preempted and recomputed) and prompts prefilled
    16 tokens a step: the same tokens as transformers."""
    path = family_models(name)
    prompts = family_prompts(len(build_tokenizer()))
    llm = LLM(
        path,
        block_size=8,
        num_kv_blocks=24,
        max_model_len=128,
        max_num_batched_tokens=16,
        dtype="float32",
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, NEW_TOKENS)


def test_moe_layers_and_router_follow_the_config(family_models, monkeypatch):
    """Qwen2-MoE's dense layer is a plain MLP, its sparse ones hold stacked experts; a
    checkpoint missing one expert's tensor names it."""
    from serverless_llm.engine.layers import linear
    from serverless_llm.engine.models.decoder import MLP, SparseMoE

    path = family_models("qwen2_moe")
    # bfloat16 on a CPU without bfloat16 arithmetic: the stacked weights stay (float32, and
    # bfloat16 where the CPU has it, are packed per expert for oneDNN)
    monkeypatch.setattr(linear, "cpu_has_bf16", lambda: False)
    llm = LLM(path, num_kv_blocks=32, max_model_len=128, dtype="bfloat16")
    kinds = [type(layer.mlp) for layer in llm.engine.model.layers]
    assert kinds == [SparseMoE, MLP, SparseMoE]
    moe = llm.engine.model.layers[0].mlp
    assert tuple(moe.experts.w13.weight.shape) == (8, 64, 64)
    assert tuple(moe.experts.w2.weight.shape) == (8, 64, 32)
    # expert 3's up rows hold the checkpoint's up_proj of expert 3
    from safetensors.torch import load_file, save_file

    state = load_file(os.path.join(path, "model.safetensors"))
    up = state["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert torch.equal(moe.experts.w13.weight[3, 32:], up.to(torch.bfloat16))
    packed = LLM(path, num_kv_blocks=32, max_model_len=128, dtype="float32")
    experts = packed.engine.model.layers[2].mlp.experts
    if experts.packed is not None:  # oneDNN's packed linear exists in this torch build
        assert [len(p) for p in experts.packed] == [8, 8] and not hasattr(experts, "w13")
    broken = os.path.join(os.path.dirname(path), "broken")
    os.makedirs(broken, exist_ok=True)
    for f in os.listdir(path):
        if f != "model.safetensors":
            with open(os.path.join(path, f), "rb") as src, open(os.path.join(broken, f), "wb") as d:
                d.write(src.read())
    del state["model.layers.2.mlp.experts.5.down_proj.weight"]
    save_file(state, os.path.join(broken, "model.safetensors"))
    with pytest.raises(KeyError, match="layers.2.mlp.experts.w2.weight"):
        LLM(broken, num_kv_blocks=32, max_model_len=128, dtype="float32")


def test_moe_dummy_weights_serve(family_models):
    """LOAD_FORMAT=dummy: random weights from the config alone, for any MoE shape."""
    llm = LLM(family_models("olmoe"), load_format="dummy", num_kv_blocks=32, max_model_len=128)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5


_PEAK_SCRIPT = """
import gc, json, os, sys
from serverless_llm import LLM

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key)) * 1024

warm = LLM(sys.argv[2], num_kv_blocks=16, max_model_len=64, dtype="float32")
warm_peak = status("VmHWM")
del warm
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM (the peak) to the current resident size
before = status("VmRSS")
llm = LLM(sys.argv[1], num_kv_blocks=16, max_model_len=64, dtype="float32")
peak = status("VmHWM")
weights = sum(os.path.getsize(os.path.join(sys.argv[1], f)) for f in os.listdir(sys.argv[1])
              if f.endswith(".safetensors"))
print(json.dumps({"before": before, "peak": peak, "weights": weights, "warm_peak": warm_peak}))
"""


def test_moe_load_peak_memory_stays_near_the_weights(tmp_path, family_models):
    """Loading a ~150 MB Qwen3-MoE checkpoint (20 MB shards) raises the process's peak resident
    memory by less than 1.3x the model's weight bytes: each expert tensor goes straight into its
    slice of the stacked weights, with no second copy of the model at any point (the CPU
    packing after the load writes each expert's panels over its own slice, one expert's
    projection held twice at a time). A tiny MoE
    model is loaded first in the same process, so imports and the tokenizer are not counted; the
    rest over 1.0x is the shard being read (its mapped pages count as resident)."""
    tok = build_tokenizer()
    config = transformers.Qwen3MoeConfig(
        **tiny_dims(tok, hidden_size=512, num_hidden_layers=4, num_attention_heads=8),
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=768,
    )
    path = str(tmp_path / "big")
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, max_shard_size="20MB")
    tok.save_pretrained(path)
    del model
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, path, family_models("qwen3_moe")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["weights"] > 140e6
    growth = (got["peak"] - got["before"]) / got["weights"]
    print(f"MoE load: peak RSS growth {growth:.2f}x the weights ({got['weights'] / 1e6:.0f} MB)")
    assert growth < 1.3, got


def test_moe_routing_matches_transformers_routers():
    """`route` against each family's own router module on the same logits' source."""
    from serverless_llm.engine.layers.moe import route

    torch.manual_seed(0)
    x = torch.randn(9, 16)
    cases = [
        (transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter,
         transformers.MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2),
         "softmax_topk", True),
        (transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter,
         transformers.Qwen2MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                     norm_topk_prob=False),
         "softmax_topk", False),
        (transformers.models.granitemoe.modeling_granitemoe.GraniteMoeTopKRouter,
         transformers.GraniteMoeConfig(hidden_size=16, num_local_experts=6, num_experts_per_tok=3),
         "topk_softmax", False),
        (transformers.models.phimoe.modeling_phimoe.PhimoeTopKRouter,
         transformers.PhimoeConfig(hidden_size=16, num_local_experts=8, router_jitter_noise=0.01),
         "sparsemixer", False),
        (transformers.models.phimoe.modeling_phimoe.PhimoeTopKRouter,
         transformers.PhimoeConfig(hidden_size=16, num_local_experts=6, router_jitter_noise=0.3),
         "sparsemixer", False),
    ]  # fmt: skip
    for cls, config, routing, renorm in cases:
        router = cls(config).eval()  # PhiMoE samples its experts in training mode
        torch.nn.init.normal_(router.weight)
        _, ref_w, ref_ids = router(x)
        eps = getattr(config, "router_jitter_noise", 0.0)
        w, ids = route(x @ router.weight.t(), ref_ids.shape[1], routing, renorm, eps)
        assert torch.equal(ids, ref_ids), cls.__name__
        torch.testing.assert_close(w.to(ref_w.dtype), ref_w)


@pytest.mark.parametrize("p", [None, 1.0, 2.0, 0.5])
def test_moe_routing_matches_dbrx_normalisation(p):
    """DBRX's softmax, top-k and p-norm renormalisation (moe_normalize_expert_weights)."""
    from serverless_llm.engine.layers.moe import route

    torch.manual_seed(1)
    config = transformers.DbrxConfig(
        d_model=16,
        attn_config={"rope_theta": 10000.0},
        ffn_config={"moe_num_experts": 8, "moe_top_k": 3, "moe_normalize_expert_weights": p},
    )
    logits = torch.randn(11, 8) * 3
    ffn = transformers.models.dbrx.modeling_dbrx.DbrxFFN(config)
    ref_w, ref_ids = ffn.route_tokens_to_experts(logits)
    w, ids = route(logits, 3, "softmax_topk", False if p is None else p)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w)


def test_dbrx_rope_base_from_attn_config():
    """DBRX checkpoints write the rope base in attn_config (500000 for dbrx-instruct), which
    transformers 5 no longer reads: the engine does; without it, rope_parameters'."""
    from serverless_llm.engine.models.families_moe import dbrx

    raw = {
        "architectures": ["DbrxForCausalLM"],
        "d_model": 64,
        "n_heads": 4,
        "n_layers": 2,
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8, "rope_theta": 500000},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    }
    spec = dbrx(transformers.DbrxConfig.from_dict(raw))
    assert spec.rope[0].params_dict()["rope_theta"] == 500000
    assert (spec.clip_qkv, spec.num_kv_heads, spec.moe.renormalize) == (8, 2, 1.0)
    del raw["attn_config"]["rope_theta"]
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 20000.0}
    spec = dbrx(transformers.DbrxConfig.from_dict(raw))
    assert spec.rope[0].params_dict()["rope_theta"] == 20000.0


@pytest.mark.parametrize("top_k", [1, 2, 3, 8])
def test_experts_forward_against_a_token_loop(top_k):
    """The grouped torch path against the plain definition, token by token: experts that get no
    token, one token, or every token."""
    from serverless_llm.engine.layers.moe import experts_forward

    g = torch.Generator().manual_seed(top_k)
    E, H, inter, T = 8, 24, 40, 13
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter**0.5
    scores = torch.randn(T, E, generator=g)
    scores[:, 0] += 100  # expert 0: every token
    scores[:, 5] -= 100  # expert 5: no token (unless top_k takes them all)
    scores[4, 6] += 50  # expert 6: token 4 at least
    ids = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(T, top_k, generator=g)

    def act(h):
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    got = experts_forward(x, w13, w2, weights, ids, "silu", use_kernels=False)
    want = torch.zeros_like(x)
    for t in range(T):
        for j in range(top_k):
            e = int(ids[t, j])
            want[t] += weights[t, j] * (w2[e] @ act(w13[e] @ x[t]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

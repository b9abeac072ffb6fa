"""The 2025 MoE families on DeepSeek's kind of router (issue 37), and Seed-OSS, against
transformers: a tiny random model of each from its own config class with its characteristic
options on (grouped sigmoid routing with a correction bias large enough to change choices,
shared experts, dense first layers, partial rotary, q/k norms, windows, ERNIE's MoE interval and
biases), 8 prompts of different lengths batched together, 48 greedy tokens each. Then each
router against transformers' own module (DeepSeek V2 and V3 too, whose attention is MLA), the
DeepSeek MoE description that the MLA family builds on, and the refusals."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from serverless_llm.engine.layers.moe import BiasedRouter, route
from serverless_llm.engine.models.registry import UnsupportedModelError, describe_model
from tests.engine.family_check import (
    engine_greedy,
    family_prompts,
    greedy_family_test,
    save_family_model,
    tiny_dims,
)
from tests.tiny_models import build_tokenizer

CONFIGS = {
    # 8 experts in 4 groups (the best 2 kept), top-2 renormalised and scaled, one shared expert,
    # a dense first layer, q/k/v biases, per-head q/k norms, rotary over half of each head
    "glm4_moe": lambda tok: transformers.Glm4MoeConfig(
        **tiny_dims(tok, num_hidden_layers=3),
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.8,
        use_qk_norm=True,
        attention_bias=True,
    ),
    # Qwen 3's attention with windows of 16 on layers 1 and 2; top-3 of 8 in 2 groups (the best
    # one kept), not renormalised, scaled, two shared experts, a dense first layer
    "dots1": lambda tok: transformers.Dots1Config(
        **tiny_dims(tok, num_hidden_layers=3),
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=False,
        routed_scaling_factor=2.5,
        sliding_window=16,
        max_window_layers=1,
    ),
    # MoE on layers 1 and 3 (interval 2 from index 1), softmax routing with the correction bias,
    # a shared expert, biases everywhere (use_bias), tied embeddings with an LM-head bias,
    # interleaved-pairs rotary
    "ernie4_5_moe": lambda tok: transformers.Ernie4_5_MoeConfig(
        **tiny_dims(tok, num_hidden_layers=4),
        moe_intermediate_size=32,
        moe_num_experts=8,
        moe_k=2,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        moe_layer_interval=2,
        use_bias=True,
        tie_word_embeddings=True,
    ),
    "seed_oss": lambda tok: transformers.SeedOssConfig(
        **tiny_dims(tok, head_dim=24),
        attention_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
    ),
    # q and k normed over all heads, rotary over 12 of 24 dims (rotary_dim, as released configs
    # say it), sigmoid routing with the correction bias on every layer
    "minimax_m2": lambda tok: transformers.MiniMaxM2Config(
        **tiny_dims(tok, intermediate_size=32, head_dim=24),
        num_local_experts=8,
        num_experts_per_tok=2,
        rotary_dim=12,
    ),
}

# the correction bias's spread per family: comparable to the spread of its scores
BIAS_STD = {"glm4_moe": 0.3, "dots1": 0.3, "minimax_m2": 0.3, "ernie4_5_moe": 0.05}


def save_with_biases(path: str, config, bias_std: float = 0.3) -> str:
    """`save_family_model`, then random score correction biases (a buffer, which it leaves at
    zero) written into the checkpoint, where transformers and the engine both read them."""
    save_family_model(path, config)
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    g = torch.Generator().manual_seed(7)
    for name, t in state.items():
        if name.endswith("e_score_correction_bias"):
            state[name] = (torch.randn(t.shape, generator=g) * bias_std).to(t.dtype)
    save_file(state, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", name="family_models")
def family_models_with_biases(tmp_path_factory):
    tokenizer = build_tokenizer()
    saved: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in saved:
            path = str(tmp_path_factory.mktemp(name))
            saved[name] = save_with_biases(path, CONFIGS[name](tokenizer), BIAS_STD.get(name, 0))
        return saved[name]

    return get


test_moe2_family_greedy_equals_transformers = greedy_family_test(CONFIGS)


def test_specs_follow_the_configs(family_models):
    """The layers each family builds: GLM-4.5's dense first layer and partial rotary, dots.llm1's
    windows, ERNIE's interval and biases, MiniMax-M2's all-sparse layers; the correction biases
    of the checkpoint are loaded (ERNIE's [1, E] from mlp.moe_statics)."""
    from serverless_llm import LLM
    from serverless_llm.engine.models.decoder import MLP, SparseMoE

    def load(name):
        path = family_models(name)
        llm = LLM(path, block_size=8, num_kv_blocks=64, max_model_len=128, dtype="float32")
        return llm.engine.model

    glm = load("glm4_moe")
    assert [type(layer.mlp) for layer in glm.layers] == [MLP, SparseMoE, SparseMoE]
    s = glm.spec
    assert s.moe.groups == (4, 2) and s.moe.shared_size == 32 and s.moe.routed_scale == 1.8
    assert s.rope[0].rot_dim == s.head_dim // 2 and s.qkv_bias and not s.o_bias
    state = load_file(os.path.join(family_models("glm4_moe"), "model.safetensors"))
    bias = state["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert bias.abs().max() > 0.1
    assert torch.equal(glm.layers[2].mlp.gate.e_score_correction_bias.data, bias)

    dots = load("dots1").spec
    assert dots.windows == (None, 16, 16) and dots.moe.shared_size == 64
    assert dots.moe_layers == (False, True, True) and dots.moe.renormalize is False

    ernie = load("ernie4_5_moe")
    assert ernie.spec.moe_layers == (False, True, False, True)
    assert ernie.spec.moe.routing == "softmax_biased" and not ernie.spec.rope[0].is_neox
    assert ernie.spec.lm_head_bias and ernie.spec.tied and ernie.spec.o_bias
    state = load_file(os.path.join(family_models("ernie4_5_moe"), "model.safetensors"))
    bias = state["model.layers.3.mlp.moe_statics.e_score_correction_bias"]
    assert bias.shape == (1, 8)
    assert torch.equal(ernie.layers[3].mlp.gate.e_score_correction_bias.data, bias[0])

    mm = load("minimax_m2").spec
    assert mm.moe_layers == (True, True) and mm.qk_norm == "rms_full"
    assert mm.rope[0].rot_dim == 12 and mm.moe.shared_size == 0


def test_moe2_with_preemption_and_chunked_prefill(family_models):
    """GLM-4.5 with a pool too small for the batch (requests preempted and recomputed) and
    prompts prefilled 16 tokens a step: the same tokens as transformers."""
    from serverless_llm import LLM, SamplingParams
    from tests.engine.reference import hf_greedy

    path = family_models("glm4_moe")
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
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 48)


# -- routers against transformers' modules ---------------------------------------------------


def _sorted(weights, ids):
    order = ids.argsort(-1)
    return weights.gather(1, order), ids.gather(1, order)


def _assert_same_routing(got, want):
    (gw, gi), (ww, wi) = _sorted(*got), _sorted(*want)
    assert torch.equal(gi, wi)
    torch.testing.assert_close(gw, ww.float())


def _v3_like(cls_config, router_cls, **kw):
    config = cls_config(hidden_size=32, **kw)
    router = router_cls(config)
    torch.nn.init.normal_(router.weight, std=0.3)
    router.e_score_correction_bias.normal_(std=0.5)
    return config, router


@pytest.mark.parametrize(
    "kind, groups, norm",
    [("deepseek_v3", (8, 3), True), ("deepseek_v3", (1, 1), False), ("glm4_moe", (4, 2), True),
     ("dots1", (2, 1), False)],
)  # fmt: skip
def test_sigmoid_grouped_routing_equals_transformers(kind, groups, norm):
    """DeepSeek-V3's, GLM-4.5's and dots.llm1's routers: groups ranked by their two best biased
    scores, the bias in the choice only, renormalised or not, scaled."""
    from serverless_llm.engine.models.families_moe2 import deepseek_moe

    mods = {
        "deepseek_v3": (transformers.DeepseekV3Config, "deepseek_v3", "DeepseekV3TopkRouter"),
        "glm4_moe": (transformers.Glm4MoeConfig, "glm4_moe", "Glm4MoeTopkRouter"),
        "dots1": (transformers.Dots1Config, "dots1", "Dots1TopkRouter"),
    }
    cls, module, name = mods[kind]
    router_cls = getattr(getattr(transformers.models, module), f"modeling_{module}").__dict__[name]
    torch.manual_seed(0)
    config, ref = _v3_like(
        cls,
        router_cls,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=groups[0],
        topk_group=groups[1],
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
    )
    moe = deepseek_moe(config)
    assert (moe.routing, moe.groups, moe.renormalize) == ("sigmoid_grouped", groups, norm)
    ours = BiasedRouter(32, 16)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(200, 32)
    _, want_w, want_ids = ref(x)
    got = route(
        ours(x),
        moe.top_k,
        moe.routing,
        moe.renormalize,
        score_bias=ours.e_score_correction_bias,
        groups=moe.groups,
        scale=moe.routed_scale,
    )
    _assert_same_routing(got, (want_w, want_ids))


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_routing_equals_transformers(method):
    """DeepSeek-V2's router: softmax, greedy or limited to the groups with the best
    probabilities (the others' probabilities zeroed), not renormalised, scaled."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from serverless_llm.engine.models.families_moe2 import deepseek_moe

    config = transformers.DeepseekV2Config(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=5,
        n_group=4,
        topk_group=2,
        topk_method=method,
        routed_scaling_factor=1.5,
    )
    torch.manual_seed(1)
    ref = DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(ref.weight, std=0.5)
    moe = deepseek_moe(config)
    assert moe.routing == "softmax_grouped"
    assert moe.groups == ((4, 2) if method == "group_limited_greedy" else (1, 1))
    ours = BiasedRouter(32, 16, bias=False)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(200, 32)
    _, want_w, want_ids = ref(x)
    got = route(ours(x), moe.top_k, moe.routing, moe.renormalize, groups=moe.groups,
                scale=moe.routed_scale)  # fmt: skip
    _assert_same_routing(got, (want_w, want_ids))
    if method == "group_limited_greedy":  # the groups matter on these tokens
        _, flat = route(ours(x), moe.top_k, moe.routing, False)
        assert not torch.equal(flat.sort(-1)[0], got[1].sort(-1)[0])


def test_ernie_and_minimax_routing_equal_transformers():
    """ERNIE 4.5's router (softmax, the bias in the choice, the sum floored at moe_norm_min) and
    MiniMax-M2's (sigmoid, the bias in the choice, renormalised), on tokens where the bias
    changes the choice."""
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2SparseMoeBlock

    torch.manual_seed(2)
    x = torch.randn(200, 32)
    config = transformers.Ernie4_5_MoeConfig(hidden_size=32, moe_num_experts=8, moe_k=3)
    ref = Ernie4_5_MoeTopKRouter(config)
    torch.nn.init.normal_(ref.weight, std=0.3)
    ref.moe_statics.e_score_correction_bias.data.normal_(std=0.05)
    ours = BiasedRouter(32, 8)
    ours.weight.data.copy_(ref.weight.data)
    ours.e_score_correction_bias.data.copy_(ref.moe_statics.e_score_correction_bias.data[0])
    _, want_w, want_ids = ref(x)
    got = route(ours(x), 3, "softmax_biased", True, score_bias=ours.e_score_correction_bias,
                norm_floor=config.moe_norm_min)  # fmt: skip
    _assert_same_routing(got, (want_w, want_ids))
    unbiased = route(ours(x), 3, "softmax_biased", True, norm_floor=config.moe_norm_min)
    assert not torch.equal(unbiased[1].sort(-1)[0], got[1].sort(-1)[0])

    config = transformers.MiniMaxM2Config(
        hidden_size=32, num_local_experts=8, num_experts_per_tok=2, intermediate_size=8
    )
    block = MiniMaxM2SparseMoeBlock(config)
    torch.nn.init.normal_(block.gate.weight, std=0.3)
    block.e_score_correction_bias.normal_(std=0.3)
    _, want_w, want_ids = block.gate(x, block.e_score_correction_bias)
    ours = BiasedRouter(32, 8)
    ours.weight.data.copy_(block.gate.weight.data)
    ours.e_score_correction_bias.data.copy_(block.e_score_correction_bias)
    got = route(ours(x), 2, "sigmoid_grouped", True, score_bias=ours.e_score_correction_bias)
    _assert_same_routing(got, (want_w, want_ids))


# -- DeepSeek's MoE description (for the MLA family) -------------------------------------------


def _deepseek_config(kind: str, **kw):
    shape = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=2,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
    )
    shape.update(kw)
    cls = transformers.DeepseekV3Config if kind == "v3" else transformers.DeepseekV2Config
    return cls(**shape)


@pytest.mark.parametrize("kind", ["v2", "v3"])
def test_deepseek_moe_description_covers_its_checkpoint(tmp_path, kind):
    """`deepseek_moe`, `deepseek_moe_layers` and `deepseek_moe_names` describe every MLP tensor
    of a DeepSeek checkpoint saved by transformers: the dense first layer's (Llama's names), the
    router (and V3's correction bias), each expert's and the shared experts'."""
    from serverless_llm.engine.models.decoder import WeightNames
    from serverless_llm.engine.models.families import LLAMA_LAYER
    from serverless_llm.engine.models.families_moe2 import (
        deepseek_moe,
        deepseek_moe_layers,
        deepseek_moe_names,
    )

    config = _deepseek_config(kind, n_group=4, topk_group=2)
    moe = deepseek_moe(config)
    assert deepseek_moe_layers(config) == (False, True, True)
    assert moe.shared_size == 32 and moe.num_experts == 8 and moe.intermediate_size == 16
    assert moe.routing == ("softmax_grouped" if kind == "v2" else "sigmoid_grouped")
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    names = WeightNames("model.layers", {**LLAMA_LAYER, **deepseek_moe_names(8)}, {})
    mlp = [n for n in load_file(tmp_path / "model.safetensors") if ".mlp." in n]
    assert any(n.endswith("shared_experts.down_proj.weight") for n in mlp)
    assert any(n.endswith("mlp.gate_proj.weight") for n in mlp)  # the dense layer
    assert (kind == "v3") == any("e_score_correction_bias" in n for n in mlp)
    for name in mlp:
        local, _, kind_ = name.partition(".mlp.")[2].rpartition(".")
        local = "mlp." + local if local else "mlp"
        assert local in names.layer or f"{local}.{kind_}" in names.layer, name


@pytest.mark.parametrize(
    "kind, option, value, match",
    [
        ("v3", "topk_method", "greedy", "topk_method"),
        ("v3", "scoring_func", "softmax", "scoring_func"),
        ("v3", "moe_layer_freq", 2, "moe_layer_freq"),
        ("v2", "topk_method", "noaux_tc", "topk_method"),
        ("v2", "norm_topk_prob", True, "norm_topk_prob"),
    ],
)
def test_deepseek_moe_options_transformers_ignores_are_refused(kind, option, value, match):
    from serverless_llm.engine.models.families_moe2 import deepseek_moe

    config = _deepseek_config(kind)
    setattr(config, option, value)
    with pytest.raises(ValueError, match=match):
        deepseek_moe(config)


# -- refusals ----------------------------------------------------------------------------------


def test_hy_v4_is_refused_naming_the_mechanisms():
    config = transformers.HYV4Config(architectures=["HYV4ForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="hyper-connections.*sparse attention"):
        describe_model(config)


@pytest.mark.parametrize(
    "option, value, match",
    [
        ("attn_type_list", [1, 0], "lightning"),
        ("use_qk_norm", False, "use_qk_norm"),
        ("scoring_func", "softmax", "scoring_func"),
        ("shared_intermediate_size", 64, "shared_intermediate_size"),
    ],
)
def test_minimax_m2_options_transformers_ignores_are_refused(option, value, match):
    config = CONFIGS["minimax_m2"](build_tokenizer())
    config.architectures = ["MiniMaxM2ForCausalLM"]
    setattr(config, option, value)
    with pytest.raises(UnsupportedModelError, match=match):
        describe_model(config)


def test_mtp_layers_in_the_checkpoint_are_skipped(tmp_path, family_models):
    """GLM-4.5's checkpoints carry its multi-token-prediction layer as model.layers.<L>: the
    engine skips it as transformers does."""
    src = family_models("glm4_moe")
    for f in os.listdir(src):
        if f != "model.safetensors":
            with open(os.path.join(src, f), "rb") as a, open(tmp_path / f, "wb") as b:
                b.write(a.read())
    state = load_file(os.path.join(src, "model.safetensors"))
    state["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    state["model.layers.3.mlp.experts.0.up_proj.weight"] = torch.zeros(32, 64)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    prompts = family_prompts(len(build_tokenizer()), lengths=(5,))
    assert engine_greedy(str(tmp_path), prompts, 4) == engine_greedy(src, prompts, 4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_ranks_equal_transformers(family_models, name):
    """Tensor parallelism over 2 ranks (threads of one process, gloo): each rank holds half of
    every expert's width, of the shared experts' and of the heads, the routers whole; the
    prompt's logits equal transformers'."""
    from tests.engine.reference import hf_model
    from tests.engine.tp_harness import sharded_logits

    path = family_models(name)
    ids = family_prompts(len(build_tokenizer()), lengths=(20,))[0]
    logits = sharded_logits(path, ids, size=2)["logits"]
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=2e-4)


def test_router_keeps_float32_in_a_bfloat16_model(family_models):
    """As transformers keeps them: the correction bias stays float32 in a bfloat16 model (its
    checkpoint values exactly), and ERNIE's router weight too; GLM's weight follows the model."""
    from serverless_llm import LLM

    def router(name, layer):
        path = family_models(name)
        llm = LLM(path, block_size=8, num_kv_blocks=64, max_model_len=128, dtype="bfloat16")
        state = load_file(os.path.join(path, "model.safetensors"))
        return llm.engine.model.layers[layer].mlp.gate, state

    gate, state = router("glm4_moe", 1)
    assert gate.weight.dtype == torch.bfloat16
    assert gate.e_score_correction_bias.dtype == torch.float32
    want = state["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(gate.e_score_correction_bias.data, want)
    gate, state = router("ernie4_5_moe", 1)
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(gate.weight.data, state["model.layers.1.mlp.gate.weight"])

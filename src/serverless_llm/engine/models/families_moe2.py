"""The 2025 mixture-of-experts families on DeepSeek's kind of router, and Seed-OSS.

DeepSeek's MoE block (V2 and V3, and the families that took it over) differs from Mixtral's in
its router and its extras, all in `route` (layers/moe.py) and `MoESpec` (decoder.py), the
experts' kernel unchanged:

- scores: V3 and its followers (GLM-4.5, dots.llm1, MiniMax-M2) take the sigmoid of the router
  logits and choose by score + `e_score_correction_bias` ("sigmoid_grouped"); V2 a softmax
  ("softmax_grouped"); ERNIE 4.5 a softmax with the correction bias ("softmax_biased");
- group-limited top-k: the experts in `n_group` equal groups, only the best `topk_group` groups
  considered (V3: a group ranked by the sum of its two best biased scores; V2: by its best
  probability, `topk_method` "group_limited_greedy");
- the weights are the chosen experts' unbiased scores, divided by their sum when
  `norm_topk_prob` (V2 in transformers never), times `routed_scaling_factor`;
- shared experts: `n_shared_experts` MLPs of `moe_intermediate_size` as one wider MLP that every
  token goes through, ungated;
- dense first layers (`first_k_dense_replace`); ERNIE's MoE layers every `moe_layer_interval`-th
  between `moe_layer_start_index` and `moe_layer_end_index`.

None of the families served here has zero-compute ("identity") experts; in transformers 5.23
only LongCat-Flash does, and it is not served.

`deepseek_moe`, `deepseek_moe_layers`, `deepseek_moe_names` and `mtp_skips` describe a DeepSeek
V2/V3 MoE block for a family whose attention is described elsewhere (DeepSeek's MLA).

Options that the original checkpoints carry but transformers does not read (`topk_method`
"noaux_tc", `scoring_func`, `moe_layer_freq`, MiniMax-M2's `attn_type_list`...) are refused
when they ask for something transformers would not compute, rather than silently run as
transformers runs them.
"""

from __future__ import annotations

from .decoder import DecoderSpec, MoESpec, expert_names
from .families import family, head_dim_of, llama_like, llama_names, rope_of

QK_NORMS = {"self_attn.q_norm": "self_attn.q_norm", "self_attn.k_norm": "self_attn.k_norm"}


# -- DeepSeek's MoE block ----------------------------------------------------------------------


def _refuse(config, key: str, allowed: tuple, what: str) -> None:
    value = getattr(config, key, None)
    if value is not None and value not in allowed:
        raise ValueError(f"{key} {value!r} is not supported ({what})")


def _is_v2(config) -> bool:
    return getattr(config, "model_type", None) == "deepseek_v2"


def deepseek_moe(config) -> MoESpec:
    """The MoE block of a DeepSeek-V2/V3-style config (DeepSeek V2, V3, Kimi K2, GLM-4.5,
    dots.llm1): `n_routed_experts` experts of `moe_intermediate_size`, `num_experts_per_tok`
    of them per token, `n_shared_experts` shared ones. V2 (model_type "deepseek_v2") routes by
    softmax, greedy or group-limited by `topk_method`, never renormalised; the others by sigmoid
    with the score correction bias, groups and `norm_topk_prob`. ValueError for what
    transformers does not compute (see the module's note)."""
    every = "transformers puts a MoE in every layer after the first_k_dense_replace dense ones"
    _refuse(config, "moe_layer_freq", (1,), every)
    e = config.n_routed_experts
    shared = config.moe_intermediate_size * (getattr(config, "n_shared_experts", None) or 0)
    n_group = getattr(config, "n_group", None) or 1
    topk_group = getattr(config, "topk_group", None) or n_group
    kw = dict(
        num_experts=e,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        shared_size=shared,
        routed_scale=float(getattr(config, "routed_scaling_factor", None) or 1.0),
    )
    if _is_v2(config):
        _refuse(config, "scoring_func", ("softmax",), "DeepSeek-V2 scores by softmax")
        method = getattr(config, "topk_method", None) or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"topk_method {method!r} is not supported (greedy or group_limited_greedy)"
            )
        if getattr(config, "norm_topk_prob", False):
            raise ValueError(
                "norm_topk_prob true is not supported (transformers' DeepSeek-V2 never "
                "renormalises the top-k weights)"
            )
        groups = (n_group, topk_group) if method == "group_limited_greedy" else (1, 1)
        return MoESpec(**kw, routing="softmax_grouped", groups=groups)
    _refuse(config, "scoring_func", ("sigmoid",), "DeepSeek-V3's router scores by sigmoid")
    _refuse(config, "topk_method", ("noaux_tc",), "DeepSeek-V3's router is noaux_tc")
    return MoESpec(
        **kw,
        routing="sigmoid_grouped",
        renormalize=bool(getattr(config, "norm_topk_prob", False)),
        groups=(n_group, topk_group),
    )


def deepseek_moe_layers(config) -> tuple[bool, ...]:
    """Per layer, whether its MLP is the MoE block: every layer from `first_k_dense_replace`
    on (the first ones are dense MLPs of intermediate_size)."""
    first = getattr(config, "first_k_dense_replace", None) or 0
    return tuple(i >= first for i in range(config.num_hidden_layers))


def deepseek_moe_names(num_experts: int) -> dict:
    """`WeightNames.layer` entries of a DeepSeek-style MLP: the router (`mlp.gate`: its weight and
    e_score_correction_bias), each expert's gate/up/down (`mlp.experts.<e>.gate_proj` ...; also
    transformers 5's stacked `mlp.experts.gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]),
    the shared experts (`mlp.shared_experts.*`). A dense layer's MLP (`mlp.gate_proj` ...) is
    Llama's (`llama_names`)."""
    return {
        "mlp.gate": "mlp.gate",
        **expert_names("mlp.experts", num_experts, "gate_proj", "up_proj", "down_proj"),
        "mlp.experts.gate_up_proj": "mlp.experts.w13",
        "mlp.experts.down_proj": "mlp.experts.w2",
        "mlp.shared_experts.gate_proj": ("mlp.shared_expert.gate_up_proj", "gate"),
        "mlp.shared_experts.up_proj": ("mlp.shared_expert.gate_up_proj", "up"),
        "mlp.shared_experts.down_proj": "mlp.shared_expert.down_proj",
    }


def mtp_skips(config, count: int | None = None) -> tuple[str, ...]:
    """Checkpoint prefixes of the multi-token-prediction layers that DeepSeek-V3, GLM-4.5 and
    MiniMax-M2 store after the last decoder layer (`model.layers.<L>` ...), which the engine
    does not run (as transformers does not load them). `count`: how many; default the
    config's num_nextn_predict_layers (or num_mtp_layers)."""
    if count is None:
        count = getattr(config, "num_nextn_predict_layers", None)
        if count is None:
            count = getattr(config, "num_mtp_layers", None) or 0
    n = config.num_hidden_layers
    return tuple(f"model.layers.{i}." for i in range(n, n + count))


def _with_skips(names, skips: tuple[str, ...]):
    names.skip_prefixes = tuple(names.skip_prefixes) + tuple(skips)
    return names


# -- families ----------------------------------------------------------------------------------


@family("Glm4MoeForCausalLM")
def glm4_moe(config) -> DecoderSpec:
    # GLM-4.5/4.6: Llama's attention with q/k/v biases (attention_bias; o_proj has none), q/k
    # RMSNorm per head when use_qk_norm, rotary over partial_rotary_factor of each head (halves
    # layout, 0.5 by default); DeepSeek-V3's MoE after first_k_dense_replace dense layers.
    qk = bool(getattr(config, "use_qk_norm", False))
    moe = deepseek_moe(config)
    names = llama_names(**deepseek_moe_names(moe.num_experts), **(QK_NORMS if qk else {}))
    return llama_like(
        config,
        names=_with_skips(names, mtp_skips(config)),
        o_bias=False,
        qk_norm="rms_head" if qk else None,
        windows=(None,) * config.num_hidden_layers,
        moe=moe,
        moe_layers=deepseek_moe_layers(config),
    )


@family("Dots1ForCausalLM")
def dots1(config) -> DecoderSpec:
    # dots.llm1: Qwen 3's attention (per-head q/k RMSNorm, windows on the "sliding_attention"
    # layers of layer_types) and DeepSeek-V3's MoE after first_k_dense_replace dense layers.
    moe = deepseek_moe(config)
    names = llama_names(**deepseek_moe_names(moe.num_experts), **QK_NORMS)
    return llama_like(
        config,
        names=names,
        qk_norm="rms_head",
        moe=moe,
        moe_layers=deepseek_moe_layers(config),
    )


def _ernie_moe_layers(config) -> tuple[bool, ...]:
    """ERNIE 4.5's MoE layers: every moe_layer_interval-th, from moe_layer_start_index to
    moe_layer_end_index (-1: the last layer) inclusive."""
    n = config.num_hidden_layers
    interval = config.moe_layer_interval
    start = config.moe_layer_start_index
    end = config.moe_layer_end_index
    end = n - 1 if end is None or end == -1 else end
    return tuple((i + 1) % interval == 0 and start <= i <= end for i in range(n))


@family("Ernie4_5_MoeForCausalLM")
def ernie4_5_moe(config) -> DecoderSpec:
    # ERNIE 4.5 MoE: Llama with use_bias on q/k/v/o, the dense and shared MLPs and the LM head;
    # rotary in the interleaved-pairs layout; "softmax_biased" routing (softmax, chosen with the
    # correction bias, renormalised against moe_norm_min); shared experts ungated. Checkpoints
    # keep the bias in `mlp.moe_statics` ([1, E]), transformers in `mlp.gate.moe_statics`.
    e = config.num_experts
    if not isinstance(e, int):
        raise ValueError(f"moe_num_experts {e!r}: one number of experts (text models) expected")
    bias = bool(getattr(config, "use_bias", False))
    shared = config.moe_intermediate_size * (config.moe_num_shared_experts or 0)
    moe = MoESpec(
        num_experts=e,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        routing="softmax_biased",
        renormalize=True,
        norm_floor=float(config.moe_norm_min or 0.0),
        shared_size=shared,
        float32_router=True,  # transformers keeps gate.weight in float32
    )
    names = llama_names(
        **deepseek_moe_names(e),
        **{"mlp.moe_statics": "mlp.gate", "mlp.gate.moe_statics": "mlp.gate"},
    )
    # the multi-token-prediction block (mtp_block, mtp_emb_norm, ...) is not run
    names = _with_skips(names, ("model.mtp", "mtp"))
    return llama_like(
        config,
        names=names,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        lm_head_bias=bias,
        rope=rope_of(config, head_dim_of(config), is_neox=False),
        moe=moe,
        moe_layers=_ernie_moe_layers(config),
    )


@family("SeedOssForCausalLM")
def seed_oss(config) -> DecoderSpec:
    # Seed-OSS: Llama with q/k/v biases (attention_bias), an o_proj bias of its own
    # (attention_out_bias) and MLP biases (mlp_bias); dropout only in training.
    return llama_like(
        config,
        qkv_bias=bool(getattr(config, "attention_bias", True)),
        o_bias=bool(getattr(config, "attention_out_bias", False)),
    )


def _refuse_minimax_m2_options(config) -> None:
    """MiniMax-M2's released config carries options transformers does not read; each is
    refused when it asks for something other than what transformers computes."""
    kinds = getattr(config, "attn_type_list", None)
    if kinds and any(k != 1 for k in kinds):
        linear = [i for i, k in enumerate(kinds) if k != 1]
        raise ValueError(
            f"lightning (linear) attention layers (attn_type_list 0 at layers {linear}) are not "
            "supported; MiniMax-M2 in transformers attends with softmax on every layer"
        )
    if getattr(config, "use_qk_norm", True) is False:
        raise ValueError("use_qk_norm false (transformers' MiniMax-M2 always norms q and k)")
    _refuse(config, "qk_norm_type", ("per_layer",), "q and k are normed over all heads")
    _refuse(config, "scoring_func", ("sigmoid",), "MiniMax-M2's router scores by sigmoid")
    if getattr(config, "use_routing_bias", True) is False:
        raise ValueError("use_routing_bias false (transformers' MiniMax-M2 router has the bias)")
    for key in ("shared_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if getattr(config, key, None):
            raise ValueError(f"{key} {getattr(config, key)} (MiniMax-M2 has no shared expert)")


@family("MiniMaxM2ForCausalLM")
def minimax_m2(config) -> DecoderSpec:
    # MiniMax-M2: softmax attention on every layer with q and k each RMS-normed over all heads
    # (OLMo 2's way), rotary over part of each head (rotary_dim); a MoE on every layer of
    # num_local_experts experts of intermediate_size: sigmoid scores chosen with the correction
    # bias, renormalised, no groups, no scaling, no shared expert. Checkpoints name it
    # block_sparse_moe (Mixtral's w1/w3/w2) with the bias beside the router.
    _refuse_minimax_m2_options(config)
    e = config.num_local_experts
    moe = MoESpec(
        num_experts=e,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.intermediate_size,
        routing="sigmoid_grouped",
        renormalize=True,
    )
    names = llama_names(
        **QK_NORMS,
        **{
            "block_sparse_moe.gate": "mlp.gate",
            "block_sparse_moe": "mlp.gate",  # its bare e_score_correction_bias
        },
        **expert_names("block_sparse_moe.experts", e, "w1", "w3", "w2"),
    )
    skips = mtp_skips(config, getattr(config, "num_mtp_modules", None) or 0)
    return llama_like(
        config,
        names=_with_skips(names, skips),
        qk_norm="rms_full",
        windows=(None,) * config.num_hidden_layers,
        moe=moe,
    )


@family("HYV4ForCausalLM")
def hy_v4(config) -> DecoderSpec:
    # Hunyuan V4's layers are not the engine's pieces: refused at start, naming what is missing.
    raise ValueError(
        "HYV4 needs mechanisms this engine does not have: hyper-connections (hc_mult="
        f"{getattr(config, 'hc_mult', '?')} residual streams mixed around every sublayer, "
        "DeepSeek-V4 style) and DeepSeek sparse attention (an indexer choosing index_topk keys "
        "per query, shared across layers by indexer_types) over multi-head latent attention with "
        "attention sinks and an output gate"
    )

"""The text decoders of vision-language checkpoints whose text config transformers maps to no
causal LM (so `registry.describe_model`'s fallback cannot describe them): Qwen2.5-VL
(`qwen2_5_vl_text`) and Qwen3-VL (`qwen3_vl_text`). Their vision towers are under
`models/vision/qwen_vl.py`.

- Qwen2.5-VL: Qwen2's decoder (q/k/v biases, no o_proj bias; heads of hidden / num_heads).
- Qwen3-VL: Qwen3's decoder (per-head q/k RMSNorm; biases only with `attention_bias`).

Both rotate by multimodal rope (M-RoPE): each frequency of a head takes one of three position
streams (temporal, height, width) of its token. The rope settings keep `mrope_section` (how many
of the rot_dim / 2 frequencies each stream owns) and `mrope_interleaved`: Qwen2.5-VL gives the
streams contiguous runs of frequencies (the first section to T, the next to H, the last to W);
Qwen3-VL interleaves them (frequency i takes H when i % 3 == 1 and i < 3 * section[1], W when
i % 3 == 2 and i < 3 * section[2], else T), which transformers does whatever the config says, so
its description always carries `mrope_interleaved=True`. On text alone the three streams are
equal, and M-RoPE is the plain rotation of the same frequencies.
"""

from __future__ import annotations

from ..layers.rotary import rope_parameters
from .decoder import DecoderSpec
from .families import family, head_dim_of, llama_like, llama_names, rope_of

# transformers' sections when a config names none (its text rotary's defaults)
_DEFAULT_SECTIONS = {"qwen2_5_vl": [16, 24, 24], "qwen3_vl": [24, 20, 20]}


def mrope_params(config, kind: str) -> dict:
    """The rope settings of a Qwen VL text config with its M-RoPE sections (and, Qwen3-VL, the
    interleaved layout) kept for the decoder's rotary."""
    params = rope_parameters(config)
    if params.get("type") == "mrope":  # old configs: {"type": "mrope", ...} is the default rope
        params.pop("type")
    params["mrope_section"] = list(params.get("mrope_section") or _DEFAULT_SECTIONS[kind])
    if kind == "qwen3_vl":
        params["mrope_interleaved"] = True
    else:
        params.pop("mrope_interleaved", None)
    half = head_dim_of(config) // 2
    if sum(params["mrope_section"]) != half:
        raise ValueError(
            f"mrope_section {params['mrope_section']} does not cover the {half} rotary "
            "frequencies of a head"
        )
    return params


@family("Qwen2_5_VLForConditionalGeneration")
def qwen2_5_vl(config) -> DecoderSpec:
    rope = rope_of(config, head_dim_of(config), params=mrope_params(config, "qwen2_5_vl"))
    return llama_like(config, qkv_bias=True, o_bias=False, rope=rope)


@family("Qwen3VLForConditionalGeneration")
def qwen3_vl(config) -> DecoderSpec:
    names = llama_names(
        **{"self_attn.q_norm": "self_attn.q_norm", "self_attn.k_norm": "self_attn.k_norm"}
    )
    rope = rope_of(config, head_dim_of(config), params=mrope_params(config, "qwen3_vl"))
    return llama_like(config, qk_norm="rms_head", names=names, rope=rope)

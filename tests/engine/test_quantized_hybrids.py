"""Quantized checkpoints of hybrid families (issue 35): GPTQ, AWQ and FP8 checkpoints whose
attention, MLP and recurrent-layer projections are all quantized (tests/quant_checkpoints.py
writes them from the formats' descriptions, beside a float twin holding exactly the weights
they stand for). The engine's greedy tokens, with the weights dequantized at load and (GPTQ,
AWQ) kept packed, equal transformers' on the float twin."""

from __future__ import annotations

import re

import pytest
import transformers

from serverless_llm import LLM, SamplingParams
from tests.engine.family_check import family_prompts, save_family_model, tiny_dims
from tests.engine.reference import hf_greedy
from tests.quant_checkpoints import write_fp8, write_quantized
from tests.tiny_models import build_tokenizer

# hidden 96: groups of 32 give 3 groups; every quantized output width a multiple of 8
SHAPE = dict(hidden_size=96, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2)
MODELS = {
    # the short convolutions' in/out projections quantized with attention and MLP
    "lfm2": (
        lambda tok: transformers.Lfm2Config(
            **tiny_dims(tok, num_hidden_layers=3, **SHAPE),
            layer_types=["conv", "full_attention", "conv"],
            block_auto_adjust_ff_dim=False,
        ),
        re.compile(
            r"^model\.layers\.\d+\.(self_attn\.\w+_proj|feed_forward\.w[123]|conv\.(in|out)_proj)"
            r"\.weight$"
        ),
    ),
    # Mamba-2's in_proj (z, xBC and dt: 2 x 192 + 2 x 16 + 8 rows) and out_proj quantized
    "granitemoehybrid": (
        lambda tok: transformers.GraniteMoeHybridConfig(
            **tiny_dims(tok, num_hidden_layers=3, **SHAPE),
            layer_types=["mamba", "attention", "mamba"],
            num_local_experts=0,
            shared_intermediate_size=160,
            mamba_n_heads=8,
            mamba_d_head=24,
            mamba_d_state=16,
            mamba_n_groups=1,
            mamba_expand=2,
        ),
        re.compile(
            r"^model\.layers\.\d+\.(self_attn\.\w+_proj|mamba\.(in|out)_proj|shared_mlp\.\w+)"
            r"\.weight$"
        ),
    ),
}
CASES = {
    "lfm2-gptq4-g32-actorder": ("lfm2", "gptq", True),
    "lfm2-awq-g32": ("lfm2", "awq", False),
    "lfm2-fp8-channel": ("lfm2", "fp8", False),
    "granitemoehybrid-gptq4-g32": ("granitemoehybrid", "gptq", False),
    "granitemoehybrid-fp8-channel": ("granitemoehybrid", "fp8", False),
}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized-hybrids")
    made: dict[str, tuple[str, str]] = {}

    def get(case: str) -> tuple[str, str]:
        if case not in made:
            model, method, act_order = CASES[case]
            config, linear = MODELS[model]
            src = save_family_model(str(root / f"{case}-src"), config(build_tokenizer()), std=0.1)
            dirs = (str(root / f"{case}-float"), str(root / f"{case}-quant"))
            if method == "fp8":
                made[case] = write_fp8(src, *dirs, "fp8", "channel", linear=linear)
            else:
                made[case] = write_quantized(src, *dirs, method, 4, 32, act_order, linear=linear)
        return made[case]

    return get


# FP8 kept packed quantizes activations per token too (tested on its own in
# test_quantized_models.py): only its dequantized weights equal the float twin's tokens.
RUNS = [
    (case, mode)
    for case, (_, method, _) in CASES.items()
    for mode in (("dequantize",) if method == "fp8" else ("dequantize", "packed"))
]


@pytest.mark.parametrize("case,mode", RUNS)
def test_quantized_hybrid_matches_transformers_on_its_float_twin(quantized, case, mode):
    float_dir, quant_dir = quantized(case)
    llm = LLM(quant_dir, block_size=8, num_kv_blocks=64, max_model_len=256, quantized_weights=mode)
    prompts = family_prompts(llm.engine.vocab_size, lengths=(3, 12, 31))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(float_dir, prompt, 24), (case, len(prompt))

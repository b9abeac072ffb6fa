"""LFM2 and LFM3 (attention beside gated short convolutions, issue 35) against transformers: a
tiny random model with convolution and attention layers interleaved, 8 prompts of different
lengths batched together, 48 greedy tokens each."""

from __future__ import annotations

import transformers

from tests.engine.family_check import family_models_fixture, greedy_family_test, tiny_dims

CONFIGS = {
    # conv, attention, conv, conv: the state and the KV cache side by side; an auto-adjusted MLP
    # width, conv bias on
    "lfm2": lambda tok: transformers.Lfm2Config(
        **tiny_dims(tok, num_hidden_layers=4),
        layer_types=["conv", "full_attention", "conv", "conv"],
        conv_L_cache=3,
        conv_bias=True,
        block_auto_adjust_ff_dim=True,
        block_multiple_of=32,
        block_ffn_dim_multiplier=1.3,
        norm_eps=1e-5,
    ),
    # conv, sliding (window 16 < the prompts), full (proportional rope over half the pairs),
    # conv, sliding, with the head gate and sandwich norms; 7 taps
    "lfm3": lambda tok: transformers.Lfm3Config(
        **tiny_dims(tok, num_hidden_layers=5, head_dim=16),
        layer_types=["conv", "sliding_attention", "full_attention", "conv", "sliding_attention"],
        sliding_window=16,
        conv_L_cache=7,
        norm_eps=1e-5,
    ),
    # without the head gate and the sandwich norms, conv bias on
    "lfm3_plain": lambda tok: transformers.Lfm3Config(
        **tiny_dims(tok, num_hidden_layers=3, head_dim=16),
        layer_types=["conv", "full_attention", "conv"],
        use_attention_gate=False,
        use_sandwich_norm=False,
        conv_bias=True,
        norm_eps=1e-5,
    ),
}

family_models = family_models_fixture(CONFIGS)
test_family_greedy_equals_transformers = greedy_family_test(CONFIGS)

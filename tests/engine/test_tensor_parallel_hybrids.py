"""Tensor parallelism of hybrid models' recurrent layers (issue 35): each rank holds its share of
the heads (or channels) of every short convolution, Gated DeltaNet, Kimi Delta Attention, Mamba
and Mamba-2 layer, and its state slots hold only that share. Two ranks as the engine runs them
(rank 1 a spawned process, gloo between them), on tiny random models whose counts split: greedy
tokens equal transformers' through chunked prefills (a step budget of 16 tokens cuts the longer
prompts, beside other requests' decodes) and decodes. Counts that do not split are refused at
start, naming them. tensor_parallel_size=2 needs two GPUs on CUDA: these run on CPU."""

from __future__ import annotations

import pytest
import torch
import transformers

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine import ConfigError
from serverless_llm.engine.layers.attention import TorchAttentionBackend
from serverless_llm.engine.models.decoder import DecoderModel
from serverless_llm.engine.models.registry import describe_model
from serverless_llm.engine.models.sharding import check_shardable
from serverless_llm.engine.parallel.group import TensorParallel
from tests.engine.family_check import family_prompts, save_family_model, tiny_dims
from tests.engine.reference import hf_greedy, hf_model
from tests.engine.test_families_jamba import CONFIGS as JAMBA
from tests.engine.test_families_kimi import CONFIGS as KIMI
from tests.engine.test_families_kimi import kimi_config, kimi_greedy
from tests.engine.test_families_linear import CONFIGS as LINEAR
from tests.engine.test_families_linear import LINEAR as GDN_SIZES
from tests.engine.test_families_mamba import CONFIGS as MAMBA2
from tests.engine.test_families_mamba import granite_hybrid
from tests.engine.test_hybrid_engine import HYBRIDS
from tests.engine.test_quantized_hybrids import MODELS as QUANTIZED_MODELS
from tests.engine.tp_harness import prompt_batch, sharded_logits
from tests.quant_checkpoints import write_quantized
from tests.tiny_models import build_tokenizer

NEW_TOKENS = 24
LENGTHS = (1, 7, 20, 45)
ENGINE = dict(block_size=8, num_kv_blocks=96, max_model_len=128, dtype="float32")


def olmo_hybrid(tok):
    """OLMo Hybrid with 8 value heads over 2 q/k heads: transformers saves its fused q/k/v
    convolution as three near-equal thirds, and rank 0 holds none of the last third's channels
    (a checkpoint part with nothing for one rank)."""
    return transformers.OlmoHybridConfig(
        **tiny_dims(tok, num_hidden_layers=3),
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        **{**GDN_SIZES, "linear_num_value_heads": 8},
    )


def granite_one_group(tok):
    """Granite 4.0-H (Mamba-2 beside attention, a MoE and the shared MLP) with one group of B
    and C, as the released models: both ranks hold the group, and the gated norm over all of
    d_inner spans them (its sum of squares all-reduced)."""
    config = granite_hybrid(
        tok, num_local_experts=4, num_experts_per_tok=2, position_embedding_type="rope"
    )
    config.mamba_n_groups = 1
    return config


CONFIGS = {
    # short convolutions beside attention: 32 channels per rank
    "lfm2": HYBRIDS["lfm2"],
    # Gated DeltaNet (one q/k head and its two value heads per rank, interleaved checkpoint
    # projections) beside gated attention, a MoE with a shared expert
    "qwen3_next": LINEAR["qwen3_next"],
    "olmo_hybrid": olmo_hybrid,
    # Mamba (64 inner channels per rank, x_proj's partial sums all-reduced) beside attention
    "jamba": JAMBA["jamba"],
    # Kimi Delta Attention alone: one head per rank
    "kimi_linear": KIMI["kimi_linear"],
    # Mamba-2: 4 of 8 heads per rank
    "granitemoehybrid": granite_one_group,
    # attention beside Mamba-2 in every layer (2 groups: one per rank), the muP multipliers
    # folded into the weights before each rank takes its rows
    "falcon_h1": MAMBA2["falcon_h1"],
}
# The state tensors one rank of two allocates per slot, per recurrent layer (whole: one rank).
STATE_SHAPES = {
    # the convolution's K - 1 inputs of its 32 of 64 channels
    "lfm2": ([(32, 2)], [(64, 2)]),
    # conv over q | k | v (16 + 16 + 32 of 32 + 32 + 64 channels), delta state of 2 of 4 heads
    "qwen3_next": ([(64, 3), (2, 16, 16)], [(128, 3), (4, 16, 16)]),
    # d_inner 64 of 128: conv and SSM state
    "jamba": ([(64, 2), (64, 8)], [(128, 2), (128, 8)]),
    # conv over 3 x 32 of 3 x 64 channels, one head's delta state of two
    "kimi_linear": ([(96, 2), (1, 32, 32)], [(192, 2), (2, 32, 32)]),
    # conv over x | B | C: 64 of 128 x channels and the one group's B and C (16 each), whole
    "granitemoehybrid": ([(96, 2), (4, 16, 16)], [(160, 2), (8, 16, 16)]),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            path = str(tmp_path_factory.mktemp(name))
            made[name] = save_family_model(path, CONFIGS[name](build_tokenizer()))
        return made[name]

    return get


def spec_of(config):
    """The family description of a config made in the test (its architecture as a saved
    checkpoint's config would name it)."""
    if not config.architectures:
        names = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        config.architectures = [names[config.model_type]]
    return describe_model(config)


def reference(path: str, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens (Kimi Linear's stepped by hand: its generate cannot run an
    all-KDA model with a cache)."""
    if transformers.AutoConfig.from_pretrained(path).model_type == "kimi_linear":
        return kimi_greedy(path, tuple(prompt), NEW_TOKENS)
    return hf_greedy(path, prompt, NEW_TOKENS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_ranks_greedy_equal_transformers(models, name):
    path = models(name)
    prompts = family_prompts(transformers.AutoConfig.from_pretrained(path).vocab_size, 0, LENGTHS)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # a step budget of 16 tokens: the longer prompts in chunks, beside the others' decodes
    with LLM(path, tensor_parallel_size=2, max_num_batched_tokens=16, **ENGINE) as llm:
        outs = llm.generate(prompts, params)
        e = llm.engine
        assert e.state_pool.num_free == e.state_pool.num_slots - 1, "state slots leaked"
        assert e.block_pool.num_free == e.block_pool.num_blocks, "KV blocks leaked"
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference(path, prompt), len(prompt)


@pytest.mark.parametrize("name", list(STATE_SHAPES))
def test_each_rank_allocates_its_share_of_the_state(name):
    """A rank's recurrent layers and their state tensors are its share (built on the meta
    device for rank 0 of 2, and whole)."""
    config = CONFIGS[name](build_tokenizer())
    spec = spec_of(config)
    got = []
    for tp in (TensorParallel(0, 2), TensorParallel()):
        with torch.device("meta"):
            model = DecoderModel(spec, config, TorchAttentionBackend(), 64, tp)
        shapes = model.state_shapes()
        assert set(shapes) == set(spec.state_layers)
        layer = shapes[spec.state_layers[0]]
        assert all(s == shapes[i] for i, s in shapes.items())
        got.append([shape for shape, _ in layer])
    assert tuple(got) == STATE_SHAPES[name]


# name -> (config, tensor_parallel_size, what the refusal names)
REFUSALS = {
    # no attention layer: the convolutions' 64 channels meet 3 ranks first
    "lfm2": (
        lambda tok: transformers.Lfm2Config(**tiny_dims(tok), layer_types=["conv", "conv"]),
        3,
        r"short-convolution channels \(its hidden size\) \(64\)",
    ),
    # the attention heads split, the one q/k head does not
    "qwen3_5": (
        lambda tok: transformers.Qwen3_5TextConfig(
            **tiny_dims(tok, num_hidden_layers=2),
            head_dim=32,
            layer_types=["linear_attention", "full_attention"],
            **{**GDN_SIZES, "linear_num_key_heads": 1},
        ),
        2,
        r"Gated DeltaNet q/k heads \(1\)",
    ),
    "mamba": (JAMBA["mamba"], 3, r"Mamba inner channels \(d_inner\) \(128\)"),
    "kimi_linear": (
        lambda tok: kimi_config(tok, linear_num_heads=3),
        2,
        r"Kimi Delta Attention heads \(3\)",
    ),
    "mamba2_heads": (
        lambda tok: _mamba2(tok, num_heads=6, head_dim=32, n_groups=2),
        4,
        r"Mamba-2 heads \(6\)",
    ),
    # 12 heads split, 3 groups neither split across 2 ranks nor serve whole ones
    "mamba2_groups": (
        lambda tok: _mamba2(tok, num_heads=12, head_dim=16, n_groups=3),
        2,
        r"and the model's 3 Mamba-2 B/C groups \(n_groups\): one must divide the other",
    ),
    "nemotron_h_latent_moe": (MAMBA2["nemotron_h"], 2, "latent or non-gated experts"),
}


def _mamba2(tok, **sizes):
    config = MAMBA2["mamba2"](tok)
    config.hidden_size = 96
    for key, value in sizes.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("name", list(REFUSALS))
def test_counts_that_do_not_split_are_refused_by_name(name):
    config, size, named = REFUSALS[name]
    spec = spec_of(config(build_tokenizer()))
    with pytest.raises(ConfigError, match=f"tensor_parallel_size={size}.*{named}"):
        check_shardable(spec, size)


def test_refused_at_start_before_any_rank(tmp_path):
    """The engine refuses before it spawns a rank, with the same message."""
    config, size, named = REFUSALS["qwen3_5"]
    path = save_family_model(str(tmp_path / "m"), config(build_tokenizer()))
    with pytest.raises(ConfigError, match=named):
        LLM(path, tensor_parallel_size=size, **ENGINE)


def test_quantized_recurrent_projections_split_packed(tmp_path):
    """A GPTQ act-order LFM2 whose convolution projections are quantized too, held packed: each
    rank slices the packed in_proj rows and out_proj columns (every act-order group kept for the
    row-parallel out_proj) and the tokens are one rank's."""
    config, linear = QUANTIZED_MODELS["lfm2"]
    src = save_family_model(str(tmp_path / "src"), config(build_tokenizer()), std=0.1)
    _, quant = write_quantized(src, str(tmp_path / "f"), str(tmp_path / "q"), "gptq", 4, 32, True,
                               linear=linear)  # fmt: skip
    prompts = family_prompts(384, 0, LENGTHS)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    kw = dict(quantized_weights="packed", **ENGINE)
    with LLM(quant, tensor_parallel_size=2, max_num_batched_tokens=16, **kw) as llm:
        two = llm.generate(prompts, params)
    one = LLM(quant, **kw).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


def test_four_ranks_share_groups_and_norm_groups(tmp_path, monkeypatch):
    """Mamba-2 alone with 2 groups of B and C and 2 norm groups over 4 ranks (threads of one
    process, tp_harness.py): ranks 0-1 hold group 0, ranks 2-3 group 1, and each norm group's
    sum of squares is all-reduced in its own column. One prefill's logits equal transformers'."""
    path = save_family_model(str(tmp_path / "m"), MAMBA2["mamba2"](build_tokenizer()))
    ids = [5 + (7 * i) % 300 for i in range(37)]

    def with_state(ids):  # the prefill in state slot 1, no KV blocks (no attention layer)
        batch = prompt_batch(ids)
        batch.slots, batch.block_tables = [], []
        batch.state_slots, batch.prompt_rows = [1], [True] * len(ids)
        return batch

    monkeypatch.setattr("tests.engine.tp_harness.prompt_batch", with_state)
    logits = sharded_logits(path, ids, size=4)["logits"]
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=2e-4)

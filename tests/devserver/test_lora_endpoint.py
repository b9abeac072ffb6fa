"""LoRA through the local endpoint (issue 18): the worker started with ENABLE_LORA and
LORA_MODULES (worker-vllm's JSON list), one slot (MAX_LORAS=1), and the official OpenAI client:
`model=<adapter name>` gets that adapter's output (the offline engine with the same adapter is
the reference, itself checked against peft in tests/engine/test_lora.py); /v1/models lists the
adapters with the base as parent; an unknown name is OpenAI's 404; an adapter that cannot be
served is left out at start and the worker serves the rest; requests on two adapters and the
base at once all finish right."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from serverless_llm import LLM, LoRARequest, SamplingParams
from tests.devserver.conftest import API_KEY, serve
from tests.lora_adapters import make_adapter

pytest.importorskip("peft")

SERVED = "tiny-base"
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def lora_endpoint(tiny_llama, tmp_path_factory):
    from serverless_llm.devserver.app import create_app
    from serverless_llm.worker.handler import Worker
    from serverless_llm.worker.settings import Settings

    root = tmp_path_factory.mktemp("lora-endpoint")
    a1 = make_adapter(tiny_llama, str(root / "a1"), 8, 16, ["q_proj", "v_proj"], seed=1)
    a2 = make_adapter(tiny_llama, str(root / "a2"), 4, 8, ["o_proj", "down_proj"], seed=2)
    bad = make_adapter(tiny_llama, str(root / "bad"), 32, 8, ["q_proj"], seed=3)  # rank 32
    modules = [
        {"name": "a1", "path": a1},
        {"name": "a2", "path": a2, "base_model_name": SERVED},
        {"name": "bad", "path": bad},
    ]
    settings = Settings.from_env(
        {
            "MODEL_NAME": tiny_llama,
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": SERVED,
            "BASE_PATH": str(root / "base"),
            "DEVICE": "cpu",
            "DTYPE": "float32",
            "MAX_MODEL_LEN": "256",
            "BLOCK_SIZE": "8",
            "NUM_KV_BLOCKS": "256",
            "ENABLE_LORA": "true",
            "LORA_MODULES": json.dumps(modules),
            "MAX_LORAS": "1",
            "MAX_LORA_RANK": "16",
        }
    )
    worker = Worker(settings)
    app = create_app(worker, api_key=API_KEY, max_concurrency=settings.max_concurrency)
    with serve(app) as server:
        server.worker = worker  # type: ignore[attr-defined]
        server.adapters = {"a1": a1, "a2": a2}  # type: ignore[attr-defined]
        yield server


@pytest.fixture(scope="module")
def client(lora_endpoint) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{lora_endpoint.base_url}/openai/v1", api_key=API_KEY, timeout=60
    )


@pytest.fixture(scope="module")
def offline(tiny_llama, lora_endpoint):
    """The offline engine's greedy text for the prompt: base, a1, a2."""
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_loras=2, num_kv_blocks=64,
              max_model_len=256)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    texts = {None: llm.generate(PROMPT, params)[0].outputs[0].text}
    for i, name in enumerate(("a1", "a2"), start=1):
        req = LoRARequest(name, i, lora_endpoint.adapters[name])
        texts[name] = llm.generate(PROMPT, params, lora_request=req)[0].outputs[0].text
    assert len(set(texts.values())) == 3  # each adapter changes the text
    return texts


def _complete(client, model):
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert out.model == model
    return out.choices[0].text


def test_models_lists_the_adapters_with_their_parent(client):
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == [SERVED, "a1", "a2"]  # "bad" (rank 32 > 16) was left out
    assert models["a1"].model_extra["parent"] == SERVED
    assert models["a2"].model_extra["parent"] == SERVED
    assert client.models.retrieve("a2").id == "a2"


def test_adapter_by_model_name(client, offline):
    assert _complete(client, "a1") == offline["a1"]
    assert _complete(client, "a2") == offline["a2"]
    assert _complete(client, SERVED) == offline[None]
    chat = client.chat.completions.create(
        model="a1", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0
    )
    assert chat.model == "a1" and chat.choices[0].message.content is not None


def test_unknown_and_unserved_adapters_are_404(client):
    for name in ("nope", "bad"):
        with pytest.raises(openai.NotFoundError) as e:
            _complete(client, name)
        assert e.value.body["code"] == "model_not_found"


def test_two_adapters_and_the_base_at_once_with_one_slot(client, offline, lora_endpoint):
    models = ["a1", "a2", SERVED] * 4
    with ThreadPoolExecutor(len(models)) as pool:
        texts = list(pool.map(lambda m: _complete(client, m), models))
    for model, text in zip(models, texts):
        assert text == offline[None if model == SERVED else model], model
    lora = lora_endpoint.worker.engine.core.lora
    assert lora.slot_loads >= 2
    pool_ = lora_endpoint.worker.engine.core.block_pool
    assert pool_.num_free == pool_.num_blocks


def test_native_job_names_the_adapter_in_model(lora_endpoint, offline):
    import httpx

    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=lora_endpoint.base_url, headers=headers, timeout=60) as http:

        def run(**extra):
            job = {"prompt": PROMPT, "sampling_params": {"max_tokens": 16, "temperature": 0.0,
                                                         "ignore_eos": True}, **extra}  # fmt: skip
            return http.post("/runsync", json={"input": job}).json()

        def text(body):
            assert body["status"] == "COMPLETED", body.get("error")
            return "".join(body["output"][0]["choices"][0]["tokens"])

        assert text(run(model="a2")) == offline["a2"]
        assert text(run(model=SERVED)) == offline[None]
        assert text(run()) == offline[None]
        error = run(model="nope")
        assert error["status"] == "FAILED"
        assert "unknown model 'nope'" in error["error"] and "a1" in error["error"]

"""Request priority through the local endpoint (issue 38, item 6): `priority` on chat,
completions, Responses and native jobs. With SCHEDULING_POLICY=priority the engine serves the
waiting requests by it; with the default FCFS policy a non-zero priority is a 400 (OpenAI's
shape) or a native `{"error": ...}` naming SCHEDULING_POLICY, and 0 is accepted."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from serverless_llm.devserver.app import create_app
from tests.devserver.conftest import API_KEY, ServerThread, serve, wait_until
from tests.step_gate import StepGate

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def by_priority(tiny_llama, tmp_path_factory) -> Iterator[ServerThread]:
    """The tiny Llama with SCHEDULING_POLICY=priority and one request running at a time."""
    from serverless_llm.worker.handler import Worker
    from serverless_llm.worker.settings import Settings

    settings = Settings.from_env(
        {
            "MODEL_NAME": tiny_llama,
            "BASE_PATH": str(tmp_path_factory.mktemp("priority")),
            "DEVICE": "cpu",
            "DTYPE": "float32",
            "MAX_MODEL_LEN": "64",
            "BLOCK_SIZE": "8",
            "NUM_KV_BLOCKS": "32",
            "MAX_NUM_SEQS": "1",
            "SCHEDULING_POLICY": "priority",
        }
    )
    worker = Worker(settings)
    with serve(create_app(worker, api_key=API_KEY, max_concurrency=8)) as server:
        server.worker = worker  # type: ignore[attr-defined]
        yield server


def _client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/openai/v1", api_key=API_KEY, timeout=60)


def _complete(client: openai.OpenAI, priority: int, prompt: str = "hello there") -> tuple:
    """(text, the engine's request id)."""
    out = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        extra_body={"priority": priority, "ignore_eos": True},
    )
    return out.choices[0].text, f"{out.id}-0"


def test_waiting_requests_are_served_by_priority(by_priority: ServerThread):
    """One request runs (MAX_NUM_SEQS=1) held between steps; a priority-5 request, then a
    priority -5 one, queue behind it: the later one, with the lower value, is served first."""
    core = by_priority.worker.engine.core  # type: ignore[attr-defined]
    engine = by_priority.worker.engine  # type: ignore[attr-defined]
    client = _client(by_priority)
    gate = StepGate(core)
    gate.install()
    try:
        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(_complete, client, 0, "first")
            gate.wait_held()
            late = pool.submit(_complete, client, 5, "late")
            wait_until(lambda: engine.num_unfinished == 2, "the priority-5 request is queued")
            urgent = pool.submit(_complete, client, -5, "urgent")
            wait_until(lambda: engine.num_unfinished == 3, "the priority -5 request is queued")
            gate.release()
            results = [f.result() for f in (first, late, urgent)]
    finally:
        gate.uninstall()
    (first_text, first_id), (late_text, late_id), (urgent_text, urgent_id) = results
    assert gate.seen == [first_id, urgent_id, late_id]
    assert gate.finished == [first_id, urgent_id, late_id]
    assert first_text == _complete(client, 0, "first")[0]
    assert late_text == _complete(client, 0, "late")[0]
    assert urgent_text == _complete(client, 0, "urgent")[0]


def test_every_route_takes_priority(by_priority: ServerThread):
    client = _client(by_priority)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        extra_body={"priority": 7},
    )
    assert chat.choices[0].finish_reason in ("length", "stop")
    resp = client.responses.create(
        model=model, input="hi", max_output_tokens=3, extra_body={"priority": -1}
    )
    assert resp.status in ("completed", "incomplete")
    native = httpx.post(
        f"{by_priority.base_url}/runsync",
        json={"input": {"prompt": "hi", "priority": 3, "sampling_params": {"max_tokens": 3}}},
        headers=AUTH,
        timeout=60,
    ).json()
    assert native["status"] == "COMPLETED", native
    assert native["output"][0]["usage"]["output"] == 3


def test_fcfs_refuses_a_priority_naming_the_setting(endpoint: ServerThread):
    client = _client(endpoint)
    model = client.models.list().data[0].id
    calls = [
        lambda: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], extra_body={"priority": 1}
        ),
        lambda: client.completions.create(model=model, prompt="hi", extra_body={"priority": -3}),
        lambda: client.responses.create(model=model, input="hi", extra_body={"priority": 2}),
    ]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == "priority"
        assert "SCHEDULING_POLICY=priority" in e.value.body["message"]
    # 0, every request's priority, is taken.
    out = client.completions.create(
        model=model, prompt="hi", max_tokens=2, extra_body={"priority": 0}
    )
    assert out.choices[0].text is not None
    native = httpx.post(
        f"{endpoint.base_url}/runsync",
        json={"input": {"prompt": "hi", "priority": 4, "sampling_params": {"max_tokens": 2}}},
        headers=AUTH,
        timeout=60,
    ).json()
    assert native["status"] == "FAILED"
    assert "SCHEDULING_POLICY=priority" in native["error"], native


def test_a_priority_that_is_not_an_integer_is_refused(by_priority: ServerThread):
    client = _client(by_priority)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="x", prompt="hi", extra_body={"priority": "high"})
    assert "priority" in str(e.value.body)
    native = httpx.post(
        f"{by_priority.base_url}/runsync",
        json={"input": {"prompt": "hi", "priority": 1.5}},
        headers=AUTH,
        timeout=60,
    ).json()
    assert native["status"] == "FAILED"
    assert native["error"].startswith("'priority': input should be a valid integer"), native

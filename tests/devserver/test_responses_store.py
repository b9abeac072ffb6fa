"""Stored responses through the official OpenAI client: two local-endpoint processes sharing one
real redis-server (RESPONSES_STORE_URL), where a conversation started on the first continues on
the second with `previous_response_id`, is retrieved, listed and deleted from either; and an
in-process endpoint whose in-memory store (RESPONSES_STORE_MAX_COUNT) evicts its oldest
response into a 404."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from serverless_llm.devserver.app import create_app
from tests.devserver.conftest import ServerThread, serve
from tests.redis_server import redis_url  # noqa: F401 (the fixture)

START_TIMEOUT_S = 120.0  # only guards against a hang: the wait ends at the ready banner
GEN = {"max_output_tokens": 6, "temperature": 0}


class DevServer:
    """`python -m serverless_llm.devserver --port 0` in a process of its own."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serverless_llm.devserver", "--port", "0"],
            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        deadline = time.monotonic() + START_TIMEOUT_S
        base = None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            match = re.search(r"ready at (http://127\.0\.0\.1:\d+)", line)
            if match:
                base = match.group(1)
                break
        if base is None:
            self.stop()
            raise RuntimeError("the local endpoint did not start:\n" + "".join(self.lines))
        self.base_url = base
        # Keep reading its output, so a chatty log never blocks it on a full pipe.
        self._drain = threading.Thread(target=self._read, daemon=True)
        self._drain.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/openai/v1", api_key="unused", timeout=60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def two_endpoints(
    tiny_llama: str,
    redis_url: str,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[DevServer, DevServer]]:
    env = {
        "MODEL_NAME": tiny_llama,
        "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "tiny",
        "DEVICE": "cpu",
        "DTYPE": "float32",
        "MAX_MODEL_LEN": "256",
        "NUM_KV_BLOCKS": "64",
        "RESPONSES_STORE_URL": redis_url,
    }
    servers: list[DevServer] = []
    try:
        for name in ("a", "b"):
            base = str(tmp_path_factory.mktemp(f"base-{name}"))
            servers.append(DevServer({**env, "BASE_PATH": base}))
        yield servers[0], servers[1]
    finally:
        for server in servers:
            server.stop()


def test_a_conversation_started_on_one_worker_continues_on_another(two_endpoints):
    a, b = (server.client() for server in two_endpoints)
    first = a.responses.create(model="tiny", instructions="Be brief.", input="Hello there", **GEN)
    assert first.store is True
    follow = b.responses.create(
        model="tiny", input="And then?", previous_response_id=first.id, **GEN
    )
    assert follow.previous_response_id == first.id
    # The same turn with the history sent whole (instructions do not carry over, as on OpenAI).
    history = [{"role": "user", "content": "Hello there"}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    whole = a.responses.create(
        model="tiny", input=[*history, {"role": "user", "content": "And then?"}], **GEN
    )
    assert follow.usage.input_tokens == whole.usage.input_tokens
    assert follow.output_text == whole.output_text
    alone = b.responses.create(model="tiny", input="And then?", **GEN)
    assert follow.usage.input_tokens > alone.usage.input_tokens

    # Either worker retrieves and lists what the other stored.
    assert a.responses.retrieve(follow.id).model_dump() == follow.model_dump()
    assert b.responses.retrieve(first.id).output_text == first.output_text
    items = list(a.responses.input_items.list(follow.id, order="asc"))
    assert [item.type for item in items] == ["message", "message", "message"]
    assert items[0].content[0].text == "Hello there"
    assert items[1].id == first.output[0].id
    assert items[2].content[0].text == "And then?"

    # Deleted on one, gone on both: retrieve, delete again and continue are 404s.
    b.responses.delete(first.id)
    for client in (a, b):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        a.responses.create(model="tiny", input="x", previous_response_id=first.id, **GEN)
    assert info.value.body["param"] == "previous_response_id"
    # The follow-up was stored whole: it still continues after its predecessor is gone.
    again = a.responses.create(model="tiny", input="More?", previous_response_id=follow.id, **GEN)
    assert again.usage.input_tokens > follow.usage.input_tokens


def test_store_false_keeps_nothing_anywhere(two_endpoints):
    a, b = (server.client() for server in two_endpoints)
    unstored = a.responses.create(model="tiny", input="Hi", store=False, **GEN)
    assert unstored.store is False
    for client in (a, b):
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.retrieve(unstored.id)
        assert info.value.status_code == 404
        assert unstored.id in info.value.body["message"]


def test_streamed_responses_are_stored_before_they_complete(two_endpoints):
    a, b = (server.client() for server in two_endpoints)
    final = None
    with a.responses.stream(model="tiny", input="Hi", **GEN) as stream:
        for event in stream:
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
                # The closing event goes out only once the response is stored.
                assert b.responses.retrieve(final.id).output_text == final.output_text
    assert final is not None
    follow = b.responses.create(model="tiny", input="Go on", previous_response_id=final.id, **GEN)
    assert follow.usage.input_tokens > final.usage.input_tokens


@pytest.fixture(scope="module")
def small_store_endpoint(
    tiny_llama: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    """The worker with a memory store of two responses, in-process."""
    from serverless_llm.worker.handler import Worker
    from serverless_llm.worker.settings import Settings

    settings = Settings.from_env(
        {
            "MODEL_NAME": tiny_llama,
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "tiny",
            "BASE_PATH": str(tmp_path_factory.mktemp("base")),
            "DEVICE": "cpu",
            "DTYPE": "float32",
            "MAX_MODEL_LEN": "256",
            "NUM_KV_BLOCKS": "64",
            "RESPONSES_STORE_MAX_COUNT": "2",
        }
    )
    with serve(create_app(Worker(settings))) as server:
        yield server


def test_the_memory_store_evicts_its_oldest_into_a_404(small_store_endpoint):
    client = openai.OpenAI(
        base_url=f"{small_store_endpoint.base_url}/openai/v1", api_key="unused", timeout=60
    )
    made = [client.responses.create(model="tiny", input=text, **GEN) for text in "abc"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[0].id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="tiny", input="x", previous_response_id=made[0].id, **GEN)
    assert info.value.body["code"] == "previous_response_not_found"
    assert [client.responses.retrieve(r.id).id for r in made[1:]] == [r.id for r in made[1:]]

"""vLLM's utility routes on the local endpoint and through `openai_route` jobs: /tokenize and
/detokenize (shapes, agreement with the tokenizer and the chat route, round trips, bad input),
/version, and /metrics read back with prometheus_client's own parser after real traffic, its
counters adding up to what the requests' usage says."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

import serverless_llm
from tests.devserver.conftest import ServerThread, serve, wait_until
from tests.step_gate import StepGate

MODEL = "tiny-utility"
MAX_MODEL_LEN = 512  # the tiny model's positions: room for the described tools
MESSAGES = [{"role": "user", "content": "Hello world! How are you today?"}]
PROMPT = "The quick brown fox jumps over"
PREFIXES = ("", "/openai/v1")


def _settings(tiny_llama: str, base: str, **extra: str) -> Any:
    from serverless_llm.worker.settings import Settings

    return Settings.from_env(
        {
            "MODEL_NAME": tiny_llama,
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": MODEL,
            "BASE_PATH": base,
            "DEVICE": "cpu",
            "DTYPE": "float32",
            "MAX_MODEL_LEN": str(MAX_MODEL_LEN),
            "BLOCK_SIZE": "8",
            "NUM_KV_BLOCKS": "256",
            "MAX_NUM_SEQS": "16",
            **extra,
        }
    )


@pytest.fixture(scope="module")
def server(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """A worker of its own, so the metrics count this module's requests only."""
    from serverless_llm.devserver.app import create_app
    from serverless_llm.worker.handler import Worker

    worker = Worker(_settings(tiny_llama, str(tmp_path_factory.mktemp("base"))))
    with serve(create_app(worker)) as srv:
        srv.worker = worker  # type: ignore[attr-defined]
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/openai/v1", api_key="unused", timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: str):
    return AutoTokenizer.from_pretrained(tiny_llama)


def _assert_openai_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


# -- /tokenize and /detokenize -------------------------------------------------------------------


@pytest.mark.parametrize("prefix", PREFIXES)
def test_tokenize_prompt_as_the_tokenizer(http: httpx.Client, tokenizer, prefix: str):
    want = tokenizer(PROMPT)["input_ids"]
    resp = http.post(f"{prefix}/tokenize", json={"prompt": PROMPT})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {
        "count": len(want),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": want,
        "token_strs": None,
    }
    bare = http.post(
        f"{prefix}/tokenize",
        json={"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True},
    ).json()
    plain = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert bare["tokens"] == plain and bare["count"] == len(plain)
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(plain)


def test_tokenize_chat_counts_what_the_chat_route_uses(
    http: httpx.Client, client: openai.OpenAI, tokenizer
):
    resp = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0.0
    )
    assert body["count"] == chat.usage.prompt_tokens
    no_prompt = http.post(
        "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}
    ).json()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert no_prompt["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert no_prompt["count"] < body["count"]


@pytest.mark.parametrize("prefix", PREFIXES)
def test_detokenize_round_trips(http: httpx.Client, tokenizer, prefix: str):
    ids = http.post(
        f"{prefix}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}
    ).json()["tokens"]
    resp = http.post(f"{prefix}/detokenize", json={"tokens": ids})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"prompt": PROMPT}
    chat_ids = http.post(f"{prefix}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    text = http.post(f"{prefix}/detokenize", json={"tokens": chat_ids}).json()["prompt"]
    # Special tokens are kept, so the rendered chat comes back whole.
    assert text == tokenizer.decode(chat_ids, skip_special_tokens=False)
    assert MESSAGES[0]["content"] in text


BAD_TOKENIZE = [
    ({}, None),  # neither prompt nor messages
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "bogus": 1}, "bogus"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"messages": MESSAGES, "continue_final_message": True}, None),  # with the generation prompt
]


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize(("body", "param"), BAD_TOKENIZE)
def test_tokenize_bad_input_is_400(http: httpx.Client, prefix: str, body: Any, param: str | None):
    err = _assert_openai_error(http.post(f"{prefix}/tokenize", json=body), 400)
    if param is not None:
        assert param in (err["param"] or "") or param in err["message"]


@pytest.mark.parametrize(
    "body",
    [{}, {"tokens": "abc"}, {"tokens": [-1]}, {"tokens": [10**9]}, {"tokens": [1.5]}],
)
def test_detokenize_bad_input_is_400(http: httpx.Client, body: Any):
    err = _assert_openai_error(http.post("/detokenize", json=body), 400)
    assert "tokens" in (err["param"] or "") or "tokens" in err["message"]


def test_bad_bodies_and_models(http: httpx.Client):
    _assert_openai_error(http.post("/tokenize", content=b"{not json"), 400)
    _assert_openai_error(http.post("/tokenize", json=[1, 2]), 400)
    err = _assert_openai_error(http.post("/tokenize", json={"prompt": "x", "model": "nope"}), 404)
    assert err["code"] == "model_not_found"
    err = _assert_openai_error(http.post("/detokenize", json={"tokens": [1], "model": "no"}), 404)
    assert err["code"] == "model_not_found"
    # The worker keeps serving.
    assert http.post("/tokenize", json={"prompt": "x"}).status_code == 200


# -- /version -------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", PREFIXES)
def test_version(http: httpx.Client, prefix: str):
    resp = http.get(f"{prefix}/version")
    assert resp.status_code == 200
    assert resp.json() == {"version": serverless_llm.__version__}


# -- /metrics -------------------------------------------------------------------------------------

COUNTERS = ("request_success", "prompt_tokens", "generation_tokens", "num_preemptions")
COUNTERS += ("prefix_cache_queries", "prefix_cache_hits")
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
)


def scrape(http: httpx.Client, path: str = "/metrics") -> dict[tuple[str, tuple], float]:
    """Every sample, keyed by (name, sorted labels), parsed by prometheus_client itself."""
    resp = http.get(path)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    key = (f"serverless_llm:{name}", tuple(sorted({"model_name": MODEL, **labels}.items())))
    assert key in samples, f"{key} not among {sorted(k[0] for k in samples)}"
    return samples[key]


def test_metrics_add_up_after_traffic(http: httpx.Client, client: openai.OpenAI):
    before = scrape(http)
    greedy = {"model": MODEL, "temperature": 0.0}
    usages: list[Any] = []
    reasons: list[str] = []
    # Non-streamed, stopped by length (the same prompt twice: the second finds its prefix).
    for _ in range(2):
        r = client.chat.completions.create(
            messages=MESSAGES, max_tokens=6, extra_body={"ignore_eos": True}, **greedy
        )
        usages.append(r.usage)
        reasons.append(r.choices[0].finish_reason)
    # Streamed chats with usage.
    for n in (3, 7):
        usage, finish = None, None
        for chunk in client.chat.completions.create(
            messages=[{"role": "user", "content": f"Count to {n}."}],
            max_tokens=n,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **greedy,
        ):
            usage = chunk.usage or usage
            for c in chunk.choices:
                finish = c.finish_reason or finish
        usages.append(usage)
        reasons.append(finish)
    # A completion stopped by a stop string: its greedy text's start, learnt first.
    probe = client.completions.create(
        prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True}, **greedy
    )
    usages.append(probe.usage)
    reasons.append(probe.choices[0].finish_reason)
    text = probe.choices[0].text
    stop_at = text[len(text) // 2 :][:3] if text[len(text) // 2 :].strip() else text[:3]
    assert stop_at.strip(), f"no text to stop at: {text!r}"
    stopped = client.completions.create(
        prompt=PROMPT, max_tokens=8, stop=[stop_at], extra_body={"ignore_eos": True}, **greedy
    )
    usages.append(stopped.usage)
    reasons.append(stopped.choices[0].finish_reason)
    assert reasons.count("stop") == 1 and reasons.count("length") == len(reasons) - 1, reasons

    after = scrape(http)
    assert scrape(http, "/openai/v1/metrics") == after  # the same registry (nothing ran since)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    for reason in ("stop", "length"):
        assert delta("request_success_total", finished_reason=reason) == reasons.count(reason)
    assert delta("request_success_total", finished_reason="abort") == 0
    assert delta("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("generation_tokens_total") == sum(u.completion_tokens for u in usages)
    sent = len(reasons)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"{name}_count") == sent
        assert delta(f"{name}_sum") > 0
    assert delta("request_queue_time_seconds_count") == sent
    # One token a step: every token after a request's first comes one interval later.
    itl = sum(u.completion_tokens - 1 for u in usages)
    assert delta("inter_token_latency_seconds_count") == itl
    # The histogram's cumulative buckets end with all of its samples.
    assert value(after, "e2e_request_latency_seconds_bucket", le="+Inf") == value(
        after, "e2e_request_latency_seconds_count"
    )
    # The repeated chat found its prompt's full blocks in the prefix cache.
    assert delta("prefix_cache_hits_total") >= 8
    assert delta("prefix_cache_queries_total") >= delta("prefix_cache_hits_total")
    assert value(after, "num_preemptions_total") >= 0
    assert value(after, "num_requests_running") == 0
    assert value(after, "num_requests_waiting") == 0
    assert 0 <= value(after, "kv_cache_usage_perc") <= 1


def test_metrics_names_carry_the_prefix(http: httpx.Client):
    text = http.get("/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert all(n.startswith("serverless_llm:") for n in names), names
    want = {f"serverless_llm:{n}" for n in COUNTERS + GAUGES + HISTOGRAMS}
    assert want <= names, want - names
    assert "_created" not in text


def test_a_client_that_hangs_up_counts_as_aborted(server: ServerThread, http: httpx.Client):
    engine = server.worker.engine  # type: ignore[attr-defined]
    before = scrape(http)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "ignore_eos": True}
    gate = StepGate(engine.core)
    gate.install()
    try:
        with http.stream(
            "POST", "/openai/v1/chat/completions", json={**body, "stream": True}
        ) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    break  # the first chunk: then hang up while the next step waits
            gate.wait_held()
        wait_until(lambda: engine.num_unfinished == 0, "the stream let go of its request")
        gate.release()
        wait_until(lambda: engine.stats().num_requests == 0, "the engine dropped the request")
    finally:
        gate.uninstall()
    assert gate.finished == [] and len(gate.aborted) == 1
    after = scrape(http)
    assert after[ABORTED] - before[ABORTED] == 1
    assert after[SUCCESS_LENGTH] == before[SUCCESS_LENGTH]


ABORTED = (
    "serverless_llm:request_success_total",
    (("finished_reason", "abort"), ("model_name", MODEL)),
)
SUCCESS_LENGTH = (
    "serverless_llm:request_success_total",
    (("finished_reason", "length"), ("model_name", MODEL)),
)


# -- through openai_route jobs, and off -----------------------------------------------------------


def test_openai_route_jobs(server: ServerThread):
    worker = server.worker  # type: ignore[attr-defined]

    def job(route: str, body: Any = None) -> list[Any]:
        inp: dict[str, Any] = {"openai_route": route}
        if body is not None:
            inp["openai_input"] = body
        return asyncio.run(worker.handle_aggregate({"id": "j", "input": inp}))

    [tok] = job("/tokenize", {"prompt": PROMPT})
    assert tok["count"] == len(tok["tokens"]) > 0
    assert job("/detokenize", {"tokens": tok["tokens"]}) == [{"prompt": PROMPT}]
    assert job("/version", {}) == [{"version": serverless_llm.__version__}]
    [text] = job("/metrics", {})
    assert isinstance(text, str)
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "serverless_llm:request_success" in names
    [err] = job("/tokenize", {"prompt": 1})
    assert err["error"]["type"] == "invalid_request_error"


def test_metrics_off(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory):
    from serverless_llm.devserver.app import create_app
    from serverless_llm.worker.handler import Worker

    settings = _settings(tiny_llama, str(tmp_path_factory.mktemp("off")), ENABLE_METRICS="false")
    worker = Worker(settings)
    with serve(create_app(worker)) as srv, httpx.Client(base_url=srv.base_url) as http:
        err = _assert_openai_error(http.get("/metrics"), 404)
        assert "ENABLE_METRICS" in err["message"]
        assert worker.metrics is None and not worker.engine._observers
        assert http.post("/tokenize", json={"prompt": "x"}).status_code == 200


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_tokenize_chat_with_tools_counts_what_the_chat_route_uses(
    http: httpx.Client, client: openai.OpenAI
):
    with_tools = http.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS}).json()
    without = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert with_tools["count"] > without["count"]  # the tools reach the prompt
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=1, temperature=0.0
    )
    assert with_tools["count"] == chat.usage.prompt_tokens
    err = _assert_openai_error(
        http.post("/tokenize", json={"messages": MESSAGES, "tools": [{"type": "nope"}]}), 400
    )
    assert "tools" in (err["param"] or "") or "tools" in err["message"]

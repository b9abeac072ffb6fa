"""OpenAI's schema, to the letter (issue 38 item 9), on the real worker and tiny Llama behind the
local endpoint: what OpenAI's published OpenAPI document (as the official client's generated
types carry it) declares is accepted in the shape it declares, and what it refuses is refused
naming the field.

- chat logprobs carry `refusal` (null) beside `content`;
- chat takes `moderation`, `prompt_cache_options`, `prompt_cache_retention` (checked, ignored)
  and `reasoning_effort` "xhigh" / "max" (as "high" for templates and harmony);
- a whole-number float is an integer wherever one is expected; 2.5 is still refused;
- `top_p: 0` is greedy decoding;
- completions with `echo` and `max_tokens: 0` answer the prompt's log-probabilities alone
  (lm-evaluation-harness's log-likelihood request), equal to transformers';
- `/v1/responses` checks the input item fields it does not read;
- a body not sent as JSON is a 415 in the route's shape.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from serverless_llm.api.openai import harmony as hm
from serverless_llm.api.openai.chat import render_chat_text
from serverless_llm.api.openai.protocol import ChatCompletionRequest
from tests.devserver.conftest import API_KEY, SERVED_MODEL, ServerThread

MESSAGES = [{"role": "user", "content": "Hello world! How are you today?"}]
PROMPT = "The quick brown fox jumps over the lazy dog"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def client(endpoint: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{endpoint.base_url}/openai/v1", api_key=API_KEY, timeout=60)


@pytest.fixture(scope="module")
def http(endpoint: ServerThread) -> httpx.Client:
    with httpx.Client(base_url=endpoint.base_url, headers=HEADERS, timeout=60) as c:
        yield c


def post(http: httpx.Client, route: str, body: dict[str, Any]) -> httpx.Response:
    return http.post(f"/openai/v1/{route}", json=body)


def chat_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": SERVED_MODEL,
        "messages": MESSAGES,
        "max_tokens": 6,
        "ignore_eos": True,
        **extra,
    }


def error_of(resp: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


# -- chat logprobs: refusal ----------------------------------------------------------------


def test_chat_logprobs_carry_refusal_null(http):
    body = chat_body(temperature=0, logprobs=True, top_logprobs=2)
    whole = post(http, "chat/completions", body)
    assert whole.status_code == 200, whole.text
    logprobs = whole.json()["choices"][0]["logprobs"]
    assert set(logprobs) == {"content", "refusal"}
    assert logprobs["refusal"] is None and len(logprobs["content"]) == 6
    with http.stream("POST", "/openai/v1/chat/completions", json={**body, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    chunks = [json.loads(ln[6:]) for ln in lines]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert streamed and all(set(lp) == {"content", "refusal"} for lp in streamed)
    assert all(lp["refusal"] is None for lp in streamed)
    assert sum(len(lp["content"]) for lp in streamed) == 6


# -- declared chat fields ------------------------------------------------------------------


def test_moderation_and_prompt_cache_fields_are_accepted_and_change_nothing(client):
    kwargs = dict(model=SERVED_MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(
        **kwargs,
        moderation={"model": "omni-moderation-latest", "policy": {"input": {"mode": "block"}}},
        prompt_cache_options={"mode": "explicit", "ttl": "30m"},
        prompt_cache_retention="24h",
        extra_body={"ignore_eos": True},
    )
    assert full.choices[0].message.content == plain.choices[0].message.content
    assert full.usage.completion_tokens == 8


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"moderation": {"policy": None}}, "moderation.model"),
        ({"moderation": {"model": "m", "policy": {"input": {"mode": "warn"}}}}, "moderation"),
        ({"prompt_cache_options": {"ttl": "1h"}}, "prompt_cache_options.ttl"),
        ({"prompt_cache_options": {"mode": "implicit", "bogus": 1}}, "prompt_cache_options"),
        ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ],
)
def test_declared_fields_in_a_wrong_shape_are_refused_naming_them(http, extra, param):
    error = error_of(post(http, "chat/completions", chat_body(**extra)))
    assert error["param"].startswith(param), error


@pytest.mark.parametrize("effort", ["xhigh", "max"])
def test_reasoning_effort_above_high_is_accepted(client, effort):
    out = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, max_tokens=3, reasoning_effort=effort
    )
    assert out.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("effort", ["xhigh", "max"])
def test_reasoning_effort_above_high_reaches_templates_and_harmony_as_high(tiny_llama, effort):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    template = "{{ reasoning_effort }}|{{ messages[0]['content'] }}"

    def rendered(value: str) -> str:
        request = ChatCompletionRequest.model_validate(
            {"messages": MESSAGES, "reasoning_effort": value, "chat_template": template}
        )
        return render_chat_text(request, tokenizer, None)

    assert rendered(effort) == rendered("high") == f"high|{MESSAGES[0]['content']}"
    assert rendered("low") == f"low|{MESSAGES[0]['content']}"  # the others pass as they are
    today = "2025-01-01"
    high = hm.render_prompt(MESSAGES, reasoning_effort="high", today=today)
    above = hm.render_prompt(MESSAGES, reasoning_effort=effort, today=today)
    low = hm.render_prompt(MESSAGES, reasoning_effort="low", today=today)
    assert above.token_ids == high.token_ids != low.token_ids


# -- whole-number floats -------------------------------------------------------------------


def test_whole_number_floats_are_integers_on_chat_and_completions(http):
    chat = post(http, "chat/completions", chat_body(n=2.0, max_tokens=4.0, seed=3.0))
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 2 and chat.json()["usage"]["completion_tokens"] == 8
    body = {
        "model": SERVED_MODEL,
        "prompt": PROMPT,
        "max_tokens": 5.0,
        "logprobs": 2.0,
        "temperature": 0,
        "ignore_eos": True,
        "top_k": 40.0,
        "stop_token_ids": [2.0],
    }
    comp = post(http, "completions", body)
    assert comp.status_code == 200, comp.text
    choice = comp.json()["choices"][0]
    assert comp.json()["usage"]["completion_tokens"] == 5
    assert len(choice["logprobs"]["tokens"]) == 5
    # The same request with ints gives the same answer.
    ints = post(
        http,
        "completions",
        {**body, "max_tokens": 5, "logprobs": 2, "top_k": 40, "stop_token_ids": [2]},
    )
    assert ints.json()["choices"][0]["text"] == choice["text"]
    assert ints.json()["choices"][0]["logprobs"] == choice["logprobs"]


@pytest.mark.parametrize(
    "route, extra, param",
    [
        ("chat/completions", {"n": 2.5}, "n"),
        ("chat/completions", {"max_tokens": 16.5}, "max_tokens"),
        ("chat/completions", {"max_completion_tokens": 1e-3}, "max_completion_tokens"),
        ("chat/completions", {"top_logprobs": 1.5, "logprobs": True}, "top_logprobs"),
        ("chat/completions", {"seed": 0.5}, "seed"),
        ("chat/completions", {"n": True}, "n"),
        ("chat/completions", {"n": "2"}, "n"),
        ("completions", {"logprobs": 0.5}, "logprobs"),
        ("completions", {"stop_token_ids": [2.5]}, "stop_token_ids"),
    ],
)
def test_non_whole_numbers_are_still_refused(http, route, extra, param):
    body = chat_body(**extra) if route.startswith("chat") else {"prompt": PROMPT, **extra}
    error = error_of(post(http, route, body))
    assert error["param"].startswith(param), error


def test_whole_number_floats_on_responses_and_native_jobs(http, client):
    out = client.responses.create(
        model=SERVED_MODEL, input="Hello", max_output_tokens=4.0, extra_body={"ignore_eos": True}
    )
    assert out.usage.output_tokens == 4
    bad = error_of(post(http, "responses", {"input": "Hello", "max_output_tokens": 4.5}))
    assert bad["param"] == "max_output_tokens"
    job = {"prompt": PROMPT, "sampling_params": {"max_tokens": 3.0, "n": 2.0, "ignore_eos": True}}
    done = http.post("/runsync", json={"input": job})
    assert done.status_code == 200, done.text
    output = done.json()["output"]
    assert len(output[0]["choices"]) == 2 and output[0]["usage"]["output"] == 6
    failed = http.post("/runsync", json={"input": {**job, "sampling_params": {"n": 1.5}}})
    assert "n" in failed.json()["error"] and "integer" in failed.json()["error"]
    # The job's own integer field too (0 is the only priority the default FCFS policy takes).
    zero = http.post("/runsync", json={"input": {**job, "priority": 0.0}})
    assert zero.json()["status"] == "COMPLETED", zero.text
    half = http.post("/runsync", json={"input": {**job, "priority": 0.5}})
    assert "priority" in half.json()["error"] and "integer" in half.json()["error"]


# -- top_p 0 -------------------------------------------------------------------------------


def test_top_p_zero_is_greedy(client):
    kwargs = dict(model=SERVED_MODEL, max_tokens=12, extra_body={"ignore_eos": True})
    greedy = client.chat.completions.create(messages=MESSAGES, temperature=0, **kwargs)
    for seed in (1, 2):
        hot = client.chat.completions.create(
            messages=MESSAGES, temperature=1.5, top_p=0, seed=seed, **kwargs
        )
        assert hot.choices[0].message.content == greedy.choices[0].message.content
    # Without top_p 0, that temperature does sample (so the test above can fail).
    sampled = {
        client.chat.completions.create(messages=MESSAGES, temperature=1.5, seed=seed, **kwargs)
        .choices[0]
        .message.content
        for seed in (1, 2, 3)
    }
    assert sampled != {greedy.choices[0].message.content}
    plain = client.completions.create(prompt=PROMPT, temperature=0, **kwargs)
    zero = client.completions.create(prompt=PROMPT, top_p=0.0, seed=5, **kwargs)
    assert zero.choices[0].text == plain.choices[0].text
    resp = client.responses.create(model=SERVED_MODEL, input="Hello", top_p=0, max_output_tokens=6)
    greedy_resp = client.responses.create(
        model=SERVED_MODEL, input="Hello", temperature=0, max_output_tokens=6
    )
    assert resp.output_text == greedy_resp.output_text


# -- echo with max_tokens 0 ----------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_logprobs(tiny_llama: str) -> tuple[list[int], list[float]]:
    """transformers' log-probability of each prompt token after the ones before it."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    lsm = torch.log_softmax(logits.float(), dim=-1)
    return ids, [lsm[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_echo_with_max_tokens_zero_scores_the_prompt_only(client, tiny_llama, reference_logprobs):
    ids, want = reference_logprobs
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    out = client.completions.create(
        model=SERVED_MODEL, prompt=PROMPT, echo=True, max_tokens=0, logprobs=1, temperature=0
    )
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) == len(lp.token_logprobs)
    assert lp.tokens == [tokenizer.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    # lm-evaluation-harness reads whether each token was the greedy one from top_logprobs.
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    # Streamed: the same prompt tokens, nothing generated.
    chunks = list(
        client.completions.create(
            model=SERVED_MODEL,
            prompt=PROMPT,
            echo=True,
            max_tokens=0,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert text == PROMPT and tokens == lp.tokens and finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 0
    # Without logprobs: the prompt alone, in a list of prompts too.
    both = client.completions.create(
        model=SERVED_MODEL, prompt=[PROMPT, "Hello"], echo=True, max_tokens=0
    )
    assert [c.text for c in both.choices] == [PROMPT, "Hello"]
    assert all(c.logprobs is None and c.finish_reason == "length" for c in both.choices)


def test_max_tokens_zero_needs_echo(http):
    error = error_of(post(http, "completions", {"prompt": PROMPT, "max_tokens": 0}))
    assert error["param"] == "max_tokens" and "echo" in error["message"]
    error = error_of(
        post(
            http, "completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "min_tokens": 2}
        )
    )
    assert error["param"] == "min_tokens"
    error = error_of(post(http, "chat/completions", chat_body(max_tokens=0)))
    assert error["param"] == "max_tokens"


# -- responses: input items' unread fields -------------------------------------------------


def test_responses_input_items_with_every_declared_field_are_accepted(client):
    items = [
        {
            "type": "message",
            "role": "user",
            "content": "What is the weather?",
            "status": "completed",
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "Look it up."}],
            "encrypted_content": None,
            "status": "completed",
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": "{}",
            "status": "completed",
            "namespace": "functions",
            "caller": {"type": "direct"},
        },
        {
            "type": "function_call_output",
            "id": None,
            "call_id": "call_1",
            "output": "sunny",
            "status": None,
            "caller": None,
        },
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "phase": "final_answer",
            "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}],
        },
        {"role": "user", "content": "Thanks", "phase": None},
    ]
    out = client.responses.create(model=SERVED_MODEL, input=items, max_output_tokens=3)
    assert out.status in ("completed", "incomplete")


@pytest.mark.parametrize(
    "item, param, code",
    [
        ({"role": "user", "content": "hi", "id": 7}, "input[0].id", "invalid_type"),
        ({"role": "user", "content": "hi", "status": "done"}, "input[0].status", "invalid_type"),
        ({"role": "user", "content": "hi", "phase": "draft"}, "input[0].phase", "invalid_type"),
        (
            {"role": "user", "content": "hi", "colour": "red"},
            "input[0].colour",
            "unknown_parameter",
        ),
        (
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "id": None},
            "input[0].id",
            "invalid_type",
        ),
        (
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "caller": {}},
            "input[0].caller",
            "invalid_type",
        ),
        (
            {"type": "function_call_output", "call_id": "c", "output": "x", "name": 3},
            "input[0].name",
            "invalid_type",
        ),
        (
            {"type": "reasoning", "summary": [{"type": "text", "text": "x"}]},
            "input[0].summary",
            "invalid_type",
        ),
        (
            {"type": "reasoning", "summary": [], "encrypted_content": 5},
            "input[0].encrypted_content",
            "invalid_type",
        ),
    ],
)
def test_responses_input_items_unread_fields_are_checked(http, item, param, code):
    error = error_of(post(http, "responses", {"model": SERVED_MODEL, "input": [item]}))
    assert error["param"] == param and error["code"] == code, error
    assert param in error["message"]


# -- Content-Type --------------------------------------------------------------------------

BODY = b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}' % (
    SERVED_MODEL.encode()
)


@pytest.mark.parametrize(
    "content_type",
    [None, "application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8"],
)
def test_json_content_types_are_taken(http, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    resp = http.post("/openai/v1/chat/completions", content=BODY, headers=headers)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1"],
)
def test_other_content_types_get_415_in_each_routes_shape(http, endpoint, content_type):
    headers = {"Content-Type": content_type}
    resp = http.post("/openai/v1/chat/completions", content=BODY, headers=headers)
    error = error_of(resp, 415)
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_media_type"
    assert "application/json" in error["message"] or "UTF-8" in error["message"]
    anthropic = http.post("/v1/messages", content=BODY, headers=headers)
    assert anthropic.status_code == 415
    assert anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "invalid_request_error"
    job = http.post("/runsync", content=b'{"input": {"prompt": "x"}}', headers=headers)
    assert job.status_code == 415 and isinstance(job.json()["error"], str)
    # The worker keeps serving.
    assert http.post("/openai/v1/chat/completions", content=BODY).status_code == 200


def test_whole_number_floats_meet_the_same_limits_as_integers(http):
    """MAX_N is checked on the body as sent: n as a float is held to it as n as an int."""
    for name in ("n", "best_of"):
        error = error_of(post(http, "chat/completions", chat_body(**{name: 1e9})))
        assert error["param"] == name and error["code"] == "integer_above_max_value", error
    job = {"prompt": PROMPT, "sampling_params": {"n": 1e9}}
    failed = http.post("/runsync", json={"input": job})
    assert "MAX_N" in failed.json()["error"]


def test_responses_take_the_same_moderation_and_prompt_cache_shapes(client, http):
    out = client.responses.create(
        model=SERVED_MODEL,
        input="Hello",
        max_output_tokens=2,
        moderation={"model": "omni-moderation-latest", "policy": {"output": {"mode": "score"}}},
        prompt_cache_options={"mode": "implicit", "ttl": "30m"},
        prompt_cache_retention="in_memory",
    )
    assert out.status in ("completed", "incomplete")
    for extra, param in (
        ({"prompt_cache_retention": "1y"}, "prompt_cache_retention"),
        ({"moderation": {"policy": {}}}, "moderation.model"),
        ({"prompt_cache_options": {"mode": "always"}}, "prompt_cache_options.mode"),
    ):
        error = error_of(post(http, "responses", {"input": "Hello", **extra}))
        assert error["param"] == param, error

"""Malformed requests on the OpenAI routes: each gets one error dict in OpenAI's shape with the
right status, no KV block leaks, and the engine keeps serving."""

from __future__ import annotations

import json

import httpx2
import openai
import pytest
from openai.types.chat import ChatCompletion

from serverless_llm.api.openai import http_status, is_error, openai_error
from serverless_llm.api.openai.errors import validation_error
from serverless_llm.api.openai.protocol import CompletionRequest
from tests.api.conftest import MODEL, collect, parse_sse

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hello world!"}]
LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def chat(**kw):
    return {"model": MODEL, "messages": USER, "max_tokens": 4, **kw}


def completion(**kw):
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **kw}


def without(body, key):
    return {k: v for k, v in body.items() if k != key}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (id, route, body, status, param, code) — param/code None means "not checked".
CASES = [
    ("body-not-object", CHAT, "hello", 400, None, "invalid_type"),
    ("body-none", CHAT, None, 400, None, "invalid_type"),
    ("body-list", COMPLETIONS, [1, 2], 400, None, "invalid_type"),
    ("missing-messages", CHAT, without(chat(), "messages"), 400, "messages", None),
    ("empty-messages", CHAT, chat(messages=[]), 400, "messages", "invalid_value"),
    ("messages-string", CHAT, chat(messages="hi"), 400, "messages", "invalid_type"),
    ("message-not-object", CHAT, chat(messages=["hi"]), 400, "messages[0]", None),
    ("bad-role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, None, None),
    ("function-role", CHAT, chat(messages=[{"role": "function", "content": "x"}]), 400, None, None),
    ("content-int", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, None, None),
    ("content-missing", CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content", None),
    (
        "image-part",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages[0].content[0]",
        "unsupported_parameter",
    ),
    (
        "text-part-without-text",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        400,
        "messages[0].content[0].text",
        None,
    ),
    ("negative-max-tokens", CHAT, chat(max_tokens=-1), 400, "max_tokens", None),
    ("zero-max-tokens", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens", None),
    ("string-max-tokens", CHAT, chat(max_tokens="10"), 400, "max_tokens", "invalid_type"),
    ("float-max-tokens", CHAT, chat(max_tokens=3.5), 400, "max_tokens", None),
    ("negative-max-completion", CHAT, chat(max_completion_tokens=-5), 400, None, None),
    ("negative-temperature", CHAT, chat(temperature=-0.5), 400, "temperature", None),
    ("string-temperature", COMPLETIONS, completion(temperature="hot"), 400, "temperature", None),
    ("nan-temperature", CHAT, chat(temperature=float("nan")), 400, None, "invalid_json"),
    ("inf-top-p", CHAT, chat(top_p=float("inf")), 400, None, "invalid_json"),
    ("negative-top-p", CHAT, chat(top_p=-0.1), 400, "top_p", None),  # 0 is greedy
    ("top-p-above-one", COMPLETIONS, completion(top_p=1.5), 400, "top_p", None),
    ("bad-top-k", CHAT, chat(top_k=-2), 400, "top_k", None),
    ("n-zero", CHAT, chat(n=0), 400, "n", None),
    ("n-too-large", COMPLETIONS, completion(n=1000), 400, "n", None),
    ("n-bool", CHAT, chat(n=True), 400, "n", None),
    ("seed-string", CHAT, chat(seed="abc"), 400, "seed", None),
    ("seed-too-large", CHAT, chat(seed=2**70), 400, "seed", None),
    ("stream-string", CHAT, chat(stream="yes"), 400, "stream", None),
    ("stream-options-without-stream", CHAT, chat(stream_options={}), 400, "stream_options", None),
    ("bad-stop-token", CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids[0]", None),
    ("unknown-field", CHAT, chat(temprature=0.5), 400, "temprature", "unknown_parameter"),
    ("set-value", CHAT, chat(user={1, 2}), 400, None, "invalid_json"),
    ("bytes-value", COMPLETIONS, completion(prompt=b"hello"), 400, None, "invalid_json"),
    ("object-value", CHAT, chat(metadata=object()), 400, None, "invalid_json"),
    ("empty-stop-string", CHAT, chat(stop=["\n", ""]), 400, "stop", "invalid_value"),
    ("top-logprobs-alone", CHAT, chat(top_logprobs=3), 400, "top_logprobs", "invalid_value"),
    ("top-logprobs-range", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    ("tool-not-object", CHAT, chat(tools=["f"]), 400, None, None),
    (
        "tool-choice-auto-disabled",
        CHAT,
        chat(tools=[TOOL], tool_choice="auto"),
        400,
        "tool_choice",
        "invalid_value",
    ),
    (
        "tool-choice-unknown-function",
        CHAT,
        chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
        "tool_choice",
        None,
    ),
    (
        "tool-choice-and-guided",
        CHAT,
        chat(tools=[TOOL], tool_choice="required", guided_regex="a+"),
        400,
        "tool_choice",
        "invalid_value",
    ),
    (
        "response-format-unknown",
        CHAT,
        chat(response_format={"type": "yaml"}),
        400,
        "response_format",
        "invalid_value",
    ),
    (
        "two-constraints",
        COMPLETIONS,
        completion(guided_json={"type": "object"}, guided_regex="a+"),
        400,
        "guided_regex",
        "invalid_value",
    ),
    ("empty-choices", COMPLETIONS, completion(guided_choice=[]), 400, "guided_choice", None),
    ("bad-regex", COMPLETIONS, completion(guided_regex="(a"), 400, "guided_regex", None),
    ("bad-regex-stream", CHAT, chat(guided_regex="(a", stream=True), 400, "guided_regex", None),
    (
        "bad-grammar",
        CHAT,
        chat(guided_grammar="root ::= undefined_rule"),
        400,
        "guided_grammar",
        None,
    ),
    (
        "bad-backend",
        CHAT,
        chat(guided_regex="a", guided_decoding_backend="nope"),
        400,
        "guided_decoding_backend",
        None,
    ),
    ("penalty", CHAT, chat(frequency_penalty=2.5), 400, "frequency_penalty", None),
    ("penalty-range", CHAT, chat(presence_penalty=5), 400, "presence_penalty", None),
    ("min-p", COMPLETIONS, completion(min_p=1.5), 400, "min_p", None),
    ("repetition-zero", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty", None),
    ("top-a", CHAT, chat(top_a=-0.5), 400, "top_a", "invalid_value"),
    ("tfs-zero", COMPLETIONS, completion(tfs=0.0), 400, "tfs", "invalid_value"),
    ("typical-above-one", CHAT, chat(typical_p=1.5), 400, "typical_p", "invalid_value"),
    ("eta-negative", CHAT, chat(eta_cutoff=-1.0), 400, "eta_cutoff", "invalid_value"),
    ("epsilon-range", CHAT, chat(epsilon_cutoff=2000.0), 400, "epsilon_cutoff", "invalid_value"),
    ("smoothing-factor", CHAT, chat(smoothing_factor=-1.0), 400, "smoothing_factor", None),
    ("smoothing-curve", CHAT, chat(smoothing_curve=0.5), 400, "smoothing_curve", None),
    ("logit-bias-range", CHAT, chat(logit_bias={"5": 150}), 400, "logit_bias", "invalid_value"),
    ("logit-bias-key", CHAT, chat(logit_bias={"five": 1}), 400, "logit_bias", "invalid_value"),
    ("logit-bias-vocab", CHAT, chat(logit_bias={"100000": 1}), 400, "logit_bias", None),
    ("allowed-vocab", CHAT, chat(allowed_token_ids=[3, 99999]), 400, "allowed_token_ids", None),
    ("allowed-empty", CHAT, chat(allowed_token_ids=[]), 400, "allowed_token_ids", None),
    (
        "stop-token-vocab",
        COMPLETIONS,
        completion(stop_token_ids=[10**6]),
        400,
        "stop_token_ids",
        None,
    ),
    ("min-tokens-above-max", CHAT, chat(min_tokens=10), 400, "min_tokens", "invalid_value"),
    ("best-of-streamed", COMPLETIONS, completion(best_of=3, stream=True), 400, "best_of", None),
    (
        "prompt-logprobs-streamed",
        CHAT,
        chat(prompt_logprobs=1, stream=True),
        400,
        "prompt_logprobs",
        None,
    ),
    (
        "prompt-logprobs-range",
        COMPLETIONS,
        completion(prompt_logprobs=30),
        400,
        "prompt_logprobs",
        None,
    ),
    # Beam search's own parameters mean nothing without it (vLLM's rule).
    ("length-penalty", CHAT, chat(length_penalty=0.5), 400, "length_penalty", "invalid_value"),
    ("early-stopping", CHAT, chat(early_stopping=True), 400, "early_stopping", "invalid_value"),
    ("early-stopping-value", CHAT, chat(early_stopping="always"), 400, "early_stopping", None),
    ("best-of-below-n", COMPLETIONS, completion(best_of=1, n=2), 400, "best_of", "invalid_value"),
    (
        "beam-search-temperature",
        CHAT,
        chat(use_beam_search=True, temperature=0.7),
        400,
        "temperature",
        "invalid_value",
    ),
    (
        "beam-search-top-p",
        COMPLETIONS,
        completion(use_beam_search=True, top_p=0.5),
        400,
        "top_p",
        "invalid_value",
    ),
    ("beam-search-stop", CHAT, chat(use_beam_search=True, stop=["x"]), 400, "stop", None),
    (
        "both-generation-flags",
        CHAT,
        chat(continue_final_message=True),
        400,
        None,
        "invalid_chat_template",
    ),
    (
        "reserved-template-kwarg",
        CHAT,
        chat(chat_template_kwargs={"tokenize": True}),
        400,
        None,
        "invalid_chat_template",
    ),
    ("broken-template", CHAT, chat(chat_template="{% for %}"), 400, None, "invalid_chat_template"),
    (
        "chat-prompt-too-long",
        CHAT,
        chat(messages=[{"role": "user", "content": LONG_TEXT}]),
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("max-tokens-too-large", CHAT, chat(max_tokens=10_000), 400, "messages", None),
    ("missing-prompt", COMPLETIONS, without(completion(), "prompt"), 400, "prompt", None),
    ("empty-prompt-list", COMPLETIONS, completion(prompt=[]), 400, "prompt", None),
    ("mixed-prompt-list", COMPLETIONS, completion(prompt=[1, "a"]), 400, "prompt", None),
    ("empty-token-list", COMPLETIONS, completion(prompt=[[]]), 400, "prompt[0]", None),
    ("empty-string-prompt", COMPLETIONS, completion(prompt=""), 400, "prompt", None),
    ("token-out-of-range", COMPLETIONS, completion(prompt=[10**6]), 400, "prompt", None),
    ("negative-token", COMPLETIONS, completion(prompt=[[3, -1]]), 400, "prompt[0]", None),
    ("bool-tokens", COMPLETIONS, completion(prompt=[True, False]), 400, "prompt", None),
    (
        "completion-prompt-too-long",
        COMPLETIONS,
        completion(prompt=[[5, 6], [5] * 300]),
        400,
        "prompt[1]",
        "context_length_exceeded",
    ),
    ("suffix-without-fim", COMPLETIONS, completion(suffix="!"), 400, "suffix", "invalid_value"),
    ("completion-logprobs", COMPLETIONS, completion(logprobs=21), 400, "logprobs", None),
    ("echo-string", COMPLETIONS, completion(echo="yes"), 400, "echo", None),
    ("model-not-string", CHAT, chat(model=5), 400, "model", None),
    ("unknown-model", CHAT, chat(model="gpt-4"), 404, "model", "model_not_found"),
    ("unknown-model-completions", COMPLETIONS, completion(model="x"), 404, "model", None),
    ("unknown-route", "/v1/audio/speech", chat(), 404, None, "unknown_url"),
    ("route-none", None, chat(), 404, None, "unknown_url"),
]


def check_error_shape(err: dict) -> None:
    assert is_error(err)
    assert set(err) == {"error"}
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert isinstance(err["error"]["message"], str) and err["error"]["message"]
    # The status survives a JSON round trip (RunPod aggregates outputs as JSON).
    assert http_status(json.loads(json.dumps(err))) == http_status(err)


@pytest.mark.parametrize(
    ("route", "body", "status", "param", "code"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_malformed_request(serve, route, body, status, param, code):
    async def run(s):
        bad = await collect(s, route, body)
        good = await collect(s, CHAT, chat(max_tokens=2, stream=True))
        return bad, good

    bad, good = serve(run)
    assert len(bad) == 1, bad
    (err,) = bad
    check_error_shape(err)
    assert http_status(err) == status, err
    if param is not None:
        assert err["error"]["param"] == param, err
    if code is not None:
        assert err["error"]["code"] == code, err
    parse_sse(good)  # the engine still serves


def test_enough_malformed_cases():
    assert len(CASES) >= 30


def test_streamed_request_errors_before_any_chunk(serve):
    items = serve(lambda s: collect(s, CHAT, chat(stream=True, n=0)))
    (err,) = items
    assert is_error(err) and err["error"]["param"] == "n"


@pytest.mark.parametrize("n", [1, 3])
def test_engine_rejection_is_a_400_and_frees_the_others(serve, n):
    """The engine's own guard backs up the serving layer's: with the context check bypassed
    (a prompt "prepared" without being fitted), the engine refuses to build its requests, and
    the choices already queued are aborted."""
    from serverless_llm.engine import PreparedPrompt

    def unfitted(ids, params):
        max_len = s_engine["engine"].max_model_len
        return PreparedPrompt(
            list(ids), None, params.max_tokens, params.truncate_prompt_tokens, max_len
        )

    s_engine = {}

    async def run(s):
        s_engine["engine"] = s.engine
        s.engine.prepare_prompt = unfitted
        return await collect(s, COMPLETIONS, completion(prompt=[5] * 300, n=n, stream=True))

    (err,) = serve(run)
    check_error_shape(err)
    assert http_status(err) == 400 and "max_model_len" in err["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_mid_request_is_a_500(serve, core, monkeypatch, stream):
    real_execute = core.runner.execute
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("boom")
        return real_execute(batch)

    monkeypatch.setattr(core.runner, "execute", flaky)
    body = completion(max_tokens=50, ignore_eos=True, stream=stream)
    items = serve(lambda s: collect(s, COMPLETIONS, body))
    err = items[-1]
    check_error_shape(err)
    assert http_status(err) == 500 and "boom" in err["error"]["message"]
    if stream:
        assert len(items) > 1 and all(isinstance(i, str) for i in items[:-1])
    else:
        assert len(items) == 1


def _client_error(err: dict) -> openai.APIStatusError:
    """What the official client raises when the devserver sends `err` with its status."""
    client = openai.OpenAI(api_key="test", base_url="http://127.0.0.1:1/v1")
    request = httpx2.Request("POST", "http://127.0.0.1:1/v1/chat/completions")
    response = httpx2.Response(http_status(err), json=err, request=request)
    return client._make_status_error_from_response(response)


def test_official_client_reads_the_errors(serve):
    async def run(s):
        return (
            await collect(s, CHAT, chat(model="gpt-4")),
            await collect(s, CHAT, chat(n=0)),
            await collect(s, "/v1/nope", {}),
        )

    (missing,), (bad,), (route,) = serve(run)
    exc = _client_error(missing)
    assert isinstance(exc, openai.NotFoundError)
    assert exc.code == "model_not_found" and exc.param == "model"
    assert "gpt-4" in exc.message
    exc = _client_error(bad)
    assert isinstance(exc, openai.BadRequestError) and exc.param == "n"
    assert exc.type == "invalid_request_error"
    assert isinstance(_client_error(route), openai.NotFoundError)


@pytest.mark.parametrize(
    ("kwargs", "status", "type_"),
    [
        ({}, 400, "invalid_request_error"),
        ({"status": 404}, 404, "not_found_error"),
        ({"status": 500}, 500, "server_error"),
        ({"status": 503}, 503, "service_unavailable_error"),
        ({"type": "server_error", "status": 500}, 500, "server_error"),
        ({"code": "model_not_found", "status": 404}, 404, "invalid_request_error"),
        ({"type": "rate_limit_error", "status": 429}, 429, "rate_limit_error"),
    ],
)
def test_openai_error_and_http_status(kwargs, status, type_):
    err = openai_error("msg", **kwargs)
    assert err["error"]["type"] == type_
    assert http_status(err) == status
    assert http_status(json.loads(json.dumps(err))) == status


def test_http_status_of_foreign_error_dicts():
    assert http_status({"error": {"message": "x", "type": "BadRequestError", "code": 400}}) == 400
    assert http_status({"error": {"message": "x", "type": "NotFoundError", "code": 404}}) == 404
    assert http_status({"error": {"message": "x", "type": "whatever"}}) == 400
    assert http_status({"error": "a string"}) == 500


def test_validation_error_names_the_field():
    try:
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": -1, "n": 0})
    except Exception as exc:  # noqa: BLE001
        err = validation_error(exc)
    assert err["error"]["param"] == "max_tokens"
    assert "n" in err["error"]["message"]  # the other offending field is named too


def test_error_response_is_not_a_chat_completion():
    """An error dict must not parse as a response (clients tell them apart by `error`)."""
    with pytest.raises(Exception):  # noqa: B017
        ChatCompletion.model_validate(openai_error("x"))

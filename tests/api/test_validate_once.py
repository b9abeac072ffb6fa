"""A request is validated once: the route prepares each prompt through the engine (tokenized or
checked, fitted to the context, its grammar compiled), and the engine requests built from it,
one per sequence, tokenize, fit and compile nothing again."""

from __future__ import annotations

from serverless_llm.api.openai import is_error
from tests.api.conftest import MODEL, collect

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def counting(core, monkeypatch) -> dict[str, int]:
    inputs = core.inputs
    calls = {"tokenize_prompt": 0, "fit_prompt": 0, "compile_grammar": 0, "build_request": 0}
    for name in calls:
        real = getattr(inputs, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(inputs, name, wrapped)
    return calls


def test_chat_with_n_and_a_grammar_is_validated_once(serve, core, monkeypatch):
    calls = counting(core, monkeypatch)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Give me JSON."}],
        "max_tokens": 8,
        "n": 3,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": SCHEMA},
        },
    }
    (out,) = serve(lambda s: collect(s, CHAT, body))
    assert not is_error(out) and len(out["choices"]) == 3
    assert calls["build_request"] == 3  # one engine request per choice
    assert calls["fit_prompt"] == 1 and calls["compile_grammar"] == 1
    assert calls["tokenize_prompt"] == 1  # the rendered chat's ids checked once


def test_completion_prompts_are_each_validated_once(serve, core, monkeypatch):
    calls = counting(core, monkeypatch)
    body = {"model": MODEL, "prompt": ["Hello", "World", "Again"], "max_tokens": 4, "n": 2}
    (out,) = serve(lambda s: collect(s, COMPLETIONS, body))
    assert not is_error(out) and len(out["choices"]) == 6
    assert calls["build_request"] == 6
    assert calls["fit_prompt"] == 3 and calls["tokenize_prompt"] == 3
    assert calls["compile_grammar"] == 0

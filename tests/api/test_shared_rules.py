"""One place for each rule the API shares with the engine: the request errors (one base class,
one argument order, one mapping to each route's shape), the sampling defaults (the engine's,
restated nowhere), the path of a field in an error, and the SSE framing."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import pkgutil
from pathlib import Path

import pytest

import serverless_llm
from serverless_llm.api import errors as api_errors
from serverless_llm.api.errors import REQUEST_ERRORS, NativeJobError, loc_to_path
from serverless_llm.api.limits import RequestLimitError, RequestLimits
from serverless_llm.api.native_sampling import VLLMSamplingParams, parse_sampling_params
from serverless_llm.api.openai import errors as openai_errors
from serverless_llm.api.openai.errors import request_error
from serverless_llm.api.openai.protocol import ChatCompletionRequest, _SamplingRequest
from serverless_llm.api.openai.sse import SSE_DONE, sse_event, sse_events
from serverless_llm.api.openai.tool_parsers import ToolChoiceError, resolve_tool_choice
from serverless_llm.engine import (
    BEAM_SEARCH_TEMPERATURE,
    SAMPLING_DEFAULTS,
    ChatTemplateError,
    ContextLengthError,
    InvalidRequestError,
    LoRAError,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputError,
)
from serverless_llm.engine import errors as engine_errors

SRC = Path(serverless_llm.__file__).parent


def _package_exceptions() -> list[type[BaseException]]:
    """Every exception class the package defines (its modules imported)."""
    found = {}
    for info in pkgutil.walk_packages([str(SRC)], "serverless_llm."):
        if ".kernels" in info.name or info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:  # optional dependencies (GPU-only modules): not request errors
            continue
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__.startswith("serverless_llm.")
            ):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(found.values())


# -- errors ----------------------------------------------------------------------------------


def test_one_sampling_error_class_defined_in_the_engine():
    """The native route's sampling errors are the engine's class (there is no second one)."""
    assert SamplingParamsError.__module__ == "serverless_llm.engine.errors"
    with pytest.raises(SamplingParamsError) as info:
        parse_sampling_params({"bogus": 1}, default_max_tokens=10)
    assert type(info.value) is SamplingParamsError and info.value.param == "bogus"
    with pytest.raises(SamplingParamsError) as info:
        parse_sampling_params({"top_p": 0.0}, default_max_tokens=10)  # the engine's range check
    assert info.value.param == "top_p"
    names = {c.__name__ for c in _package_exceptions()}
    assert "SamplingParamError" not in names


def test_request_errors_share_one_base_and_one_argument_order():
    """Every request error takes (message, param) and is an InvalidRequestError, so both routes
    answer it as a 400 without knowing its class."""
    for cls in (SamplingParamsError, StructuredOutputError, LoRAError, NativeJobError):
        err = cls("the message", "field")
        assert isinstance(err, InvalidRequestError) and isinstance(err, REQUEST_ERRORS)
        assert (str(err), err.param) == ("the message", "field")
    limit = RequestLimitError("the message", "field", "some_code")
    assert isinstance(limit, InvalidRequestError)
    assert (str(limit), limit.param, limit.code) == ("the message", "field", "some_code")
    tool = ToolChoiceError("the message", "tool_choice")
    assert isinstance(tool, InvalidRequestError) and tool.param == "tool_choice"
    # Every exception class of the package that takes a `param` takes the message first.
    checked = 0
    for cls in _package_exceptions():
        params = list(inspect.signature(cls.__init__).parameters)
        if "param" in params:
            assert params[1] == "message", (cls, params)
            checked += 1
    assert checked >= 8


def test_engine_request_errors_live_in_one_module():
    for cls in (InvalidRequestError, SamplingParamsError, StructuredOutputError, LoRAError):
        assert cls.__module__ == engine_errors.__name__
    assert issubclass(ContextLengthError, InvalidRequestError)


@pytest.mark.parametrize(
    "exc, param, code, message",
    [
        (SamplingParamsError("top_p must be in (0, 1], got 0"), "top_p", "invalid_value", None),
        (
            StructuredOutputError("the regex is invalid", "guided_regex"),
            "guided_regex",
            "invalid_value",
            None,
        ),
        (InvalidRequestError("the prompt is empty"), None, None, None),
        (ContextLengthError(10, 5, 8), None, None, None),
        (LoRAError("adapter 'x' cannot be read", "model"), "model", "invalid_value", None),
        (ToolChoiceError("tools must be a list", "tools"), "tools", "invalid_value", None),
        (NativeJobError("the chat prompt is empty"), None, None, None),
        (ChatTemplateError("chat template error: boom"), None, "invalid_chat_template", None),
        (
            RequestLimitError(
                "'stop' has 9 entries, over the limit", "stop", "array_above_max_length"
            ),
            "stop",
            "array_above_max_length",
            "'stop' has 9 entries, over the limit.",
        ),
    ],
)
def test_each_request_error_has_one_openai_shape(exc, param, code, message):
    assert isinstance(exc, REQUEST_ERRORS)
    error = request_error(exc)
    assert openai_errors.http_status(error) == 400
    body = error["error"]
    assert body["type"] == "invalid_request_error"
    assert (body["param"], body["code"]) == (param, code)
    assert body["message"] == (message or str(exc))
    assert api_errors.native_error(str(exc)) == {"error": str(exc)}


def test_limit_errors_word_the_same_on_both_routes():
    with pytest.raises(RequestLimitError) as info:
        RequestLimits(max_n=2).check_sampling(n=3, best_of=None, stop=None, logit_bias=None)
    body = request_error(info.value)["error"]
    assert body["message"] == str(info.value)[0].upper() + str(info.value)[1:] + "."
    assert (body["param"], body["code"]) == ("n", "integer_above_max_value")


def test_tool_choice_errors_reach_the_route_as_raised():
    with pytest.raises(ToolChoiceError) as info:
        resolve_tool_choice([], "required", auto_enabled=False, why_not="")
    assert request_error(info.value)["error"]["param"] == "tool_choice"


# -- sampling defaults -----------------------------------------------------------------------

# Fields whose route default means "not given" on purpose (the route decides, or the engine's
# default applies when the value is left out).
_NOT_GIVEN = {"max_tokens", "stop_token_ids", "temperature", "top_p", "top_k"}


def test_native_defaults_are_the_engines():
    for name, field in VLLMSamplingParams.model_fields.items():
        if name in SAMPLING_DEFAULTS and name not in ("max_tokens", "stop_token_ids"):
            assert field.default == SAMPLING_DEFAULTS[name], name
    parsed = parse_sampling_params({}, default_max_tokens=7).params
    engine = SamplingParams(max_tokens=7)
    for name in SAMPLING_DEFAULTS:
        assert getattr(parsed, name) == getattr(engine, name), name
    beam = parse_sampling_params({"use_beam_search": True, "n": 2}, default_max_tokens=7).params
    assert beam.temperature == BEAM_SEARCH_TEMPERATURE


def test_openai_defaults_are_the_engines():
    from serverless_llm.api.openai.params import chat_sampling_params

    # The shared sampling fields (chat's `logprobs` is a boolean of another meaning).
    for name, field in _SamplingRequest.model_fields.items():
        if name in SAMPLING_DEFAULTS and name not in _NOT_GIVEN and field.default is not None:
            assert field.default == SAMPLING_DEFAULTS[name], name
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    params = chat_sampling_params(request)
    engine = SamplingParams(max_tokens=params.max_tokens)
    for name in SAMPLING_DEFAULTS:
        assert getattr(params, name) == getattr(engine, name), name
    beam = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True, "n": 2}
    )
    assert chat_sampling_params(beam).temperature == BEAM_SEARCH_TEMPERATURE


@pytest.mark.parametrize(
    "path, cls",
    [
        ("api/native_sampling.py", "VLLMSamplingParams"),
        ("api/openai/protocol.py", "_SamplingRequest"),
    ],
)
def test_sampling_defaults_are_not_restated(path, cls):
    """A request model declares an engine parameter's default by reading the engine's
    (SAMPLING_DEFAULTS), never as a literal that could drift from it."""
    tree = ast.parse((SRC / path).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    restated = []
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name = stmt.target.id
        if name not in SAMPLING_DEFAULTS or stmt.value is None:
            continue
        value = stmt.value
        if isinstance(value, ast.Call) and value.args:  # Field(default, ...)
            value = value.args[0]
        if isinstance(value, ast.Constant) and value.value is not None:
            restated.append(name)
    assert not restated, f"{path}: restates the engine's default of {restated}"


# -- field paths and SSE -----------------------------------------------------------------------


def test_one_loc_to_path():
    assert loc_to_path(("messages", 0, "role")) == "messages[0].role"
    assert loc_to_path((1,), "stop") == "stop[1]"
    assert openai_errors.loc_to_path is loc_to_path
    copies = [
        f"{p.relative_to(SRC)}:{n.name}"
        for p in SRC.rglob("*.py")
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.FunctionDef) and "loc_to" in n.name
    ]
    assert copies == ["api/errors.py:loc_to_path"], copies


def test_sse_framing():
    chunk = {"id": "c", "choices": [{"text": "é"}]}
    assert sse_event(chunk) == 'data: {"id":"c","choices":[{"text":"é"}]}\n\n'
    event = {"type": "response.created", "sequence_number": 0}
    assert sse_event(event) == (
        'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'
    )
    assert sse_events([chunk, chunk]) == sse_event(chunk) * 2
    assert SSE_DONE == "data: [DONE]\n\n"
    assert json.loads(sse_event(chunk)[len("data: ") :]) == chunk

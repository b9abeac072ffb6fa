"""Structured output and tool calls through the official OpenAI client against the local
endpoint: `chat.completions.parse(response_format=<pydantic model>)`, a named tool_choice whose
arguments validate, streamed tool-call deltas that reassemble to the same call, and (slow) the
SmolLM2 sentiment example with `guided_choice`."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.devserver.conftest import API_KEY, SERVED_MODEL, ServerThread, serve

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMETERS},
    }
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
COMPACT = {"guided_decoding_backend": "xgrammar:disable-any-whitespace"}


class Weather(BaseModel):
    city: str = Field(min_length=1, max_length=8)
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def client(endpoint: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{endpoint.base_url}/openai/v1", api_key=API_KEY, timeout=60)


def test_parse_with_a_pydantic_model(client: openai.OpenAI):
    for seed in range(5):
        completion = client.chat.completions.parse(
            model=SERVED_MODEL,
            messages=MESSAGES,
            response_format=Weather,
            max_tokens=120,
            seed=seed,
            extra_body=COMPACT,
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Weather)
        assert Weather.model_validate_json(message.content) == message.parsed


def test_named_tool_choice_and_streamed_deltas(client: openai.OpenAI):
    kwargs = dict(
        model=SERVED_MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=NAMED,
        max_tokens=120,
        seed=11,
        extra_body=COMPACT,
    )
    full = client.chat.completions.create(**kwargs)
    (call,) = full.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS)

    name, arguments, ids = "", "", set()
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                if tc.id:
                    ids.add(tc.id)
                name += (tc.function and tc.function.name) or ""
                arguments += (tc.function and tc.function.arguments) or ""
    assert name == "get_weather" and len(ids) == 1
    assert arguments == call.function.arguments


@pytest.fixture(scope="module")
def smollm2_endpoint(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory):
    from serverless_llm.devserver.app import create_app
    from serverless_llm.worker.handler import Worker
    from serverless_llm.worker.settings import Settings

    settings = Settings.from_env(
        {
            "MODEL_NAME": smollm2_dir,
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "smollm2",
            "BASE_PATH": str(tmp_path_factory.mktemp("base-smollm2")),
            "DEVICE": "cpu",
            "MAX_MODEL_LEN": "1024",
        }
    )
    worker = Worker(settings)
    app = create_app(worker, api_key=API_KEY, max_concurrency=settings.max_concurrency)
    with serve(app) as server:
        yield server


@pytest.mark.slow
def test_smollm2_sentiment_guided_choice(smollm2_endpoint: ServerThread):
    client = openai.OpenAI(
        base_url=f"{smollm2_endpoint.base_url}/openai/v1", api_key=API_KEY, timeout=120
    )
    for text in ("I love this product, it works great!", "This is the worst day ever."):
        completion = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": f"Classify the sentiment of this text: {text}"}],
            extra_body={"guided_choice": ["positive", "negative"]},
        )
        assert completion.choices[0].message.content in ("positive", "negative")

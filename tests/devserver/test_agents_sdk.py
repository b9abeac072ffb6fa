"""The OpenAI Agents SDK's default model (the Responses API) runs one-tool agents against the
local endpoint. On the tiny random model the tool call is forced by the grammar
(`tool_choice="required"`) and the final answer by the agent's output type (`text.format`);
after the tool ran, the SDK sends the call and its output back as input items."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Literal

import agents
import openai
import pytest
from pydantic import BaseModel

from tests.devserver.conftest import ServerThread, serve
from tests.tiny_models import build_tiny_model

MODEL = "agent-model"
COMPACT = {"guided_decoding_backend": "xgrammar:disable-any-whitespace"}


class Answer(BaseModel):
    verdict: Literal["sunny", "rainy"]


@pytest.fixture(scope="module")
def agent_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """The tiny Llama with room for the SDK's second turn: its template ignores tools, so the
    worker describes them in a system message (hundreds of byte-level tokens)."""
    from serverless_llm.devserver.app import create_app
    from serverless_llm.worker.handler import Worker
    from serverless_llm.worker.settings import Settings

    root = tmp_path_factory.mktemp("agents")
    model_dir = build_tiny_model(str(root / "llama"), "llama", max_position_embeddings=2048)
    settings = Settings.from_env(
        {
            "MODEL_NAME": model_dir,
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": MODEL,
            "BASE_PATH": str(root / "base"),
            "DEVICE": "cpu",
            "DTYPE": "float32",
            "MAX_MODEL_LEN": "2048",
            "BLOCK_SIZE": "16",
            "NUM_KV_BLOCKS": "512",
        }
    )
    with serve(create_app(Worker(settings))) as server:
        yield server


@pytest.fixture()
def sdk(agent_endpoint: ServerThread):
    """The SDK's default client pointed at the endpoint, tracing off (it would call OpenAI)."""
    client = openai.AsyncOpenAI(base_url=f"{agent_endpoint.base_url}/openai/v1", api_key="x")
    agents.set_default_openai_client(client, use_for_tracing=False)
    agents.set_default_openai_api("responses")
    agents.set_tracing_disabled(True)
    return agents


def _weather_agent(sdk, calls: list[str], **kwargs):
    @sdk.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    settings = sdk.ModelSettings(
        tool_choice="required", parallel_tool_calls=False, max_tokens=150, extra_body=COMPACT
    )
    return sdk.Agent(
        name="weather",
        instructions="Answer with the weather.",
        model=MODEL,
        tools=[get_weather],
        model_settings=settings,
        **kwargs,
    )


def test_agent_calls_its_tool(sdk):
    calls: list[str] = []
    agent = _weather_agent(sdk, calls, tool_use_behavior="stop_on_first_tool")
    result = sdk.Runner.run_sync(agent, "What is the weather in Paris?")
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome")
    assert result.final_output == f"sunny in {calls[0]}"


def test_agent_answers_after_the_tool_output(sdk):
    calls: list[str] = []
    agent = _weather_agent(sdk, calls, output_type=Answer)
    result = sdk.Runner.run_sync(agent, "What is the weather in Paris?")
    assert len(calls) == 1
    assert isinstance(result.final_output, Answer)
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert len(result.raw_responses) == 2
    first, second = (r.usage for r in result.raw_responses)
    assert second.input_tokens > first.input_tokens > 0


def test_streamed_agent_run(sdk):
    calls: list[str] = []
    agent = _weather_agent(sdk, calls, output_type=Answer)

    async def run() -> tuple[object, list[str]]:
        result = sdk.Runner.run_streamed(agent, "What is the weather in Rome?")
        names = [
            event.name
            async for event in result.stream_events()
            if event.type == "run_item_stream_event"
        ]
        return result.final_output, names

    final, names = asyncio.run(run())
    assert isinstance(final, Answer) and len(calls) == 1
    assert names == ["tool_called", "tool_output", "message_output_created"]

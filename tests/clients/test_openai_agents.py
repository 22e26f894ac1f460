"""openai-agents, with its default model (the Responses API one), against `tokenwise serve`.

The server answers to the SDK's default model name, so an `Agent` with no `model` and the
default `ModelSettings` for that name (reasoning effort, verbosity) runs unchanged; only the
client is pointed at the server, and tracing is off, so nothing reaches OpenAI. The built-in
model writes no useful text, so behaviour is forced and results are checked for structure and
against the chat endpoint: a plain run ends at a stop string and equals the chat reply, a tool
is forced by `tool_choice` and its result must reach the next prompt exactly as the chat
template renders it, structured outputs are guided by the `output_type`'s schema, and a run
chained with `previous_response_id` runs on the conversation the server kept.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from typing import Annotated, Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, Field

from tests._optional import require
from tests.clients._chat_server import CHAT_TEMPLATE
from tests.entrypoints._server import RemoteServer
from tokenwise.default_model import DEFAULT_MODEL_DIR

agents = require("agents", "the openai-agents SDK (pip install openai-agents)")
from agents import (  # noqa: E402
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_tracing_disabled,
)
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem  # noqa: E402
from agents.models import get_default_model, get_default_model_settings  # noqa: E402

INSTRUCTIONS = "You write Python."
QUESTION = "def fibonacci(n):"


class Report(BaseModel):
    city: str = Field(max_length=10)
    days: int = Field(ge=1, le=9)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = str(tmp_path_factory.mktemp("agents") / "default-chat")
    shutil.copytree(DEFAULT_MODEL_DIR, model_dir)
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    with RemoteServer(model_dir, "--served-model-name", get_default_model()) as srv:
        set_tracing_disabled(True)
        set_default_openai_api("responses")
        yield srv


@pytest.fixture(autouse=True)
def agents_client(server: RemoteServer) -> None:
    """A fresh client per test: its connections belong to the event loop of one run."""
    client = AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
    set_default_openai_client(client, use_for_tracing=False)


@pytest.fixture(scope="module")
def chat(server: RemoteServer) -> OpenAI:
    return OpenAI(base_url=server.url("/v1"), api_key="unused", timeout=120.0, max_retries=0)


def settings(**overrides: Any) -> ModelSettings:
    """The SDK's defaults for its default model, with `overrides` on top."""
    return get_default_model_settings().resolve(ModelSettings(**overrides))


def chat_reply_ending_at_a_stop(chat: OpenAI) -> tuple[str, str, int]:
    """A stop string the greedy chat reply contains past its start, the reply it cuts, and the
    prompt's tokens: the model never ends a reply itself, a stop string ends it."""
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": QUESTION},
    ]
    greedy = dict(model=get_default_model(), messages=messages, temperature=0.0, max_tokens=16)
    text = chat.chat.completions.create(**greedy).choices[0].message.content
    stop = next(
        text[k : k + 3] for k in range(8, len(text) - 3) if text.index(text[k : k + 3]) == k
    )
    out = chat.chat.completions.create(stop=[stop], **greedy)
    assert out.choices[0].finish_reason == "stop"
    return stop, out.choices[0].message.content, out.usage.prompt_tokens


def plain_agent(stop: str) -> Agent:
    model_settings = settings(temperature=0.0, max_tokens=16, extra_body={"stop": [stop]})
    return Agent(name="plain", instructions=INSTRUCTIONS, model_settings=model_settings)


def test_plain_run_returns_the_chat_reply(chat: OpenAI) -> None:
    stop, expected, prompt_tokens = chat_reply_ending_at_a_stop(chat)
    result = Runner.run_sync(plain_agent(stop), QUESTION)
    assert result.final_output == expected and expected
    (response,) = result.raw_responses
    assert response.usage.input_tokens == prompt_tokens
    assert [type(item) for item in result.new_items] == [MessageOutputItem]


def test_streamed_run_gives_the_same_text(chat: OpenAI) -> None:
    stop, expected, _ = chat_reply_ending_at_a_stop(chat)

    async def run() -> tuple[str, list[str]]:
        result = Runner.run_streamed(plain_agent(stop), QUESTION)
        deltas = []
        async for event in result.stream_events():
            if event.type == "raw_response_event" and event.data.type.endswith("text.delta"):
                deltas.append(event.data.delta)
        return result.final_output, deltas

    final, deltas = asyncio.run(run())
    assert final == expected == "".join(deltas)


def test_tool_round_trip_feeds_the_result_back(server: RemoteServer) -> None:
    calls: list[tuple[str, int]] = []

    @function_tool
    def get_forecast(
        city: Annotated[str, Field(max_length=10)], days: Annotated[int, Field(ge=1, le=9)]
    ) -> str:
        """The weather forecast for a city."""
        calls.append((city, days))
        return f"sunny in {city} for {days} days"

    agent = Agent(
        name="tools",
        instructions=INSTRUCTIONS,
        tools=[get_forecast],
        output_type=Report,
        # Forced on the first turn; the SDK then resets it, and the reply is the Report.
        model_settings=settings(
            tool_choice="get_forecast", temperature=1.0, max_tokens=128, extra_body={"seed": 3}
        ),
    )
    result = Runner.run_sync(agent, "Weather in Paris?")
    assert len(calls) == 1
    kinds = [type(item) for item in result.new_items]
    assert kinds == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    assert isinstance(result.final_output, Report)
    first, second = result.raw_responses
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_forecast"
    assert json.loads(call.arguments) == {"city": calls[0][0], "days": calls[0][1]}
    # The second prompt is the chat template's rendering of the call and its result.
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result.new_items[1].output},
    ]  # fmt: skip
    tool = get_forecast
    tools = [
        {"type": "function", "function": {"name": tool.name, "description": tool.description,
         "parameters": tool.params_json_schema, "strict": tool.strict_json_schema}}
    ]  # fmt: skip
    body = {"model": get_default_model(), "messages": messages, "tools": tools}
    counted = httpx.post(server.url("/tokenize"), json=body, timeout=60).json()["count"]
    assert second.usage.input_tokens == counted
    assert "sunny in" in result.new_items[1].output


def test_structured_output_type() -> None:
    agent = Agent(
        name="structured",
        instructions=INSTRUCTIONS,
        output_type=Report,
        model_settings=settings(temperature=1.0, max_tokens=96, extra_body={"seed": 1}),
    )
    result = Runner.run_sync(agent, "Report.")
    assert isinstance(result.final_output, Report)
    (response,) = result.raw_responses
    assert Report.model_validate_json(response.output[0].content[0].text) == result.final_output


def test_previous_response_id_continues_on_the_server(server: RemoteServer) -> None:
    """The SDK sends only the new input; the server prepends the stored conversation."""
    agent = Agent(
        name="chained",
        instructions=INSTRUCTIONS,
        output_type=Report,
        model_settings=settings(temperature=1.0, max_tokens=96, extra_body={"seed": 2}),
    )
    first = Runner.run_sync(agent, "Report.")
    second = Runner.run_sync(agent, "Again.", previous_response_id=first.last_response_id)
    assert isinstance(second.final_output, Report)
    first_text = first.raw_responses[0].output[0].content[0].text
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "Report."},
        {"role": "assistant", "content": first_text},
        {"role": "user", "content": "Again."},
    ]
    body = {"model": get_default_model(), "messages": messages}
    counted = httpx.post(server.url("/tokenize"), json=body, timeout=60).json()["count"]
    assert second.raw_responses[0].usage.input_tokens == counted

"""langchain-openai's `ChatOpenAI` against `tokenwise serve`: plain and streamed text, a tool
bound with `bind_tools` and forced by `tool_choice`, and `with_structured_output` by JSON schema
and by function calling.

The built-in model writes no meaningful text, so tool calls and structured outputs are forced
(a named `tool_choice`, a `response_format` schema: the server's guided decoding) and checked for
structure: the tool call's arguments validate against the tool's schema, the structured output
is an instance of the pydantic class with bounded fields. Plain text is compared with what the
openai client gets for the same greedy request.
"""

from __future__ import annotations

from typing import Annotated

import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests._optional import require
from tests.clients._chat_server import SERVED_NAME
from tests.entrypoints._server import RemoteServer

require("langchain_openai", "langchain-openai (pip install langchain-openai)")
from langchain_core.messages import AIMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402


class Forecast(BaseModel):
    """A weather forecast."""

    city: str = Field(max_length=10)
    days: int = Field(ge=1, le=9)
    tags: list[Annotated[str, Field(max_length=6)]] = Field(max_length=2)


@tool
def get_forecast(city: Annotated[str, Field(max_length=10)], days: int) -> str:
    """The weather forecast for a city, `days` days ahead."""
    return f"sunny in {city} for {days} days"


def chat_model(server: RemoteServer, **kwargs) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=server.url("/v1"),
        api_key="unused",
        model=SERVED_NAME,
        timeout=120.0,
        max_retries=0,
        **kwargs,
    )


def test_invoke_and_stream_give_the_openai_clients_text(server: RemoteServer) -> None:
    prompt = "def fibonacci(n):"
    openai = OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
    expected = openai.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": prompt}],
        temperature=0.0,
        max_tokens=12,
    )
    llm = chat_model(server, temperature=0.0, max_tokens=12, stream_usage=True)
    reply = llm.invoke(prompt)
    assert isinstance(reply, AIMessage)
    assert reply.content == expected.choices[0].message.content and reply.content
    assert reply.usage_metadata["input_tokens"] == expected.usage.prompt_tokens
    assert reply.usage_metadata["output_tokens"] == expected.usage.completion_tokens == 12
    assert reply.response_metadata["finish_reason"] == "length"

    chunks = list(llm.stream(prompt))
    assert len(chunks) > 1
    assert "".join(chunk.content for chunk in chunks) == reply.content
    streamed = sum(chunks[1:], chunks[0])
    assert streamed.usage_metadata["output_tokens"] == 12


def test_bind_tools_with_a_forced_tool_choice_returns_valid_tool_calls(
    server: RemoteServer,
) -> None:
    llm = chat_model(server, temperature=1.0, max_tokens=96, seed=3)
    reply = llm.bind_tools([get_forecast], tool_choice="get_forecast").invoke(
        "Weather in Paris for three days?"
    )
    (call,) = reply.tool_calls
    assert call["name"] == "get_forecast" and call["id"]
    assert set(call["args"]) == {"city", "days"}
    assert isinstance(call["args"]["city"], str) and len(call["args"]["city"]) <= 10
    assert isinstance(call["args"]["days"], int)
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    # The tool runs on the arguments it was given.
    assert get_forecast.invoke(call["args"]).startswith("sunny in ")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_an_instance(server: RemoteServer, method: str) -> None:
    llm = chat_model(server, temperature=1.0, max_tokens=128, seed=5)
    structured = llm.with_structured_output(Forecast, method=method, include_raw=True)
    out = structured.invoke("Forecast for Paris.")
    assert out["parsing_error"] is None
    forecast = out["parsed"]
    assert isinstance(forecast, Forecast)
    assert len(forecast.city) <= 10 and 1 <= forecast.days <= 9
    assert len(forecast.tags) <= 2 and all(len(tag) <= 6 for tag in forecast.tags)
    raw = out["raw"]
    if method == "function_calling":
        (call,) = raw.tool_calls
        assert call["name"] == "Forecast"
        assert Forecast.model_validate(call["args"]) == forecast
    else:
        assert not raw.tool_calls
        assert Forecast.model_validate_json(raw.content) == forecast

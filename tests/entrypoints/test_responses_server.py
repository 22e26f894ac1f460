"""`POST /v1/responses` through the official `openai` client, against a real `tokenwise serve`.

The endpoint runs its requests as chat requests, so the chat endpoint is the reference: greedy
text, prompt token counts and rendered tool results must equal what `/v1/chat/completions`
gives for the equivalent messages. The built-in model writes no JSON unguided, so every valid
call or JSON reply here is the grammar's doing. Bad values of every field are 400s naming it.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.entrypoints._server import RemoteServer, wait_for_idle
from tokenwise.default_model import DEFAULT_MODEL_DIR

NAME = "tokenwise-default"
# Renders tools, assistant tool calls and tool results, so each reaches the prompt.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m.get('tool_calls') %}{{ m['tool_calls'] | tojson }}{% endif %}"
    "{% if m.get('tool_call_id') %} ({{ m['tool_call_id'] }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "name": "get_forecast",
    "description": "Forecast.",
    "parameters": SCHEMA,
}
GREEDY = {"temperature": 0.0, "max_output_tokens": 12}


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=14)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = str(tmp_path_factory.mktemp("responses") / "default-chat")
    shutil.copytree(DEFAULT_MODEL_DIR, model_dir)
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    args = ("--served-model-name", NAME, "--max-tokens-cap", "256", "--strict-request-fields")
    with RemoteServer(model_dir, *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> OpenAI:
    return OpenAI(base_url=server.url("/v1"), api_key="unused", timeout=120.0, max_retries=0)


def chat_text(client: OpenAI, messages: list[dict], max_tokens: int = 12):
    out = client.chat.completions.create(
        model=NAME, messages=messages, temperature=0.0, max_tokens=max_tokens
    )
    return out.choices[0].message.content, out.usage.prompt_tokens


def test_text_equals_chat_completions(client: OpenAI) -> None:
    out = client.responses.create(
        model=NAME, instructions="Be brief.", input="Write a function.", **GREEDY
    )
    expected, prompt_tokens = chat_text(
        client,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Write a function."},
        ],
    )
    assert out.output_text == expected and expected
    assert out.id.startswith("resp") and out.object == "response" and out.model == NAME
    (message,) = out.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    # 12 tokens and no end: cut off by max_output_tokens, as OpenAI reports it.
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert message.status == "incomplete"
    assert out.usage.input_tokens == prompt_tokens and out.usage.output_tokens == 12
    assert out.usage.total_tokens == prompt_tokens + 12
    assert out.instructions == "Be brief." and out.temperature == 0.0


def test_stream_events_in_order_and_deltas_make_the_text(client: OpenAI) -> None:
    kwargs = dict(model=NAME, input=[{"role": "user", "content": "def main():"}], **GREEDY)
    collected = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == collected.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 12
    assert final.usage.input_tokens == collected.usage.input_tokens
    assert events[0].response.status == "in_progress" and events[0].response.output == []


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_is_a_function_call_item(client: OpenAI, stream: bool) -> None:
    kwargs = dict(
        model=NAME, input="Weather in Paris?", tools=[TOOL], extra_body={"seed": 4}, temperature=1.0,
        tool_choice={"type": "function", "name": "get_forecast"}, max_output_tokens=96,
    )  # fmt: skip
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        pieces = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert done.arguments == pieces
        assert events[-1].type == "response.completed"
        out = events[-1].response
    else:
        out = client.responses.create(**kwargs)
    assert out.status == "completed"
    (call,) = out.output
    assert call.type == "function_call" and call.name == "get_forecast"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    assert out.output_text == ""


def test_required_tool_call_picks_a_given_tool(client: OpenAI) -> None:
    other = {"type": "function", "name": "noop", "parameters": {"type": "object"}}
    out = client.responses.create(
        model=NAME, input="Go.", tools=[TOOL, other], tool_choice="required", extra_body={"seed": 2},
        parallel_tool_calls=False, temperature=1.0, max_output_tokens=128,
    )  # fmt: skip
    (call,) = out.output
    assert call.type == "function_call" and call.name in ("get_forecast", "noop")
    assert isinstance(json.loads(call.arguments), dict)


def test_function_call_output_is_rendered_into_the_prompt(client: OpenAI) -> None:
    """A tool round trip renders as the chat messages a chat client would send."""
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_forecast",
         "arguments": '{"city": "Paris", "days": 2}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 24 C"},
    ]  # fmt: skip
    out = client.responses.create(model=NAME, input=items, tools=[TOOL], **GREEDY)
    chat_tool = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
    messages = [
        items[0],
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_forecast", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]  # fmt: skip
    expected = client.chat.completions.create(
        model=NAME, messages=messages, tools=[chat_tool], temperature=0.0, max_tokens=12
    )
    assert out.usage.input_tokens == expected.usage.prompt_tokens
    assert out.output_text == expected.choices[0].message.content
    # The result is in the prompt: without it the prompt is shorter by its rendering.
    without = client.responses.create(model=NAME, input=items[:2], tools=[TOOL], **GREEDY)
    assert out.usage.input_tokens > without.usage.input_tokens + 5


def test_text_format_json_schema(client: OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "forecast", "schema": SCHEMA, "strict": True}
    for seed in range(3):
        out = client.responses.create(
            model=NAME,
            input="Forecast?",
            text={"format": fmt},
            extra_body={"seed": seed},
            max_output_tokens=96,
        )
        assert out.status == "completed"
        jsonschema.validate(json.loads(out.output_text), SCHEMA)
        assert out.text.format.type == "json_schema"
    parsed = client.responses.parse(
        model=NAME,
        input="Forecast?",
        text_format=Forecast,
        extra_body={"seed": 5},
        max_output_tokens=96,
    )
    assert isinstance(parsed.output_parsed, Forecast)
    events = list(
        client.responses.create(
            model=NAME,
            input="Forecast?",
            text={"format": fmt},
            extra_body={"seed": 1},
            stream=True,
            max_output_tokens=96,
        )  # fmt: skip
    )
    jsonschema.validate(json.loads(events[-1].response.output_text), SCHEMA)
    out = client.responses.create(
        model=NAME, input="JSON?", text={"format": {"type": "json_object"}}, extra_body={"seed": 3},
        max_output_tokens=96,
    )  # fmt: skip
    assert out.output_text.startswith("{")


def test_previous_response_id_continues_the_conversation(client: OpenAI) -> None:
    first = client.responses.create(
        model=NAME, instructions="Not carried over.", input="class A:", metadata={"k": "v"},
        **GREEDY,
    )  # fmt: skip
    second = client.responses.create(
        model=NAME, previous_response_id=first.id, input="class B:", **GREEDY
    )
    messages = [
        {"role": "user", "content": "class A:"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "class B:"},
    ]
    expected, prompt_tokens = chat_text(client, messages)
    assert second.output_text == expected
    assert second.usage.input_tokens == prompt_tokens
    assert second.previous_response_id == first.id
    fetched = client.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == first.output_text
    assert fetched.metadata == {"k": "v"}
    # A continuation of a continuation renders all three turns.
    third = client.responses.create(
        model=NAME, previous_response_id=second.id, input="class C:", **GREEDY
    )
    more = [*messages, {"role": "assistant", "content": second.output_text}]
    expected, prompt_tokens = chat_text(client, [*more, {"role": "user", "content": "class C:"}])
    assert third.output_text == expected and third.usage.input_tokens == prompt_tokens
    # Deleted: neither fetched nor continued any more.
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=NAME, previous_response_id=first.id, input="x")
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)


def test_unstored_and_unknown_responses_cannot_be_continued(
    server: RemoteServer, client: OpenAI
) -> None:
    unstored = client.responses.create(model=NAME, input="x", store=False, max_output_tokens=2)
    for response_id in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(
                model=NAME, previous_response_id=response_id, input="y", max_output_tokens=2
            )
        error = info.value.body
        assert error["param"] == "previous_response_id"
        assert error["code"] == "previous_response_not_found" and response_id in error["message"]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)
    wait_for_idle(server)


TOOLS = [TOOL]
BAD = [
    ({"input": 3}, "input", "string or a list"),
    ({"input": []}, "input", "no items"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "unsupported item type"),
    ({"input": [{"role": "bot", "content": "x"}]}, "input", "role"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input", "input_file"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input", "arguments"),
    ({"input": [{"type": "function_call_output", "output": "o"}]}, "input", "call_id"),
    ({"instructions": 5}, "instructions", "string"),
    ({"tools": [{"type": "web_search"}]}, "tools", "function"),
    ({"tools": [{"type": "function", "name": ""}]}, "tools", "at least 1"),
    ({"tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "not in tools"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"text": {"format": {"type": "xml"}}}, "text", "xml"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object",
      "properties": 1}}}}, "text", "text.format"),
    ({"text": {"verbosity": "loud"}}, "text", "verbosity"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"max_output_tokens": "9"}, "max_output_tokens", "integer"),
    ({"max_output_tokens": 100000}, "max_output_tokens", "--max-tokens-cap"),
    ({"temperature": -1.0}, "temperature", ">= 0"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"top_p": 2.0}, "top_p", "top_p"),
    ({"stream": "true"}, "stream", "boolean"),
    ({"previous_response_id": 7}, "previous_response_id", "string"),
    ({"store": "no"}, "store", "boolean"),
    ({"metadata": {"k": 1}}, "metadata", "string"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "16"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning", "effort"),
    ({"truncation": "sometimes"}, "truncation", "auto"),
    ({"user": 5}, "user", "string"),
    ({"include": ["everything"]}, "include", "include"),
    ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"seed": "x"}, "seed", "integer"),
    ({"stop": 5}, "stop", ""),
    ({"top_k": "x"}, "top_k", "integer"),
    ({"unknown_field": 1}, "unknown_field", "unknown field"),
    ({"model": 5}, "model", "string"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "words"), BAD)
def test_bad_values_are_400_naming_the_field(
    server: RemoteServer, fields: dict, param: str, words: str
) -> None:
    body = {"model": NAME, "input": "hi", "max_output_tokens": 2, **fields}
    response = httpx.post(server.url("/v1/responses"), json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"], error


def test_unknown_model_is_404_and_server_serves_on(server: RemoteServer) -> None:
    body = {"model": "gpt-nope", "input": "hi"}
    response = httpx.post(server.url("/v1/responses"), json=body, timeout=60)
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    ok = httpx.post(server.url("/v1/responses"), json={"input": "hi", "max_output_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 2


def test_truncation_auto_drops_the_oldest_messages(server: RemoteServer, client: OpenAI) -> None:
    """The built-in model's context is 1024 tokens; five long turns overflow it."""
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "x = 1\n" * 90}
        for i in range(5)
    ]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=NAME, input=turns, max_output_tokens=2)
    assert info.value.body["param"] == "input" and "max_model_len" in info.value.body["message"]
    out = client.responses.create(
        model=NAME, input=turns, instructions="Kept.", truncation="auto", max_output_tokens=2
    )
    assert out.status == "incomplete" and out.truncation == "auto"

    def count(messages: list[dict]) -> int:
        body = {"model": NAME, "messages": [{"role": "system", "content": "Kept."}, *messages]}
        return httpx.post(server.url("/tokenize"), json=body, timeout=60).json()["count"]

    # The longest suffix of the conversation that fits (instructions kept) is what ran.
    kept = next(k for k in range(len(turns)) if count(turns[k:]) < 1024)
    assert 0 < kept < len(turns) - 1
    assert out.usage.input_tokens == count(turns[kept:])


def test_reasoning_parser_gives_reasoning_items(tmp_path) -> None:
    """deepseek_r1 reads a reply as reasoning until `</think>`, which the built-in model never
    writes: the whole reply is one reasoning item, the chat endpoint's reasoning_content."""
    model_dir = str(tmp_path / "model")
    shutil.copytree(DEFAULT_MODEL_DIR, model_dir)
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    args = ("--served-model-name", NAME, "--reasoning-parser", "deepseek_r1")
    with RemoteServer(model_dir, *args) as srv:
        client = OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Think."}]
        chat = client.chat.completions.create(
            model=NAME, messages=messages, temperature=0.0, max_tokens=12
        )
        expected = chat.choices[0].message.reasoning_content
        assert expected
        out = client.responses.create(model=NAME, input=messages, **GREEDY)
        (item,) = out.output
        assert item.type == "reasoning" and item.id.startswith("rs_")
        assert item.content[0].type == "reasoning_text" and item.content[0].text == expected
        assert out.output_text == ""
        events = list(client.responses.create(model=NAME, input=messages, stream=True, **GREEDY))
        deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        assert "".join(deltas) == expected
        done = next(e for e in events if e.type == "response.reasoning_text.done")
        assert done.text == expected and events[-1].response.output[0].type == "reasoning"
        # A guided reply is read without the parser: the message is all JSON.
        fmt = {"type": "json_schema", "name": "f", "schema": SCHEMA}
        guided = client.responses.create(
            model=NAME, input=messages, text={"format": fmt}, max_output_tokens=96,
            extra_body={"seed": 0},
        )  # fmt: skip
        assert [i.type for i in guided.output] == ["message"]
        jsonschema.validate(json.loads(guided.output_text), SCHEMA)

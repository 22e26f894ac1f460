"""`POST /v1/messages` (Anthropic's Messages API) through the official `anthropic` client,
unchanged, against a real `tokenwise serve` with an API key (which the client sends as
`x-api-key`).

The endpoint runs its requests as chat requests, so `/v1/chat/completions` is the reference:
greedy text and token counts must equal what chat gives for the equivalent messages. The
built-in model writes no JSON unguided, so a forced tool's valid input is the grammar's doing.
"""

from __future__ import annotations

import json
import os
import shutil

import anthropic
import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.entrypoints._server import RemoteServer
from tokenwise.default_model import DEFAULT_MODEL_DIR

NAME = "tokenwise-default"
KEY = "messages-key"
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
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOL = {"name": "get_forecast", "description": "Forecast.", "input_schema": SCHEMA}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_forecast", "description": "Forecast.", "parameters": SCHEMA},
}
USER = [{"role": "user", "content": "def main():"}]
# This SDK has no sampling arguments (newer Claude models take none); the API has the fields.
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = str(tmp_path_factory.mktemp("messages") / "default-chat")
    shutil.copytree(DEFAULT_MODEL_DIR, model_dir)
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    args = ("--served-model-name", NAME, "--api-key", KEY, "--max-tokens-cap", "128")
    with RemoteServer(model_dir, *args, "--strict-request-fields") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url(""), api_key=KEY, timeout=60.0, max_retries=0)


@pytest.fixture(scope="module")
def chat(server: RemoteServer) -> OpenAI:
    return OpenAI(base_url=server.url("/v1"), api_key=KEY, timeout=60.0, max_retries=0)


def test_create_equals_chat_completions(client: anthropic.Anthropic, chat: OpenAI) -> None:
    out = client.messages.create(
        model=NAME, system="Be brief.", messages=USER, max_tokens=12, extra_body=GREEDY
    )
    system = [{"role": "system", "content": "Be brief."}]
    expected = chat.chat.completions.create(
        model=NAME, messages=system + USER, max_tokens=12, temperature=0.0
    )
    text = expected.choices[0].message.content
    assert text and out.content[0].type == "text" and out.content[0].text == text
    assert len(out.content) == 1
    assert out.id.startswith("msg") and out.type == "message" and out.role == "assistant"
    assert out.model == NAME
    assert out.usage.input_tokens == expected.usage.prompt_tokens
    assert out.usage.output_tokens == expected.usage.completion_tokens
    finish = expected.choices[0].finish_reason
    assert out.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert out.stop_sequence is None
    # System as text blocks is the same prompt; metadata is accepted and changes nothing.
    blocks = client.messages.create(
        model=NAME, system=[{"type": "text", "text": "Be brief."}], messages=USER,
        max_tokens=12, extra_body=GREEDY, metadata={"user_id": "u-1"},
    )  # fmt: skip
    assert blocks.content[0].text == text and blocks.usage == out.usage


def test_stop_sequence_ends_the_reply_and_is_named(client: anthropic.Anthropic) -> None:
    full = client.messages.create(model=NAME, messages=USER, max_tokens=24, extra_body=GREEDY)
    text = full.content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    out = client.messages.create(
        model=NAME, messages=USER, max_tokens=24, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert out.content[0].text == text[: text.index(stop)]


def test_stream_text_events_make_the_message(client: anthropic.Anthropic) -> None:
    kwargs = dict(model=NAME, messages=USER, max_tokens=12, extra_body=GREEDY)
    collected = client.messages.create(**kwargs)
    events = list(client.messages.create(stream=True, **kwargs))
    types = [e.type for e in events]
    deltas = types.count("content_block_delta")
    assert deltas >= 1
    assert types == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0].message
    assert start.content == [] and start.usage.input_tokens == collected.usage.input_tokens
    assert events[1].content_block.type == "text" and events[1].index == 0
    assert all(e.delta.type == "text_delta" for e in events[2 : 2 + deltas])
    text = "".join(e.delta.text for e in events[2 : 2 + deltas])
    assert text == collected.content[0].text
    assert events[-2].delta.stop_reason == collected.stop_reason
    assert events[-2].usage.output_tokens == collected.usage.output_tokens
    # The SDK's own accumulation of the same events.
    with client.messages.stream(**kwargs) as stream:
        assert "".join(stream.text_stream) == text
        final = stream.get_final_message()
    assert final.content[0].text == text and final.usage == collected.usage


def test_forced_tool_use_streams_its_input(client: anthropic.Anthropic) -> None:
    kwargs = dict(
        model=NAME, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=96,
        extra_body=GREEDY, tools=[TOOL], tool_choice={"type": "tool", "name": "get_forecast"},
    )  # fmt: skip
    events = list(client.messages.create(stream=True, **kwargs))
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"]
    block = starts[0].content_block
    assert block.name == "get_forecast" and block.id.startswith("toolu_") and block.input == {}
    pieces = [e.delta for e in events if e.type == "content_block_delta"]
    assert pieces and all(p.type == "input_json_delta" for p in pieces)
    streamed = json.loads("".join(p.partial_json for p in pieces))
    jsonschema.validate(streamed, SCHEMA)
    assert events[-2].delta.stop_reason == "tool_use"
    collected = client.messages.create(**kwargs)
    (call,) = collected.content
    assert call.type == "tool_use" and call.name == "get_forecast" and call.input == streamed
    assert collected.stop_reason == "tool_use"
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].input == streamed


def test_tool_result_conversation_renders_as_chat(
    client: anthropic.Anthropic, chat: OpenAI
) -> None:
    """tool_use and tool_result blocks become the chat messages a chat client would send."""
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_forecast",
             "input": {"city": "Paris", "days": 2}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 24 C"},
            {"type": "text", "text": "And tomorrow?"}]},
    ]  # fmt: skip
    chat_messages = [
        messages[0],
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {
                "name": "get_forecast", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 24 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    out = client.messages.create(
        model=NAME, messages=messages, tools=[TOOL], max_tokens=8, extra_body=GREEDY
    )
    expected = chat.chat.completions.create(
        model=NAME, messages=chat_messages, tools=[CHAT_TOOL], max_tokens=8, temperature=0.0
    )
    assert out.usage.input_tokens == expected.usage.prompt_tokens
    assert out.content[0].text == expected.choices[0].message.content
    counted = client.messages.count_tokens(model=NAME, messages=messages, tools=[TOOL])
    assert counted.input_tokens == out.usage.input_tokens
    # Without the result the prompt is shorter by its rendering.
    fewer = client.messages.count_tokens(model=NAME, messages=messages[:2], tools=[TOOL])
    assert counted.input_tokens > fewer.input_tokens + 5


def test_count_tokens_counts_the_system_prompt(client: anthropic.Anthropic) -> None:
    plain = client.messages.count_tokens(model=NAME, messages=USER).input_tokens
    system = client.messages.count_tokens(model=NAME, system="Be brief.", messages=USER)
    ran = client.messages.create(model=NAME, messages=USER, max_tokens=1)
    assert ran.usage.input_tokens == plain and system.input_tokens > plain


def raw_post(server: RemoteServer, path: str, body: dict, headers: dict | None = None):
    headers = {"x-api-key": KEY} if headers is None else headers
    return httpx.post(server.url(path), json=body, headers=headers, timeout=30.0)


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind
    return body["error"]["message"]


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ({"max_tokens": None}, "max_tokens"),  # required
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 129}, "max_tokens"),  # over --max-tokens-cap 128
        ({"temperature": -1.0}, "temperature"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [TOOL]}, "tool_choice"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),  # no tools
        ({"thinking": {"type": "enabled", "budget_tokens": 50}}, "thinking"),  # >= max_tokens
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"tools": [{"name": "t"}]}, "tools.0.input_schema"),
        ({"unknown_field": 1}, "unknown_field"),  # --strict-request-fields
    ],
)
def test_bad_input_is_400_in_anthropic_shape_naming_the_field(
    server: RemoteServer, override: dict, names: str
) -> None:
    body = {"model": NAME, "messages": USER, "max_tokens": 8, **override}
    body = {k: v for k, v in body.items() if v is not None}
    message = anthropic_error(raw_post(server, "/v1/messages", body), 400, "invalid_request_error")
    assert names in message, message


def test_errors_reach_the_sdk_as_its_exceptions(
    client: anthropic.Anthropic, server: RemoteServer
) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=NAME, messages=USER, max_tokens=500)
    assert "max_tokens must be <= 128" in info.value.message
    assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", messages=USER, max_tokens=4)
    bad_key = anthropic.Anthropic(base_url=server.url(""), api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad_key.messages.count_tokens(model=NAME, messages=USER)
    # Either header carries the key; neither is a 401 in Anthropic's shape.
    body = {"model": NAME, "messages": USER}
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert raw_post(server, "/v1/messages/count_tokens", body, bearer).status_code == 200
    anthropic_error(
        raw_post(server, "/v1/messages/count_tokens", body, {}), 401, "authentication_error"
    )
    # The built-in model reads no images: refused before anything runs.
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
    }
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model=NAME, max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    assert info.value.body["type"] == "error"
    # The OpenAI routes keep OpenAI's shape.
    chat_body = {"model": NAME, "messages": USER, "temperature": -1.0}
    response = raw_post(server, "/v1/chat/completions", chat_body, bearer)
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"

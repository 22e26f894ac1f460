"""Structured outputs and forced tool calls through the server, with the official `openai`
client: `response_format` json_schema (also through the client's own `parse`, which turns the
reply into a pydantic object), vLLM's `guided_*` fields, and tool calls forced by name or by
"required", streamed and not. The built-in model writes no JSON unguided, so every valid reply
here is the grammar's doing. Bad specs are 400s that name the field, and the server serves on.
"""

from __future__ import annotations

import json
import os
import re
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
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_forecast",
            "description": "Weather forecast for a city.",
            "parameters": SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert",
            "parameters": {
                "type": "object",
                "properties": {"amount": {"type": "integer", "minimum": 0, "maximum": 999}},
                "required": ["amount"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLED = {"temperature": 1.0, "max_completion_tokens": 96}


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=14)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = str(tmp_path_factory.mktemp("structured") / "default-chat")
    shutil.copytree(DEFAULT_MODEL_DIR, model_dir)
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    with RemoteServer(model_dir, "--served-model-name", NAME) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> OpenAI:
    return OpenAI(base_url=server.url("/v1"), api_key="unused", timeout=120.0, max_retries=0)


def stream_reply(client: OpenAI, **kwargs) -> tuple[str, dict[int, dict], str | None]:
    """Reassemble a streamed chat reply: (content, tool calls by index, finish reason)."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=NAME, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                if piece.id:
                    assert call["id"] is None, "a call's id is sent once"
                    call["id"] = piece.id
                if piece.function is not None:
                    call["name"] += piece.function.name or ""
                    call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_response_format_json_schema(client: OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA, "strict": True}}
    for seed in range(4):
        out = client.chat.completions.create(
            model=NAME, messages=MESSAGES, response_format=fmt, seed=seed, **SAMPLED
        )
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    content, calls, finish = stream_reply(
        client, messages=MESSAGES, response_format=fmt, seed=7, **SAMPLED
    )
    assert finish == "stop" and not calls
    jsonschema.validate(json.loads(content), SCHEMA)


def test_client_parse_into_a_pydantic_model(client: OpenAI) -> None:
    out = client.chat.completions.parse(
        model=NAME, messages=MESSAGES, response_format=Forecast, seed=3, **SAMPLED
    )
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Forecast) and 1 <= parsed.days <= 14


def test_json_object_and_guided_fields_on_completions(client: OpenAI) -> None:
    out = client.chat.completions.create(
        model=NAME, messages=MESSAGES, response_format={"type": "json_object"}, seed=1, **SAMPLED
    )
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    assert out.choices[0].message.content.startswith("{")
    regex = r"[A-Z][a-z]{2,8} [0-9]{1,2}"
    outs = client.completions.create(
        model=NAME, prompt="def f():", n=4, max_tokens=20, temperature=1.0, seed=2,
        extra_body={"guided_regex": regex},
    )  # fmt: skip
    assert all(re.fullmatch(regex, c.text) for c in outs.choices)
    choices = ["alpha", "beta", "gamma"]
    outs = client.completions.create(
        model=NAME, prompt="x =", n=6, max_tokens=8, temperature=1.0, seed=5,
        extra_body={"guided_choice": choices},
    )  # fmt: skip
    assert {c.text for c in outs.choices} <= set(choices)
    out = client.completions.create(
        model=NAME, prompt="x =", max_tokens=64, temperature=1.0, seed=6,
        extra_body={"guided_json": SCHEMA},
    )  # fmt: skip
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_forced_named_tool_call(client: OpenAI, stream: bool) -> None:
    choice = {"type": "function", "function": {"name": "get_forecast"}}
    kwargs = dict(messages=MESSAGES, tools=TOOLS, tool_choice=choice, seed=4, **SAMPLED)
    if stream:
        content, calls, finish = stream_reply(client, **kwargs)
        assert content == "" and len(calls) == 1
        call = calls[0]
        assert call["id"].startswith("call_") and call["name"] == "get_forecast"
        name, arguments = call["name"], call["arguments"]
    else:
        out = client.chat.completions.create(model=NAME, **kwargs)
        message, finish = out.choices[0].message, out.choices[0].finish_reason
        assert message.content is None and len(message.tool_calls) == 1
        tool_call = message.tool_calls[0]
        assert tool_call.type == "function" and tool_call.id.startswith("call_")
        name, arguments = tool_call.function.name, tool_call.function.arguments
    assert finish == "tool_calls" and name == "get_forecast"
    check_call(name, arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_call(client: OpenAI, stream: bool) -> None:
    kwargs = dict(
        messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        seed=9, temperature=1.0, max_completion_tokens=128,
    )  # fmt: skip
    if stream:
        _, by_index, finish = stream_reply(client, **kwargs)
        calls = [(c["name"], c["arguments"]) for c in by_index.values()]
    else:
        out = client.chat.completions.create(model=NAME, **kwargs)
        finish = out.choices[0].finish_reason
        calls = [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]
    assert finish == "tool_calls" and len(calls) == 1
    check_call(*calls[0])


def test_tool_choice_none_and_unforced_replies_are_text(client: OpenAI) -> None:
    out = client.chat.completions.create(
        model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_completion_tokens=8
    )
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 1}}}},  # noqa: E501
         "response_format", ["invalid JSON schema", "properties"]),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format", ["json_schema.schema"]),
        ({"guided_regex": "(ab"}, "guided_regex", ["invalid regex", "parenthesis"]),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar", ["missing"]),
        ({"guided_json": "{oops"}, "guided_json", ["not valid JSON"]),
        ({"guided_choice": []}, "guided_choice", ["non-empty"]),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", ["at most one"]),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", ["nope", "not in tools"]),
        ({"tool_choice": "required"}, "tool_choice", ["needs tools"]),
    ],
)  # fmt: skip
def test_bad_specs_are_400_naming_the_field(
    server: RemoteServer, body: dict, param: str, words: list[str]
) -> None:
    payload = {"model": NAME, "messages": MESSAGES, "max_tokens": 4, **body}
    response = httpx.post(server.url("/v1/chat/completions"), json=payload, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    for word in words:
        assert word in error["message"]
    assert ".cc:" not in error["message"]


def test_server_serves_on_after_bad_specs(server: RemoteServer, client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="invalid regex"):
        client.completions.create(
            model=NAME, prompt="x", max_tokens=4, extra_body={"guided_regex": "[z-a]"}
        )
    out = client.completions.create(
        model=NAME, prompt="x", max_tokens=4, extra_body={"guided_regex": "[a-c]{4}"}
    )
    assert re.fullmatch("[a-c]{4}", out.choices[0].text)
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    wait_for_idle(server)


def test_a_grammar_too_slow_to_compile_is_refused() -> None:
    """Compiles take 3 s in this server (planted), the timeout is 0.5 s."""
    env = {"TOKENWISE_GRAMMAR_COMPILE_TIMEOUT_S": "0.5"}
    launcher = ("-m", "tests.entrypoints._slow_grammar_serve")
    args = ("--served-model-name", NAME)
    with RemoteServer(DEFAULT_MODEL_DIR, *args, env=env, launcher=launcher) as srv:
        slow = {"model": NAME, "prompt": "x", "max_tokens": 4, "guided_regex": "[a-z]{1,9}"}
        response = httpx.post(srv.url("/v1/completions"), json=slow, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "grammar_refused"
        assert "did not compile within 0.5 s" in error["message"]
        plain = {"model": NAME, "prompt": "x", "max_tokens": 4}
        assert httpx.post(srv.url("/v1/completions"), json=plain, timeout=60).status_code == 200
        wait_for_idle(srv)

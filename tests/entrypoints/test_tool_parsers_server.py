"""Tool calls through the server for every `--tool-call-parser`, with the official client: the
model is made to write each family's exact reply (a one-choice `guided_choice` plants it), and
the reply comes back as content and `tool_calls`, collected and streamed alike. Also with a
parser configured: `tool_choice` "required", a named function (with `structured_outputs`'
`disable_any_whitespace`), `allowed_tools` narrowing what the template renders, and 400s
naming the field for bad forms.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.entrypoints._server import RemoteServer
from tests.entrypoints._tool_parser_serve import PREFIX
from tests.entrypoints.tool_call_samples import PLANTED, TOOLS
from tokenwise.default_model import DEFAULT_MODEL_DIR

NAME = "tokenwise-default"
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Weather in Paris, and convert 5?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = str(tmp_path_factory.mktemp("toolparsers") / "default-chat")
    shutil.copytree(DEFAULT_MODEL_DIR, model_dir)
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    args = ("--served-model-name", NAME, "--tool-call-parser", "mistral")
    launcher = ("-m", "tests.entrypoints._tool_parser_serve")
    with RemoteServer(model_dir, *args, "--enable-auto-tool-choice", launcher=launcher) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> OpenAI:
    return OpenAI(base_url=server.url("/v1"), api_key="unused", timeout=120.0, max_retries=0)


def planted(parser: str, **extra: Any) -> dict[str, Any]:
    text = PLANTED[parser][0]
    return dict(
        model=NAME, messages=MESSAGES, tools=TOOLS, max_completion_tokens=400,
        user=PREFIX + parser, extra_body={"guided_choice": [text]}, **extra,
    )  # fmt: skip


def stream(client: OpenAI, parser: str) -> tuple[str, list[tuple[str, str]], str | None]:
    """The planted reply streamed: (content, calls as (name, arguments), finish reason)."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **planted(parser)):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for piece in ch.delta.tool_calls or []:
                if piece.index not in calls:
                    assert piece.id and piece.function.name, "a call opens with id and name"
                    calls[piece.index] = [piece.function.name, ""]
                else:
                    assert piece.id is None and piece.function.name is None
                calls[piece.index][1] += piece.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("parser", sorted(PLANTED))
def test_planted_reply_is_read_collected_and_streamed(client: OpenAI, parser: str) -> None:
    _, content, calls = PLANTED[parser]
    # Both at once: the engine batches them, halving the wait for a tiny model on a busy CPU.
    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream, client, parser)
        out = client.chat.completions.create(**planted(parser))
        streamed_content, streamed, finish = streaming.result(timeout=300)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content == content
    got = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert got == calls
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
    assert finish == "tool_calls" and streamed_content.strip() == (content or "")
    assert streamed == [(c.function.name, c.function.arguments) for c in message.tool_calls]


def test_required_and_named_choices_are_guided_with_any_parser(client: OpenAI) -> None:
    out = client.chat.completions.create(
        model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=1,
        parallel_tool_calls=False, max_completion_tokens=120, user=PREFIX + "qwen3_coder",
    )  # fmt: skip
    calls = out.choices[0].message.tool_calls
    if out.choices[0].finish_reason == "tool_calls":
        assert len(calls) == 1 and calls[0].function.name in ("get_weather", "convert")
        assert isinstance(json.loads(calls[0].function.arguments), dict)
    forced = {"type": "function", "function": {"name": "convert"}}
    for seed in range(3):
        out = client.chat.completions.create(
            model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=forced, seed=seed,
            max_completion_tokens=60, temperature=1.0,
            extra_body={"structured_outputs": {"disable_any_whitespace": True}},
        )  # fmt: skip
        call = out.choices[0].message.tool_calls[0]
        assert call.function.name == "convert"
        if out.choices[0].finish_reason == "tool_calls":
            arguments = call.function.arguments
            # No whitespace of the model's choosing: exactly json.dumps' layout.
            assert arguments == json.dumps(json.loads(arguments))


def test_allowed_tools_narrow_what_the_template_renders(
    client: OpenAI, server: RemoteServer
) -> None:
    def prompt_tokens(**fields: Any) -> int:
        out = client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_completion_tokens=1, **fields
        )
        return out.usage.prompt_tokens

    convert_only = [TOOLS[1]]
    choice = {
        "type": "allowed_tools",
        "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "convert"}}]},
    }  # fmt: skip
    narrowed = prompt_tokens(tools=TOOLS, tool_choice=choice)
    tokenized = httpx.post(
        server.url("/tokenize"), json={"messages": MESSAGES, "tools": convert_only}, timeout=30
    ).json()["count"]
    assert narrowed == tokenized == prompt_tokens(tools=convert_only)
    assert narrowed < prompt_tokens(tools=TOOLS)
    required = {
        "type": "allowed_tools",
        "allowed_tools": {**choice["allowed_tools"], "mode": "required"},
    }
    out = client.chat.completions.create(
        model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=required, seed=2,
        max_completion_tokens=60, extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )  # fmt: skip
    if out.choices[0].finish_reason == "tool_calls":
        assert {c.function.name for c in out.choices[0].message.tool_calls} == {"convert"}


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
            {"type": "function", "function": {"name": "nope"}}]}}},
         "tool_choice", ["allowed_tools.tools[0]", "nope"]),
        ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "often", "tools": []}}},
         "tool_choice", ["tool_choice"]),
        ({"structured_outputs": {"regex": "(", "disable_any_whitespace": True}},
         "structured_outputs", ["structured_outputs"]),
        ({"structured_outputs": {"disable_any_whitespace": "yes"}},
         "structured_outputs", ["disable_any_whitespace"]),
    ],
)  # fmt: skip
def test_bad_forms_are_400s_naming_the_field(
    client: OpenAI, fields: dict, param: str, words: list[str]
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=NAME, messages=MESSAGES, tools=TOOLS, max_completion_tokens=4, extra_body=fields
        )
    error = info.value.body
    assert error["param"] == param and all(w in error["message"] for w in words), error

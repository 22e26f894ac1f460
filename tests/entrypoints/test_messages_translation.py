"""The Messages API's translation to chat and back, without a model: `thinking` against a known
reply (an in-process app whose engine answers with fixed pieces, `--reasoning-parser
deepseek_r1`), and how blocks, tool choices and output formats become the chat request.
"""

from __future__ import annotations

import json

import pytest

from tests.entrypoints._recording_engine import NAME, app_for
from tests.tiny_checkpoints import tiny_tokenizer
from tokenwise.entrypoints.openai.anthropic_input import chat_request, stop_reason
from tokenwise.entrypoints.openai.protocol_anthropic import CountTokensRequest, MessagesRequest

# Reasoning (no opening tag, as DeepSeek-R1 writes it), then the answer; one piece per step.
PIECES = ["plan ", "it</think>", "Hello", " world"]
USER = [{"role": "user", "content": "Hi"}]


def events_of(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event; the name must equal the data's type."""
    out = []
    for chunk in text.strip().split("\n\n"):
        name_line, data_line = chunk.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        out.append((name, data))
    return out


@pytest.mark.timeout(60)
def test_thinking_returns_the_reasoning_as_a_thinking_block() -> None:
    client, _ = app_for(tiny_tokenizer(), PIECES, reasoning_parser="deepseek_r1")
    body = {"model": NAME, "messages": USER, "max_tokens": 200}
    with client:
        shown = client.post(
            "/v1/messages", json={**body, "thinking": {"type": "enabled", "budget_tokens": 100}}
        ).json()
        plain = client.post("/v1/messages", json=body).json()
        omitted = client.post(
            "/v1/messages", json={**body, "thinking": {"type": "adaptive", "display": "omitted"}}
        ).json()
        stream = client.post(
            "/v1/messages", json={**body, "stream": True, "thinking": {"type": "adaptive"}}
        )
    assert shown["content"] == [
        {"type": "thinking", "thinking": "plan it", "signature": ""},
        {"type": "text", "text": "Hello world"},
    ]
    assert shown["stop_reason"] == "end_turn" and shown["usage"]["output_tokens"] == 4
    # Not asked to think (or asked not to show it): the reasoning is dropped.
    assert plain["content"] == omitted["content"] == [{"type": "text", "text": "Hello world"}]
    assert stream.headers["content-type"].startswith("text/event-stream")
    events = events_of(stream.text)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == [
        "message_delta",
        "message_stop",
    ]
    blocks = [d for n, d in events if n == "content_block_start"]
    assert [(b["index"], b["content_block"]["type"]) for b in blocks] == [
        (0, "thinking"),
        (1, "text"),
    ]
    deltas = [d for n, d in events if n == "content_block_delta"]
    thinking = "".join(d["delta"]["thinking"] for d in deltas if d["index"] == 0)
    text = "".join(d["delta"]["text"] for d in deltas if d["index"] == 1)
    assert (thinking, text) == ("plan it", "Hello world")
    assert [d["index"] for n, d in events if n == "content_block_stop"] == [0, 1]
    # Every block closes before the next opens.
    order = [(n, d.get("index")) for n, d in events if n.startswith("content_block_")]
    assert order.index(("content_block_stop", 0)) < order.index(("content_block_start", 1))
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert final["usage"] == {"output_tokens": 4}


def test_thinking_sets_the_template_switch_and_needs_a_budget_below_max_tokens() -> None:
    base = {"model": "m", "messages": USER, "max_tokens": 100}
    on = chat_request(MessagesRequest(**base, thinking={"type": "enabled", "budget_tokens": 10}))
    assert on.chat_template_kwargs == {"enable_thinking": True} and on.include_reasoning
    off = chat_request(MessagesRequest(**base, thinking={"type": "disabled"}))
    assert off.chat_template_kwargs == {"enable_thinking": False} and not off.include_reasoning
    unset = chat_request(MessagesRequest(**base))
    assert unset.chat_template_kwargs is None and not unset.include_reasoning


def test_blocks_become_chat_messages() -> None:
    image = {"type": "base64", "media_type": "image/png", "data": "QUJD"}
    body = MessagesRequest(
        model="m", max_tokens=5, system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image", "source": image}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                 "content": [{"type": "text", "text": "boom"}]},
                {"type": "text", "text": "retry"}]},
        ],
    )  # fmt: skip
    messages = [m.model_dump(exclude_none=True) for m in chat_request(body).messages]
    assert messages == [
        {"role": "system", "content": "A\nB"},
        {"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}]},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: boom"},
        {"role": "user", "content": "retry"},
    ]  # fmt: skip


def test_tool_choice_and_output_format_become_the_chat_fields() -> None:
    tool = {"name": "f", "input_schema": {"type": "object"}}
    base = {"model": "m", "messages": USER, "max_tokens": 5, "tools": [tool]}
    auto = chat_request(MessagesRequest(**base))
    assert auto.tool_choice == "auto" and auto.tools[0].function.parameters == {"type": "object"}
    forced = chat_request(
        MessagesRequest(
            **base, tool_choice={"type": "tool", "name": "f", "disable_parallel_tool_use": True}
        )
    )
    assert forced.tool_choice.function.name == "f" and forced.parallel_tool_calls is False
    assert (
        chat_request(MessagesRequest(**base, tool_choice={"type": "any"})).tool_choice == "required"
    )
    none = chat_request(MessagesRequest(**base, tool_choice={"type": "none"}))
    assert none.tools[0].function.name == "f" and none.tool_choice == "none"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"format": {"type": "json_schema", "schema": schema}}
    shaped = chat_request(
        MessagesRequest(model="m", messages=USER, max_tokens=5, output_config=fmt)
    )
    assert shaped.response_format.type == "json_schema"
    assert shaped.response_format.json_schema.json_schema == schema
    counted = chat_request(CountTokensRequest(model="m", messages=USER))
    assert counted.max_completion_tokens is None and not counted.stream


@pytest.mark.parametrize(
    ("finish", "stopped_by", "expected"),
    [
        ("length", None, ("max_tokens", None)),
        ("tool_calls", None, ("tool_use", None)),
        ("stop", "END", ("stop_sequence", "END")),
        ("stop", 0, ("end_turn", None)),  # the EOS token
        ("stop", None, ("end_turn", None)),
    ],
)
def test_stop_reason(finish: str, stopped_by, expected) -> None:
    assert stop_reason(finish, stopped_by) == expected

"""`tool_choice="auto"`: reading Hermes / Qwen `<tool_call>` blocks out of canned replies, and
the same reply streamed in pieces of every size giving the same content and calls."""

from __future__ import annotations

import json

import pytest

from tokenwise.entrypoints.openai.structured_outputs import ToolMode
from tokenwise.entrypoints.openai.tool_calls import ToolCallReader, parse_call_array
from tokenwise.entrypoints.openai.tool_parser import HermesToolParser, parse_tool_calls

TWO_CALLS = (
    "Let me check both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
    '<tool_call>{"name": "convert", "arguments": {"amount": 5}}</tool_call>'
)


def test_calls_and_content_are_separated() -> None:
    result = parse_tool_calls(TWO_CALLS)
    assert result.content == "Let me check both."
    assert [c.name for c in result.calls] == ["get_weather", "convert"]
    assert json.loads(result.calls[0].arguments) == {"city": "Paris", "days": 3}
    assert json.loads(result.calls[1].arguments) == {"amount": 5}


@pytest.mark.parametrize(
    "text",
    [
        "no calls here, just <b>markup</b> and a < sign",
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>["get_weather"]</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}',  # never closed
    ],
)
def test_text_without_well_formed_calls_stays_content(text: str) -> None:
    result = parse_tool_calls(text)
    assert result.calls == [] and result.content == text.strip()


def test_parameters_key_and_string_arguments_are_accepted() -> None:
    result = parse_tool_calls(
        '<tool_call>{"name": "a", "parameters": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == [
        ("a", {"x": 1}),
        ("b", {"y": 2}),
    ]
    assert result.content == ""


@pytest.mark.parametrize("size", [1, 2, 3, 7, 11, 1000])
def test_streamed_pieces_give_the_same_reply(size: int) -> None:
    parser = HermesToolParser()
    content, calls = "", []
    for i in range(0, len(TWO_CALLS), size):
        piece = parser.feed(TWO_CALLS[i : i + size])
        content += piece.content
        calls += piece.calls
        assert "<tool_call" not in content  # never leaks a tag, even half of one
    content += parser.finish()
    whole = parse_tool_calls(TWO_CALLS)
    assert content.strip() == whole.content and calls == whole.calls


def test_a_partial_tag_is_held_back_then_released() -> None:
    parser = HermesToolParser()
    assert parser.feed("answer <tool").content == "answer "
    assert parser.feed("box>").content == "<toolbox>"


def test_stream_reader_reports_tool_calls_in_openai_shapes() -> None:
    reader = ToolCallReader(ToolMode("auto"))
    deltas = []
    for i in range(0, len(TWO_CALLS), 5):
        delta, finish = reader.delta(TWO_CALLS[i : i + 5], None)
        assert finish is None
        if delta is not None:
            deltas.append(delta)
    final, finish = reader.delta("", "stop")
    assert finish == "tool_calls" and final is not None
    pieces = [p for d in deltas for p in d.tool_calls or []]
    assert [p.index for p in pieces] == [0, 1]
    assert all(p.id and p.id.startswith("call_") and p.type == "function" for p in pieces)
    assert [p.function.name for p in pieces] == ["get_weather", "convert"]
    message, finish = ToolCallReader(ToolMode("auto")).message(TWO_CALLS, "stop")
    assert finish == "tool_calls" and message.content == "Let me check both."
    assert [c.function.arguments for c in message.tool_calls] == [
        p.function.arguments for p in pieces
    ]


def test_length_cut_replies_keep_their_finish_reason() -> None:
    message, finish = ToolCallReader(ToolMode("named", "f")).message('{"a": 1', "length")
    assert finish == "length" and message.tool_calls[0].function.arguments == '{"a": 1'
    message, finish = ToolCallReader(ToolMode("required")).message('[{"name": "f"', "length")
    assert finish == "length" and message.tool_calls is None and message.content == '[{"name": "f"'


def test_required_array_parsing() -> None:
    calls = parse_call_array(
        '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]'
    )
    assert [(c.name, json.loads(c.arguments)) for c in calls or []] == [("f", {"a": 1}), ("g", {})]
    assert parse_call_array('{"name": "f"}') is None and parse_call_array("[1]") is None

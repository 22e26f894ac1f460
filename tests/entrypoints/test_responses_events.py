"""The Responses endpoint's parts without a server: replies read into output items and event
streams (reasoning with a parser, Hermes tool calls), input items rendered as chat messages,
the bounded store, and chat errors renamed to the Responses fields.

A reply split into any pieces must stream to the same items the collected response has, in
the published event order; reasoning needs `--reasoning-parser` and a model that writes
`<think>`, which the built-in one never does, hence hand-written replies here.
"""

from __future__ import annotations

import json

import pytest

from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.protocol_responses import (
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    ResponseObject,
    ResponsesRequest,
)
from tokenwise.entrypoints.openai.reasoning import Qwen3ReasoningParser
from tokenwise.entrypoints.openai.responses_events import ResponseEvents
from tokenwise.entrypoints.openai.responses_input import (
    input_messages,
    output_items,
    output_messages,
    renamed,
    without_oldest,
)
from tokenwise.entrypoints.openai.responses_store import ResponseStore
from tokenwise.entrypoints.openai.structured_outputs import ToolMode
from tokenwise.entrypoints.openai.tool_calls import ToolCallReader

REASONED = "<think>\nCheck the cache first.\n</think>\n\nThe answer is 42."
CALLING = 'Let me look.<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'


def reader(mode: str, reasoning: bool) -> ToolCallReader:
    return ToolCallReader(ToolMode(mode), Qwen3ReasoningParser() if reasoning else None)


def stream(text: str, size: int, mode: str, reasoning: bool) -> list[dict]:
    """The events of `text` generated `size` characters at a time."""
    events = ResponseEvents(ResponseObject(id="resp-1", model="m"))
    lines = events.start()
    read = reader(mode, reasoning)
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for n, piece in enumerate(pieces):
        delta, _ = read.delta(piece, "stop" if n == len(pieces) - 1 else None)
        if delta is not None:
            lines += events.feed(delta)
    events.response.status = "completed"
    lines += events.finish("completed")
    parsed = []
    for line in lines:
        head, data = line.strip().split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        parsed.append(payload)
    return parsed


def collapse(types: list[str]) -> list[str]:
    """Event types with runs of the same delta event written once."""
    return [t for i, t in enumerate(types) if not (i and t == types[i - 1] and "delta" in t)]


def test_reasoning_comes_before_the_message() -> None:
    message, _ = reader("none", True).message(REASONED, "stop")
    items = output_items(message)
    assert [type(i) for i in items] == [OutputReasoning, OutputMessage]
    assert items[0].content[0].text == "Check the cache first."
    assert items[1].content[0].text == "The answer is 42."
    # Reasoning stays out of the conversation a continuation renders.
    assert output_messages(items) == [{"role": "assistant", "content": "The answer is 42."}]


@pytest.mark.parametrize("size", [1, 3, 7, len(REASONED)])
def test_streamed_reasoning_then_message_in_the_published_order(size: int) -> None:
    events = stream(REASONED, size, "none", True)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert collapse([e["type"] for e in events]) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]["output"]
    collected = output_items(reader("none", True).message(REASONED, "stop")[0])
    assert [i["type"] for i in final] == ["reasoning", "message"]
    assert final[0]["content"][0]["text"] == collected[0].content[0].text
    assert final[1]["content"][0]["text"] == collected[1].content[0].text
    reasoning = "".join(e["delta"] for e in events if e["type"].endswith("reasoning_text.delta"))
    assert reasoning == collected[0].content[0].text
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1]
    assert added[0]["item"]["status"] == "in_progress"
    assert all(i["status"] == "completed" for i in final)


@pytest.mark.parametrize("size", [1, 5, len(CALLING)])
def test_hermes_calls_become_function_call_items(size: int) -> None:
    message, _ = reader("auto", False).message(CALLING, "stop")
    collected = output_items(message)
    assert [type(i) for i in collected] == [OutputMessage, OutputFunctionCall]
    call = collected[1]
    assert call.name == "lookup" and json.loads(call.arguments) == {"key": "a"}
    events = stream(CALLING, size, "auto", False)
    types = collapse([e["type"] for e in events])
    assert types[-5:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["name"] == "lookup" and json.loads(done["arguments"]) == {"key": "a"}
    final = events[-1]["response"]["output"]
    assert final[0]["content"][0]["text"] == "Let me look."
    assert final[1]["call_id"].startswith("call_") and final[1]["id"] == done["item_id"]


def test_incomplete_stream_marks_the_cut_item() -> None:
    events = ResponseEvents(ResponseObject(id="resp-1", model="m"))
    events.start()
    read = reader("none", False)
    events.feed(read.delta("partial", None)[0])
    last = json.loads(events.finish("incomplete")[-1].split("data: ", 1)[1])
    assert last["type"] == "response.incomplete"
    assert last["response"]["output"][0]["status"] == "incomplete"


def test_input_items_render_as_the_chat_messages_a_chat_client_sends() -> None:
    body = ResponsesRequest.model_validate(
        {
            "input": [
                {"role": "developer", "content": "Rules."},
                {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                             {"type": "input_text", "text": "b"}]},
                {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                 "content": [{"type": "output_text", "text": "Calling.", "annotations": []}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {"type": "function_call_output", "call_id": "c2",
                 "output": [{"type": "input_text", "text": "two"}]},
            ]
        }
    )  # fmt: skip
    call = {"type": "function", "function": {"arguments": "{}"}}
    assert input_messages(body.input) == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Calling.", "tool_calls": [
            {"id": "c1", **call, "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", **call, "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]  # fmt: skip


def test_store_keeps_the_most_recently_used() -> None:
    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put(ResponseObject(id=name, model="m"), [{"role": "user", "content": name}])
    assert store.previous("a").conversation == [{"role": "user", "content": "a"}]  # a is fresh
    store.put(ResponseObject(id="c", model="m"), [])
    assert len(store) == 2 and store.get("b") is None and store.get("a") is not None
    with pytest.raises(OpenAIError) as info:
        store.previous("b")
    assert info.value.status_code == 400 and info.value.param == "previous_response_id"
    with pytest.raises(OpenAIError) as info:
        store.retrieve("b")
    assert info.value.status_code == 404
    nothing = ResponseStore(0)
    nothing.put(ResponseObject(id="a", model="m"), [])
    assert len(nothing) == 0


def test_chat_errors_name_the_responses_fields() -> None:
    error = renamed(OpenAIError(400, "response_format: invalid JSON schema", "response_format"))
    assert error.param == "text" and error.message == "text.format: invalid JSON schema"
    error = renamed(OpenAIError(400, "max_completion_tokens must be <= 8", "max_completion_tokens"))
    assert error.param == "max_output_tokens" and error.message.startswith("max_output_tokens")
    assert renamed(OpenAIError(400, "x", "temperature")).param == "temperature"


def test_truncation_drops_the_oldest_and_the_results_it_orphans() -> None:
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}
    result = {"role": "tool", "tool_call_id": "c", "content": "r"}
    last = {"role": "user", "content": "now"}
    assert without_oldest([call, result, result, last]) == [last]
    assert without_oldest([{"role": "user", "content": "a"}, call, result, last]) == [
        call,
        result,
        last,
    ]
    assert without_oldest([last]) is None
